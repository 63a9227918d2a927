// An owning test cache: K, V, lengths, positions (and a block table) in std::vector storage
// with random contents, and the dense or paged view over it. The cache computes row
// addresses with its own arithmetic, so a test can read "what is really stored" without
// going through the view under test.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"

namespace triattn_test {

enum class cache_layout { dense_nhd, dense_hnd, paged_nhd, paged_hnd };
inline constexpr cache_layout all_layouts[] = {cache_layout::dense_nhd, cache_layout::dense_hnd,
                                               cache_layout::paged_nhd, cache_layout::paged_hnd};
inline constexpr triattn::dtype all_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16};

inline bool is_paged(cache_layout l) { return l == cache_layout::paged_nhd || l == cache_layout::paged_hnd; }
inline const char* layout_name(cache_layout l) {
  switch (l) {
    case cache_layout::dense_nhd: return "dense NHD";
    case cache_layout::dense_hnd: return "dense HND";
    case cache_layout::paged_nhd: return "paged NHD";
    case cache_layout::paged_hnd: return "paged HND";
  }
  return "?";
}

struct cache_shape {
  int num_layers = 2;
  int num_kv_heads = 2;
  int group = 1;  ///< query heads per KV head
  int head_dim = 8;
  triattn::dtype type = triattn::dtype::f32;
  std::int64_t capacity = 16;
  cache_layout layout = cache_layout::dense_nhd;
  int page_size = 4;    ///< paged layouts only
  int spare_pages = 2;  ///< pool pages of "other sequences": nothing may ever write them
  triattn::key_state keys = triattn::key_state::post_rope;
  triattn::rope_desc rope{};
  float k_scale = 1.0f;  ///< per-tensor scales (fp8 caches): value = decode(bits) x scale
  float v_scale = 1.0f;

  std::string describe() const {
    return std::string(layout_name(layout)) + " " + triattn::dtype_name(type) + " L=" + std::to_string(num_layers) +
           " H=" + std::to_string(num_kv_heads) + " G=" + std::to_string(group) + " D=" + std::to_string(head_dim) +
           " cap=" + std::to_string(capacity) + (is_paged(layout) ? " page=" + std::to_string(page_size) : "") +
           (k_scale != 1.0f || v_scale != 1.0f ? " k_scale=" + std::to_string(k_scale) + " v_scale=" + std::to_string(v_scale) : "") +
           (keys == triattn::key_state::pre_rope ? " pre_rope" : "") +
           (rope.style == triattn::rope_style::interleaved ? " interleaved" : "");
  }
};

/// Bounds of `random_shape` (inclusive).
struct shape_bounds {
  int min_layers = 1, max_layers = 3;
  int max_kv_heads = 4;
  int max_half_dim = 6;  ///< head_dim is 2 x [1, max_half_dim]
  std::int64_t min_capacity = 1, max_capacity = 40;
};

/// A small random shape within `b` (by default 1-3 layers, 1-4 KV heads, an even head_dim in
/// [2, 12], capacity in [1, 40]).
inline cache_shape random_shape(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int page_size,
                                int group = 1, const shape_bounds& b = {}) {
  std::uniform_int_distribution<int> layers(b.min_layers, b.max_layers), heads(1, b.max_kv_heads),
      half_dim(1, b.max_half_dim);
  std::uniform_int_distribution<std::int64_t> capacity(b.min_capacity, b.max_capacity);
  cache_shape s;
  s.num_layers = layers(g);
  s.num_kv_heads = heads(g);
  s.group = group;
  s.head_dim = 2 * half_dim(g);
  s.type = type;
  s.capacity = capacity(g);
  s.layout = layout;
  s.page_size = page_size;
  return s;
}

/// What one slot holds: its K and V rows (bytes) and its position.
struct slot_contents {
  std::vector<std::byte> k, v;
  std::int32_t position = 0;
  bool operator==(const slot_contents&) const = default;
};

/// Everything a cache owns, for "nothing changed" checks.
struct cache_bytes {
  std::vector<std::vector<std::byte>> k, v;
  std::vector<std::int32_t> lengths, positions, block_table;
  bool operator==(const cache_bytes&) const = default;
};

class test_cache {
 public:
  std::vector<std::int32_t> lengths;      ///< [layers * kv_heads]
  std::vector<std::int32_t> positions;    ///< [layers * kv_heads * capacity]
  std::vector<std::int32_t> block_table;  ///< paged: distinct, shuffled page ids

