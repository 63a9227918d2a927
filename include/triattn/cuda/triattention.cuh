/// \file triattn/cuda/triattention.cuh
/// \brief TriAttention on the GPU: the folded scorer over every layer and head of a batch, as
/// the device scorer of `plan_round` (round.cuh), which does the rest of the round.
///
/// Scoring is four launches:
/// 1. coefficients: one row [sets][c_re | c_im] then e per (batch, layer, q_head)
///    (`triattention_coefficient_row`) from the calibrated stats and each sequence's round
///    start, once per round, on the device (one thread per band: phasors in double, as the CPU
///    forms them);
/// 2. scores: one thread per (sequence, layer, kv_head, slot) reads its key once through the
///    view's accessor (`load_key_row`: 16-byte loads of f16/bf16/fp8 decoded to fp32 times
///    k_scale, or the view's own `key_accessor`), forms the bands and |K_f| once for the GQA
///    group and writes one score per q-head, accumulating in fp32;
/// 3. z-scores per (sequence, layer, q_head) row over the candidate slots (double sums);
/// 4. the GQA reduction into one row per (sequence, layer, kv_head).
/// Every formula is triattention_math.hpp's: the CPU scorer calls the same functions.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/triattention_config.hpp"
#include "triattn/policies/triattention_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// Calibrated query statistics in device memory, with the host copy of their shape.
struct triattention_device_stats {
  const float* q_mean_re = nullptr;   ///< [layers, q_heads, bands]
  const float* q_mean_im = nullptr;   ///< [layers, q_heads, bands]
  const float* q_abs_mean = nullptr;  ///< [layers, q_heads, bands]
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  rope_style style = rope_style::half;
  double attention_scale = 1.0;
};

/// Floats `upload_stats` needs in its device buffer: 3 x layers x q_heads x bands.
inline std::size_t stats_floats(const query_stats& s) { return 3 * s.row(s.num_layers, 0); }

/// Copies `s` into `device` [stats_floats(s)] on `stream` (an explicit copy the caller asks
/// for, once per model) and describes it. `s` must stay alive until the copy has run.
inline cudaError_t upload_stats(const query_stats& s, float* device, cudaStream_t stream,
                                triattention_device_stats& out) {
  const std::size_t n = s.row(s.num_layers, 0);
  const float* parts[] = {s.q_mean_real.data(), s.q_mean_imag.data(), s.q_abs_mean.data()};
  for (std::size_t i = 0; i < 3; ++i)
    if (const cudaError_t err = cudaMemcpyAsync(device + i * n, parts[i], n * sizeof(float), cudaMemcpyHostToDevice, stream);
        err != cudaSuccess)
      return err;
  out = {device, device + n, device + 2 * n, s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim, s.style,
         s.attention_scale};
  return cudaSuccess;
}

namespace detail {

/// Offsets, phasors and coefficient sets of a round: the CPU scorer's `score_into` setup.
struct triattention_round {
  int num_offsets;  ///< of {1, 2, 4, ..., <= offset_max}
  int sets;         ///< 1 (mean folds every offset) or num_offsets (max)
  double scale;     ///< triattention_coefficient_scale
  bool trig, norm;  ///< terms kept by the ablation flags
};

inline triattention_round make_round(const triattention_config& c, const triattention_device_stats& stats,
                                     key_state keys) {
  const int n = triattention_num_offsets(c.offset_max);
  return {n, c.aggregation == offset_aggregation::mean ? 1 : n,
          triattention_coefficient_scale(stats.attention_scale, keys), !c.disable_trig, !c.disable_norm};
}

/// Largest number of offsets: 2^62 bounds every int64 offset_max.
inline constexpr int max_offsets = 63;

/// One thread per (sequence, layer, q_head, band): w_f, the round phasors and c_f, e_f.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    triattention_coefficients(kv_geometry g, triattention_device_stats stats, triattention_round round,
                              const std::int64_t* round_starts, int batch, double* w, float* coef) {
  const int F = g.head_dim / 2;
  const std::int64_t rows = std::int64_t{batch} * g.num_layers * g.num_q_heads;
  const std::int64_t t = blockIdx.x * std::int64_t{Threads} + threadIdx.x;
  if (t >= rows * F) return;
  const int f = static_cast<int>(t % F);
  const std::int64_t row = t / F;  // (b * layers + l) * q_heads + qh
  const segment_id id = segment_of(row, g.num_layers, g.num_q_heads);
  const std::int64_t stats_row = std::int64_t{id.l} * g.num_q_heads + id.h;
  const int b = id.b;
  const double wf = inv_freq(g.rope, g.head_dim, f);
  if (row == 0) w[f] = wf;
  std::int64_t offsets[max_offsets];
  for (int j = 0; j < round.num_offsets; ++j) offsets[j] = triattention_offset(j);
  const std::int64_t q = stats_row * F + f;
  const int per_set = round.num_offsets / round.sets;
  float* c = coef + row * triattention_coefficient_row(round.sets, F);  // [sets][c_re | c_im], e
  for (int j = 0; j < round.sets; ++j) {
    double w_re = 0.0, w_im = 0.0;
    triattention_phasors(&wf, 1, round_starts[b], offsets + j * per_set, per_set, &w_re, &w_im);
    c[2 * j * F + f] = c[2 * j * F + F + f] = 0.0f;
    if (round.trig)
      triattention_trig_coefficients(stats.q_mean_re + q, stats.q_mean_im + q, &w_re, &w_im, 1, round.scale,
                                     c + 2 * j * F + f, c + 2 * j * F + F + f);
  }
  c[2 * round.sets * F + f] = 0.0f;
  if (round.norm)
    triattention_norm_coefficients(stats.q_mean_re + q, stats.q_mean_im + q, stats.q_abs_mean + q, 1, round.scale,
                                   c + 2 * round.sets * F + f);
}

