/// \file triattn/cuda/accumulated.cuh
/// \brief H2O and VATP on the GPU: accumulated attention fed with the engine's probabilities,
/// per-slot scores, keep plans and the reset of freed slots, each one launch for a whole batch.
///
/// **The state** is the CPU accumulator's (attention_accumulator.hpp), one copy per sequence:
/// sums [batch, layers, q_heads, capacity] (float) and row counts [batch, layers, kv_heads,
/// capacity] (int32), `capacity` being the batch's. A new sequence starts with both zeroed
/// (cudaMemsetAsync). Every formula is accumulated_math.hpp's, which the CPU policies call
/// too, so that the GPU holds and ranks the same floats.
///
/// **A round**, in stream order:
///  1. after each attention, `accumulate_attention` adds the new query row of every (sequence,
///     layer, q_head);
///  2. `plan_round` (round.cuh) with an `accumulated_scorer` scores every (sequence, layer,
///     kv_head) and selects the keep sets of the round's decisions;
///  3. `compact` (compact.cuh) moves K, V, positions and, given `accumulated_slot_states`, the
///     sums and counts with the same keep indices, so that a slot's state follows its token;
///  4. `clear_past_length` zeroes the state of the slots the compaction freed: the next tokens
///     enter there and must start from nothing, as on the CPU (`after_compact`).
/// A VATP round whose value norms are not finite writes `round_status::non_finite_key` to the
/// round's status word; the compaction given that word then moves nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/accumulated_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// The accumulated attention of a batch, in device memory (see the file comment). Sequence b's
/// part starts at b x layers x q_heads x capacity (sums) and b x layers x kv_heads x capacity
/// (counts).
struct accumulated_state {
  float* sums = nullptr;           ///< [batch, layers, q_heads, capacity]
  std::int32_t* counts = nullptr;  ///< [batch, layers, kv_heads, capacity]
};

/// How the sums become one score per (kv_head, slot): H2O's options, and VATP's weighting.
struct accumulated_scoring {
  gqa_aggregation gqa = gqa_aggregation::mean;
  bool normalize = false;       ///< divide by the rows that saw the slot (h2o_config::normalize)
  bool value_weighted = false;  ///< VATP: times the value row's L1 norm, read from the cache
};

/// H2O's budget split (`h2o_config::budget_parts()`, readable on the device) and the CPU
/// policy's `rule`: the sinks and the recent window protected, heavy + recent kept.
struct accumulated_split {
  h2o_budget parts{};

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const {
    const h2o_split s = parts.split(info.budget, info.prompt_length);
    return {s.protected_slots(), s.total()};
  }
};

/// The state arrays as `compact` moves them: a KV head owns the G sum rows of its group and
/// its count row; sequence b's arrays start `sequence_stride` elements after sequence b - 1's.
template <KVCacheView V>
device_slot_states accumulated_slot_states(const view_batch<V>& batch, const accumulated_state& state) {
  const kv_geometry& g = batch.geometry;
  device_slot_states s;
  s.items[0] = make_slot_state(state.sums, g.num_kv_heads, g.group_size(), batch.capacity);
  s.items[1] = make_slot_state(state.counts, g.num_kv_heads, 1, batch.capacity);
  s.sequence_stride[0] = std::int64_t{g.num_layers} * g.num_q_heads * batch.capacity;
  s.sequence_stride[1] = std::int64_t{g.num_layers} * g.num_kv_heads * batch.capacity;
  s.count = 2;
  return s;
}

