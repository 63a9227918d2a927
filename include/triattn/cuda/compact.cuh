/// \file triattn/cuda/compact.cuh
/// \brief In-place compaction on the GPU: K and V rows, positions, lengths and per-slot policy
/// state of every (sequence, layer, kv_head), in one launch.
///
/// One block per (sequence, layer, kv_head) performs the forward gather keep[i] -> i of the
/// CPU's `compact` without scratch rows. It walks the kept rows in chunks of one element per
/// thread: every thread of a chunk loads before any thread stores (a barrier between), and
/// later chunks only read rows at or above their own destinations, which no earlier chunk
/// wrote (keep[i] >= i because the indices ascend). A validation kernel runs first and
/// writes the round's status word; the gather moves nothing unless that word is `ok`.
/// Paged views: pages past ceil(new length / page_size) of every (layer, kv_head) are free
/// afterwards; the engine reads the new lengths and returns them to its allocator.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/cuda/common.cuh"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// Per-slot state that moves with the cache (H2O sums and counts, ...), for every sequence
/// of a batch: sequence b's array is `state` with `data` advanced by b * `sequence_stride`
/// elements. Up to `max_items` arrays per call.
struct device_slot_states {
  static constexpr int max_items = 4;
  slot_state items[max_items]{};
  std::int64_t sequence_stride[max_items]{};
  int count = 0;
};

/// The keep plan of a batch in device memory: (sequence b, layer l, kv_head h) keeps
/// `kept[r]` slots, `keep[r * stride, r * stride + kept[r])` ascending, r = (b * layers + l)
/// * kv_heads + h. `plan_round` (round.cuh) and `select_keep` write exactly this layout.
struct device_keep_plan {
  std::int32_t* keep = nullptr;  ///< [batch, layers, kv_heads, stride]
  std::int32_t* kept = nullptr;  ///< [batch, layers, kv_heads]
  std::int32_t stride = 0;
};

namespace detail {

/// Checks every row of the plan (ascending, inside [0, length), a length within capacity) and
/// that every row it moves is aligned to `unit` bytes.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) compact_validate(view_batch<V> batch, device_keep_plan plan,
                                                            std::size_t unit, std::int32_t* status) {
  const segment_id id = segment_of(static_cast<int>(blockIdx.x), batch.geometry);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  const std::int32_t k = plan.kept[blockIdx.x];
  const std::int32_t* keep = plan.keep + static_cast<std::int64_t>(blockIdx.x) * plan.stride;
  bool bad = threadIdx.x == 0 && (k < 0 || k > plan.stride || k > n || n > batch.capacity);
  bool misaligned = false;
  const auto aligned = [&](const std::byte* row) { return reinterpret_cast<std::uintptr_t>(row) % unit == 0; };
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); !bad && i < k && k <= plan.stride; i += Threads) {
    bad = keep[i] < 0 || keep[i] >= n || (i > 0 && keep[i] <= keep[i - 1]);
    misaligned = misaligned || (!bad && keep[i] != i &&
                                !(aligned(view.key(id.l, id.h, keep[i])) && aligned(view.value(id.l, id.h, keep[i])) &&
                                  aligned(view.key(id.l, id.h, i)) && aligned(view.value(id.l, id.h, i))));
  }
  if (bad) fail_round(status, round_status::bad_keep);
  if (misaligned) fail_round(status, round_status::misaligned_rows);
}

/// The chunked in-place forward gather of `items` elements per kept row (see the file comment).
/// `move(src_row, dst_row, element, phase)`: phase 0 loads into the thread's register, phase 1
/// stores it.
template <int Threads, class Move>
__device__ void gather_in_place(const std::int32_t* keep, std::int32_t kept, int items, Move& move) {
  const std::int64_t total = static_cast<std::int64_t>(kept) * items;
  for (std::int64_t base = 0; base < total; base += Threads) {
    const std::int64_t at = base + threadIdx.x;
    const bool active = at < total;
    const auto i = static_cast<std::int32_t>(active ? at / items : 0);
    const int e = static_cast<int>(active ? at % items : 0);
    if (active) move.load(keep[i], e);
    __syncthreads();
    if (active && keep[i] != i) move.store(i, e);
    __syncthreads();
  }
}

/// Moves K and V rows in units of `Unit` (16 bytes when rows allow it).
template <class Unit, KVCacheView V>
struct row_mover {
  const V& view;
  int l, h;
  Unit k{}, v{};
  __device__ void load(std::int32_t src, int e) {
    k = reinterpret_cast<const Unit*>(view.key(l, h, src))[e];
    v = reinterpret_cast<const Unit*>(view.value(l, h, src))[e];
  }
  __device__ void store(std::int32_t dst, int e) {
    reinterpret_cast<Unit*>(view.key(l, h, dst))[e] = k;
    reinterpret_cast<Unit*>(view.value(l, h, dst))[e] = v;
  }
};

template <KVCacheView V>
struct position_mover {
  const V& view;
  int l, h;
  std::int32_t p = 0;
  __device__ void load(std::int32_t src, int) { p = view.position(l, h, src); }
  __device__ void store(std::int32_t dst, int) { view.position(l, h, dst) = p; }
};

