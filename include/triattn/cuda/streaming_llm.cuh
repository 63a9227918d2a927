/// \file triattn/cuda/streaming_llm.cuh
/// \brief StreamingLLM on the GPU: index-only keep plans (sinks + recent window) for every
/// (sequence, layer, kv_head) of a batch, in the layout `compact` reads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/policies/streaming_llm.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

/// One thread per (sequence, layer, kv_head, output index): the CPU's `streaming_keep_slot`.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    streaming_llm_keep(view_batch<V> batch, std::int64_t sinks, std::int32_t budget, std::int32_t* keep,
                       std::int32_t* kept) {
  const kv_geometry& g = batch.geometry;
  const std::int64_t t = blockIdx.x * std::int64_t{Threads} + threadIdx.x;
  const std::int64_t row = t / budget, i = t % budget;  // row = (b * layers + l) * kv_heads + h
  if (row >= std::int64_t{batch.size} * g.num_layers * g.num_kv_heads) return;
  const int h = static_cast<int>(row % g.num_kv_heads);
  const int l = static_cast<int>(row / g.num_kv_heads % g.num_layers);
  const std::int64_t n = batch.views[row / g.num_kv_heads / g.num_layers].length(l, h);
  const std::int64_t k = n < budget ? n : budget;
  if (i < k) keep[t] = static_cast<std::int32_t>(streaming_keep_slot(i, n, budget, sinks));
  if (i == 0) kept[row] = static_cast<std::int32_t>(k);
}

}  // namespace detail

/// Keep plan of a StreamingLLM round: `keep` [batch, layers, kv_heads, budget] and `kept`
/// [batch, layers, kv_heads] (`device_keep_plan{keep, kept, budget}` for `compact`). Needs no
/// workspace. The pos_shift mode (`streaming_llm_config::reposition`) has no GPU path.
template <KVCacheView V>
cudaError_t streaming_llm_plan(const view_batch<V>& batch, const streaming_llm_config& config, std::int32_t budget,
                               std::int32_t* keep, std::int32_t* kept, cudaStream_t stream) {
  const char* api = "triattn::cuda::streaming_llm_plan";
  if (const cudaError_t err = detail::check_batch(api, batch); err != cudaSuccess) return err;
  if (budget < 1) return detail::reject(api, "budget ", budget, " must be >= 1");
  if (config.sinks < 0) return detail::reject(api, "sinks ", config.sinks, " must be >= 0");
  if (config.reposition) return detail::reject(api, "reposition (pos_shift) has no CUDA path");
  if (keep == nullptr || kept == nullptr) return detail::reject(api, "keep and kept must not be null");
  constexpr int threads = 256;
  const kv_geometry& g = batch.geometry;
  const std::int64_t items = std::int64_t{batch.size} * g.num_layers * g.num_kv_heads * budget;
  detail::streaming_llm_keep<threads><<<detail::blocks_for(items, threads), threads, 0, stream>>>(
      batch, config.sinks, budget, keep, kept);
  return cudaGetLastError();
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