  /// Random K/V everywhere (spare pages and slots past the lengths too), random lengths in
  /// [0, capacity], strictly ascending random positions.
  test_cache(const cache_shape& shape, std::mt19937_64& g) : shape_(shape) {
    const auto L = static_cast<std::size_t>(shape.num_layers);
    std::size_t layer_elems = static_cast<std::size_t>(shape.capacity) * row_elems();
    if (is_paged(shape.layout)) {
      const auto blocks = (shape.capacity + shape.page_size - 1) / shape.page_size;
      pool_pages_ = static_cast<int>(blocks) + shape.spare_pages;
      std::vector<std::int32_t> ids(static_cast<std::size_t>(pool_pages_));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), g);
      block_table.assign(ids.begin(), ids.begin() + blocks);
      layer_elems = static_cast<std::size_t>(pool_pages_) * static_cast<std::size_t>(shape.page_size) * row_elems();
    }
    std::normal_distribution<double> normal(0.0, 1.0);
    const std::size_t bytes = layer_elems * triattn::dtype_bytes(shape.type);
    for (auto* kv : {&k_, &v_}) {
      const double scale = kv == &k_ ? shape.k_scale : shape.v_scale;  // stored values decode to ~N(0, 1)
      kv->assign(L, std::vector<std::byte>(bytes));
      for (auto& layer : *kv)
        for (std::size_t i = 0; i < layer_elems; ++i) ref::store(layer.data(), shape.type, i, normal(g) / scale);
    }
    for (std::size_t l = 0; l < L; ++l) {
      k_ptrs_.push_back(k_[l].data());
      v_ptrs_.push_back(v_[l].data());
    }
    std::uniform_int_distribution<std::int32_t> len(0, static_cast<std::int32_t>(shape.capacity));
    lengths.resize(L * static_cast<std::size_t>(shape.num_kv_heads));
    for (auto& n : lengths) n = len(g);
    positions.resize(lengths.size() * static_cast<std::size_t>(shape.capacity));
    std::uniform_int_distribution<std::int32_t> start(0, 50), gap(1, 4);
    for (std::size_t r = 0; r < lengths.size(); ++r) {
      std::int32_t p = start(g);
      for (std::int64_t s = 0; s < shape.capacity; ++s, p += gap(g)) positions[r * shape.capacity + s] = p;
    }
  }
  test_cache(const test_cache&) = delete;
  test_cache& operator=(const test_cache&) = delete;
  test_cache(test_cache&&) = default;  // the heap buffers, and so the views' pointers, survive a move

  const cache_shape& shape() const { return shape_; }
  int pool_pages() const { return pool_pages_; }

  triattn::kv_geometry geometry() const {
    return {shape_.num_layers, shape_.num_kv_heads * shape_.group, shape_.num_kv_heads, shape_.head_dim, shape_.type,
            shape_.keys, shape_.rope, shape_.k_scale, shape_.v_scale};
  }

  triattn::dense_kv_view dense_view() {
    const auto st = shape_.layout == cache_layout::dense_hnd ? triattn::kv_strides::hnd(shape_.capacity, shape_.head_dim)
                                                             : triattn::kv_strides::nhd(shape_.num_kv_heads, shape_.head_dim);
    return {geometry(), k_ptrs_.data(), v_ptrs_.data(), st, st, slots()};
  }
  triattn::paged_kv_view paged_view() {
    const auto st = shape_.layout == cache_layout::paged_hnd
                        ? triattn::kv_strides::paged_hnd(shape_.page_size, shape_.num_kv_heads, shape_.head_dim)
                        : triattn::kv_strides::paged_nhd(shape_.page_size, shape_.num_kv_heads, shape_.head_dim);
    return {geometry(), k_ptrs_.data(), v_ptrs_.data(), st, st, block_table.data(),
            static_cast<std::int32_t>(block_table.size()), shape_.page_size, pool_pages_, slots()};
  }
  /// Calls `f` with the view of this cache's layout.
  template <class F>
  decltype(auto) with_view(F&& f) {
    if (is_paged(shape_.layout)) return f(paged_view());
    return f(dense_view());
  }

  /// The test's own addressing: element offset of row (h, s) inside a layer's buffer.
  std::size_t row_offset(int h, std::int64_t s) const {
    const std::int64_t H = shape_.num_kv_heads, D = shape_.head_dim, cap = shape_.capacity, ps = shape_.page_size;
    switch (shape_.layout) {
      case cache_layout::dense_nhd: return static_cast<std::size_t>((s * H + h) * D);
      case cache_layout::dense_hnd: return static_cast<std::size_t>((h * cap + s) * D);
      case cache_layout::paged_nhd: return static_cast<std::size_t>(((block_table[s / ps] * ps + s % ps) * H + h) * D);
      case cache_layout::paged_hnd: return static_cast<std::size_t>(((block_table[s / ps] * H + h) * ps + s % ps) * D);
    }
    return 0;
  }
  std::byte* key_row(int l, int h, std::int64_t s) { return row(k_, l, h, s); }
  std::byte* value_row(int l, int h, std::int64_t s) { return row(v_, l, h, s); }
  std::vector<std::byte> key_bytes(int l, int h, std::int64_t s) { return row_bytes(k_, l, h, s); }
  std::vector<std::byte> value_bytes(int l, int h, std::int64_t s) { return row_bytes(v_, l, h, s); }
  /// The key row as doubles, decoded by the reference (times k_scale).
  std::vector<double> key(int l, int h, std::int64_t s) {
    std::vector<double> x(static_cast<std::size_t>(shape_.head_dim));
    for (std::size_t d = 0; d < x.size(); ++d) x[d] = ref::load(key_row(l, h, s), shape_.type, d) * shape_.k_scale;
    return x;
  }
  /// The value row as doubles, decoded by the reference (times v_scale).
  std::vector<double> value(int l, int h, std::int64_t s) {
    std::vector<double> x(static_cast<std::size_t>(shape_.head_dim));
    for (std::size_t d = 0; d < x.size(); ++d) x[d] = ref::load(value_row(l, h, s), shape_.type, d) * shape_.v_scale;
    return x;
  }
  /// Stores `x` (values, divided by k_scale and rounded to the cache's type) as the key row.
  void store_key(int l, int h, std::int64_t s, const std::vector<double>& x) {
    for (std::size_t d = 0; d < x.size(); ++d) ref::store(key_row(l, h, s), shape_.type, d, x[d] / shape_.k_scale);
  }
  void store_value(int l, int h, std::int64_t s, const std::vector<double>& x) {
    for (std::size_t d = 0; d < x.size(); ++d) ref::store(value_row(l, h, s), shape_.type, d, x[d] / shape_.v_scale);
  }

  slot_contents slot(int l, int h, std::int64_t s) { return {key_bytes(l, h, s), value_bytes(l, h, s), position(l, h, s)}; }

  std::int32_t& length(int l, int h) { return lengths[static_cast<std::size_t>(l * shape_.num_kv_heads + h)]; }
  std::int32_t& position(int l, int h, std::int64_t s) {
    return positions[static_cast<std::size_t>((l * shape_.num_kv_heads + h) * shape_.capacity + s)];
  }

  cache_bytes snapshot() const { return {k_, v_, lengths, positions, block_table}; }

  /// Bytes of pool page `page` of layer `l` (K then V), for "untouched" checks on spare pages.
  std::vector<std::byte> page_bytes(int l, std::int32_t page) const {
    const std::size_t n = static_cast<std::size_t>(shape_.page_size) * row_elems() * triattn::dtype_bytes(shape_.type);
    const auto at = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(page) * n);
    std::vector<std::byte> out(k_[l].begin() + at, k_[l].begin() + at + static_cast<std::ptrdiff_t>(n));
    out.insert(out.end(), v_[l].begin() + at, v_[l].begin() + at + static_cast<std::ptrdiff_t>(n));
    return out;
  }
  /// Pool pages that are not in the block table.
  std::vector<std::int32_t> spare_page_ids() const {
    std::vector<std::int32_t> out;
    for (std::int32_t p = 0; p < pool_pages_; ++p)
      if (std::find(block_table.begin(), block_table.end(), p) == block_table.end()) out.push_back(p);
    return out;
  }

 private:
  cache_shape shape_;
  int pool_pages_ = 0;
  std::vector<std::vector<std::byte>> k_, v_;
  std::vector<std::byte*> k_ptrs_, v_ptrs_;

  std::size_t row_elems() const { return static_cast<std::size_t>(shape_.num_kv_heads) * shape_.head_dim; }
  triattn::slot_table slots() { return {lengths.data(), positions.data(), shape_.capacity}; }
  std::byte* row(std::vector<std::vector<std::byte>>& kv, int l, int h, std::int64_t s) {
    return kv[static_cast<std::size_t>(l)].data() + row_offset(h, s) * triattn::dtype_bytes(shape_.type);
  }
  std::vector<std::byte> row_bytes(std::vector<std::vector<std::byte>>& kv, int l, int h, std::int64_t s) {
    const std::byte* p = row(kv, l, h, s);
    return {p, p + static_cast<std::size_t>(shape_.head_dim) * triattn::dtype_bytes(shape_.type)};
  }
};

