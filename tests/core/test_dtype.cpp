// f16 / bf16 conversions against the definitions of the formats (support/reference.hpp),
// and the runtime-typed element access.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "triattn/core/dtype.hpp"

namespace {

using triattn_test::ref::bf16_format;
using triattn_test::ref::f16_format;

std::string hex(std::uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

/// Counts disagreements of `got(x)` with `want(x)` over `inputs` and reports the first.
template <class Got, class Want>
void check_all(const std::vector<float>& inputs, Got got, Want want) {
  std::size_t bad = 0;
  std::string first;
  for (const float x : inputs) {
    const std::uint16_t g = got(x), w = want(x);
    if (g != w && ++bad == 1)
      first = "input " + hex(std::bit_cast<std::uint32_t>(x)) + ": got " + hex(g) + ", want " + hex(w);
  }
  INFO(first);
  CHECK(bad == 0);
}

/// Random floats with a uniform exponent in [lo, hi] and a random mantissa and sign, so that
/// every binade of the range is hit about equally often.
std::vector<float> floats_in_binades(std::mt19937_64& g, std::size_t n, int lo, int hi) {
  std::uniform_int_distribution<int> e(lo, hi);
  std::uniform_int_distribution<std::uint32_t> mant(0, (1u << 23) - 1), sign(0, 1);
  std::vector<float> out(n);
  for (auto& x : out) x = std::bit_cast<float>((sign(g) << 31) | (static_cast<std::uint32_t>(e(g) + 127) << 23) | mant(g));
  return out;
}

/// Exact midpoints between neighbouring representable values of a 16-bit format (plus one
/// float ulp either side), built from the reference decoder: the hardest rounding inputs.
std::vector<float> ties(std::mt19937_64& g, triattn_test::ref::small_float_format f, std::size_t n) {
  std::uniform_int_distribution<std::uint32_t> bits(0, 0x7ffe);
  std::vector<float> out;
  while (out.size() < n) {
    const auto b = static_cast<std::uint16_t>(bits(g));
    const double lo = triattn_test::ref::decode(f, b), hi = triattn_test::ref::decode(f, static_cast<std::uint16_t>(b + 1));
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    const auto mid = static_cast<float>((lo + hi) / 2);
    REQUIRE(static_cast<double>(mid) == (lo + hi) / 2);  // a midpoint needs one more bit: a float holds it
    for (const float m : {mid, -mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) out.push_back(m);
  }
  return out;
}

}  // namespace

TEST_CASE("every f16 bit pattern decodes to its IEEE value and round-trips") {
  std::size_t bad_value = 0, bad_trip = 0;
  std::string first;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float x = triattn::half_bits_to_float(h);
    const double want = triattn_test::ref::decode(f16_format, h);
    const bool nan = std::isnan(want);
    // Compare as values and signs (a NaN must stay a NaN whatever its payload).
    if (nan ? !std::isnan(x) : (static_cast<double>(x) != want || std::signbit(x) != std::signbit(want))) {
      if (++bad_value == 1) first = "decode " + hex(b);
    }
    const std::uint16_t back = triattn::float_to_half_bits(x);
    const bool back_ok = nan ? std::isnan(triattn_test::ref::decode(f16_format, back)) : back == h;
    if (!back_ok && ++bad_trip == 1) first += " round trip " + hex(b) + " -> " + hex(back);
  }
  INFO(first);
  CHECK(bad_value == 0);
  CHECK(bad_trip == 0);
}

TEST_CASE("float_to_half_bits rounds to nearest even like the double reference") {
  auto g = triattn_test::rng(101);
  const auto want = [](float x) { return triattn_test::ref::encode(f16_format, x); };
  const auto got = [](float x) { return triattn::float_to_half_bits(x); };

  SECTION("the f16 range, its subnormals and past both ends") { check_all(floats_in_binades(g, 400000, -30, 17), got, want); }
  SECTION("any float bit pattern") {
    std::uniform_int_distribution<std::uint32_t> bits;
    std::vector<float> xs;
    while (xs.size() < 200000) {
      const float x = std::bit_cast<float>(bits(g));
      if (!std::isnan(x)) xs.push_back(x);
    }
    check_all(xs, got, want);
  }
  SECTION("exact ties, normal and subnormal") { check_all(ties(g, f16_format, 50000), got, want); }
  SECTION("the overflow boundary and other landmarks") {
    const std::vector<float> xs = {65504.0f, 65519.99f, 65520.0f, std::nextafter(65520.0f, 0.0f), 65536.0f, 1e9f,
                                   std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                                   0x1p-24f, 0x1p-25f, std::nextafter(0x1p-25f, 1.0f), 0x1.8p-24f, 0x1p-14f,
                                   std::nextafter(0x1p-14f, 0.0f), std::numeric_limits<float>::denorm_min(), 0.0f,
                                   1.0f, 2049.0f, 2051.0f, 0.1f};
    std::vector<float> both = xs;
    for (const float x : xs) both.push_back(-x);
    check_all(both, got, want);
    // Spelled out, independently of the reference:
    CHECK(triattn::float_to_half_bits(65504.0f) == 0x7bff);
    CHECK(triattn::float_to_half_bits(65519.99f) == 0x7bff);
    CHECK(triattn::float_to_half_bits(65520.0f) == 0x7c00);  // tie between 65504 and 2^16: even is 2^16 = inf
    CHECK(triattn::float_to_half_bits(-65520.0f) == 0xfc00);
    CHECK(triattn::float_to_half_bits(0x1p-25f) == 0x0000);  // tie between 0 and the smallest subnormal
    CHECK(triattn::float_to_half_bits(0x1.8p-24f) == 0x0002);  // tie between subnormals 1 and 2: even is 2
    CHECK(triattn::float_to_half_bits(2049.0f) == 0x6800);    // tie 2048 / 2050 goes to 2048
    CHECK(triattn::float_to_half_bits(2051.0f) == 0x6802);    // tie 2050 / 2052 goes to 2052
  }
  SECTION("NaN stays NaN") {
    for (const std::uint32_t b : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fbfffffu, 0xff800001u}) {
      const std::uint16_t h = triattn::float_to_half_bits(std::bit_cast<float>(b));
      INFO(hex(b) << " -> " << hex(h));
      CHECK(std::isnan(triattn_test::ref::decode(f16_format, h)));
    }
  }
}