/// One thread per (sequence, layer, kv_head, slot): the key's bands once, one score per q-head
/// of the group into `scores` [batch, layers, q_heads, capacity]. `MaxDim` bounds head_dim so
/// that the per-thread rows have a compile-time size. In a round (`budgets` [batch] not null),
/// a row of at most its sequence's budget is kept whole and not read: as on the CPU, only a
/// ranked row can fail on a non-finite key.
template <int Threads, int MaxDim, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    triattention_scores(view_batch<V> batch, triattention_round round, const std::int32_t* budgets, const double* w,
                        const float* coef, float* scores, std::int32_t* status) {
  const kv_geometry& g = batch.geometry;
  const int F = g.head_dim / 2, G = g.group_size();
  // Grid (slot blocks, layers x kv_heads, batch): the row is (z * layers * kv_heads + y).
  const segment_id id = segment_of(std::int64_t{blockIdx.z} * g.num_layers * g.num_kv_heads + blockIdx.y, g);
  const int b = id.b, l = id.l, h = id.h;
  const V& view = batch.views[b];
  const std::int64_t s = blockIdx.x * std::int64_t{Threads} + threadIdx.x;
  const std::int32_t n = view.length(l, h);
  if (s >= n || (budgets != nullptr && n <= budgets[b])) return;
  float key[MaxDim], x[3 * MaxDim / 2];
  load_key_row(view, l, h, s, key);
  bool finite = true;
  for (int d = 0; d < g.head_dim; ++d) finite = finite && isfinite(key[d]);
  if (!finite && status != nullptr)
    fail_round(status, round_status::non_finite_key);
  triattention_key_features(key, g.head_dim, g.rope.style, x);
  if (g.keys == key_state::pre_rope) {
    float p_re[MaxDim / 2], p_im[MaxDim / 2];
    for (int f = 0; f < F; ++f) triattention_position_phasor(w[f], view.position(l, h, s), p_re[f], p_im[f]);
    triattention_rotate_features(x, p_re, p_im, F);
  }
  triattention_key_moduli(x, F);
  const int R = triattention_coefficient_row(round.sets, F);
  for (int gi = 0; gi < G; ++gi) {
    const std::int64_t row = (std::int64_t{b} * g.num_layers + l) * g.num_q_heads + h * G + gi;
    scores[row * batch.capacity + s] = triattention_key_score(coef + row * R, round.sets, x, F);
  }
}

/// One block per (sequence, layer, q_head) row: z-scores it in place over its candidate slots
/// (those the round's protection leaves to compete).
template <int Threads, class Scorer, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    triattention_normalize(view_batch<V> batch, Scorer scorer, device_round round, float* scores) {
  using reduce = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ double mean_shared, count_shared, std_shared;
  const kv_geometry& g = batch.geometry;
  const std::int64_t row = blockIdx.x;  // (b * layers + l) * q_heads + qh
  const segment_id id = segment_of(row, g.num_layers, g.num_q_heads);
  const int l = id.l, h = id.h / g.group_size();
  const V& view = batch.views[id.b];
  const protection prot = sequence_rule(scorer, round, id.b).prot;
  const std::int32_t n = view.length(l, h);
  float* x = scores + row * batch.capacity;
  double sum = 0.0, count = 0.0;
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += Threads)
    if (!is_protected(prot, s, n, view.position(l, h, s))) sum += x[s], count += 1.0;
  const double total = reduce(temp).Sum(sum);  // valid in thread 0
  __syncthreads();                             // before `temp` is reused
  const double candidates = reduce(temp).Sum(count);
  if (threadIdx.x == 0) {
    count_shared = candidates;
    mean_shared = candidates > 0.0 ? total / candidates : 0.0;
  }
  __syncthreads();
  if (count_shared == 0.0) return;  // no candidate: the row stays raw, as on the CPU (uniform exit)
  const double mean = mean_shared;
  double sq = 0.0;
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += Threads)
    if (!is_protected(prot, s, n, view.position(l, h, s))) sq += triattention_squared_deviation(x[s], mean);
  const double sum_sq = reduce(temp).Sum(sq);
  if (threadIdx.x == 0) std_shared = triattention_row_std(sum_sq, static_cast<std::int64_t>(count_shared));
  __syncthreads();
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += Threads)
    x[s] = triattention_zscore(x[s], mean, std_shared);
}