/// One element of every state row of the kv_head: element e of a kept slot is state row
/// first_row + e. Elements of 1, 2, 4 or 8 bytes, carried as 8.
struct state_mover {
  std::byte* base;  // the layer's array of this sequence
  slot_state st;
  int first_row;
  std::uint64_t x = 0;
  __device__ std::byte* at(std::int32_t slot, int e) const {
    return base + ((first_row + e) * st.row_stride + slot) * static_cast<std::int64_t>(st.elem_bytes);
  }
  __device__ void load(std::int32_t src, int e) {
    const std::byte* p = at(src, e);
    x = 0;
    for (std::size_t b = 0; b < st.elem_bytes; ++b) x |= static_cast<std::uint64_t>(p[b]) << (8 * b);
  }
  __device__ void store(std::int32_t dst, int e) {
    std::byte* p = at(dst, e);
    for (std::size_t b = 0; b < st.elem_bytes; ++b) p[b] = static_cast<std::byte>((x >> (8 * b)) & 0xffu);
  }
};

template <int Threads, class Unit, KVCacheView V>
__global__ void __launch_bounds__(Threads) compact_gather(view_batch<V> batch, device_keep_plan plan,
                                                          device_slot_states states, const std::int32_t* status) {
  if (*status != static_cast<std::int32_t>(round_status::ok)) return;  // a failed round moves nothing
  const segment_id id = segment_of(static_cast<int>(blockIdx.x), batch.geometry);
  const V& view = batch.views[id.b];
  const std::int32_t k = plan.kept[blockIdx.x];
  const std::int32_t* keep = plan.keep + static_cast<std::int64_t>(blockIdx.x) * plan.stride;
  const int units = static_cast<int>(batch.geometry.head_dim * dtype_bytes(batch.geometry.type) / sizeof(Unit));
  row_mover<Unit, V> rows{view, id.l, id.h};
  gather_in_place<Threads>(keep, k, units, rows);
  position_mover<V> positions{view, id.l, id.h};
  gather_in_place<Threads>(keep, k, 1, positions);
  for (int s = 0; s < states.count; ++s) {
    const slot_state& st = states.items[s];
    std::byte* base = st.data + (id.b * states.sequence_stride[s] + id.l * st.layer_stride) *
                                    static_cast<std::int64_t>(st.elem_bytes);
    state_mover mover{base, st, id.h * st.rows_per_kv_head};
    gather_in_place<Threads>(keep, k, st.rows_per_kv_head, mover);
  }
  if (threadIdx.x == 0) view.set_length(id.l, id.h, k);
}

template <class Unit, KVCacheView V>
cudaError_t launch_compact(const view_batch<V>& batch, const device_keep_plan& plan, const device_slot_states& states,
                           std::int32_t* status, cudaStream_t stream) {
  constexpr int threads = 256;
  const auto segments = static_cast<unsigned>(batch.size * batch.geometry.num_layers * batch.geometry.num_kv_heads);
  compact_validate<threads><<<segments, threads, 0, stream>>>(batch, plan, sizeof(Unit), status);
  compact_gather<threads, Unit><<<segments, threads, 0, stream>>>(batch, plan, states, status);
  return cudaGetLastError();
}

}  // namespace detail

/// Applies `plan` to every view of `batch` in place: K and V rows, positions, lengths and
/// every array of `states`. The plan is checked on the device first (ascending, inside
/// [0, length), at most `stride` per row); a bad plan, or a `status` word that is already not
/// `ok` (a failed scoring of the same round), leaves everything untouched and `status` says
/// why. K and V rows move in 16-byte units when head_dim x element size allows it (else 8, 4
/// or 2: head_dim is even, so a 1-byte fp8 row of head_dim bytes always has a unit), which needs rows aligned to that unit, as cudaMalloc'd pools and dense caches with
/// such strides are; a plan that would move a misaligned row fails the round
/// (`misaligned_rows`) and moves nothing.
template <KVCacheView V>
cudaError_t compact(const view_batch<V>& batch, const device_keep_plan& plan, const device_slot_states& states,
                    std::int32_t* status, cudaStream_t stream) {
  const char* api = "triattn::cuda::compact";
  if (const cudaError_t err = detail::check_batch(api, batch); err != cudaSuccess) return err;
  if (plan.keep == nullptr || plan.kept == nullptr || plan.stride < 1)
    return detail::reject(api, "keep plan at ", static_cast<const void*>(plan.keep), " with stride ", plan.stride,
                          ": expected device arrays and a stride >= 1");
  if (status == nullptr) return detail::reject(api, "status is null: the round's status word is required");
  if (states.count < 0 || states.count > device_slot_states::max_items)
    return detail::reject(api, "states.count ", states.count, " must be in [0, ", device_slot_states::max_items, "]");
  for (int s = 0; s < states.count; ++s) {
    const slot_state& st = states.items[s];
    const std::size_t b = st.elem_bytes;
    if (st.data == nullptr || (b != 1 && b != 2 && b != 4 && b != 8) || st.rows_per_kv_head < 1)
      return detail::reject(api, "state ", s, " is null or has elem_bytes ", b, ", rows_per_kv_head ",
                            st.rows_per_kv_head, ": expected 1, 2, 4 or 8 bytes and >= 1 row");
  }
  const std::size_t row_bytes = static_cast<std::size_t>(batch.geometry.head_dim) * dtype_bytes(batch.geometry.type);
  if (row_bytes % 16 == 0) return detail::launch_compact<uint4>(batch, plan, states, status, stream);
  if (row_bytes % 8 == 0) return detail::launch_compact<uint2>(batch, plan, states, status, stream);
  if (row_bytes % 4 == 0) return detail::launch_compact<std::uint32_t>(batch, plan, states, status, stream);
  return detail::launch_compact<std::uint16_t>(batch, plan, states, status, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
