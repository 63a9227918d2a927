/// \file triattn/cuda/window_attention.cuh
/// \brief What SnapKV (snapkv.cuh) and R-KV (rkv.cuh) share on the GPU: the kept window
/// queries, the key check, and the window attention recomputed from those queries.
///
/// The formulas are the CPU's (policies/window_math.hpp): each kernel calls the same
/// per-element functions as snapkv.hpp / rkv.hpp, in fp32. A (sequence, layer, kv_head)
/// "segment" of n slots is scored when n > window and n > its sequence's budget (a round's
/// segment that fits is kept whole, unread, as on the CPU); its last `window` slots score
/// +inf, and so do all slots of a segment that is not scored.
///
/// Keys are read as whole rows through the view's accessor (`load_key_row`: the view's
/// `key_accessor` hook, else its dtype and `k_scale`), as the CPU policies read them, so an
/// engine's own element encoding scores the same on both sides.
///
/// **Kernels** (segment s = (b * layers + l) * kv_heads + h, `segment_of`):
/// 1. `window_prepare`: one thread per slot checks the key is finite (else the status word
///    becomes `non_finite_key`) and, for R-KV, stores the divisor of its unit key.
/// 2. `window_attention`: one block per (segment, q-head) for SnapKV, per segment for R-KV
///    (the logit of a (row, key) pair is then the max over the group). For every window row
///    it computes the logits once into a per-block scratch row, reduces their max and the sum
///    of the softmax numerators with `cub::BlockReduce`, and adds the probabilities to the
///    row's votes. Every slot j is owned by thread j % threads in all passes, so no two
///    threads touch one entry and no atomics are needed.
/// Then each policy's own kernels turn the votes into scores. Every reduction has a fixed
/// order, so a call gives the same scores on every run.
///
/// **Limits.** All sequences of a batch have the same number of window rows. Keys must be
/// post-RoPE (`key_state::pre_rope` is rejected, naming the policy; the CPU rotates them).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <cub/block/block_reduce.cuh>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/window_config.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// The kept window queries of a batch: the last `rows` post-RoPE queries of every (sequence,
/// layer, q_head), oldest first, and their token positions (one set per sequence: the engine
/// observes every layer and head at each token). Queries must be finite.
struct window_query_batch {
  const float* queries = nullptr;           ///< [batch, layers, q_heads, rows, head_dim]
  const std::int32_t* positions = nullptr;  ///< [batch, rows]
  int rows = 0;                             ///< m, 1 <= m <= window
};

namespace detail {

/// How a policy's votes are counted: per q-head (SnapKV) or once per group over the group's
/// largest logit, averaged over the rows (R-KV).
enum class window_votes : std::uint8_t { per_q_head, group_max };

/// Everything the shared kernels read besides the batch (passed by value).
struct window_params {
  window_votes votes = window_votes::per_q_head;
  int window = 1;
  window_query_batch q{};
  device_round round{};  ///< the sequences' budgets (null outside a round: every segment over `window` is scored)
};

/// Whether segment (sequence b) of n slots is scored (else every slot scores +inf and no key is read).
TRIATTN_HOST_DEVICE bool window_scored(const window_params& p, int b, std::int64_t n) {
  return n > p.window && n > p.round.info(b).budget;
}

/// Threads of the window kernels: one per cell of R-KV's 16 x 16 similarity tiles.
inline constexpr int similarity_tile = 16;
inline constexpr int window_threads = similarity_tile * similarity_tile;

struct max_op {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// A block-wide reduction whose result every thread receives: `cub::BlockReduce` (a fixed
/// order for a given block size, so the same float on every run) and a broadcast. Every
/// thread must call it; `temp` and `shared` are free again on return.
template <int Threads>
struct block_all_reduce {
  using reduce = cub::BlockReduce<float, Threads>;
  typename reduce::TempStorage temp;
  float shared;

  __device__ float broadcast(float r) {
    if (threadIdx.x == 0) shared = r;
    __syncthreads();
    const float out = shared;
    __syncthreads();
    return out;
  }
  __device__ float max(float v) { return broadcast(reduce(temp).Reduce(v, max_op{})); }
  __device__ float sum(float v) { return broadcast(reduce(temp).Sum(v)); }
};

/// q·k in fp32 for a decoded key `key` and a query `q`, both [head_dim].
__device__ inline float key_dot(const float* key, int head_dim, const float* q) {
  float s = 0.0f;
  for (int d = 0; d < head_dim; ++d) s += key[d] * q[d];
  return s;
}

/// One thread per slot of every scored segment: the finite-key check, and R-KV's unit-key
/// divisors [segments, capacity] when `divisors` is not null.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) window_prepare(view_batch<V> batch, window_params p, float* divisors,
                                                          std::int32_t* status) {
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  if (!window_scored(p, id.b, n)) return;
  const int head_dim = batch.geometry.head_dim;
  float key[max_head_dim];
  for (std::int64_t j = blockIdx.y * static_cast<std::int64_t>(Threads) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.y) * Threads) {
    load_key_row(view, id.l, id.h, j, key);
    float squared = 0.0f;
    bool finite = true;
    for (int d = 0; d < head_dim; ++d) {
      const float x = key[d];
      finite = finite && isfinite(x);
      squared += x * x;
    }
    if (!finite) fail_round(status, round_status::non_finite_key);
    if (divisors != nullptr) divisors[s * batch.capacity + j] = rkv_unit_divisor(squared);
  }
}

