/// \file triattn/cuda/rkv.cuh
/// \brief R-KV on the GPU: the device scorer of `plan_round` (round.cuh). The window
/// attention (window_attention.cuh, the group's max logit averaged over the rows) gives the
/// importance; the redundancy is computed on 16 x 16 tiles of unit keys in shared memory
/// (each tile's 16 keys read whole through the view's accessor, `load_unit_rows`):
/// - `rkv_newest` finds each key's newest near-duplicate, scanning column tiles newest first
///   and stopping once every row of the tile has one;
/// - `rkv_column_means` sums every column over all rows in a fixed order;
/// - `rkv_redundancy_softmax` normalises them over the n keys (`cub::BlockReduce`);
/// - `rkv_finish` mixes the pooled importance and the redundancy (rkv_mix).
/// Every formula is window_math.hpp's, as rkv.hpp calls them.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/window_attention.cuh"
#include "triattn/policies/window_config.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// 16 unit keys of one (layer, kv_head) in shared memory: row i is key `first + i` read
/// through the view's accessor (`load_key_row`) and divided by its divisor, zero past n.
/// A row is padded by one float so that the 16 rows of a column read fall in different banks.
using unit_rows = float[similarity_tile][max_head_dim + 1];

/// Fills `rows` (see `unit_rows`). Every thread of the block must call it; it starts with a
/// barrier (every thread is done with the old rows) and ends with one (the new rows are
/// visible). An accessor decodes whole rows, so one thread reads each row, then the block divides.
template <KVCacheView V>
__device__ void load_unit_rows(const V& view, int l, int h, int head_dim, const float* divisors, std::int64_t n,
                               std::int64_t first, unit_rows& rows) {
  constexpr int side = similarity_tile;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < side && first + threadIdx.x < n)
    load_key_row(view, l, h, first + threadIdx.x, rows[threadIdx.x]);
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < side * head_dim; e += static_cast<int>(blockDim.x)) {
    const int i = e / head_dim, d = e % head_dim;
    rows[i][d] = first + i < n ? rows[i][d] / divisors[first + i] : 0.0f;
  }
  __syncthreads();
}

/// The unit-key dot product S[r0 + ty, c0 + tx] for this thread (ty, tx) = (threadIdx.x /
/// side, threadIdx.x % side), rows r0.. in `a` and c0.. in `b` (`load_unit_rows`). The sum runs
/// over d in order, so S[r, j] and S[j, r] are the same float.
__device__ inline float unit_dot(const unit_rows& a, const unit_rows& b, int head_dim) {
  constexpr int side = similarity_tile;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  float s = 0.0f;
  for (int d = 0; d < head_dim; ++d) s += a[ty][d] * b[tx][d];
  return s;
}

/// `newest` [segments, capacity]: for every key r of a scored segment, its newest
/// near-duplicate (rkv_duplicate_candidate), 0 when none. Grid (segments, row tiles).
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_newest(view_batch<V> batch, window_params p, float threshold,
                                                      const float* divisors, std::int32_t* newest) {
  constexpr int side = similarity_tile;
  static_assert(Threads == side * side, "one thread per tile cell");
  __shared__ unit_rows a, b;  // the row tile's unit keys, the column tile's
  __shared__ int best[side];
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, id.b, n)) return;
  const std::int64_t seg_row = s * batch.capacity, tiles = (n + side - 1) / side;
  const int head_dim = batch.geometry.head_dim;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  for (std::int64_t rt = blockIdx.y; rt < tiles; rt += gridDim.y) {
    const std::int64_t r0 = rt * side, r = r0 + ty;
    if (static_cast<int>(threadIdx.x) < side) best[threadIdx.x] = 0;  // visible after load_unit_rows' barriers
    load_unit_rows(view, id.l, id.h, head_dim, divisors + seg_row, n, r0, a);
    for (std::int64_t ct = tiles - 1; ct >= 0; --ct) {
      const std::int64_t j = ct * side + tx;
      load_unit_rows(view, id.l, id.h, head_dim, divisors + seg_row, n, ct * side, b);
      const float dot = unit_dot(a, b, head_dim);
      if (r < n && j < n && rkv_duplicate_candidate(rkv_similarity(dot, r, j), j, threshold))
        atomicMax(&best[ty], static_cast<int>(j));
      __syncthreads();
      // Older column tiles hold only smaller j: once every row has a candidate, none can win.
      if (__syncthreads_and(r >= n || best[ty] > 0)) break;
    }
    if (static_cast<int>(threadIdx.x) < side && r0 + threadIdx.x < n) newest[seg_row + r0 + threadIdx.x] = best[threadIdx.x];
    __syncthreads();  // `best` is reset by the next row tile (`a` is reloaded behind a barrier)
  }
}