namespace detail {

/// Slot blocks per row of a grid (rows, slot blocks): enough to cover `capacity`, at most 64
/// (the kernels stride over the rest), so that long rows do not need huge grids.
inline dim3 accumulated_grid(std::int64_t rows, std::int64_t capacity, int threads) {
  const unsigned slot_blocks = blocks_for(capacity, threads);
  return {static_cast<unsigned>(rows), slot_blocks < 64 ? slot_blocks : 64u};
}

/// Row r = (b x layers + l) x q_heads + qh of the sums, with the offsets of its sum row and of
/// its KV head's count row, and whether it owns the counts (the group's first q-head: a query
/// token's row is counted once per KV head).
struct accumulated_row {
  int b, l, h;
  std::int64_t sums, counts;
  bool counts_owner;
};
TRIATTN_HOST_DEVICE accumulated_row accumulated_row_of(std::int64_t r, const kv_geometry& g, std::int64_t capacity) {
  const segment_id q = segment_of(r, g.num_layers, g.num_q_heads);
  const int G = g.group_size();
  const std::int64_t count_row = (std::int64_t{q.b} * g.num_layers + q.l) * g.num_kv_heads + q.h / G;
  return {q.b, q.l, q.h / G, r * capacity, count_row * capacity, q.h % G == 0};
}

/// The first slot of this thread in a (rows, slot blocks) grid, and the stride between its slots.
__device__ inline std::int64_t accumulated_first_slot() {
  return static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t accumulated_slot_stride() { return static_cast<std::int64_t>(gridDim.y) * blockDim.x; }

template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) accumulate_probability_rows(view_batch<V> batch, const float* probs,
                                                                       const float* weights, accumulated_state state) {
  const accumulated_row q = accumulated_row_of(blockIdx.x, batch.geometry, batch.capacity);
  const float weight = weights == nullptr ? 1.0f : weights[q.b];
  if (weight == 0.0f) return;  // a row that is not recorded (row_weight): neither summed nor counted
  const std::int32_t n = batch.views[q.b].length(q.l, q.h);
  for (std::int64_t j = accumulated_first_slot(); j < n; j += accumulated_slot_stride()) {
    float& sum = state.sums[q.sums + j];
    sum = ::TRIATTN_NAMESPACE::accumulate_probability(sum, weight, probs[q.sums + j]);
    if (q.counts_owner) ++state.counts[q.counts + j];
  }
}

template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    clear_accumulated_past_length(view_batch<V> batch, accumulated_state state) {
  const accumulated_row q = accumulated_row_of(blockIdx.x, batch.geometry, batch.capacity);
  const std::int32_t n = batch.views[q.b].length(q.l, q.h);
  for (std::int64_t j = n + accumulated_first_slot(); j < batch.capacity; j += accumulated_slot_stride()) {
    state.sums[q.sums + j] = 0.0f;
    if (q.counts_owner) state.counts[q.counts + j] = 0;
  }
}

/// Scores of segment r = (b x layers + l) x kv_heads + h into `scores` [rows, capacity]. In a
/// round (`in_round`), a segment of at most the slots its decision keeps is kept whole:
/// its slots score 0 and its values are not read, so that, as on the CPU, only a row that is
/// really ranked can fail on a non-finite value.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    score_accumulated_segments(view_batch<V> batch, accumulated_state state, accumulated_scoring scoring,
                               bool in_round, accumulated_split split, device_round round, float* scores,
                               std::int32_t* status) {
  const kv_geometry& g = batch.geometry;
  const std::int64_t r = blockIdx.x;
  const segment_id id = segment_of(r, g);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  const std::int64_t kept_all = in_round ? split.rule(round.info(id.b)).kept : 0;
  const int G = g.group_size();
  const std::int64_t cap = batch.capacity;
  const float* sums = state.sums + ((std::int64_t{id.b} * g.num_layers + id.l) * g.num_q_heads + id.h * G) * cap;
  const std::int32_t* counts = state.counts + r * cap;  // [b, l, h] is row r
  float* out = scores + r * cap;
  float value[max_head_dim];
  for (std::int64_t j = accumulated_first_slot(); j < n; j += accumulated_slot_stride()) {
    if (n <= kept_all) {
      out[j] = 0.0f;
      continue;
    }
    float s = ::TRIATTN_NAMESPACE::accumulated_score(sums + j, G, cap, counts[j], scoring.gqa, scoring.normalize);
    if (scoring.value_weighted) {
      load_value_row(view, id.l, id.h, j, value);
      const float norm = ::TRIATTN_NAMESPACE::value_l1_norm(value, g.head_dim);
      if (!isfinite(norm))
        fail_round(status, round_status::non_finite_key);
      s = ::TRIATTN_NAMESPACE::value_weighted_score(s, norm);
    }
    out[j] = s;
  }
}

