/// \file triattn/cuda/select.cuh
/// \brief Deterministic keep sets on the GPU: per segment (a row of scores with its own
/// length), the protected slots and then the best-scoring of the rest, ascending.
///
/// The order is the CPU's (selection.hpp): protected slots first by slot, then higher scores,
/// ties to the lower slot, NaN below every number. Each slot becomes one 64-bit key,
/// `rank_key(score, protected) << b | slot` with b the bits of a slot index, so every key is distinct and a segmented radix
/// sort gives the same order on every run whatever its stability; the first min(budget, n)
/// slots of each segment are then sorted ascending by a second segmented radix sort (their
/// indices are distinct too). Both sorts are CUB's `DeviceSegmentedRadixSort`, chosen over
/// `cub::DeviceTopK` because the latter exists only in recent CCCL releases and returns its
/// k items unordered.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "triattn/core/config.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/cuda/common.cuh"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// The rows a selection reads. Segment s holds `lengths[s]` valid slots of the row
/// `scores + s * capacity`; `positions` [count, capacity] are read only when a segment's
/// `protection::prompt_length` > 0 and may be null otherwise. `budgets` and `protections`,
/// when set, give each segment its own kept count (clamped to [0, the call's budget]) and
/// protection, as a round's decisions have (round.cuh); null: the call's for every segment.
struct select_segments {
  const float* scores = nullptr;              ///< [count, capacity]
  const std::int32_t* lengths = nullptr;      ///< [count]
  const std::int32_t* positions = nullptr;    ///< [count, capacity], or null
  int count = 0;
  std::int64_t capacity = 0;
  const std::int32_t* budgets = nullptr;      ///< [count], or null
  const protection* protections = nullptr;    ///< [count], or null
};

namespace detail {

/// Bits needed to hold every value in [0, n).
inline int bits_for(std::int64_t n) {
  int b = 1;
  while (b < 31 && (std::int64_t{1} << b) < n) ++b;
  return b;
}

/// One key per valid slot, and the segment bounds of the first sort.
template <int Threads>
__global__ void __launch_bounds__(Threads) select_rank_keys(select_segments seg, protection prot, int slot_bits, std::uint64_t* keys,
                                 int* begin, int* end) {
  const int s = static_cast<int>(blockIdx.y);
  const std::int64_t n = seg.lengths[s];
  const std::int64_t row = static_cast<std::int64_t>(s) * seg.capacity;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    begin[s] = static_cast<int>(row);
    end[s] = static_cast<int>(row + n);
  }
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const protection& p = seg.protections != nullptr ? seg.protections[s] : prot;
    const std::int64_t position = p.prompt_length > 0 ? seg.positions[row + j] : j;
    const bool kept_anyway = is_protected(p, j, n, position);
    keys[row + j] = static_cast<std::uint64_t>(rank_key(seg.scores[row + j], kept_anyway)) << slot_bits |
                    static_cast<std::uint64_t>(j);
  }
}

/// The first min(budget, n) sorted slots of each segment, and the bounds of the second sort.
template <int Threads>
__global__ void __launch_bounds__(Threads) select_take_first(select_segments seg, std::int32_t budget, int slot_bits,
                                                             const std::uint64_t* sorted, std::int32_t* picked,
                                                             std::int32_t* kept, int* begin, int* end) {
  const int s = static_cast<int>(blockIdx.x);
  const std::int32_t n = seg.lengths[s];
  std::int32_t cap = seg.budgets != nullptr ? seg.budgets[s] : budget;
  cap = cap < 0 ? 0 : (cap > budget ? budget : cap);
  const std::int32_t k = n < cap ? n : cap;
  const std::int64_t row = static_cast<std::int64_t>(s) * seg.capacity;
  const std::int64_t out = static_cast<std::int64_t>(s) * budget;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < k; i += static_cast<std::int32_t>(blockDim.x))
    picked[out + i] = static_cast<std::int32_t>(sorted[row + i] & ((std::uint64_t{1} << slot_bits) - 1));
  if (threadIdx.x == 0) {
    kept[s] = k;
    begin[s] = static_cast<int>(out);
    end[s] = static_cast<int>(out + k);
  }
}

}  // namespace detail

