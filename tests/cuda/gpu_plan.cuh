// One GPU round of a device scorer over a batch, synchronised and downloaded, for the tests
// that compare its keep sets with another view's or the CPU's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/round.cuh"

namespace triattn_cuda_test {

/// A device scorer that runs `S` and keeps a copy of the row scores it wrote.
template <class S>
struct recording_scorer {
  S inner;
  float* copy = nullptr;  // [batch, layers, kv_heads, capacity]
  static constexpr triattn::score_domain domain = triattn::score_domain_of<S>();

  TRIATTN_HOST_DEVICE triattn::row_rule rule(const triattn::round_info& info) const { return inner.rule(info); }

  template <triattn::KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes,
                    const triattn::cuda::view_batch<V>& batch, const triattn::cuda::device_round& round, float* scores,
                    std::int32_t* status, cudaStream_t stream) const {
    const cudaError_t err = inner.score(api, workspace, workspace_bytes, batch, round, scores, status, stream);
    if (err != cudaSuccess || workspace == nullptr) return err;
    const triattn::kv_geometry& g = batch.geometry;
    const auto n = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_kv_heads * batch.capacity;
    return cudaMemcpyAsync(copy, scores, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
  }
};

/// A round's keep plan as the host sees it, with the round's status word.
struct gpu_plan {
  std::vector<std::int32_t> keep, kept;  // [batch, layers, kv_heads, budget], [batch, layers, kv_heads]
  std::int32_t status = -1, budget = 0;

  /// The keep set of plan row `r` (the device_keep_plan order).
  std::vector<std::int32_t> row(std::size_t r) const {
    const auto at = keep.begin() + static_cast<std::ptrdiff_t>(r) * budget;
    return {at, at + kept[r]};
  }
  bool operator==(const gpu_plan& o) const {
    if (kept != o.kept || status != o.status) return false;
    for (std::size_t r = 0; r < kept.size(); ++r)
      if (row(r) != o.row(r)) return false;
    return true;
  }
};

/// Every sequence of `batch` cut to `budget` by `scorer` under `options`, from `round_starts` (or
/// null) after prompts of `prompt_length` tokens: `plan_round`, then, with `compact`, the batch
/// compacted with the round's status word.
template <class V, class S>
gpu_plan run_plan(const triattn::cuda::view_batch<V>& batch, const S& scorer, const triattn::round_options& options,
                  const std::int64_t* round_starts, std::int64_t prompt_length, std::int32_t budget,
                  bool compact = false) {
  const std::size_t rows = static_cast<std::size_t>(batch.size) * batch.geometry.num_layers * batch.geometry.num_kv_heads;
  device_buffer<std::int32_t> keep(rows * static_cast<std::size_t>(budget)), kept(rows);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  const device_buffer<std::int32_t> budgets(std::vector<std::int32_t>(static_cast<std::size_t>(batch.size), budget));
  const device_buffer<std::int64_t> prompts(std::vector<std::int64_t>(static_cast<std::size_t>(batch.size), prompt_length));
  const triattn::cuda::round_inputs inputs{budgets.get(), round_starts, prompts.get()};
  const triattn::cuda::device_keep_plan plan{keep.get(), kept.get(), budget};
  std::size_t bytes = 0;
  CUDA_REQUIRE(triattn::cuda::plan_round(nullptr, bytes, batch, scorer, options, inputs, plan, status.get(), nullptr));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(triattn::cuda::plan_round(ws.get(), bytes, batch, scorer, options, inputs, plan, status.get(), nullptr));
  if (compact) CUDA_REQUIRE(triattn::cuda::compact(batch, plan, {}, status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {keep.download(), kept.download(), status.download()[0], budget};
}

}  // namespace triattn_cuda_test
