/// \file triattn/core/kv_cache_view.hpp
/// \brief The `KVCacheView` concept and its two models: a dense strided cache and a paged
/// (block-table) cache.
///
/// A view describes the KV cache of ONE sequence, across every layer, without owning any of
/// it. The engine keeps its memory, its allocator and its attention kernels; triattn reads
/// keys through the view and compacts the cache in place through it. A batch is a
/// `std::span` of views.
///
/// Addressing is (layer, kv_head, slot) -> the first element of a row of `head_dim`
/// contiguous elements (the dim stride must be 1: vector loads and memcpy of whole rows).
/// Slots are per (layer, kv_head): heads that kept different tokens hold different
/// positions, so each (layer, kv_head) has its own token count and a position per slot.
///
/// As in mdspan, where a row is (the layout: `key`, `value`) is apart from how its elements
/// decode (the accessor: `key_accessor`, `value_accessor`). The built-in views take the
/// element type as a template parameter: `dense_kv_view_of<bfloat16_t>` decodes with a
/// compile-time `scaled_accessor`, `dense_kv_view` (= `basic_dense_kv_view<any_element>`) with
/// a `dtype_accessor` that dispatches once per row on `kv_geometry::type`.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/rope.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Whether the cached keys carry their rotary embedding.
enum class key_state : std::uint8_t {
  post_rope,  ///< rotated at their position before caching (llama.cpp, vLLM, HF, TensorRT-LLM default)
  pre_rope,   ///< rotated inside the attention kernel (FlashInfer in-kernel RoPE, TRT pos_shift)
};

/// The model-side shape of a cache: what every view model carries.
struct kv_geometry {
  int num_layers = 0;
  int num_q_heads = 0;   ///< query heads; a GQA group is num_q_heads / num_kv_heads
  int num_kv_heads = 0;
  int head_dim = 0;      ///< K and V share it
  dtype type = dtype::f32;
  key_state keys = key_state::post_rope;
  rope_desc rope{};
  float k_scale = 1.0f;  ///< per-tensor scale of K: value = decode(bits) x k_scale (1 unless fp8)
  float v_scale = 1.0f;  ///< per-tensor scale of V

  /// Query heads per KV head. Query head h reads KV head h / group_size().
  TRIATTN_HOST_DEVICE int group_size() const { return num_q_heads / num_kv_heads; }
};

/// Row strides of one of K or V, in elements. The dim stride is 1.
///
/// Dense NHD [tokens, kv_heads, head_dim]: token = kv_heads*head_dim, head = head_dim.
/// Dense HND [kv_heads, tokens, head_dim]: token = head_dim, head = capacity*head_dim.
/// Paged adds `page` (the distance between two pages of the pool).
struct kv_strides {
  std::int64_t token = 0;
  std::int64_t head = 0;
  std::int64_t page = 0;  ///< paged views only

  static constexpr kv_strides nhd(int num_kv_heads, int head_dim) {
    return {std::int64_t{num_kv_heads} * head_dim, head_dim, 0};
  }
  static constexpr kv_strides hnd(std::int64_t tokens_per_head, int head_dim) {
    return {head_dim, tokens_per_head * head_dim, 0};
  }
  /// Within a page of `page_size` tokens, NHD: [pages, page_size, kv_heads, head_dim].
  static constexpr kv_strides paged_nhd(int page_size, int num_kv_heads, int head_dim) {
    return {std::int64_t{num_kv_heads} * head_dim, head_dim, std::int64_t{page_size} * num_kv_heads * head_dim};
  }
  /// Within a page, HND: [pages, kv_heads, page_size, head_dim] (TensorRT-LLM, FlashInfer HND).
  static constexpr kv_strides paged_hnd(int page_size, int num_kv_heads, int head_dim) {
    return {head_dim, std::int64_t{page_size} * head_dim, std::int64_t{page_size} * num_kv_heads * head_dim};
  }
};