/// `means` [segments, capacity]: column j's redundancy before the softmax, the mean over all
/// rows r of rkv_column_term. Grid (segments, column tiles); each column is summed in a fixed
/// order (per tile row, then over the tile's rows).
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_column_means(view_batch<V> batch, window_params p, const float* divisors,
                                                            const std::int32_t* newest, float* means) {
  constexpr int side = similarity_tile;
  static_assert(Threads == side * side, "one thread per tile cell");
  __shared__ unit_rows a, b;  // the row tile's unit keys, the column tile's
  __shared__ float part[side][side + 1];
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, id.b, n)) return;
  const std::int64_t seg_row = s * batch.capacity, tiles = (n + side - 1) / side;
  const int head_dim = batch.geometry.head_dim;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  for (std::int64_t ct = blockIdx.y; ct < tiles; ct += gridDim.y) {
    const std::int64_t c0 = ct * side, j = c0 + tx;
    load_unit_rows(view, id.l, id.h, head_dim, divisors + seg_row, n, c0, b);
    float sum = 0.0f;
    for (std::int64_t rt = 0; rt < tiles; ++rt) {
      const std::int64_t r = rt * side + ty;
      load_unit_rows(view, id.l, id.h, head_dim, divisors + seg_row, n, rt * side, a);
      const float dot = unit_dot(a, b, head_dim);
      if (r < n && j < n) sum += rkv_column_term(rkv_similarity(dot, r, j), j, newest[seg_row + r]);
    }
    part[ty][tx] = sum;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < side && c0 + threadIdx.x < n) {
      float column = 0.0f;
      for (int k = 0; k < side; ++k) column += part[k][threadIdx.x];
      means[seg_row + c0 + threadIdx.x] = rkv_column_mean(column, n);
    }
    __syncthreads();  // `part` is rewritten by the next column tile
  }
}

/// R-KV's redundancy in place: the softmax over the n column means of each scored segment.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_redundancy_softmax(view_batch<V> batch, window_params p, float* means) {
  __shared__ block_all_reduce<Threads> all;
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const std::int64_t n = batch.views[id.b].length(id.l, id.h);
  if (!window_scored(p, id.b, n)) return;
  float* x = means + s * batch.capacity;
  float top = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) top = fmaxf(top, x[j]);
  top = all.max(top);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) sum += x[j] = softmax_numerator(x[j], top);
  sum = all.sum(sum);
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) x[j] = softmax_probability(x[j], sum);
}

/// `scores` [segments, capacity] for the slots below each length: on the prefix the mix of
/// the pooled importance `acc` and the redundancy, +inf on the window and in unscored segments.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_finish(view_batch<V> batch, window_params p, rkv_config c,
                                                      const float* acc, const float* redundancy, float* scores) {
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const std::int64_t n = batch.views[id.b].length(id.l, id.h);
  const std::int64_t prefix = window_scored(p, id.b, n) ? n - p.window : 0;
  const std::int64_t seg_row = s * batch.capacity;
  for (std::int64_t j = blockIdx.y * static_cast<std::int64_t>(Threads) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.y) * Threads)
    scores[seg_row + j] =
        j < prefix ? rkv_mix(pool_at(acc + seg_row, prefix, j, c.kernel, pooling::max), redundancy[seg_row + j], c.lambda)
                   : INFINITY;
}

}  // namespace detail

/// R-KV's device scorer for `plan_round`: `config` and the batch's kept window queries. Its
/// rule protects the last `config.window` slots; otherwise as `snapkv_scorer`.
struct rkv_scorer {
  static constexpr score_domain domain = score_domain::logit;  ///< as the CPU policy's
  rkv_config config{};
  window_query_batch queries{};

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(0, config.window), info.budget};
  }

  /// Scores (λ·importance − (1 − λ)·redundancy on the prefix, +inf on the window) into
  /// `scores` [batch, layers, kv_heads, capacity]; otherwise as `snapkv_scorer::score`.
  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const cudaError_t err = detail::check_window(api, "R-KV", batch, queries, config.window,
                                                        rkv_config_error(config));
        err != cudaSuccess)
      return err;
    const detail::window_params p{detail::window_votes::group_max, config.window, queries, round};
    detail::workspace_carver ws(workspace);
    const detail::window_buffers b = detail::carve_window(ws, batch, p);
    const auto slots = static_cast<std::size_t>(detail::segments_of(batch) * batch.capacity);
    auto* divisors = ws.take<float>(slots);         // [segments, capacity]
    auto* newest = ws.take<std::int32_t>(slots);    // [segments, capacity]
    auto* means = ws.take<float>(slots);            // [segments, capacity]: column means, then redundancy
    cudaError_t err;
    if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
    if ((err = detail::check_window_pointers(api, scores, status, queries)) != cudaSuccess) return err;
    if ((err = detail::launch_window_attention(batch, p, b, divisors, status, stream)) != cudaSuccess) return err;
    constexpr int threads = detail::window_threads;
    const dim3 per_tile = detail::window_grid(batch, detail::similarity_tile);
    detail::rkv_newest<threads><<<per_tile, threads, 0, stream>>>(batch, p, config.threshold, divisors, newest);
    detail::rkv_column_means<threads><<<per_tile, threads, 0, stream>>>(batch, p, divisors, newest, means);
    detail::rkv_redundancy_softmax<threads>
        <<<static_cast<unsigned>(detail::segments_of(batch)), threads, 0, stream>>>(batch, p, means);
    detail::rkv_finish<threads><<<detail::window_grid(batch, threads), threads, 0, stream>>>(batch, p, config, b.acc,
                                                                                            means, scores);
    return cudaGetLastError();
  }
};

/// R-KV scores of every (sequence, layer, kv_head) outside a round: `rkv_scorer::score`.
template <KVCacheView V>
cudaError_t rkv_score(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                      const window_query_batch& queries, const rkv_config& config, float* scores, std::int32_t* status,
                      cudaStream_t stream) {
  return rkv_scorer{config, queries}.score("triattn::cuda::rkv_score", workspace, workspace_bytes, batch, device_round{},
                                           scores, status, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
