/// \file triattn/cuda/key_scored.cuh
/// \brief What the device scorers of the key-only policies share (knorm.cuh, keydiff.cuh):
/// one thread per slot of every scored (sequence, layer, kv_head) segment reads its key and
/// writes the policy's score, as key_scored.hpp's row scorers do on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/round.cuh"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

inline constexpr int key_scored_threads = 128;

/// Whether segment (b, n slots) is ranked in a round of `budgets` [batch] (null: always, as
/// outside a round). As on the CPU, a segment that fits its budget is kept whole and never
/// read, so only a ranked segment can fail on a non-finite key.
TRIATTN_HOST_DEVICE bool key_segment_scored(const std::int32_t* budgets, int b, std::int64_t n) {
  return budgets == nullptr || n > budgets[b];
}

/// The slot a thread of a (slot blocks, layers x kv_heads, batch) grid of `Threads`-thread
/// blocks covers: segment `seg` = (sequence, layer, kv_head) `id` holding `n` slots, slot `s`;
/// `active` when s < n and the segment is ranked.
struct slot_thread {
  std::int64_t seg, s;
  segment_id id;
  std::int32_t n;
  bool active;
};
#if defined(__CUDACC__)
template <int Threads, KVCacheView V>
__device__ slot_thread slot_of_thread(const view_batch<V>& batch, const std::int32_t* budgets) {
  const kv_geometry& g = batch.geometry;
  slot_thread t;
  t.seg = std::int64_t{blockIdx.z} * g.num_layers * g.num_kv_heads + blockIdx.y;
  t.id = segment_of(t.seg, g);
  t.s = blockIdx.x * std::int64_t{Threads} + threadIdx.x;
  t.n = batch.views[t.id.b].length(t.id.l, t.id.h);
  t.active = t.s < t.n && key_segment_scored(budgets, t.id.b, t.n);
  return t;
}
#endif

/// Grid (slot blocks, layers x kv_heads, batch): thread s of segment (z, y) loads key s and
/// writes `score(key, head_dim, segment)` into `scores` [batch, layers, kv_heads, capacity].
/// A non-finite key sets `non_finite_key`.
template <int Threads, class Score, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    key_scored_slots(view_batch<V> batch, const std::int32_t* budgets, Score score, float* scores,
                     std::int32_t* status) {
  const slot_thread t = slot_of_thread<Threads>(batch, budgets);
  if (!t.active) return;
  const int D = batch.geometry.head_dim;
  float key[max_head_dim];
  load_key_row(batch.views[t.id.b], t.id.l, t.id.h, t.s, key);
  bool finite = true;
  for (int d = 0; d < D; ++d) finite = finite && isfinite(key[d]);
  if (!finite) fail_round(status, round_status::non_finite_key);
  scores[t.seg * batch.capacity + t.s] = score(key, D, t.seg);
}

/// The grid of `key_scored_slots` and of the per-segment kernels (x: 1 for those).
template <KVCacheView V>
dim3 key_scored_grid(const view_batch<V>& batch, unsigned x) {
  return dim3(x, static_cast<unsigned>(batch.geometry.num_layers * batch.geometry.num_kv_heads),
              static_cast<unsigned>(batch.size));
}

/// Host checks of a key-only scorer's call: the batch, the grid's limits, and (launch pass)
/// the pointers.
template <KVCacheView V>
cudaError_t check_key_scored(const char* api, const view_batch<V>& batch) {
  if (const cudaError_t err = check_batch(api, batch); err != cudaSuccess) return err;
  const kv_geometry& g = batch.geometry;
  if (std::int64_t{g.num_layers} * g.num_kv_heads > 65535 || batch.size > 65535)
    return reject(api, g.num_layers, " layers x ", g.num_kv_heads, " kv_heads and a batch of ", batch.size,
                  " must each stay within 65535 (a grid dimension)");
  return cudaSuccess;
}
inline cudaError_t check_key_scored_pointers(const char* api, const float* scores, const std::int32_t* status) {
  if (scores == nullptr || status == nullptr) return reject(api, "scores and status must not be null");
  return cudaSuccess;
}

/// Launches `key_scored_slots` with `score`.
template <class Score, KVCacheView V>
cudaError_t launch_key_scored(const view_batch<V>& batch, const std::int32_t* budgets, const Score& score,
                              float* scores, std::int32_t* status, cudaStream_t stream) {
  constexpr int threads = key_scored_threads;
  key_scored_slots<threads><<<key_scored_grid(batch, blocks_for(batch.capacity, threads)), threads, 0, stream>>>(
      batch, budgets, score, scores, status);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace cuda
TRIATTN_NAMESPACE_END
