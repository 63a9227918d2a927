/// \file triattn/cuda/knorm.cuh
/// \brief K-norm on the GPU: the device scorer of `plan_round` (round.cuh), −‖k‖₂ per slot
/// (key_only_math.hpp, as knorm.hpp). The key as cached: either key state.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/key_scored.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/key_only_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {
namespace detail {
struct knorm_score_of {
  __device__ float operator()(const float* key, int head_dim, std::int64_t) const {
    return knorm_score(l2_norm(key, head_dim));
  }
};
}  // namespace detail

/// K-norm's device scorer: `plan_round(..., knorm_scorer{}, ...)`. No protection of its own.
struct knorm_scorer {
  static constexpr score_domain domain = score_domain::logit;  ///< as the CPU policy's
  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const { return {protection{}, info.budget}; }

  /// Needs no workspace; writes −‖k‖₂ of every slot of each ranked segment into `scores`
  /// [batch, layers, kv_heads, capacity].
  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const cudaError_t err = detail::check_key_scored(api, batch); err != cudaSuccess) return err;
    if (workspace == nullptr) {
      workspace_bytes = 0;
      return cudaSuccess;
    }
    if (const cudaError_t err = detail::check_key_scored_pointers(api, scores, status); err != cudaSuccess) return err;
    return detail::launch_key_scored(batch, round.in.budgets, detail::knorm_score_of{}, scores, status, stream);
  }
};

}  // namespace cuda
TRIATTN_NAMESPACE_END