/// Token bookkeeping shared by both models, owned by the engine:
/// `lengths` [num_layers, num_kv_heads] valid slots per (layer, kv_head);
/// `positions` [num_layers, num_kv_heads, capacity] the token position held by each slot.
/// The views forward `length`, `set_length` and `position` here, so the indexing is written once.
struct slot_table {
  std::int32_t* lengths = nullptr;
  std::int32_t* positions = nullptr;
  std::int64_t capacity = 0;  ///< slots per (layer, kv_head)

  /// The valid slots of (l, h) in a cache of `num_kv_heads` KV heads per layer.
  TRIATTN_HOST_DEVICE std::int32_t& length(int num_kv_heads, int l, int h) const {
    return lengths[l * num_kv_heads + h];
  }
  /// The token position held by slot `s` of (l, h).
  TRIATTN_HOST_DEVICE std::int32_t& position(int num_kv_heads, int l, int h, std::int64_t s) const {
    return positions[(static_cast<std::int64_t>(l) * num_kv_heads + h) * capacity + s];
  }
};

/// The KVCacheView concept.
///
/// A model `V` provides, with `l` a layer, `h` a KV head and `s` a slot:
/// - `v.geometry()`: the `kv_geometry` (layers, heads, head_dim, dtype, key state, RoPE);
/// - `v.key(l, h, s)`, `v.value(l, h, s)`: `std::byte*` to the row of `head_dim` elements;
/// - `v.length(l, h)` and `v.set_length(l, h, n)`: the number of valid slots;
/// - `v.position(l, h, s)`: `std::int32_t&`, the token position held by slot `s`;
/// - `v.capacity()`: slots addressable per (layer, kv_head);
/// - `v.validate(api)`: throws `triattn::error` naming `api` when the view is malformed.
/// Models are trivially copyable so that kernels can take them by value.
///
/// Optional hooks, found by `requires`:
/// - `v.key_accessor(l)`, `v.value_accessor(l)`: how the rows of layer `l` decode (an object
///   with `load(const std::byte*, int n, float*)` and `store(std::byte*, int n, const float*)`);
///   without them, `dtype_accessor{geometry().type, k_scale or v_scale}`;
/// - `v.freed_pages(before, after)`: the pages a compaction from `before` to `after` slots
///   (the largest length over every (layer, kv_head)) released, for the engine's allocator;
/// - `V::equal_lengths` (a `static constexpr bool`): true for a cache whose every (layer,
///   kv_head) holds the same tokens in the same slots (a cell-based cache such as llama.cpp's,
///   where one cell holds a token for every layer and head): a round on it must decide one keep
///   set for the sequence (union granularity, no budget split), and a keep plan's rows must be
///   equal;
/// - `v.free_evicted(plan)`: the engine frees the slots a validated keep plan evicts in its
///   own cache instead of the rows moving (llama.cpp's cells: `llama_memory_seq_rm`), and the
///   view updates its own slot map, positions and lengths; it may throw, before it changes
///   anything. Compaction then moves no K or V row; the policy's per-slot state still moves.
template <class V>
concept KVCacheView = std::is_trivially_copyable_v<V> &&
                      requires(const V v, int l, int h, std::int64_t s, std::int32_t n, const char* api) {
                        { v.geometry() } -> std::convertible_to<const kv_geometry&>;
                        { v.key(l, h, s) } -> std::same_as<std::byte*>;
                        { v.value(l, h, s) } -> std::same_as<std::byte*>;
                        { v.length(l, h) } -> std::same_as<std::int32_t>;
                        { v.position(l, h, s) } -> std::same_as<std::int32_t&>;
                        { v.capacity() } -> std::same_as<std::int64_t>;
                        v.set_length(l, h, n);
                        v.validate(api);
                      };

/// The element-type parameter of the built-in views that means "the type is `kv_geometry::type`,
/// known at run time".
struct any_element {};

