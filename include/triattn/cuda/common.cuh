/// \file triattn/cuda/common.cuh
/// \brief What every CUDA entry point shares: the batch of device views, the workspace
/// protocol, host-side argument errors, the round status word and 16-byte row loads.
///
/// **Conventions** (CUB's): an entry point takes `(void* workspace, std::size_t&
/// workspace_bytes, ..., cudaStream_t stream)`. With a null `workspace` it only stores the
/// bytes it needs and returns `cudaSuccess`; otherwise it enqueues its kernels on `stream` and
/// returns. Nothing allocates, nothing synchronises, nothing copies between host and device.
/// Every pointer argument is device memory unless its comment says otherwise. A call whose
/// host-side arguments are wrong enqueues nothing and returns `cudaErrorInvalidValue`;
/// `last_error_message()` then names the API and the value.
///
/// **Device-side failures** (a non-finite key, a keep index out of range) cannot be returned
/// without a synchronisation, so they are written to a caller-owned status word
/// (`round_status`). A compaction given that word moves nothing when it is not `ok`: a failed
/// round leaves the cache untouched, on the GPU as on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "triattn/core/config.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/kv_cache_view.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// A batch of sequences: `views` [size] in device memory, each a `KVCacheView` model whose
/// pointers (layer arrays, pools, block table, lengths, positions) are device pointers. Every
/// view has the host copy `geometry` (one model) and a capacity of at most `capacity`, the row
/// length of every per-slot buffer of the CUDA API ([batch, ..., capacity]).
/// `geometry.rope.inv_freq_table`, when set, must point to device memory.
template <KVCacheView V>
struct view_batch {
  const V* views = nullptr;
  int size = 0;
  kv_geometry geometry{};
  std::int64_t capacity = 0;
};

/// The status word a round writes on the device. Zero means success; a compaction reading a
/// non-zero word moves nothing.
/// The caller zeroes the word before a round (cudaMemsetAsync): nothing resets it, so that a
/// failure stays visible until the caller has read it.
enum class round_status : std::int32_t {
  ok = 0,
  non_finite_key = 1,  ///< a scored key holds a NaN or an infinity
  bad_keep = 2,        ///< keep indices not strictly ascending or outside [0, length), or a length above capacity
  misaligned_rows = 3, ///< a K or V row is not aligned to the unit `compact` moves it in
  unequal_rows = 4,    ///< rows sharing a decision (per_kv_head, whole_sequence) hold different slots
  bad_budget = 5,      ///< a sequence's budget is < 1, or a decision keeps more slots than the plan's stride
  no_queries = 6,      ///< a (sequence, layer, q_head) holds no window query the scorer may use
  non_finite_value = 7,  ///< a value-aware round met a value whose weight is a NaN or an infinity
};

/// The message of the last host-side argument error of this thread ("" when none).
inline std::string& last_error_message() {
  thread_local std::string message;
  return message;
}

/// Largest head_dim of the CUDA path: a scorer holds one key row per thread.
inline constexpr int max_head_dim = 256;

namespace detail {

/// Records "api: parts..." as this thread's last error and returns `cudaErrorInvalidValue`.
template <class... Parts>
cudaError_t reject(const char* api, const Parts&... parts) {
  std::ostringstream os;
  os << api << ": ";
  (os << ... << parts);
  last_error_message() = os.str();
  return cudaErrorInvalidValue;
}

/// Carves 256-byte-aligned buffers out of one caller-provided block. With a null base it
/// only counts, so one code path both sizes the workspace and lays it out.
class workspace_carver {
 public:
  explicit workspace_carver(void* base) : base_(static_cast<std::byte*>(base)) {}
  template <class T>
  T* take(std::size_t count) {
    const std::size_t at = used_;
    used_ += (count * sizeof(T) + 255) / 256 * 256;
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + at);
  }
  std::size_t bytes() const { return used_; }

 private:
  std::byte* base_;
  std::size_t used_ = 0;
};

/// The end of every entry point's sizing pass: a null workspace receives the size; a
/// workspace smaller than that is an error naming `api`. Returns true when the caller should
/// go on and launch.
inline bool workspace_ready(const char* api, void* workspace, std::size_t& workspace_bytes,
                            const workspace_carver& carver, cudaError_t& result) {
  result = cudaSuccess;
  if (workspace == nullptr) {
    workspace_bytes = carver.bytes();
    return false;
  }
  if (workspace_bytes < carver.bytes()) {
    result = reject(api, "workspace holds ", workspace_bytes, " bytes, the call needs ", carver.bytes());
    return false;
  }
  return true;
}

/// Host checks of a batch that need no device read: a non-empty batch, a well-formed model.
template <KVCacheView V>
cudaError_t check_batch(const char* api, const view_batch<V>& batch) {
  const kv_geometry& g = batch.geometry;
  if (batch.views == nullptr || batch.size < 1)
    return reject(api, "batch of ", batch.size, " views at ", static_cast<const void*>(batch.views),
                  ": expected a device array of >= 1 views");
  if (g.num_layers < 1 || g.num_kv_heads < 1 || g.num_q_heads < 1 || g.num_q_heads % g.num_kv_heads != 0)
    return reject(api, "geometry of ", g.num_layers, " layers, ", g.num_q_heads, " q_heads, ", g.num_kv_heads,
                  " kv_heads: expected >= 1 layer and q_heads a positive multiple of kv_heads");
  if (!is_valid_dtype(g.type)) return reject(api, "dtype ", static_cast<int>(g.type), " is not a triattn::dtype");
  if (!(g.k_scale > 0.0f && g.k_scale < INFINITY && g.v_scale > 0.0f && g.v_scale < INFINITY))
    return reject(api, "k_scale ", g.k_scale, " and v_scale ", g.v_scale, " must be finite and > 0");
  if (g.head_dim < 2 || g.head_dim % 2 != 0 || g.head_dim > max_head_dim)
    return reject(api, "head_dim ", g.head_dim, " must be even and in [2, ", max_head_dim, "]");
  if (batch.capacity < 0 || batch.capacity > INT32_MAX)
    return reject(api, "capacity ", batch.capacity, " must be in [0, 2^31)");
  return cudaSuccess;
}