TEST_CASE("bf16 rounds to nearest even like the double reference") {
  auto g = triattn_test::rng(102);
  const auto want = [](float x) { return triattn_test::ref::encode(bf16_format, x); };
  const auto got = [](float x) { return triattn::float_to_bf16_bits(x); };

  SECTION("any float bit pattern") {
    std::uniform_int_distribution<std::uint32_t> bits;
    std::vector<float> xs;
    while (xs.size() < 300000) {
      const float x = std::bit_cast<float>(bits(g));
      if (!std::isnan(x)) xs.push_back(x);
    }
    check_all(xs, got, want);
  }
  SECTION("crafted ties: the low 16 bits are exactly 0x8000") {
    std::uniform_int_distribution<std::uint32_t> hi(0, 0xffff);
    std::vector<float> xs;
    while (xs.size() < 100000) {
      const float x = std::bit_cast<float>((hi(g) << 16) | 0x8000u);
      if (!std::isnan(x)) xs.push_back(x);
    }
    check_all(xs, got, want);
    CHECK(triattn::float_to_bf16_bits(std::bit_cast<float>(0x3f808000u)) == 0x3f80);  // tie, even stays
    CHECK(triattn::float_to_bf16_bits(std::bit_cast<float>(0x3f818000u)) == 0x3f82);  // tie, odd rounds up
    CHECK(triattn::float_to_bf16_bits(std::bit_cast<float>(0x7f7fffffu)) == 0x7f80);  // max float overflows to inf
  }
  SECTION("ties built from the reference decoder") { check_all(ties(g, bf16_format, 50000), got, want); }
  SECTION("decoding is exact and NaN stays NaN") {
    std::size_t bad = 0;
    for (std::uint32_t b = 0; b <= 0xffff; ++b) {
      const auto h = static_cast<std::uint16_t>(b);
      const float x = triattn::bf16_bits_to_float(h);
      const double w = triattn_test::ref::decode(bf16_format, h);
      if (std::isnan(w) ? !std::isnan(x) || !std::isnan(triattn_test::ref::decode(bf16_format, triattn::float_to_bf16_bits(x)))
                        : static_cast<double>(x) != w || triattn::float_to_bf16_bits(x) != h)
        ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("load_element and store_element address, round and decode each dtype") {
  auto g = triattn_test::rng(103);
  for (const auto t : {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16}) {
    INFO("dtype " << triattn::dtype_name(t));
    const std::size_t n = 257, bytes = triattn::dtype_bytes(t);
    CHECK(bytes == (t == triattn::dtype::f32 ? 4u : 2u));
    const auto xs = triattn_test::normal_floats(g, n, 300.0f);  // wide enough to meet f16 rounding at every scale
    std::vector<std::byte> buf(n * bytes), want(n * bytes);
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : buf) b = static_cast<std::byte>(byte(g));
    want = buf;
    // Store in a scrambled order so that a wrong stride or a stray write shows.
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = (i * 101) % n;
    for (const std::size_t i : order) {
      triattn::store_element(buf.data(), t, i, xs[i]);
      triattn_test::ref::store(want.data(), t, i, xs[i]);
    }
    CHECK(buf == want);
    for (std::size_t i = 0; i < n; ++i) {
      const float got = triattn::load_element(buf.data(), t, i);
      const double expected = triattn_test::ref::load(want.data(), t, i);
      CHECK(static_cast<double>(got) == expected);
      if (t == triattn::dtype::f32) CHECK(got == xs[i]);
      else CHECK(std::fabs(got - xs[i]) <= triattn_test::ref::unit_roundoff(t) * std::fabs(xs[i]) + 1e-7);  // + f16 subnormals
    }
  }
}