namespace detail {
/// Checks the element type and scales of a geometry.
inline void validate_elements(const char* api, const kv_geometry& g) {
  TRIATTN_CHECK(is_valid_dtype(g.type), api, "dtype ", static_cast<int>(g.type), " is not a triattn::dtype");
  const auto good = [](float s) { return s > 0.0f && s < INFINITY; };  // false for NaN
  TRIATTN_CHECK(good(g.k_scale) && good(g.v_scale), api, "k_scale ", g.k_scale, " and v_scale ", g.v_scale,
                " must be finite and > 0");
}

/// A typed view must describe a cache of its own type.
template <class Element>
void validate_element_type(const char* api, const kv_geometry& g) {
  if constexpr (!std::is_same_v<Element, any_element>)
    TRIATTN_CHECK(g.type == dtype_of<Element>, api, "the view's element type is ", dtype_name(dtype_of<Element>),
                  " but its geometry says ", dtype_name(g.type));
}

/// Checks the parts of a view that both models share: the geometry, the element type of a
/// typed view, the slot table.
template <class Element>
void validate_common(const char* api, const kv_geometry& g, const slot_table& t) {
  validate_elements(api, g);
  TRIATTN_CHECK(g.num_layers > 0, api, "num_layers ", g.num_layers, " must be >= 1");
  TRIATTN_CHECK(g.num_kv_heads > 0, api, "num_kv_heads ", g.num_kv_heads, " must be >= 1");
  // Rows are counted in int (a layer times its kv_heads): the product must fit.
  TRIATTN_CHECK(std::int64_t{g.num_layers} * g.num_kv_heads <= INT32_MAX &&
                    std::int64_t{g.num_layers} * g.num_q_heads <= INT32_MAX,
                api, "num_layers ", g.num_layers, " x num_q_heads ", g.num_q_heads, " must be below 2^31");
  TRIATTN_CHECK(g.num_q_heads > 0 && g.num_q_heads % g.num_kv_heads == 0, api, "num_q_heads ", g.num_q_heads,
                " must be a positive multiple of num_kv_heads ", g.num_kv_heads);
  validate_rope(api, g.rope, g.head_dim);
  TRIATTN_CHECK(t.lengths != nullptr, api, "lengths is null");
  TRIATTN_CHECK(t.positions != nullptr, api, "positions is null");
  TRIATTN_CHECK(t.capacity >= 0, api, "capacity ", t.capacity, " must be >= 0");
  for (int i = 0; i < g.num_layers * g.num_kv_heads; ++i) {
    TRIATTN_CHECK(t.lengths[i] >= 0 && t.lengths[i] <= t.capacity, api, "length ", t.lengths[i], " of layer ",
                  i / g.num_kv_heads, " kv_head ", i % g.num_kv_heads, " is outside [0, capacity ", t.capacity,
                  "]");
  }
  validate_element_type<Element>(api, g);
}

/// The accessor of a built-in view's K or V: compile-time when `Element` is a storage type.
template <class Element>
TRIATTN_HOST_DEVICE auto element_accessor(const kv_geometry& g, float scale) {
  if constexpr (std::is_same_v<Element, any_element>) {
    return dtype_accessor{g.type, scale};
  } else {
    return scaled_accessor<Element>{scale};
  }
}
template <class Element>
TRIATTN_HOST_DEVICE std::int64_t element_bytes(const kv_geometry& g) {
  if constexpr (std::is_same_v<Element, any_element>) {
    return static_cast<std::int64_t>(dtype_bytes(g.type));
  } else {
    return static_cast<std::int64_t>(sizeof(Element));
  }
}
}  // namespace detail

/// A dense cache: per layer, K and V are base pointers with row strides. Covers NHD
/// [tokens, kv_heads, head_dim], HND [kv_heads, tokens, head_dim] and any other strided layout.
/// `Element` is the storage type when known at compile time (`any_element`: `geo.type`).
template <class Element = any_element>
struct basic_dense_kv_view {
  kv_geometry geo{};
  std::byte* const* k_layers = nullptr;  ///< [num_layers] base pointer of each layer's K
  std::byte* const* v_layers = nullptr;  ///< [num_layers] base pointer of each layer's V
  kv_strides k_stride{};
  kv_strides v_stride{};
  slot_table slots{};

