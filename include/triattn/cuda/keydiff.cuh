/// \file triattn/cuda/keydiff.cuh
/// \brief KeyDiff on the GPU: the device scorer of `plan_round` (round.cuh). One warp per
/// segment sums the unit keys into the anchor, slot after slot as keydiff.hpp does; one thread
/// per slot then writes −cos(k, anchor) (key_only_math.hpp). Post-RoPE keys only: a pre-RoPE
/// batch is refused (the CPU policy rotates them).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/key_scored.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/key_only_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

inline constexpr int keydiff_tile = 32;  ///< slots per step of the anchor sum: one warp

/// Grid (1, layers x kv_heads, batch), one warp per ranked segment: `anchors` [segments,
/// head_dim] = Σ_s k_s / max(‖k_s‖, floor), summed in slot order per dim with the CPU's
/// fused multiply-adds (`keydiff_accumulate`). Each step, lane t loads slot (step + t)'s key
/// and its unit scale into a shared tile; then lane t folds the tile's rows, in order, into
/// the dims t, t + 32, ... it owns.
template <KVCacheView V>
__global__ void __launch_bounds__(keydiff_tile)
    keydiff_anchors(view_batch<V> batch, const std::int32_t* budgets, float* anchors) {
  __shared__ float tile[keydiff_tile][max_head_dim];
  __shared__ float unit[keydiff_tile];
  const kv_geometry& g = batch.geometry;
  const std::int64_t seg = std::int64_t{blockIdx.z} * g.num_layers * g.num_kv_heads + blockIdx.y;
  const segment_id id = segment_of(seg, g);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  if (!key_segment_scored(budgets, id.b, n)) return;
  const int D = g.head_dim, lane = static_cast<int>(threadIdx.x);
  float* anchor = anchors + seg * D;
  for (int d = lane; d < D; d += keydiff_tile) anchor[d] = 0.0f;
  for (std::int32_t step = 0; step < n; step += keydiff_tile) {
    const std::int32_t s = step + lane;
    if (s < n) {
      load_key_row(view, id.l, id.h, s, tile[lane]);
      unit[lane] = unit_scale(l2_norm(tile[lane], D));
    }
    __syncwarp();
    const int rows = n - step < keydiff_tile ? n - step : keydiff_tile;
    for (int d = lane; d < D; d += keydiff_tile) {
      float acc = anchor[d];
      for (int r = 0; r < rows; ++r) acc = multiply_add(tile[r][d], unit[r], acc);
      anchor[d] = acc;
    }
    __syncwarp();
  }
}

struct keydiff_score_of {
  const float* anchors;  // [segments, head_dim]
  __device__ float operator()(const float* key, int head_dim, std::int64_t seg) const {
    return keydiff_score(key, anchors + seg * head_dim, head_dim);
  }
};

}  // namespace detail

/// KeyDiff's device scorer: `plan_round(..., keydiff_scorer{}, ...)`. No protection of its
/// own. A non-finite key of a ranked segment sets `non_finite_key`.
struct keydiff_scorer {
  static constexpr score_domain domain = score_domain::logit;  ///< as the CPU policy's
  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const { return {protection{}, info.budget}; }

  /// Workspace: one anchor per segment; writes −cos(k, anchor) of every slot of each ranked
  /// segment into `scores` [batch, layers, kv_heads, capacity].
  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const cudaError_t err = detail::check_key_scored(api, batch); err != cudaSuccess) return err;
    if (const cudaError_t err = detail::check_post_rope_keys(api, "KeyDiff", batch); err != cudaSuccess) return err;
    detail::workspace_carver ws(workspace);
    float* anchors = ws.take<float>(static_cast<std::size_t>(detail::segments_of(batch)) *
                                    static_cast<std::size_t>(batch.geometry.head_dim));
    cudaError_t err;
    if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
    if ((err = detail::check_key_scored_pointers(api, scores, status)) != cudaSuccess) return err;
    detail::keydiff_anchors<<<detail::key_scored_grid(batch, 1), detail::keydiff_tile, 0, stream>>>(
        batch, round.in.budgets, anchors);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    return detail::launch_key_scored(batch, round.in.budgets, detail::keydiff_score_of{anchors}, scores, status,
                                     stream);
  }
};

}  // namespace cuda
TRIATTN_NAMESPACE_END
