// RoPE: inverse frequencies against transcriptions of Hugging Face's formulas, rotation
// against complex multiplication, and the inverse / shift identities.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "triattn/core/rope.hpp"

namespace {

using triattn::rope_desc;
using triattn::rope_scaling;
using triattn::rope_scaling_type;
using triattn::rope_style;

struct rope_case {
  std::string name;
  rope_desc rope;
  int head_dim;
};

rope_desc make(double theta, rope_scaling s = {}, int rotary_dim = 0, double scale = 1.0) {
  rope_desc r;
  r.theta = theta;
  r.scaling = s;
  r.rotary_dim = rotary_dim;
  r.attention_scale = scale;
  return r;
}
rope_scaling linear(double factor) { return {rope_scaling_type::linear, factor}; }
rope_scaling llama3(double factor, double low, double high, double orig) {
  return {rope_scaling_type::llama3, factor, low, high, orig};
}
rope_scaling yarn(double factor, double orig, bool truncate, double beta_fast = 32, double beta_slow = 1) {
  return {rope_scaling_type::yarn, factor, 1.0, 4.0, orig, beta_fast, beta_slow, truncate};
}

/// The configurations of real model families, and partial rotary dims.
std::vector<rope_case> cases() {
  return {
      {"default D=128 theta 1e4", make(1e4), 128},
      {"default D=64 theta 1e6", make(1e6), 64},
      {"default partial 32 of 128 (theta 1e4)", make(1e4, {}, 32), 128},
      {"default partial 16 of 64 (0.25)", make(1e4, {}, 16), 64},
      {"linear x4 D=128", make(1e4, linear(4)), 128},
      {"linear x2 partial 48 of 96", make(1e4, linear(2), 48), 96},
      {"llama3.1 x8 low 1 high 4 orig 8192 theta 5e5 D=128", make(5e5, llama3(8, 1, 4, 8192)), 128},
      {"llama3.2 x32 low 1 high 4 orig 8192 theta 5e5 D=64", make(5e5, llama3(32, 1, 4, 8192)), 64},
      {"llama3 x8 partial 64 of 128", make(5e5, llama3(8, 1, 4, 8192), 64), 128},
      {"yarn x4 orig 32768 theta 1e6 D=128 truncate", make(1e6, yarn(4, 32768, true), 0, 1 + 0.1 * std::log(4.0)), 128},
      {"yarn x4 orig 32768 theta 1e6 D=128 no truncate", make(1e6, yarn(4, 32768, false)), 128},
      {"yarn x32 orig 4096 theta 150000 D=64 truncate", make(150000, yarn(32, 4096, true)), 64},
      {"yarn x32 orig 4096 theta 150000 D=64 no truncate (gpt-oss)",
       make(150000, yarn(32, 4096, false), 0, 1 + 0.1 * std::log(32.0)), 64},
      {"yarn x4 orig 4096 theta 1e6 partial 32 of 64", make(1e6, yarn(4, 4096, true), 32), 64},
      {"yarn x32 orig 32768 theta 150000 D=128 beta 16/2", make(150000, yarn(32, 32768, false, 16, 2)), 128},
  };
}

int rotary_of(const rope_case& c) { return c.rope.rotary_dim > 0 ? c.rope.rotary_dim : c.head_dim; }

std::vector<double> random_vector(std::mt19937_64& g, int n) {
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = d(g);
  return x;
}

/// Largest |a - b| relative to the largest |b| (1 when b is tiny).
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0, norm = 1e-300;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    norm = std::max(norm, std::fabs(b[i]));
  }
  return diff / norm;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}
template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

rope_desc with(rope_desc r, rope_style style, double scale) {
  r.style = style;
  r.attention_scale = scale;
  return r;
}

}  // namespace

TEST_CASE("inverse frequencies follow Hugging Face's formulas") {
  for (const auto& c : cases()) {
    INFO(c.name);
    const int dim = rotary_of(c);
    const auto want = triattn_test::ref::inv_freq(c.rope, dim);
    REQUIRE(want.size() == static_cast<std::size_t>(dim / 2));
    for (int f = 0; f < dim / 2; ++f) {
      INFO("band " << f);
      CHECK(triattn::inv_freq(c.rope, dim, f) == Approx(want[f]).epsilon(1e-13));
    }
  }
}