  TRIATTN_HOST_DEVICE const kv_geometry& geometry() const { return geo; }
  TRIATTN_HOST_DEVICE std::int64_t capacity() const { return slots.capacity; }
  TRIATTN_HOST_DEVICE std::byte* key(int l, int h, std::int64_t s) const {
    return k_layers[l] + (s * k_stride.token + h * k_stride.head) * detail::element_bytes<Element>(geo);
  }
  TRIATTN_HOST_DEVICE std::byte* value(int l, int h, std::int64_t s) const {
    return v_layers[l] + (s * v_stride.token + h * v_stride.head) * detail::element_bytes<Element>(geo);
  }
  TRIATTN_HOST_DEVICE auto key_accessor(int) const { return detail::element_accessor<Element>(geo, geo.k_scale); }
  TRIATTN_HOST_DEVICE auto value_accessor(int) const { return detail::element_accessor<Element>(geo, geo.v_scale); }
  TRIATTN_HOST_DEVICE std::int32_t length(int l, int h) const { return slots.length(geo.num_kv_heads, l, h); }
  TRIATTN_HOST_DEVICE void set_length(int l, int h, std::int32_t n) const { slots.length(geo.num_kv_heads, l, h) = n; }
  TRIATTN_HOST_DEVICE std::int32_t& position(int l, int h, std::int64_t s) const {
    return slots.position(geo.num_kv_heads, l, h, s);
  }

  void validate(const char* api) const {
    detail::validate_common<Element>(api, geo, slots);
    TRIATTN_CHECK(k_layers != nullptr && v_layers != nullptr, api, "k_layers/v_layers is null");
    for (int l = 0; l < geo.num_layers; ++l) {
      TRIATTN_CHECK(k_layers[l] != nullptr, api, "K base pointer of layer ", l, " is null");
      TRIATTN_CHECK(v_layers[l] != nullptr, api, "V base pointer of layer ", l, " is null");
    }
  }
};

/// A paged cache (vLLM / FlashInfer style): per layer a pool of pages, one block table per
/// sequence shared by all layers, mapping logical slot s to (page block_table[s / page_size],
/// offset s % page_size). Any positive page size. `Element` as for `basic_dense_kv_view`.
template <class Element = any_element>
struct basic_paged_kv_view {
  kv_geometry geo{};
  std::byte* const* k_pools = nullptr;  ///< [num_layers] base of each layer's K page pool
  std::byte* const* v_pools = nullptr;  ///< [num_layers] base of each layer's V page pool
  kv_strides k_stride{};                ///< includes `page`
  kv_strides v_stride{};
  const std::int32_t* block_table = nullptr;  ///< [num_blocks] page ids of this sequence, distinct
  std::int32_t num_blocks = 0;
  std::int32_t page_size = 0;
  std::int32_t num_pages = 0;  ///< pages in each layer's pool: every page id must be below it
  slot_table slots{};  ///< capacity must not exceed num_blocks * page_size

  TRIATTN_HOST_DEVICE const kv_geometry& geometry() const { return geo; }
  TRIATTN_HOST_DEVICE std::int64_t capacity() const { return slots.capacity; }
  TRIATTN_HOST_DEVICE std::byte* key(int l, int h, std::int64_t s) const { return row(k_pools[l], k_stride, h, s); }
  TRIATTN_HOST_DEVICE std::byte* value(int l, int h, std::int64_t s) const {
    return row(v_pools[l], v_stride, h, s);
  }
  TRIATTN_HOST_DEVICE auto key_accessor(int) const { return detail::element_accessor<Element>(geo, geo.k_scale); }
  TRIATTN_HOST_DEVICE auto value_accessor(int) const { return detail::element_accessor<Element>(geo, geo.v_scale); }
  TRIATTN_HOST_DEVICE std::int32_t length(int l, int h) const { return slots.length(geo.num_kv_heads, l, h); }
  TRIATTN_HOST_DEVICE void set_length(int l, int h, std::int32_t n) const { slots.length(geo.num_kv_heads, l, h) = n; }
  TRIATTN_HOST_DEVICE std::int32_t& position(int l, int h, std::int64_t s) const {
    return slots.position(geo.num_kv_heads, l, h, s);
  }

