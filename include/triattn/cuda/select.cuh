/// \file triattn/cuda/select.cuh
/// \brief Deterministic keep sets on the GPU: per segment (a row of scores with its own
/// length), the protected slots and then the best-scoring of the rest, each run of segment
/// quotas keeping its share, ascending.
///
/// The order is the CPU's (selection.hpp): protected slots first by slot, then higher scores,
/// ties to the lower slot, NaN below every number. Each slot becomes one 64-bit key,
/// `rank_key(score, protected) << b | slot` with b the bits of a slot index, so every key is
/// distinct and a segmented radix sort gives the same order on every run whatever its
/// stability. One block per row first lays its keys out as the selection reads them: the
/// protected slots, then the candidates in slot order, so that each run of
/// `round_options::segments` is one contiguous sort segment (a block scan gives each slot its
/// place). After the sort, each run's first `quota` keys are its keep; the kept slots of each
/// row are then sorted ascending by a second segmented radix sort (their indices are distinct
/// too). Both sorts are CUB's `DeviceSegmentedRadixSort`, chosen over `cub::DeviceTopK`
/// because the latter exists only in recent CCCL releases and returns its k items unordered.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
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
  std::int64_t runs = 1;                      ///< segment quotas (`round_options::segments`), 1 to `max_segments`
};

namespace detail {

/// Bits needed to hold every value in [0, n).
inline int bits_for(std::int64_t n) {
  int b = 1;
  while (b < 31 && (std::int64_t{1} << b) < n) ++b;
  return b;
}

/// One block per row s: its keys laid out as the selection reads them (the protected slots,
/// then the candidates in slot order), its number of protected slots, and the bounds of the
/// first sort's segments: [s * (runs + 1)] the protected slots, then one per run.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    select_rank_keys(select_segments seg, protection prot, int slot_bits, std::uint64_t* keys,
                     std::int32_t* protected_count, int* begin, int* end) {
  using scan = cub::BlockScan<int, Threads>;
  using reduce = cub::BlockReduce<int, Threads>;
  __shared__ union {
    typename scan::TempStorage scan;
    typename reduce::TempStorage reduce;
  } temp;
  __shared__ int candidates;
  const int s = static_cast<int>(blockIdx.x);
  const std::int64_t n = seg.lengths[s];
  const std::int64_t row = static_cast<std::int64_t>(s) * seg.capacity;
  const protection& p = seg.protections != nullptr ? seg.protections[s] : prot;
  const auto competes = [&](std::int64_t j) {
    return j < n && !is_protected(p, j, n, p.prompt_length > 0 ? seg.positions[row + j] : j);
  };
  int mine = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) mine += competes(j) ? 1 : 0;
  const int total = reduce(temp.reduce).Sum(mine);
  if (threadIdx.x == 0) candidates = total;
  __syncthreads();
  const std::int64_t m = candidates, protected_slots = n - m;
  int before = 0;  // candidates in the chunks already laid out
  for (std::int64_t base = 0; base < n; base += Threads) {
    const std::int64_t j = base + threadIdx.x;
    const bool c = competes(j);
    int at = 0, chunk = 0;
    scan(temp.scan).ExclusiveSum(c ? 1 : 0, at, chunk);
    __syncthreads();  // the scan's storage is reused by the next chunk
    if (j < n) {
      const std::int64_t place = c ? protected_slots + before + at : j - (before + at);
      keys[row + place] = static_cast<std::uint64_t>(rank_key(seg.scores[row + j], !c)) << slot_bits |
                          static_cast<std::uint64_t>(j);
    }
    before += chunk;
  }
  const std::int64_t first = static_cast<std::int64_t>(s) * (seg.runs + 1);
  if (threadIdx.x == 0) {
    protected_count[s] = static_cast<std::int32_t>(protected_slots);
    begin[first] = static_cast<int>(row);
    end[first] = static_cast<int>(row + protected_slots);
  }
  for (std::int64_t r = threadIdx.x; r < seg.runs; r += Threads) {
    begin[first + 1 + r] = static_cast<int>(row + protected_slots + segment_begin(r, m, seg.runs));
    end[first + 1 + r] = static_cast<int>(row + protected_slots + segment_begin(r + 1, m, seg.runs));
  }
}