TEST_CASE("the transcribed formulas have the documented shape") {
  // Guards the oracle itself: what each rule must do at the two ends of the spectrum.
  const auto base = triattn_test::ref::hf_default_inv_freq(5e5, 128);
  CHECK(base[0] == 1.0);
  CHECK(base[1] == Approx(std::pow(5e5, -2.0 / 128)).epsilon(1e-15));
  const auto l3 = triattn_test::ref::hf_llama3_inv_freq(5e5, 128, 8, 1, 4, 8192);
  CHECK(l3[0] == base[0]);                      // short wavelengths: untouched
  CHECK(l3[63] == Approx(base[63] / 8).epsilon(1e-15));  // long wavelengths: divided by the factor
  int medium = 0;
  for (std::size_t i = 0; i < l3.size(); ++i) medium += l3[i] != base[i] && l3[i] != base[i] / 8;
  CHECK(medium > 0);  // the smooth branch is exercised
  const auto y = triattn_test::ref::hf_yarn_inv_freq(1e6, 128, 4, 32, 1, 32768, true);
  CHECK(y[0] == Approx(1.0).epsilon(1e-15));
  CHECK(y[63] == Approx(std::pow(1e6, -126.0 / 128) / 4).epsilon(1e-13));
  CHECK(triattn::yarn_attention_scale(4) == Approx(triattn_test::ref::hf_yarn_attention_factor(4)).epsilon(1e-15));
  CHECK(triattn::yarn_attention_scale(32) == Approx(1 + 0.1 * std::log(32.0)).epsilon(1e-15));
  CHECK(triattn::yarn_attention_scale(1) == 1.0);
  CHECK(triattn::yarn_attention_scale(0.5) == 1.0);
}

TEST_CASE("rope_rotate is complex multiplication of the bands") {
  auto g = triattn_test::rng(201);
  std::uniform_real_distribution<double> pos(0.0, 1e6);
  for (const auto& c : cases()) {
    for (const auto style : {rope_style::half, rope_style::interleaved}) {
      const rope_desc r = with(c.rope, style, c.rope.attention_scale == 1.0 ? 0.8 : c.rope.attention_scale);
      INFO(c.name << (style == rope_style::half ? " half" : " interleaved"));
      for (int trial = 0; trial < 8; ++trial) {
        const double p = trial == 0 ? 0.0 : trial == 1 ? 1.0 : std::round(pos(g));
        INFO("position " << p);
        const auto x = random_vector(g, c.head_dim);
        const auto want = triattn_test::ref::rotate(r, x, p);

        auto xd = x;
        triattn::rope_rotate(r, xd.data(), c.head_dim, p);
        CHECK(max_rel_diff(xd, want) < 1e-8);  // phases up to 1e6 rad: ulps of w_f matter
        // Dims past the rotary dims are copied bit for bit.
        CHECK(std::equal(xd.begin() + rotary_of(c), xd.end(), x.begin() + rotary_of(c)));

        auto xf = cast<float>(x);
        triattn::rope_rotate(r, xf.data(), c.head_dim, p);
        CHECK(max_rel_diff(widen(xf), triattn_test::ref::rotate(r, widen(cast<float>(x)), p)) < 1e-6);
      }
    }
  }
}

TEST_CASE("rope_unrotate inverts rope_rotate and rope_shift composes them") {
  auto g = triattn_test::rng(202);
  std::uniform_real_distribution<double> pos(0.0, 1e6);
  for (const auto& c : cases()) {
    for (const auto style : {rope_style::half, rope_style::interleaved}) {
      const rope_desc r = with(c.rope, style, 1.25);
      INFO(c.name << (style == rope_style::half ? " half" : " interleaved"));
      for (int trial = 0; trial < 8; ++trial) {
        const double from = std::round(pos(g)), to = trial == 0 ? 0.0 : std::round(pos(g));
        INFO("from " << from << " to " << to);
        const auto x = random_vector(g, c.head_dim);

        auto y = x;
        triattn::rope_rotate(r, y.data(), c.head_dim, from);
        CHECK(max_rel_diff(y, x) > 1e-3);  // it did rotate (and scale)
        triattn::rope_unrotate(r, y.data(), c.head_dim, from);
        CHECK(max_rel_diff(y, x) < 1e-12);

        auto yf = cast<float>(x);
        triattn::rope_rotate(r, yf.data(), c.head_dim, from);
        triattn::rope_unrotate(r, yf.data(), c.head_dim, from);
        CHECK(max_rel_diff(widen(yf), x) < 2e-6);

        // shift(from, to) of a rotated vector == rotate(to) of the un-rotated one.
        auto shifted = triattn_test::ref::rotate(r, x, from);
        triattn::rope_shift(r, shifted.data(), c.head_dim, from, to);
        auto composed = triattn_test::ref::rotate(r, x, from);
        triattn::rope_unrotate(r, composed.data(), c.head_dim, from);
        triattn::rope_rotate(r, composed.data(), c.head_dim, to);
        CHECK(max_rel_diff(shifted, composed) < 1e-9);
        CHECK(max_rel_diff(shifted, triattn_test::ref::rotate(r, x, to)) < 1e-8);
      }
    }
  }
}