  /// The page ids (from the tail of the block table, in block-table order) that no (layer,
  /// kv_head) uses once the longest row went from `before` to `after` slots.
  std::vector<std::int32_t> freed_pages(std::int32_t before, std::int32_t after) const {
    const auto pages = [&](std::int32_t n) { return (n + page_size - 1) / page_size; };
    return {block_table + pages(after), block_table + pages(before)};
  }

  void validate(const char* api) const {
    detail::validate_common<Element>(api, geo, slots);
    TRIATTN_CHECK(page_size > 0, api, "page_size ", page_size, " must be >= 1");
    TRIATTN_CHECK(block_table != nullptr, api, "block_table is null");
    TRIATTN_CHECK(k_pools != nullptr && v_pools != nullptr, api, "k_pools/v_pools is null");
    TRIATTN_CHECK(slots.capacity <= std::int64_t{num_blocks} * page_size, api, "page table too short: ",
                  num_blocks, " blocks of ", page_size, " slots hold fewer than capacity ", slots.capacity);
    for (int l = 0; l < geo.num_layers; ++l) {
      TRIATTN_CHECK(k_pools[l] != nullptr, api, "K page pool of layer ", l, " is null");
      TRIATTN_CHECK(v_pools[l] != nullptr, api, "V page pool of layer ", l, " is null");
    }
    TRIATTN_CHECK(num_pages > 0, api, "num_pages ", num_pages, " must be >= 1 (the pages of each layer's pool)");
    for (std::int32_t b = 0; b < num_blocks; ++b)
      TRIATTN_CHECK(block_table[b] >= 0 && block_table[b] < num_pages, api, "block_table[", b, "] = ", block_table[b],
                    " is outside the pool's pages [0, ", num_pages, ")");
    // Two blocks on one page would alias rows: compaction would move one slot over another.
    std::vector<std::int32_t> ids(block_table, block_table + num_blocks);
    std::sort(ids.begin(), ids.end());
    const auto dup = std::adjacent_find(ids.begin(), ids.end());
    TRIATTN_CHECK(dup == ids.end(), api, "page ", dup == ids.end() ? 0 : *dup,
                  " appears twice in block_table: blocks must be distinct pages");
  }

 private:
  TRIATTN_HOST_DEVICE std::byte* row(std::byte* pool, const kv_strides& st, int h, std::int64_t s) const {
    const std::int64_t page = block_table[s / page_size];
    const std::int64_t off = s % page_size;
    return pool + (page * st.page + off * st.token + h * st.head) * detail::element_bytes<Element>(geo);
  }
};

/// The views most code uses: element type from `kv_geometry::type` at run time.
using dense_kv_view = basic_dense_kv_view<>;
using paged_kv_view = basic_paged_kv_view<>;
/// Views whose element type `T` is known at compile time (no per-row dispatch).
template <class T>
using dense_kv_view_of = basic_dense_kv_view<T>;
template <class T>
using paged_kv_view_of = basic_paged_kv_view<T>;

static_assert(KVCacheView<dense_kv_view>);
static_assert(KVCacheView<paged_kv_view>);
static_assert(KVCacheView<dense_kv_view_of<fp8_e4m3_t>>);
static_assert(std::is_standard_layout_v<dense_kv_view> && std::is_standard_layout_v<paged_kv_view>);

/// The accessor of layer `l`'s keys of `v`: the view's `key_accessor` hook, else the run-time
/// dtype with `k_scale`.
template <class V>
TRIATTN_HOST_DEVICE auto key_accessor_of(const V& v, int l) {
  if constexpr (requires { v.key_accessor(l); }) {
    return v.key_accessor(l);
  } else {
    return dtype_accessor{v.geometry().type, v.geometry().k_scale};
  }
}
/// The accessor of layer `l`'s values of `v` (see `key_accessor_of`).
template <class V>
TRIATTN_HOST_DEVICE auto value_accessor_of(const V& v, int l) {
  if constexpr (requires { v.value_accessor(l); }) {
    return v.value_accessor(l);
  } else {
    return dtype_accessor{v.geometry().type, v.geometry().v_scale};
  }
}