/// `check_batch`, and (sequence, layer, q_head) rows that fit the x dimension of a grid (the
/// kernels take one row per block row).
template <KVCacheView V>
cudaError_t check_accumulated_rows(const char* api, const view_batch<V>& batch) {
  if (const cudaError_t err = check_batch(api, batch); err != cudaSuccess) return err;
  const std::int64_t rows = std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_q_heads;
  if (rows > INT32_MAX) return reject(api, "batch x layers x q_heads ", rows, " exceeds 2^31 - 1 rows");
  return cudaSuccess;
}

/// Both state arrays are needed by every kernel.
inline cudaError_t check_accumulated_state(const char* api, const accumulated_state& state) {
  if (state.sums == nullptr || state.counts == nullptr)
    return reject(api, "state sums ", static_cast<const void*>(state.sums), ", counts ",
                  static_cast<const void*>(state.counts), ": both must be device arrays");
  return cudaSuccess;
}

/// A VATP scoring writes its failures to the status word, which it then needs.
inline cudaError_t check_accumulated_status(const char* api, const accumulated_scoring& scoring,
                                            const std::int32_t* status) {
  if (scoring.value_weighted && status == nullptr)
    return reject(api, "status is null: value-weighted (VATP) scoring reports non-finite values there");
  return cudaSuccess;
}

}  // namespace detail

/// Adds one new query row per (sequence, layer, q_head): `probs` [batch, layers, q_heads,
/// capacity] holds the row's probabilities over the slots [0, n) it attends to, n = the
/// current length of (layer, q_head / G) in that sequence's view (the new token's slot
/// included); entries past n are not read. Each sum gains weight x probability (`weights`
/// [batch], one per sequence, or null for 1; compute it with `row_weight`), and each slot's
/// count gains one row per KV head. A weight of 0 records nothing for that sequence, which is
/// how Scissorhands skips the prompt rows before its window. The probabilities must be
/// finite and >= 0 (the CPU checks them; here they come from the engine's own softmax).
template <KVCacheView V>
cudaError_t accumulate_attention(const view_batch<V>& batch, const float* probs, const float* weights,
                                 const accumulated_state& state, cudaStream_t stream) {
  const char* api = "triattn::cuda::accumulate_attention";
  if (const cudaError_t err = detail::check_accumulated_rows(api, batch); err != cudaSuccess) return err;
  if (const cudaError_t err = detail::check_accumulated_state(api, state); err != cudaSuccess) return err;
  if (probs == nullptr) return detail::reject(api, "probs is null: expected [batch, layers, q_heads, capacity] floats");
  constexpr int threads = 256;
  const std::int64_t rows = std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_q_heads;
  const dim3 grid = detail::accumulated_grid(rows, batch.capacity, threads);
  detail::accumulate_probability_rows<threads><<<grid, threads, 0, stream>>>(batch, probs, weights, state);
  return cudaGetLastError();
}

/// The policy's scores into `scores` [batch, layers, kv_heads, capacity] (the CPU's `score`):
/// the GQA-combined sums, normalised if asked, times the value's L1 norm for VATP. Slots at or
/// past a length are not written. `status` receives `round_status::non_finite_key` when a
/// value norm is not finite; it may be null unless `scoring.value_weighted`.
template <KVCacheView V>
cudaError_t score_accumulated(const view_batch<V>& batch, const accumulated_state& state,
                              const accumulated_scoring& scoring, float* scores, std::int32_t* status,
                              cudaStream_t stream) {
  const char* api = "triattn::cuda::score_accumulated";
  if (const cudaError_t err = detail::check_accumulated_rows(api, batch); err != cudaSuccess) return err;
  if (const cudaError_t err = detail::check_accumulated_state(api, state); err != cudaSuccess) return err;
  if (const cudaError_t err = detail::check_accumulated_status(api, scoring, status); err != cudaSuccess) return err;
  if (scores == nullptr)
    return detail::reject(api, "scores is null: expected [batch, layers, kv_heads, capacity] floats");
  constexpr int threads = 128;  // a thread holds a value row of up to max_head_dim floats
  const std::int64_t rows = std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_kv_heads;
  const dim3 grid = detail::accumulated_grid(rows, batch.capacity, threads);
  detail::score_accumulated_segments<threads><<<grid, threads, 0, stream>>>(batch, state, scoring, false, {}, {},
                                                                            scores, status);
  return cudaGetLastError();
}

