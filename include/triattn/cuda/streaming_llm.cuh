/// \file triattn/cuda/streaming_llm.cuh
/// \brief StreamingLLM on the GPU: the device scorer of `plan_round` (round.cuh). Its rule
/// protects exactly what it keeps (sinks + recent window), so its scores are never read: they
/// are zeroed, as the CPU policy's.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/policies/streaming_llm.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// StreamingLLM's device scorer: `plan_round(..., streaming_llm_scorer{config.sinks}, ...)`.
/// The pos_shift mode (`streaming_llm_config::reposition`) has no GPU path.
struct streaming_llm_scorer {
  std::int64_t sinks = 4;

  /// The sinks and the recent window fill the budget (the CPU policy's `rule`).
  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const { return streaming_rule(sinks, info.budget); }

  /// Needs no workspace; zeroes `scores` [batch, layers, kv_heads, capacity].
  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round&, float* scores, std::int32_t*, cudaStream_t stream) const {
    if (sinks < 0) return detail::reject(api, "sinks ", sinks, " must be >= 0");
    if (workspace == nullptr) {
      workspace_bytes = 0;
      return cudaSuccess;
    }
    const kv_geometry& g = batch.geometry;
    const auto n = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_kv_heads * batch.capacity;
    return cudaMemsetAsync(scores, 0, n * sizeof(float), stream);
  }
};

}  // namespace cuda
TRIATTN_NAMESPACE_END