/// Whether every element of `x` [n] is finite: integer tests on the exponent bits, OR-ed, so
/// the loop vectorises (a check per element that throws would not).
inline bool all_finite(const float* x, std::int64_t n) {
  std::uint32_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    bad |= (u & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
  }
  return bad == 0;
}

/// Throws naming `api` and the first non-finite element of the key row `key` [head_dim] of
/// (l, h, s), if it has one: the vectorised `all_finite` first, the element search only for a
/// row that fails.
inline void check_key_finite(const char* api, const float* key, int head_dim, int l, int h, std::int64_t s) {
  if (all_finite(key, head_dim)) return;
  for (int d = 0; d < head_dim; ++d)
    TRIATTN_CHECK(std::isfinite(key[d]), api, "key of layer ", l, " kv_head ", h, " slot ", s, " has ", key[d],
                  " at dim ", d, ": keys must be finite");
}

/// Asks the cache hierarchy for `bytes` bytes at `p` ahead of their use: a gather or a row
/// read between blocks of arithmetic, which the hardware prefetcher alone does not cover.
inline void prefetch_bytes(const std::byte* p, std::size_t bytes) {
#if defined(__GNUC__)
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
#else
  (void)p;
  (void)bytes;
#endif
}

/// Calls `f(accessor)` with layer `l`'s key accessor of `v` as a compile-time type: a
/// run-time `dtype_accessor` is dispatched once here to its `scaled_accessor<T>`, so the loops
/// of `f` decode without a dispatch per row.
template <class V, class F>
decltype(auto) with_key_accessor(const V& v, int l, F&& f) {
  const auto keys = key_accessor_of(v, l);
  if constexpr (std::is_same_v<std::remove_cv_t<decltype(keys)>, dtype_accessor>) {
    return visit_dtype(keys.type, [&]<class T>() { return f(scaled_accessor<T>{keys.scale}); });
  } else {
    return f(keys);
  }
}

/// Reads the key row (l, h, s) as f32 (scaled) into `out` [head_dim].
template <KVCacheView V>
void load_key(const V& v, int l, int h, std::int64_t s, float* out) {
  key_accessor_of(v, l).load(v.key(l, h, s), v.geometry().head_dim, out);
}
/// Reads the value row (l, h, s) as f32 (scaled) into `out` [head_dim].
template <KVCacheView V>
void load_value(const V& v, int l, int h, std::int64_t s, float* out) {
  value_accessor_of(v, l).load(v.value(l, h, s), v.geometry().head_dim, out);
}
/// Writes `in` [head_dim] as the key row (l, h, s), scaled and rounded to the cache's type.
template <KVCacheView V>
void store_key(const V& v, int l, int h, std::int64_t s, const float* in) {
  key_accessor_of(v, l).store(v.key(l, h, s), v.geometry().head_dim, in);
}
/// Writes `in` [head_dim] as the value row (l, h, s), scaled and rounded to the cache's type.
template <KVCacheView V>
void store_value(const V& v, int l, int h, std::int64_t s, const float* in) {
  value_accessor_of(v, l).store(v.value(l, h, s), v.geometry().head_dim, in);
}

/// Whether `V` declares that its rows all hold the same slots (the `equal_lengths` hook).
template <class V>
constexpr bool holds_equal_lengths() {
  if constexpr (requires { V::equal_lengths; }) {
    return V::equal_lengths;
  } else {
    return false;
  }
}

/// Largest length over every (layer, kv_head).
template <KVCacheView V>
std::int32_t max_length(const V& v) {
  std::int32_t m = 0;
  for (int l = 0; l < v.geometry().num_layers; ++l)
    for (int h = 0; h < v.geometry().num_kv_heads; ++h) m = v.length(l, h) > m ? v.length(l, h) : m;
  return m;
}

TRIATTN_NAMESPACE_END
