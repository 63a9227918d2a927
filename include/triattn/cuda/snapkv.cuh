/// \file triattn/cuda/snapkv.cuh
/// \brief SnapKV on the GPU: the device scorer of `plan_round` (round.cuh). The window
/// attention (window_attention.cuh) gives each q-head's votes on the prefix; one thread per
/// slot then pools them (pool_at) and combines the group (gqa_combine), as snapkv.hpp does.
/// SnapKV's `per_q_head` grouping (a round-robin merge of per-head orders) is CPU-only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/gqa.hpp"
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

/// `scores` [segments, capacity] for the slots below each length: the votes `acc` [segments,
/// group, capacity] pooled into `pooled` (same layout) and combined over the group; +inf on
/// the window and in unscored segments.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) snapkv_finish(view_batch<V> batch, window_params p, snapkv_config c,
                                                         const float* acc, float* pooled, float* scores) {
  const std::int64_t s = blockIdx.x;
  const segment_id id = segment_of(s, batch.geometry);
  const std::int64_t n = batch.views[id.b].length(id.l, id.h);
  const std::int64_t prefix = window_scored(p, id.b, n) ? n - p.window : 0;
  const int group = batch.geometry.group_size();
  const std::int64_t cap = batch.capacity, seg_row = s * cap;
  for (std::int64_t j = blockIdx.y * static_cast<std::int64_t>(Threads) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.y) * Threads) {
    float score = INFINITY;
    if (j < prefix) {
      // Thread j writes and then reads only column j of its segment's pooled rows.
      for (int k = 0; k < group; ++k)
        pooled[seg_row * group + k * cap + j] = pool_at(acc + seg_row * group + k * cap, prefix, j, c.kernel, c.pool);
      gqa_combine(pooled + seg_row * group + j, group, cap, 1, c.gqa, &score);
    }
    scores[seg_row + j] = score;
  }
}

}  // namespace detail

/// SnapKV's device scorer for `plan_round`: `config` (`aggregate` grouping) and the batch's
/// kept window queries. Its rule protects the last `config.window` slots (the oldest of them
/// when the budget is smaller); a segment of n <= budget keeps everything and its keys are
/// not read. A non-finite key of a scored segment sets `non_finite_key`.
struct snapkv_scorer {
  snapkv_config config{};
  window_query_batch queries{};

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(0, config.window), info.budget};
  }

  /// Scores into `scores` [batch, layers, kv_heads, capacity]: the GQA-aggregated pooled
  /// votes on the prefix, +inf on the last `window` slots and on every slot of a segment that
  /// is not scored; slots at or past a length are not written.
  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (config.grouping != snapkv_grouping::aggregate)
      return detail::reject(api, "grouping per_q_head is CPU-only: the GPU supports snapkv_grouping::aggregate");
    if (const cudaError_t err = detail::check_window(api, "SnapKV", batch, queries, config.window,
                                                        snapkv_config_error(config));
        err != cudaSuccess)
      return err;
    const detail::window_params p{detail::window_votes::per_q_head, config.window, queries, round};
    detail::workspace_carver ws(workspace);
    const detail::window_buffers b = detail::carve_window(ws, batch, p);
    auto* pooled = ws.take<float>(static_cast<std::size_t>(detail::segments_of(batch)) *
                                  static_cast<std::size_t>(batch.geometry.group_size() * batch.capacity));
    cudaError_t err;
    if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
    if ((err = detail::check_window_pointers(api, scores, status, queries)) != cudaSuccess) return err;
    if ((err = detail::launch_window_attention(batch, p, b, nullptr, status, stream)) != cudaSuccess) return err;
    constexpr int threads = detail::window_threads;
    detail::snapkv_finish<threads><<<detail::window_grid(batch, threads), threads, 0, stream>>>(batch, p, config, b.acc,
                                                                                               pooled, scores);
    return cudaGetLastError();
  }
};

/// SnapKV scores of every (sequence, layer, kv_head) outside a round (every segment of
/// n > window is scored): `snapkv_scorer::score`. CUB-style workspace.
template <KVCacheView V>
cudaError_t snapkv_score(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                         const window_query_batch& queries, const snapkv_config& config, float* scores,
                         std::int32_t* status, cudaStream_t stream) {
  return snapkv_scorer{config, queries}.score("triattn::cuda::snapkv_score", workspace, workspace_bytes, batch,
                                              device_round{}, scores, status, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