/// Oracle of `compaction_result::freed_pages`: the block-table entries (in table order) that
/// some (layer, kv_head) used with `lengths_before` and none uses with the cache's lengths now.
/// Empty for dense layouts.
inline std::vector<std::int32_t> expected_freed_pages(const test_cache& c, const std::vector<std::int32_t>& lengths_before) {
  std::vector<std::int32_t> out;
  if (!is_paged(c.shape().layout)) return out;
  const auto used = [&](const std::vector<std::int32_t>& lengths, std::int64_t block) {
    return std::any_of(lengths.begin(), lengths.end(), [&](std::int32_t n) { return n > block * c.shape().page_size; });
  };
  for (std::size_t b = 0; b < c.block_table.size(); ++b)
    if (used(lengths_before, static_cast<std::int64_t>(b)) && !used(c.lengths, static_cast<std::int64_t>(b)))
      out.push_back(c.block_table[b]);
  return out;
}

/// The largest position any slot below a length of `c` holds, or -1 for an empty cache.
inline std::int64_t largest_position(test_cache& c) {
  std::int64_t last = -1;
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.shape().num_kv_heads; ++h)
      for (std::int32_t s = 0; s < c.length(l, h); ++s) last = std::max<std::int64_t>(last, c.position(l, h, s));
  return last;
}

}  // namespace triattn_test