/// One thread per (sequence, layer, kv_head, slot): the GQA reduction of the group's q-head
/// rows `scores` [batch, layers, q_heads, capacity] into `out` [batch, layers, kv_heads, capacity].
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    triattention_reduce_group(view_batch<V> batch, bool max, const float* scores, float* out) {
  const kv_geometry& g = batch.geometry;
  const std::int64_t row = blockIdx.x;  // (b * layers + l) * kv_heads + h
  const segment_id id = segment_of(row, g);
  const std::int64_t s = blockIdx.y * std::int64_t{Threads} + threadIdx.x;
  if (s >= batch.views[id.b].length(id.l, id.h)) return;
  const int G = g.group_size();
  const std::int64_t first = ((std::int64_t{id.b} * g.num_layers + id.l) * g.num_q_heads + id.h * G) * batch.capacity;
  out[row * batch.capacity + s] = triattention_group_term(scores + first + s, G, batch.capacity, max, 1.0f);
}

template <KVCacheView V>
cudaError_t check_triattention(const char* api, const view_batch<V>& batch, const triattention_device_stats& stats,
                               const triattention_config& c) {
  if (const cudaError_t err = check_batch(api, batch); err != cudaSuccess) return err;
  const kv_geometry& g = batch.geometry;
  if (stats.num_layers != g.num_layers || stats.num_q_heads != g.num_q_heads || stats.num_kv_heads != g.num_kv_heads ||
      stats.head_dim != g.head_dim)
    return reject(api, "stats for ", stats.num_layers, " layers, ", stats.num_q_heads, " q_heads, ",
                  stats.num_kv_heads, " kv_heads, head_dim ", stats.head_dim, " do not match the batch's ",
                  g.num_layers, ", ", g.num_q_heads, ", ", g.num_kv_heads, ", ", g.head_dim);
  if (stats.style != g.rope.style || rotary_dims(g.rope, g.head_dim) != g.head_dim)
    return reject(api, "stats and model disagree on the RoPE pairing, or rotary_dim ", g.rope.rotary_dim,
                  " < head_dim ", g.head_dim, ": TriAttention needs every dim rotated with the stats' pairing");
  if (stats.q_mean_re == nullptr || stats.q_mean_im == nullptr || stats.q_abs_mean == nullptr)
    return reject(api, "device stats are null: call upload_stats first");
  if (c.offset_max < 1) return reject(api, "offset_max ", c.offset_max, " must be >= 1");
  if (std::int64_t{g.num_layers} * g.num_kv_heads > 65535 || batch.size > 65535)
    return reject(api, g.num_layers, " layers x ", g.num_kv_heads, " kv_heads and a batch of ", batch.size,
                  " must each stay within 65535 (a grid dimension)");
  return cudaSuccess;
}

/// The coefficient and score buffers of a round, carved from the workspace.
struct triattention_buffers {
  double* w;
  float *coef, *scores;  ///< coef [batch, layers, q_heads, triattention_coefficient_row]
};

template <KVCacheView V>
triattention_buffers carve_scoring(workspace_carver& ws, const view_batch<V>& batch, const triattention_round& round,
                                   bool own_scores) {
  const kv_geometry& g = batch.geometry;
  const auto rows = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_q_heads;
  const auto F = static_cast<std::size_t>(g.head_dim / 2);
  triattention_buffers out{};
  out.w = ws.take<double>(F);
  out.coef = ws.take<float>(rows * static_cast<std::size_t>(triattention_coefficient_row(round.sets, static_cast<int>(F))));
  out.scores = own_scores ? ws.take<float>(rows * static_cast<std::size_t>(batch.capacity)) : nullptr;
  return out;
}