/// One block per row: its min(budget, n) kept slots (the first of the protected slots, then
/// each run's quota of its best), and the bounds of the second sort.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    select_take_first(select_segments seg, std::int32_t budget, int slot_bits, const std::uint64_t* sorted,
                      const std::int32_t* protected_count, std::int32_t* picked, std::int32_t* kept, int* begin,
                      int* end) {
  const int s = static_cast<int>(blockIdx.x);
  const std::int32_t n = seg.lengths[s];
  std::int32_t cap = seg.budgets != nullptr ? seg.budgets[s] : budget;
  cap = cap < 0 ? 0 : (cap > budget ? budget : cap);
  const std::int32_t k = n < cap ? n : cap;
  const std::int64_t row = static_cast<std::int64_t>(s) * seg.capacity;
  const std::int64_t out = static_cast<std::int64_t>(s) * budget;
  const std::uint64_t slot_mask = (std::uint64_t{1} << slot_bits) - 1;
  const std::int64_t protected_slots = protected_count[s], m = n - protected_slots;
  const std::int64_t from_protected = k < protected_slots ? k : protected_slots, r = k - from_protected;
  for (std::int64_t i = threadIdx.x; i < from_protected; i += Threads)
    picked[out + i] = static_cast<std::int32_t>(sorted[row + i] & slot_mask);
  for (std::int64_t j = 0; j < seg.runs && r > 0; ++j) {  // the run's quota: the first keys of its sort
    const std::int64_t src = row + protected_slots + segment_begin(j, m, seg.runs);
    const std::int64_t dst = out + protected_slots + quota_begin(j, m, seg.runs, r);
    const std::int64_t quota = quota_begin(j + 1, m, seg.runs, r) - quota_begin(j, m, seg.runs, r);
    for (std::int64_t i = threadIdx.x; i < quota; i += Threads)
      picked[dst + i] = static_cast<std::int32_t>(sorted[src + i] & slot_mask);
  }
  if (threadIdx.x == 0) {
    kept[s] = k;
    begin[s] = static_cast<int>(out);
    end[s] = static_cast<int>(out + k);
  }
}

}  // namespace detail

namespace detail {

/// The first sort of a selection: every row's keys in the order it selects from (protected
/// slots by slot, then each run's candidates best first), and each row's protected count.
/// `carve` takes its buffers from a workspace (sizing CUB's); `run` enqueues it.
struct rank_order {
  std::uint64_t* keys = nullptr;
  std::uint64_t* sorted = nullptr;  ///< [count, capacity]: row s at s * capacity
  std::int32_t* protected_count = nullptr;
  int* run_begin = nullptr;
  int* run_end = nullptr;
  void* sort_tmp = nullptr;
  std::size_t sort_bytes = 0;
  int slot_bits = 0;

  cudaError_t carve(workspace_carver& ws, const select_segments& seg, cudaStream_t stream) {
    const int items = static_cast<int>(seg.count * seg.capacity), runs = static_cast<int>(seg.count * (seg.runs + 1));
    keys = ws.take<std::uint64_t>(static_cast<std::size_t>(items));
    sorted = ws.take<std::uint64_t>(static_cast<std::size_t>(items));
    protected_count = ws.take<std::int32_t>(static_cast<std::size_t>(seg.count));
    run_begin = ws.take<int>(static_cast<std::size_t>(runs));
    run_end = ws.take<int>(static_cast<std::size_t>(runs));
    slot_bits = bits_for(seg.capacity);
    const cudaError_t err = cub::DeviceSegmentedRadixSort::SortKeys(nullptr, sort_bytes, keys, sorted, items, runs,
                                                                    run_begin, run_end, 0, 32 + slot_bits, stream);
    sort_tmp = ws.take<std::byte>(sort_bytes);
    return err;
  }

