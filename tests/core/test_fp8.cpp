// fp8 e4m3 / e5m2 against the definition-based oracle of support/reference.hpp: every bit
// pattern, rounding to nearest even at every midpoint, saturation, NaN and infinity as
// core/dtype.hpp documents them, the scaled accessor, and the typed views
// (dense_kv_view_of<T>) against the run-time-typed view.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/views.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "support/triattention_reference.hpp"

namespace {

namespace ref = triattn_test::ref;

struct fp8_api {
  const char* name;
  ref::fp8_format format;
  float (*decode)(std::uint8_t);
  std::uint8_t (*encode)(float);
};
const fp8_api formats[] = {
    {"e4m3", ref::e4m3_format, triattn::fp8_e4m3_bits_to_float, triattn::float_to_fp8_e4m3_bits},
    {"e5m2", ref::e5m2_format, triattn::fp8_e5m2_bits_to_float, triattn::float_to_fp8_e5m2_bits},
};

/// Same value, or both NaN; zeros must agree in sign.
bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

}  // namespace

TEST_CASE("fp8: every bit pattern decodes to its OCP value and re-encodes to the same value") {
  const fp8_api f = GENERATE(formats[0], formats[1]);
  INFO(f.name);
  int nans = 0, infs = 0;
  for (int b = 0; b < 256; ++b) {
    const auto bits = static_cast<std::uint8_t>(b);
    const double want = ref::decode8(f.format, bits);
    const float got = f.decode(bits);
    INFO("bits 0x" << std::hex << b << std::dec << " want " << want << " got " << got);
    REQUIRE(same_value(got, want));
    // decode(encode(decode(b))) == decode(b), NaN to NaN
    REQUIRE(same_value(f.decode(f.encode(got)), got));
    if (!std::isnan(got) && !std::isinf(got)) REQUIRE(f.encode(got) == bits);  // finite patterns are canonical
    nans += std::isnan(got) ? 1 : 0;
    infs += std::isinf(got) ? 1 : 0;
  }
  // e4m3 "fn": one NaN per sign, no infinity; e5m2: 3 NaNs and one infinity per sign
  CHECK(nans == (f.format.ieee ? 6 : 2));
  CHECK(infs == (f.format.ieee ? 2 : 0));
  CHECK(ref::fp8_max(f.format) == (f.format.ieee ? 57344.0 : 448.0));
}

TEST_CASE("fp8: rounding to nearest even at every midpoint and between, saturation, NaN and infinity") {
  const fp8_api f = GENERATE(formats[0], formats[1]);
  INFO(f.name);
  const double max = ref::fp8_max(f.format);
  // every finite non-negative value, sorted
  std::vector<double> values;
  for (int b = 0; b < 0x80; ++b) {
    const double v = ref::decode8(f.format, static_cast<std::uint8_t>(b));
    if (std::isfinite(v)) values.push_back(v);
  }
  std::sort(values.begin(), values.end());
  int midpoints = 0;
  for (std::size_t i = 0; i + 1 < values.size(); ++i) {
    const double lo = values[i], hi = values[i + 1], mid = (lo + hi) / 2;  // exact in double
    for (const double sign : {1.0, -1.0}) {
      for (const double x : {mid, std::nextafter(mid, lo), std::nextafter(mid, hi), lo + (hi - lo) / 4, hi - (hi - lo) / 4}) {
        const auto xf = static_cast<float>(sign * x);
        if (static_cast<double>(xf) != sign * x) continue;  // only inputs an f32 holds exactly
        INFO("x " << xf);
        REQUIRE(same_value(f.decode(f.encode(xf)), ref::round8(f.format, xf)));
      }
      // at the midpoint itself the result has an even mantissa (the lower bit pattern when it is even)
      const auto xf = static_cast<float>(sign * mid);
      if (static_cast<double>(xf) == sign * mid) {
        ++midpoints;
        REQUIRE((f.encode(xf) & 1) == 0);
      }
    }
  }
  CHECK(midpoints >= 2 * 120);  // every midpoint of both signs is an f32
  // random f32 inputs across the whole range, subnormals included
  auto g = triattn_test::rng(2001);
  std::uniform_real_distribution<double> exponent(-30.0, 20.0);
  for (int i = 0; i < 20000; ++i) {
    const auto x = static_cast<float>((i % 2 ? -1 : 1) * std::exp2(exponent(g)));
    INFO("x " << x);
    REQUIRE(same_value(f.decode(f.encode(x)), ref::round8(f.format, x)));
  }
  // saturation: finite values beyond the largest finite one give +-max, never inf or NaN
  for (const float x : {static_cast<float>(max) * 1.01f, static_cast<float>(max) * 4.0f, 1e30f,
                        std::numeric_limits<float>::max()}) {
    INFO("x " << x);
    CHECK(f.decode(f.encode(x)) == static_cast<float>(max));
    CHECK(f.decode(f.encode(-x)) == -static_cast<float>(max));
  }
  // NaN stays NaN; infinity: e5m2 keeps it, e4m3 (no infinity) gives NaN
  CHECK(std::isnan(f.decode(f.encode(std::numeric_limits<float>::quiet_NaN()))));
  const float inf = std::numeric_limits<float>::infinity();
  if (f.format.ieee) {
    CHECK(f.decode(f.encode(inf)) == inf);
    CHECK(f.decode(f.encode(-inf)) == -inf);
  } else {
    CHECK(std::isnan(f.decode(f.encode(inf))));
    CHECK(std::isnan(f.decode(f.encode(-inf))));
  }
  // signed zeros and the smallest subnormal's halfway point (ties to even: zero)
  CHECK(f.encode(0.0f) == 0x00);
  CHECK(f.encode(-0.0f) == 0x80);
  const double tiny = ref::decode8(f.format, 1);
  CHECK(f.encode(static_cast<float>(tiny / 2)) == 0x00);
  CHECK(f.encode(static_cast<float>(tiny * 0.75)) == 0x01);
}

