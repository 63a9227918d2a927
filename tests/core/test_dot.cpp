// core/dot.hpp: the emulated fused multiply-add against the C library's fmaf (correctly
// rounded) on random, cancelling and double-rounding inputs; fixed_order_dot against its
// definition written out in long hand; the blocked kernel against one dot per pair, bit for bit.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/random.hpp"
#include "triattn/core/dot.hpp"

namespace {

using triattn::fused_multiply_add_emulated;

bool same_bits(float x, float y) { return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y); }

/// A float with a random sign, a random 24-bit significand and an exponent in [lo, hi].
float random_float(std::mt19937_64& g, int lo, int hi) {
  std::uniform_int_distribution<std::uint32_t> mantissa(1u << 23, (1u << 24) - 1);
  std::uniform_int_distribution<int> exponent(lo, hi);
  const float x = std::ldexp(static_cast<float>(mantissa(g)), exponent(g) - 23);
  return (g() & 1) ? -x : x;
}

/// Pairs of 24-bit integers whose product lies just above 2^47 (above == true) or just below,
/// within 2^18: scaled, a b is a power of two plus or minus less than a double's half ulp of
/// the sums below, the inputs on which rounding a b + c to double, then to float, goes wrong.
std::vector<std::pair<float, float>> near_power_products(std::mt19937_64& g, bool above, int count) {
  std::vector<std::pair<float, float>> out;
  std::uniform_int_distribution<std::uint64_t> pick(std::uint64_t{1} << 23, (std::uint64_t{1} << 24) - 1);
  const std::uint64_t target = std::uint64_t{1} << 47;
  while (static_cast<int>(out.size()) < count) {
    const std::uint64_t a = pick(g);
    const std::uint64_t b = above ? (target + a - 1) / a : target / a;
    if (b < (std::uint64_t{1} << 23) || b >= (std::uint64_t{1} << 24)) continue;
    const std::uint64_t off = above ? a * b - target : target - a * b;
    if (off == 0 || off >= (std::uint64_t{1} << 18)) continue;
    out.emplace_back(static_cast<float>(a), static_cast<float>(b));
  }
  return out;
}

float double_rounded(float a, float b, float c) {
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) + static_cast<double>(c));
}

}  // namespace

TEST_CASE("fused_multiply_add_emulated rounds a b + c once, as fmaf does", "[dot]") {
  auto g = triattn_test::rng(1);
  int checked = 0;
  const auto check = [&](float a, float b, float c) {
    const float want = std::fmaf(a, b, c);
    const float got = fused_multiply_add_emulated(a, b, c);
    INFO(a << " * " << b << " + " << c << ": fmaf " << want << ", emulated " << got);
    CHECK((same_bits(got, want) || (std::isnan(got) && std::isnan(want))));
    ++checked;
  };

  SECTION("random magnitudes, subnormal to overflowing results") {
    for (int i = 0; i < 200000; ++i) check(random_float(g, -130, 127), random_float(g, -130, 127), random_float(g, -149, 127));
  }
  SECTION("cancellation: c is minus a b rounded, or a neighbour of it") {
    std::uniform_int_distribution<int> step(-3, 3);
    for (int i = 0; i < 200000; ++i) {
      const float a = random_float(g, -40, 40), b = random_float(g, -40, 40);
      float c = -(a * b);
      for (int k = step(g); k != 0; k += k > 0 ? -1 : 1)
        c = std::nextafter(c, k > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity());
      check(a, b, c);
    }
  }
  SECTION("double rounding: a b + c within a double's half ulp of a float's halfway point") {
    // c + 2^-24 u is a tie between c and its next float up; a b = u (2^-24 +- delta), with
    // delta below the double's half ulp. Rounding to double lands on the tie, and the tie
    // goes to the even neighbour, which is wrong for half of these.
    int naive_wrong = 0;
    for (const bool above : {true, false}) {
      for (const auto& [a, b] : near_power_products(g, above, 2000)) {
        for (const float c : {random_float(g, -10, 10), random_float(g, -10, 10)}) {
          const float ulp = std::nextafter(std::fabs(c), std::numeric_limits<float>::infinity()) - std::fabs(c);
          // a b == 2^47 +- off: scale it to half an ulp of c
          const int shift = std::ilogb(ulp) - 1 - 47;
          const float sa = std::ldexp(a, shift), sb = b;
          const float cs = c < 0 ? -c : c;  // the tie above |c|
          check(sa, sb, cs);
          check(-sa, sb, -cs);
          naive_wrong += !same_bits(double_rounded(sa, sb, cs), std::fmaf(sa, sb, cs));
        }
      }
    }
    // The cases are the hard ones: rounding twice gets a quarter to half of them wrong.
    CHECK(naive_wrong > 1000);
  }
  SECTION("zeros, infinities, NaN and signs of zero") {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    const float values[] = {0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, nan, std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::min(), 3.0f};
    for (float a : values)
      for (float b : values)
        for (float c : values) check(a, b, c);
  }
  CHECK(checked > 1000);
}

TEST_CASE("fixed_order_dot is 16 partial sums reduced by a fixed tree; the block kernel gives the same floats",
          "[dot]") {
  auto g = triattn_test::rng(2);
  std::uniform_int_distribution<int> length(1, 300), count(1, 9);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = trial < 40 ? 16 * (1 + trial % 8) : length(g);  // AVX-512's whole-block path, and tails
    const int rows = count(g), cols = count(g);
    const std::vector<float> a = triattn_test::normal_floats(g, static_cast<std::size_t>(rows) * n);
    const std::vector<float> b = triattn_test::normal_floats(g, static_cast<std::size_t>(cols) * n);
    std::vector<float> block(static_cast<std::size_t>(rows) * (cols + 3), std::nanf(""));
    triattn::fixed_order_dot_block(a.data(), n, rows, b.data(), n, cols, n, block.data(), cols + 3);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const float* x = a.data() + static_cast<std::size_t>(r) * n;
        const float* y = b.data() + static_cast<std::size_t>(c) * n;
        // The definition: partial k sums elements k, k + 16, ... each with one rounding;
        // then halves are added, 8 + 8, 4 + 4, 2 + 2, 1 + 1.
        float part[16] = {};
        for (int i = 0; i < n; ++i) part[i % 16] = std::fmaf(x[i], y[i], part[i % 16]);
        for (int w = 8; w >= 1; w /= 2)
          for (int k = 0; k < w; ++k) part[k] = part[k] + part[k + w];
        INFO("n " << n << ", row " << r << " of " << rows << ", column " << c << " of " << cols);
        CHECK(same_bits(triattn::fixed_order_dot(x, y, n), part[0]));
        CHECK(same_bits(block[static_cast<std::size_t>(r) * (cols + 3) + c], part[0]));
      }
    for (int r = 0; r < rows; ++r)
      for (int c = cols; c < cols + 3; ++c) CHECK(std::isnan(block[static_cast<std::size_t>(r) * (cols + 3) + c]));
  }
}