  cudaError_t run(const select_segments& seg, const protection& prot, cudaStream_t stream) const {
    constexpr int threads = 256;
    select_rank_keys<threads><<<static_cast<unsigned>(seg.count), threads, 0, stream>>>(
        seg, prot, slot_bits, keys, protected_count, run_begin, run_end);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    std::size_t bytes = sort_bytes;
    return cub::DeviceSegmentedRadixSort::SortKeys(sort_tmp, bytes, keys, sorted, static_cast<int>(seg.count * seg.capacity),
                                                   static_cast<int>(seg.count * (seg.runs + 1)), run_begin, run_end, 0,
                                                   32 + slot_bits, stream);
  }
};

/// The host checks of a selection, naming `api`.
inline cudaError_t check_select(const char* api, const select_segments& seg, const protection& prot,
                                std::int32_t budget) {
  if (budget < 1) return reject(api, "budget ", budget, " must be >= 1");
  if (seg.count < 1 || seg.capacity < 1) return reject(api, "segments ", seg.count, " x capacity ", seg.capacity, " must both be >= 1");
  if (seg.runs < 1 || seg.runs > max_segments)
    return reject(api, "runs ", seg.runs, " must be in [1, ", max_segments, "] (round_options::segments)");
  if (seg.count * seg.capacity >= INT32_MAX || std::int64_t{seg.count} * budget >= INT32_MAX ||
      seg.count * (seg.runs + 1) >= INT32_MAX)
    return reject(api, "segments ", seg.count, " x capacity ", seg.capacity, " (or x budget ", budget,
                  ", or x runs + 1 ", seg.runs + 1, ") exceed the 2^31 items of one CUB sort");
  if (prot.first < 0 || prot.last < 0 || prot.prompt_length < 0)
    return reject(api, "protection first ", prot.first, ", last ", prot.last, ", prompt_length ", prot.prompt_length,
                  " must be >= 0");
  return cudaSuccess;
}

/// The pointer checks of a selection once its workspace is given.
inline cudaError_t check_select_pointers(const char* api, const select_segments& seg, const protection& prot) {
  if (seg.scores == nullptr || seg.lengths == nullptr) return reject(api, "scores and lengths must not be null");
  if ((prot.prompt_length > 0 || seg.protections != nullptr) && seg.positions == nullptr)
    return reject(api, "a prompt_length (or per-segment protections) needs the slots' positions, which are null");
  return cudaSuccess;
}

}  // namespace detail

/// Keep sets of every segment: `keep` [count, budget] receives, for segment s, its
/// min(budget or `seg.budgets[s]`, lengths[s]) kept slots ascending in `keep[s * budget, s * budget + kept[s])`;
/// `kept` [count] the number. Entries past `kept[s]` are not written.
inline cudaError_t select_keep(void* workspace, std::size_t& workspace_bytes, const select_segments& seg,
                               const protection& prot, std::int32_t budget, std::int32_t* keep, std::int32_t* kept,
                               cudaStream_t stream) {
  const char* api = "triattn::cuda::select_keep";
  if (const cudaError_t err = detail::check_select(api, seg, prot, budget); err != cudaSuccess) return err;
  const int picks = seg.count * budget;

  detail::workspace_carver ws(workspace);
  detail::rank_order order;
  cudaError_t err = order.carve(ws, seg, stream);
  if (err != cudaSuccess) return err;
  auto* picked = ws.take<std::int32_t>(static_cast<std::size_t>(picks));
  auto* begin = ws.take<int>(static_cast<std::size_t>(seg.count));
  auto* end = ws.take<int>(static_cast<std::size_t>(seg.count));
  std::size_t order_bytes = 0;
  err = cub::DeviceSegmentedRadixSort::SortKeys(nullptr, order_bytes, picked, keep, picks, seg.count, begin, end, 0,
                                                order.slot_bits, stream);
  if (err != cudaSuccess) return err;
  void* order_tmp = ws.take<std::byte>(order_bytes);
  if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (keep == nullptr || kept == nullptr) return detail::reject(api, "keep and kept must not be null");
  if ((err = detail::check_select_pointers(api, seg, prot)) != cudaSuccess) return err;

  constexpr int threads = 256;
  if ((err = order.run(seg, prot, stream)) != cudaSuccess) return err;
  detail::select_take_first<threads><<<static_cast<unsigned>(seg.count), threads, 0, stream>>>(
      seg, budget, order.slot_bits, order.sorted, order.protected_count, picked, kept, begin, end);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  std::size_t bytes = order_bytes;
  return cub::DeviceSegmentedRadixSort::SortKeys(order_tmp, bytes, picked, keep, picks, seg.count, begin, end, 0,
                                                 order.slot_bits, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