/// Votes (per q-head blockIdx.y of the group) or mean attention (the group's max logit) of
/// the prefix slots of one segment into `acc` [segments, gridDim.y, capacity]; `logits` is
/// the block's scratch row of the same layout.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) window_attention(view_batch<V> batch, window_params p, float* logits,
                                                            float* acc) {
  __shared__ block_all_reduce<Threads> all;
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, id.b, n)) return;  // the whole block leaves: no barrier is skipped
  const kv_geometry& g = batch.geometry;
  const int group = g.group_size(), head_dim = g.head_dim;
  const bool group_max = p.votes == window_votes::group_max;
  const std::int64_t prefix = n - p.window;
  const std::int64_t keys = group_max ? prefix : n;  // the keys of the softmax
  const int first_head = group_max ? 0 : static_cast<int>(blockIdx.y), heads = group_max ? group : 1;
  const std::int64_t row = (s * gridDim.y + blockIdx.y) * batch.capacity;
  float* x = logits + row;
  float* out = acc + row;
  const float scale = window_logit_scale(head_dim);
  float key[max_head_dim];
  for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] = 0.0f;
  for (int i = 0; i < p.q.rows; ++i) {
    const std::int32_t query_position = p.q.positions[static_cast<std::int64_t>(id.b) * p.q.rows + i];
    float top = -INFINITY;
    for (std::int64_t j = threadIdx.x; j < keys; j += Threads) {
      load_key_row(view, id.l, id.h, j, key);  // once for the group's q-heads
      const std::int32_t key_position = view.position(id.l, id.h, j);
      float best = -INFINITY;
      for (int k = first_head; k < first_head + heads; ++k) {
        const float* q = p.q.queries + ((s * group + k) * p.q.rows + i) * head_dim;
        best = fmaxf(best, window_logit(key_dot(key, head_dim, q), scale, key_position, query_position));
      }
      x[j] = best;
      top = fmaxf(top, best);
    }
    top = all.max(top);
    float sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < keys; j += Threads) sum += x[j] = softmax_numerator(x[j], top);
    sum = all.sum(sum);
    for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] += softmax_probability(x[j], sum);
  }
  if (group_max)
    for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] = rkv_attention_mean(out[j], p.q.rows);
}

/// The shared buffers of a window scoring pass (null while sizing).
struct window_buffers {
  float* logits = nullptr;  ///< [segments, heads, capacity], heads = group (per_q_head) or 1
  float* acc = nullptr;     ///< [segments, heads, capacity]
};

template <KVCacheView V>
window_buffers carve_window(workspace_carver& ws, const view_batch<V>& batch, const window_params& p) {
  const auto heads = static_cast<std::size_t>(p.votes == window_votes::group_max ? 1 : batch.geometry.group_size());
  const std::size_t rows = static_cast<std::size_t>(segments_of(batch)) * heads * static_cast<std::size_t>(batch.capacity);
  return {ws.take<float>(rows), ws.take<float>(rows)};
}

/// Grids of the window kernels: one block row per segment, slot blocks (or tiles) beyond.
template <KVCacheView V>
dim3 window_grid(const view_batch<V>& batch, int per_block) {
  const unsigned blocks = blocks_for(batch.capacity, per_block);
  return {static_cast<unsigned>(segments_of(batch)), blocks < 65535u ? blocks : 65535u};  // grid-stride beyond
}

/// Enqueues the key check and the window attention (kernels 1 and 2 of the file comment).
template <KVCacheView V>
cudaError_t launch_window_attention(const view_batch<V>& batch, const window_params& p, const window_buffers& b,
                                    float* divisors, std::int32_t* status, cudaStream_t stream) {
  constexpr int threads = window_threads;
  window_prepare<threads><<<window_grid(batch, threads), threads, 0, stream>>>(batch, p, divisors, status);
  const unsigned heads = p.votes == window_votes::group_max ? 1u : static_cast<unsigned>(batch.geometry.group_size());
  window_attention<threads><<<dim3(static_cast<unsigned>(segments_of(batch)), heads), threads, 0, stream>>>(
      batch, p, b.logits, b.acc);
  return cudaGetLastError();
}

/// Host checks shared by both policies: the config's message, the batch, the key state, the
/// queries' shape.
template <KVCacheView V>
cudaError_t check_window(const char* api, const char* policy, const view_batch<V>& batch, const window_query_batch& q,
                         int window, const std::string& config_error) {
  if (!config_error.empty()) return reject(api, config_error);
  if (const cudaError_t err = check_batch(api, batch); err != cudaSuccess) return err;
  if (const cudaError_t err = check_post_rope_keys(api, policy, batch); err != cudaSuccess) return err;
  if (q.rows < 1 || q.rows > window) return reject(api, "query rows ", q.rows, " must be in [1, window ", window, "]");
  if (segments_of(batch) > INT32_MAX)
    return reject(api, "batch of ", batch.size, " x ", batch.geometry.num_layers, " layers x ",
                  batch.geometry.num_kv_heads, " kv_heads exceeds 2^31 segments");
  return cudaSuccess;
}

/// Null checks of the launch pass.
inline cudaError_t check_window_pointers(const char* api, const float* scores, const std::int32_t* status,
                                         const window_query_batch& q) {
  if (scores == nullptr || status == nullptr || q.queries == nullptr || q.positions == nullptr)
    return reject(api, "scores, status, queries and query positions must not be null");
  return cudaSuccess;
}

}  // namespace detail
}  // namespace cuda
TRIATTN_NAMESPACE_END