/// H2O's and VATP's device scorer for `plan_round`: `score_accumulated`'s scores of the
/// batch's state, with the CPU policy's split of each sequence's budget (`split`: sinks and
/// recent window protected, heavy + recent kept; a split of 0 slots keeps nothing). Build it
/// with `h2o(state, config)` or `vatp(state, config)`. A row holding at most the slots its
/// decision keeps is not scored (its values are not read). `status` receives
/// `non_finite_key` when a ranked value norm is not finite (VATP).
struct accumulated_scorer {
  accumulated_state state{};
  accumulated_scoring scoring{};
  accumulated_split split{};

  static accumulated_scorer h2o(const accumulated_state& s, const h2o_config& c) {
    return {s, {c.gqa, c.normalize, false}, accumulated_split{c.budget_parts()}};
  }
  /// VATP: H2O's scores times each value row's L1 norm (vatp_config is an h2o_config).
  static accumulated_scorer vatp(const accumulated_state& s, const h2o_config& c) {
    return {s, {c.gqa, c.normalize, true}, accumulated_split{c.budget_parts()}};
  }

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const { return split.rule(info); }

  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const cudaError_t err = detail::check_accumulated_rows(api, batch); err != cudaSuccess) return err;
    const h2o_budget& parts = split.parts;
    if (parts.sinks < 0 || parts.heavy_ratio > 1.0 || parts.recent_ratio > 1.0)
      return detail::reject(api, "split sinks ", parts.sinks, ", heavy_ratio ", parts.heavy_ratio, ", recent_ratio ",
                            parts.recent_ratio, ": expected sinks >= 0 and ratios in [0, 1] (or unset)");
    if ((parts.heavy_ratio >= 0.0 || parts.recent_ratio >= 0.0) && round.in.prompt_lengths == nullptr)
      return detail::reject(api, "a ratio split is a fraction of the prompt length: round_inputs::prompt_lengths is null");
    if (workspace == nullptr) {
      workspace_bytes = 0;
      return cudaSuccess;
    }
    cudaError_t err;
    if ((err = detail::check_accumulated_state(api, state)) != cudaSuccess) return err;
    if ((err = detail::check_accumulated_status(api, scoring, status)) != cudaSuccess) return err;
    constexpr int threads = 128;  // a thread holds a value row of up to max_head_dim floats
    const std::int64_t rows = std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_kv_heads;
    const dim3 grid = detail::accumulated_grid(rows, batch.capacity, threads);
    detail::score_accumulated_segments<threads><<<grid, threads, 0, stream>>>(batch, state, scoring, true, split, round,
                                                                              scores, status);
    return cudaGetLastError();
  }
};

/// Zeroes the state of every slot at or past its (layer, kv_head)'s length, up to the batch's
/// capacity: the CPU's `clear_past_length`. Run it after every compaction (or other shortening
/// of the cache), before the next `accumulate_attention`.
template <KVCacheView V>
cudaError_t clear_past_length(const view_batch<V>& batch, const accumulated_state& state, cudaStream_t stream) {
  const char* api = "triattn::cuda::clear_past_length";
  if (const cudaError_t err = detail::check_accumulated_rows(api, batch); err != cudaSuccess) return err;
  if (const cudaError_t err = detail::check_accumulated_state(api, state); err != cudaSuccess) return err;
  constexpr int threads = 256;
  const std::int64_t rows = std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_q_heads;
  const dim3 grid = detail::accumulated_grid(rows, batch.capacity, threads);
  detail::clear_accumulated_past_length<threads><<<grid, threads, 0, stream>>>(batch, state);
  return cudaGetLastError();
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