/// Row r of a [batch, layers, heads, ...] buffer as (sequence, layer, head): the one index
/// mapping of the CUDA path. `heads` is kv_heads for keep plans and scores, q_heads for the
/// per-q-head rows of TriAttention and the accumulated sums.
struct segment_id {
  int b, l, h;
};
TRIATTN_HOST_DEVICE segment_id segment_of(std::int64_t r, int layers, int heads) {
  return {static_cast<int>(r / (std::int64_t{layers} * heads)), static_cast<int>(r / heads % layers),
          static_cast<int>(r % heads)};
}
/// Row r of a [batch, layers, kv_heads, ...] buffer (a keep plan's or a score buffer's row).
TRIATTN_HOST_DEVICE segment_id segment_of(std::int64_t r, const kv_geometry& g) {
  return segment_of(r, g.num_layers, g.num_kv_heads);
}

/// Refuses a batch of pre-RoPE keys for `policy`, whose kernels compare keys as stored with
/// post-RoPE vectors: unrotated keys would rank other tokens without an error. The CPU
/// policies rotate pre-RoPE keys; the GPU ones refuse them.
template <KVCacheView V>
cudaError_t check_post_rope_keys(const char* api, const char* policy, const view_batch<V>& batch) {
  if (batch.geometry.keys != key_state::pre_rope) return cudaSuccess;
  return reject(api, policy, " on the GPU needs post-RoPE keys: the batch's key_state is pre_rope "
                "(the CPU policy rotates pre-RoPE keys by their positions)");
}

/// The (sequence, layer, kv_head) segments of `batch`: the rows of a score buffer.
template <KVCacheView V>
std::int64_t segments_of(const view_batch<V>& batch) {
  return std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_kv_heads;
}

/// Blocks of `threads` covering `n` items (at least one block, so that a grid is valid).
inline unsigned blocks_for(std::int64_t n, int threads) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

#if defined(__CUDACC__)
/// Sets the round's `status` to `code` unless an earlier failure is there already.
__device__ inline void fail_round(std::int32_t* status, round_status code) {
  atomicCAS(status, static_cast<std::int32_t>(round_status::ok), static_cast<std::int32_t>(code));
}

/// Reads a row of `n` elements of storage type `T` as floats x `scale` into `out` [n]: 16-byte
/// vector loads (4 f32, 8 f16/bf16 or 16 fp8 elements each) when the row is 16-byte aligned
/// and a whole number of vectors, element loads otherwise. Each element is the host
/// accessor's float (`scaled_accessor<T>`: decode x scale), so a row reads the same on both sides.
/// Host and device so that the run-time dispatch below (`visit_dtype`, host and device) may
/// call it; the host only ever takes the element path.
template <class T>
TRIATTN_HOST_DEVICE void load_row(const scaled_accessor<T>& a, const std::byte* row, int n, float* out) {
  constexpr int per_vec = static_cast<int>(16 / sizeof(T));
#if defined(__CUDA_ARCH__)
  const bool vectors = reinterpret_cast<std::uintptr_t>(row) % 16 == 0 && n % per_vec == 0;
#else
  const bool vectors = false;
#endif
  if (!vectors) {
    a.load(row, n, out);
    return;
  }
#if defined(__CUDA_ARCH__)
  const auto* vec = reinterpret_cast<const uint4*>(row);
  for (int v = 0; v < n / per_vec; ++v) {
    const uint4 x = __ldg(vec + v);
    T elements[per_vec];
    memcpy(elements, &x, sizeof x);
    for (int e = 0; e < per_vec; ++e) out[v * per_vec + e] = to_float(elements[e]) * a.scale;
  }
#endif
}
/// A run-time element type: one dispatch per row, then the typed loads.
TRIATTN_HOST_DEVICE void load_row(const dtype_accessor& a, const std::byte* row, int n, float* out) {
  visit_dtype(a.type, [&]<class T>() { load_row(scaled_accessor<T>{a.scale}, row, n, out); });
}
/// An engine's own accessor (a view's `key_accessor` hook): its own `load`.
template <class Accessor>
__device__ void load_row(const Accessor& a, const std::byte* row, int n, float* out) {
  a.load(row, n, out);
}

/// Key row (l, h, s) of `view` as floats (scaled) into `out` [head_dim], through the view's accessor.
template <KVCacheView V>
__device__ void load_key_row(const V& view, int l, int h, std::int64_t s, float* out) {
  load_row(key_accessor_of(view, l), view.key(l, h, s), view.geometry().head_dim, out);
}
/// Value row (l, h, s) of `view` as floats (scaled) into `out` [head_dim].
template <KVCacheView V>
__device__ void load_value_row(const V& view, int l, int h, std::int64_t s, float* out) {
  load_row(value_accessor_of(view, l), view.value(l, h, s), view.geometry().head_dim, out);
}

#endif

}  // namespace detail
}  // namespace cuda
TRIATTN_NAMESPACE_END