template <KVCacheView V>
cudaError_t launch_scoring(const view_batch<V>& batch, const triattention_device_stats& stats,
                           const triattention_round& round, const std::int64_t* round_starts,
                           const std::int32_t* budgets, const triattention_buffers& buf, float* scores,
                           std::int32_t* status, cudaStream_t stream) {
  constexpr int threads = 128;
  const kv_geometry& g = batch.geometry;
  const std::int64_t bands = std::int64_t{batch.size} * g.num_layers * g.num_q_heads * (g.head_dim / 2);
  triattention_coefficients<threads><<<blocks_for(bands, threads), threads, 0, stream>>>(
      g, stats, round, round_starts, batch.size, buf.w, buf.coef);
  const dim3 grid(blocks_for(batch.capacity, threads), static_cast<unsigned>(g.num_layers * g.num_kv_heads),
                  static_cast<unsigned>(batch.size));
  const auto launch = [&](auto kernel) {
    kernel<<<grid, threads, 0, stream>>>(batch, round, budgets, buf.w, buf.coef, scores, status);
  };
  if (g.head_dim <= 64)
    launch(triattention_scores<threads, 64, V>);
  else if (g.head_dim <= 128)
    launch(triattention_scores<threads, 128, V>);
  else
    launch(triattention_scores<threads, max_head_dim, V>);
  return cudaGetLastError();
}

}  // namespace detail

/// Raw TriAttention scores (not z-scored) of every key of the batch into `scores`
/// [batch, layers, q_heads, capacity], as the CPU's `triattention::score`; slots past a length
/// are not written. `round_starts` [batch]: each sequence's round start r (the position of its
/// next token). `status` (may be null) receives `non_finite_key` when a key is NaN or infinite;
/// that key's scores are then NaN.
template <KVCacheView V>
cudaError_t triattention_score(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                               const triattention_device_stats& stats, const triattention_config& config,
                               const std::int64_t* round_starts, float* scores, std::int32_t* status,
                               cudaStream_t stream) {
  const char* api = "triattn::cuda::triattention_score";
  if (const cudaError_t err = detail::check_triattention(api, batch, stats, config); err != cudaSuccess) return err;
  const detail::triattention_round round = detail::make_round(config, stats, batch.geometry.keys);
  detail::workspace_carver ws(workspace);
  const detail::triattention_buffers buf = detail::carve_scoring(ws, batch, round, false);
  cudaError_t err;
  if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (scores == nullptr || round_starts == nullptr) return detail::reject(api, "scores and round_starts must not be null");
  return detail::launch_scoring(batch, stats, round, round_starts, nullptr, buf, scores, status, stream);
}

/// TriAttention's device scorer for `plan_round`: scores, z-scores (`config.normalize`) and
/// reduces the GQA group (`config.gqa_reduction`) of every (sequence, layer, kv_head); its rule
/// protects the last `config.window` slots. The granularity, the prompt's protection and the
/// row reduction are the round's (`round_options`; `seed()`'s union is `granularity::
/// whole_sequence` with `row_reduction::max`). Needs `round_inputs::round_starts`. A NaN or
/// infinite key of a ranked row (longer than its sequence's budget) sets `non_finite_key`.
struct triattention_scorer {
  static constexpr score_domain domain = score_domain::logit;  ///< as the CPU policy's
  triattention_device_stats stats{};
  triattention_config config{};

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(0, config.window), info.budget};
  }

  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const cudaError_t err = detail::check_triattention(api, batch, stats, config); err != cudaSuccess) return err;
    if (config.window < 0) return detail::reject(api, "window ", config.window, " must be >= 0");
    // The extensions beyond the paper have no device scorer yet: refuse rather than ignore them.
    if (config.value_protect != 0.0 || config.redundancy != 0.0f || config.score_ema != 0.0f)
      return detail::reject(api, "value_protect ", config.value_protect, ", redundancy ", config.redundancy,
                            " and score_ema ", config.score_ema, " must be 0: the CUDA scorer has no extensions");
    const kv_geometry& g = batch.geometry;
    const detail::triattention_round tri = detail::make_round(config, stats, g.keys);
    detail::workspace_carver ws(workspace);
    const detail::triattention_buffers buf = detail::carve_scoring(ws, batch, tri, true);
    cudaError_t err;
    if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
    if (round.in.round_starts == nullptr)
      return detail::reject(api, "round_inputs::round_starts is null: TriAttention scores from each round start");
    if ((err = detail::launch_scoring(batch, stats, tri, round.in.round_starts, round.in.budgets, buf, buf.scores,
                                      status, stream)) != cudaSuccess)
      return err;
    constexpr int threads = 256;
    if (config.normalize) {
      const auto rows = static_cast<unsigned>(batch.size * g.num_layers * g.num_q_heads);
      detail::triattention_normalize<threads><<<rows, threads, 0, stream>>>(batch, *this, round, buf.scores);
    }
    const dim3 grid(static_cast<unsigned>(batch.size * g.num_layers * g.num_kv_heads),
                    detail::blocks_for(batch.capacity, threads));
    detail::triattention_reduce_group<threads><<<grid, threads, 0, stream>>>(
        batch, config.gqa_reduction == triattention_gqa_reduction::max, buf.scores, scores);
    return cudaGetLastError();
  }
};

}  // namespace cuda
TRIATTN_NAMESPACE_END
