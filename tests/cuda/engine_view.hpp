// An engine's own KVCacheView with its own element encoding, for the GPU and the CPU alike:
// K and V rows interleaved in one allocation per layer, elements stored as signed 16-bit
// fixed point (value = q x step, a step per layer, other for K and V), decoded only by the
// view's `key_accessor` / `value_accessor`. The geometry says f16 for the 2-byte unit rows
// move in; a reader that decodes by that dtype instead of the accessor reads other numbers
// (and NaNs: q in [-1024, -1] is an f16 NaN or infinity). Host and device (nvcc or a C++
// compiler): the .cu test and the host reference (reference_engine_view.cpp) share it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "support/views.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"

namespace triattn_cuda_test {

/// Signed 16-bit fixed point: element d of a row is q[d] x step.
struct fixed16_accessor {
  float step = 1.0f;

  TRIATTN_HOST_DEVICE void load(const std::byte* row, int n, float* out) const {
    for (int d = 0; d < n; ++d) {
      std::int16_t q;
      std::memcpy(&q, row + 2 * d, sizeof q);
      out[d] = static_cast<float>(q) * step;
    }
  }
  /// Rounds half away from zero, saturating at +-32767.
  TRIATTN_HOST_DEVICE void store(std::byte* row, int n, const float* in) const {
    for (int d = 0; d < n; ++d) {
      const float t = in[d] / step;
      const float r = t >= 0.0f ? t + 0.5f : t - 0.5f;
      const auto q = static_cast<std::int16_t>(r >= 32767.0f ? 32767 : r <= -32767.0f ? -32767 : static_cast<int>(r));
      std::memcpy(row + 2 * d, &q, sizeof q);
    }
  }
};

/// The steps of layer l: powers of two, so that every decoded value is exact in f32.
TRIATTN_HOST_DEVICE float key_step(int l) { return l % 2 == 0 ? 1.0f / 1024.0f : 1.0f / 2048.0f; }
TRIATTN_HOST_DEVICE float value_step(int l) { return l % 2 == 0 ? 1.0f / 256.0f : 1.0f / 512.0f; }

/// Per layer one allocation [capacity, kv_heads, 2 (K then V), head_dim] of int16.
struct engine_view {
  triattn::kv_geometry geo{};
  std::byte* const* layers = nullptr;  ///< [num_layers]
  std::int32_t* lengths = nullptr;     ///< [layers, kv_heads]
  std::int32_t* positions = nullptr;   ///< [layers, kv_heads, capacity]
  std::int64_t cap = 0;

  TRIATTN_HOST_DEVICE const triattn::kv_geometry& geometry() const { return geo; }
  TRIATTN_HOST_DEVICE std::int64_t capacity() const { return cap; }
  TRIATTN_HOST_DEVICE std::byte* row(int l, int h, std::int64_t s, int kv) const {
    return layers[l] + ((s * geo.num_kv_heads + h) * 2 + kv) * geo.head_dim * 2;
  }
  TRIATTN_HOST_DEVICE std::byte* key(int l, int h, std::int64_t s) const { return row(l, h, s, 0); }
  TRIATTN_HOST_DEVICE std::byte* value(int l, int h, std::int64_t s) const { return row(l, h, s, 1); }
  TRIATTN_HOST_DEVICE fixed16_accessor key_accessor(int l) const { return {key_step(l)}; }
  TRIATTN_HOST_DEVICE fixed16_accessor value_accessor(int l) const { return {value_step(l)}; }
  TRIATTN_HOST_DEVICE std::int32_t length(int l, int h) const { return lengths[l * geo.num_kv_heads + h]; }
  TRIATTN_HOST_DEVICE void set_length(int l, int h, std::int32_t n) const { lengths[l * geo.num_kv_heads + h] = n; }
  TRIATTN_HOST_DEVICE std::int32_t& position(int l, int h, std::int64_t s) const {
    return positions[(static_cast<std::int64_t>(l) * geo.num_kv_heads + h) * cap + s];
  }
  void validate(const char* api) const {
    TRIATTN_CHECK(layers != nullptr && lengths != nullptr && positions != nullptr, api, "engine_view: null pointer");
    TRIATTN_CHECK(geo.num_layers > 0 && geo.num_kv_heads > 0 && geo.num_q_heads % geo.num_kv_heads == 0, api,
                  "engine_view: bad shape");
    for (int i = 0; i < geo.num_layers * geo.num_kv_heads; ++i)
      TRIATTN_CHECK(lengths[i] >= 0 && lengths[i] <= cap, api, "engine_view: length ", lengths[i]);
  }
};
static_assert(triattn::KVCacheView<engine_view>);
static_assert(std::is_trivially_copyable_v<engine_view> && std::is_standard_layout_v<engine_view>);

/// An engine cache holding the slots of a test cache (`mirror`, dense f32) in its own encoding;
/// `mirror` is rewritten to hold the decoded values, so that the two hold the same numbers.
class engine_cache {
 public:
  std::vector<std::vector<std::byte>> layers;  ///< [num_layers] of [capacity, kv_heads, 2, head_dim] int16
  std::vector<std::int32_t> lengths, positions;
  triattn::kv_geometry geometry{};
  std::int64_t capacity = 0;

  explicit engine_cache(triattn_test::test_cache& mirror)
      : lengths(mirror.lengths), positions(mirror.positions), geometry(mirror.geometry()),
        capacity(mirror.shape().capacity) {
    geometry.type = triattn::dtype::f16;  // the 2-byte unit of a row; the accessors decode
    const auto D = static_cast<std::size_t>(geometry.head_dim);
    layers.assign(static_cast<std::size_t>(geometry.num_layers),
                  std::vector<std::byte>(static_cast<std::size_t>(capacity * geometry.num_kv_heads) * 2 * D * 2));
    const engine_view v = host_view();
    std::vector<float> x(D), decoded(D);
    const auto encode = [&](const fixed16_accessor& a, std::byte* row, std::vector<double> values) {
      for (std::size_t d = 0; d < D; ++d) x[d] = static_cast<float>(std::clamp(values[d], -15.0, 15.0));
      a.store(row, geometry.head_dim, x.data());
      a.load(row, geometry.head_dim, decoded.data());
      return std::vector<double>(decoded.begin(), decoded.end());
    };
    for (int l = 0; l < geometry.num_layers; ++l)
      for (int h = 0; h < geometry.num_kv_heads; ++h)
        for (std::int64_t s = 0; s < capacity; ++s) {
          mirror.store_key(l, h, s, encode(v.key_accessor(l), v.key(l, h, s), mirror.key(l, h, s)));
          mirror.store_value(l, h, s, encode(v.value_accessor(l), v.value(l, h, s), mirror.value(l, h, s)));
        }
  }
  engine_cache(const engine_cache&) = delete;
  engine_cache& operator=(const engine_cache&) = delete;
  engine_cache(engine_cache&&) = default;

  /// The view over the host copy (the CPU policies read it).
  engine_view host_view() {
    pointers_.clear();
    for (auto& layer : layers) pointers_.push_back(layer.data());
    return {geometry, pointers_.data(), lengths.data(), positions.data(), capacity};
  }

 private:
  std::vector<std::byte*> pointers_;
};

}  // namespace triattn_cuda_test