/// Keep sets of every segment: `keep` [count, budget] receives, for segment s, its
/// min(budget or `seg.budgets[s]`, lengths[s]) kept slots ascending in `keep[s * budget, s * budget + kept[s])`;
/// `kept` [count] the number. Entries past `kept[s]` are not written.
inline cudaError_t select_keep(void* workspace, std::size_t& workspace_bytes, const select_segments& seg,
                               const protection& prot, std::int32_t budget, std::int32_t* keep, std::int32_t* kept,
                               cudaStream_t stream) {
  const char* api = "triattn::cuda::select_keep";
  if (budget < 1) return detail::reject(api, "budget ", budget, " must be >= 1");
  if (seg.count < 1 || seg.capacity < 1) return detail::reject(api, "segments ", seg.count, " x capacity ", seg.capacity, " must both be >= 1");
  if (seg.count * seg.capacity >= INT32_MAX || std::int64_t{seg.count} * budget >= INT32_MAX)
    return detail::reject(api, "segments ", seg.count, " x capacity ", seg.capacity, " (or x budget ", budget,
                          ") exceed the 2^31 items of one CUB sort");
  if (seg.count > 65535) return detail::reject(api, "segments ", seg.count, " exceed 65535 (one grid row each)");
  if (prot.first < 0 || prot.last < 0 || prot.prompt_length < 0)
    return detail::reject(api, "protection first ", prot.first, ", last ", prot.last, ", prompt_length ",
                          prot.prompt_length, " must be >= 0");
  const int items = static_cast<int>(seg.count * seg.capacity);
  const int picks = seg.count * budget;

  detail::workspace_carver ws(workspace);
  auto* keys = ws.take<std::uint64_t>(static_cast<std::size_t>(items));
  auto* sorted = ws.take<std::uint64_t>(static_cast<std::size_t>(items));
  auto* picked = ws.take<std::int32_t>(static_cast<std::size_t>(picks));
  auto* begin = ws.take<int>(static_cast<std::size_t>(seg.count));
  auto* end = ws.take<int>(static_cast<std::size_t>(seg.count));
  std::size_t sort_bytes = 0, order_bytes = 0;
  const int slot_bits = detail::bits_for(seg.capacity);
  cudaError_t err = cub::DeviceSegmentedRadixSort::SortKeys(nullptr, sort_bytes, keys, sorted, items, seg.count,
                                                            begin, end, 0, 32 + slot_bits, stream);
  if (err != cudaSuccess) return err;
  err = cub::DeviceSegmentedRadixSort::SortKeys(nullptr, order_bytes, picked, keep, picks, seg.count, begin, end, 0,
                                                slot_bits, stream);
  if (err != cudaSuccess) return err;
  void* sort_tmp = ws.take<std::byte>(sort_bytes > order_bytes ? sort_bytes : order_bytes);
  if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (keep == nullptr || kept == nullptr || seg.scores == nullptr || seg.lengths == nullptr)
    return detail::reject(api, "scores, lengths, keep and kept must not be null");
  if ((prot.prompt_length > 0 || seg.protections != nullptr) && seg.positions == nullptr)
    return detail::reject(api, "a prompt_length (or per-segment protections) needs the slots' positions, which are null");

  constexpr int threads = 256;
  const unsigned row_blocks = detail::blocks_for(seg.capacity, threads);
  const dim3 grid(row_blocks < 64 ? row_blocks : 64, static_cast<unsigned>(seg.count));  // grid-stride over a row
  detail::select_rank_keys<threads><<<grid, threads, 0, stream>>>(seg, prot, slot_bits, keys, begin, end);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  std::size_t bytes = sort_bytes;
  err = cub::DeviceSegmentedRadixSort::SortKeys(sort_tmp, bytes, keys, sorted, items, seg.count, begin, end, 0,
                                                32 + slot_bits, stream);
  if (err != cudaSuccess) return err;
  detail::select_take_first<threads><<<static_cast<unsigned>(seg.count), threads, 0, stream>>>(seg, budget, slot_bits, sorted, picked,
                                                                                      kept, begin, end);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  bytes = order_bytes;
  return cub::DeviceSegmentedRadixSort::SortKeys(sort_tmp, bytes, picked, keep, picks, seg.count, begin, end, 0,
                                                 slot_bits, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