TEST_CASE("fp8: the scaled accessor stores x / scale and loads decode x scale") {
  auto g = triattn_test::rng(2002);
  std::uniform_real_distribution<float> scale_of(0.01f, 4.0f);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int i = 0; i < 200; ++i) {
    const float scale = scale_of(g);
    const triattn::dtype t = i % 2 ? triattn::dtype::fp8_e4m3 : triattn::dtype::fp8_e5m2;
    std::vector<float> in(16), out(16);
    for (auto& x : in) x = normal(g);
    std::vector<std::byte> row(16);
    triattn::dtype_accessor{t, scale}.store(row.data(), 16, in.data());
    triattn::dtype_accessor{t, scale}.load(row.data(), 16, out.data());
    for (int d = 0; d < 16; ++d) {
      INFO("scale " << scale << " x " << in[d]);
      const double stored = ref::round8(ref::fp8_of(t), static_cast<float>(in[d] / scale));
      REQUIRE(ref::load(row.data(), t, static_cast<std::size_t>(d)) == stored);
      REQUIRE(out[d] == static_cast<float>(static_cast<float>(stored) * scale));
    }
  }
}

TEST_CASE("typed views dense_kv_view_of<T> read what the run-time view reads and keep the same sets") {
  auto g = triattn_test::rng(2003);
  const auto check_type = [&]<class T>() {
    for (int i = 0; i < 6; ++i) {
      auto shape = triattn_test::random_shape(g, triattn_test::cache_layout::dense_nhd, triattn::dtype_of<T>, 4,
                                              1 << (i % 3), {.min_capacity = 6});
      if (ref::is_fp8(shape.type)) shape.k_scale = shape.v_scale = 0.05f;
      triattn_test::test_cache a(shape, g), b(shape, g);
      // b: a's bytes (same random draw is not guaranteed): copy every row
      b.lengths = a.lengths;
      b.positions = a.positions;
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h)
          for (std::int64_t s = 0; s < shape.capacity; ++s) {
            std::copy_n(a.key_row(l, h, s), shape.head_dim * sizeof(T), b.key_row(l, h, s));
            std::copy_n(a.value_row(l, h, s), shape.head_dim * sizeof(T), b.value_row(l, h, s));
          }
      const triattn::dense_kv_view any = a.dense_view();
      triattn::dense_kv_view_of<T> typed;
      const triattn::dense_kv_view bv = b.dense_view();
      typed.geo = bv.geo;
      typed.k_layers = bv.k_layers;
      typed.v_layers = bv.v_layers;
      typed.k_stride = bv.k_stride;
      typed.v_stride = bv.v_stride;
      typed.slots = bv.slots;
      INFO(shape.describe());
      std::vector<float> x(static_cast<std::size_t>(shape.head_dim)), y(x.size());
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h)
          for (std::int64_t s = 0; s < shape.capacity; ++s) {
            triattn::load_key(any, l, h, s, x.data());
            triattn::load_key(typed, l, h, s, y.data());
            REQUIRE(x == y);
            const auto want = a.key(l, h, s);
            for (std::size_t d = 0; d < x.size(); ++d) REQUIRE(std::fabs(x[d] - want[d]) <= 1e-6 * std::fabs(want[d]));
          }
      // the same keep sets (TriAttention reads every key)
      const auto stats = ref::tri_random_stats(g, a.geometry());
      triattn::triattention_config cfg;
      cfg.round.grain = triattn::granularity::per_layer;
      triattn::triattention p(stats, cfg);
      const std::int64_t budget = std::max<std::int64_t>(1, shape.capacity / 3);
      const auto pa = p.plan(any, budget), pb = p.plan(typed, budget);
      CHECK(pa.indices == pb.indices);
      CHECK(pa.offsets == pb.offsets);
      p.compress(any, budget);
      p.compress(typed, budget);
      CHECK(a.snapshot() == b.snapshot());
      // a typed view must describe a cache of its own type
      typed.geo.type = typed.geo.type == triattn::dtype::f32 ? triattn::dtype::f16 : triattn::dtype::f32;
      CHECK_THROWS_WITH(typed.validate("triattn::test"),
                        Catch::Contains("triattn::test") && Catch::Contains("element type is"));
    }
  };
  check_type.operator()<float>();
  check_type.operator()<triattn::half_t>();
  check_type.operator()<triattn::bfloat16_t>();
  check_type.operator()<triattn::fp8_e4m3_t>();
  check_type.operator()<triattn::fp8_e5m2_t>();
}
