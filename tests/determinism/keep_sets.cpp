// Prints what every policy keeps from random caches drawn from a seed, for comparison across
// builds (tests/determinism/CMakeLists.txt builds this file once per instruction set and
// compare_builds.cmake diffs their outputs). Issue 15: keep sets must not depend on the build.
//
//   triattn_keep_sets SEED TRIALS
//
// One line per (trial, policy): the positions each (layer, kv_head) keeps after one compress,
// then one line with an FNV-1a hash of the bits of the policy's scores. A quarter of every
// row's slots are exact copies of other slots (key, value and, for the accumulated policies,
// attention column), so that ties between identical keys are exercised: they must go to the
// lower slot in every build.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/policies/expected_attention.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/keydiff.hpp"
#include "triattn/policies/knorm.hpp"
#include "triattn/policies/rkv.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/vatp.hpp"

namespace {

using triattn_test::test_cache;

/// A value in [-scale, scale) with 23 significant bits, made from random bits without
/// floating-point arithmetic: the inputs themselves must not depend on the build (the
/// standard distributions' multiply-adds are contracted differently by each build).
double exact_uniform(std::mt19937_64& g, double scale = 2.0) {
  return std::ldexp(scale * static_cast<double>(static_cast<std::int64_t>(g() >> 41) - (std::int64_t{1} << 22)), -22);
}

std::vector<double> exact_row(std::mt19937_64& g, int n) {
  std::vector<double> x(static_cast<std::size_t>(n));
  for (double& v : x) v = exact_uniform(g);
  return x;
}

/// One trial's inputs, drawn from its own seed so that every policy sees the same cache.
struct trial {
  std::uint64_t seed = 0;
  triattn_test::cache_shape shape;
  std::int64_t budget = 1;
  int window = 4;
  std::vector<std::vector<std::int32_t>> copy_of;  // [layer * kv_heads][slot]: the slot it copies, or itself
};

trial draw_trial(std::mt19937_64& g) {
  trial t;
  t.seed = g();
  const int group = 1 << std::uniform_int_distribution<int>(0, 2)(g);
  const auto type = triattn_test::all_dtypes[std::uniform_int_distribution<int>(0, 2)(g)];
  triattn_test::shape_bounds bounds;
  t.shape = triattn_test::random_shape(g, triattn_test::cache_layout::dense_nhd, type, 1, group, bounds);
  t.shape.head_dim = 16 * std::uniform_int_distribution<int>(1, 8)(g);  // up to 128, as real heads
  t.shape.capacity = std::uniform_int_distribution<std::int64_t>(24, 160)(g);
  t.shape.keys = g() % 2 ? triattn::key_state::pre_rope : triattn::key_state::post_rope;
  t.shape.rope.style = g() % 2 ? triattn::rope_style::interleaved : triattn::rope_style::half;
  t.window = std::uniform_int_distribution<int>(2, 8)(g);
  t.budget = std::uniform_int_distribution<std::int64_t>(t.window + 1, t.shape.capacity)(g);
  return t;
}

/// The trial's cache: full rows, a quarter of each row's slots overwritten by earlier ones.
test_cache make_cache(trial& t) {
  std::mt19937_64 g(t.seed);
  test_cache c(t.shape, g);
  const int L = t.shape.num_layers, H = t.shape.num_kv_heads;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      for (std::int64_t s = 0; s < t.shape.capacity; ++s) {
        c.store_key(l, h, s, exact_row(g, t.shape.head_dim));
        c.store_value(l, h, s, exact_row(g, t.shape.head_dim));
      }
  // Every row at the first row's positions: the shared granularities decide over several rows.
  const auto cap = static_cast<std::size_t>(t.shape.capacity);
  for (std::size_t i = cap; i < c.positions.size(); ++i) c.positions[i] = c.positions[i % cap];
  t.copy_of.assign(static_cast<std::size_t>(L * H), {});
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const auto n = static_cast<std::int32_t>(t.shape.capacity);
      c.length(l, h) = n;
      auto& copy = t.copy_of[static_cast<std::size_t>(l * H + h)];
      copy.resize(static_cast<std::size_t>(n));
      for (std::int32_t s = 0; s < n; ++s) copy[s] = s;
      for (std::int32_t i = 0; i < n / 4; ++i) {
        const std::int32_t dst = std::uniform_int_distribution<std::int32_t>(1, n - 1)(g);
        const std::int32_t src = std::uniform_int_distribution<std::int32_t>(0, dst - 1)(g);
        copy[dst] = copy[src];
        c.store_key(l, h, dst, c.key(l, h, src));
        c.store_value(l, h, dst, c.value(l, h, src));
      }
    }
  return c;
}

/// Statistics with the structure of real ones (a complex centre per band, a mean modulus
/// above its modulus), from `exact_uniform`.
triattn::query_stats random_stats(std::mt19937_64& g, const triattn::kv_geometry& geo) {
  triattn::query_stats st;
  st.num_layers = geo.num_layers;
  st.num_q_heads = geo.num_q_heads;
  st.num_kv_heads = geo.num_kv_heads;
  st.head_dim = geo.head_dim;
  st.style = geo.rope.style;
  st.attention_scale = geo.rope.attention_scale;
  st.inv_freq = triattn_test::ref::inv_freq(geo.rope, geo.head_dim);
  for (std::size_t i = 0; i < st.row(geo.num_layers, 0); ++i) {
    const double re = exact_uniform(g), im = exact_uniform(g);
    st.q_mean_real.push_back(static_cast<float>(re));
    st.q_mean_imag.push_back(static_cast<float>(im));
    st.q_abs_mean.push_back(static_cast<float>(std::hypot(re, im) * (3.0 + exact_uniform(g))));  // / R, R in [0.2, 1]
  }
  return st;
}

std::int32_t last_position(const test_cache& c) { return *std::max_element(c.positions.begin(), c.positions.end()); }

std::uint64_t hash_floats(std::span<const float> x) {
  std::uint64_t h = 1469598103934665603ull;
  for (const float f : x) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, 4);
    for (int b = 0; b < 4; ++b) h = (h ^ ((bits >> (8 * b)) & 0xffu)) * 1099511628211ull;
  }
  return h;
}

void print_keep(int index, const char* policy, test_cache& c) {
  std::printf("trial %d %s keeps", index, policy);
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.shape().num_kv_heads; ++h) {
      std::printf(" |");
      for (std::int32_t s = 0; s < c.length(l, h); ++s) std::printf(" %d", c.position(l, h, s));
    }
  std::printf("\n");
}

/// Scores of `policy` (`score(view, out)` over [layers, kv_heads or q_heads, capacity]), hashed,
/// then one compress: both printed.
template <class Policy, class Score>
void run(int index, const char* name, trial& t, Policy& policy, test_cache& c, Score&& score) {
  const auto& s = c.shape();
  std::vector<float> out(static_cast<std::size_t>(s.num_layers * s.num_kv_heads * s.group * s.capacity),
                         std::numeric_limits<float>::quiet_NaN());
  c.with_view([&](const auto& v) { score(v, std::span<float>(out)); });
  std::printf("trial %d %s scores %016llx\n", index, name, static_cast<unsigned long long>(hash_floats(out)));
  c.with_view([&](const auto& v) { policy.compress(v, t.budget, {-1, 0}); });
  print_keep(index, name, c);
}

/// Attention rows for the accumulated policies: softmax of random logits, equal in the columns
/// of copied slots.
template <class Policy>
void feed_attention(Policy& policy, const trial& t, test_cache& c, std::mt19937_64& g) {
  const auto& s = c.shape();
  c.with_view([&](const auto& v) { policy.attach(v); });
  const std::int32_t first = last_position(c) + 1;
  for (int row = 0; row < t.window; ++row)
    for (int l = 0; l < s.num_layers; ++l)
      for (int qh = 0; qh < s.num_kv_heads * s.group; ++qh) {
        const auto& copy = t.copy_of[static_cast<std::size_t>(l * s.num_kv_heads + qh / s.group)];
        std::vector<double> logit(copy.size());
        for (std::size_t j = 0; j < logit.size(); ++j) logit[j] = copy[j] == static_cast<std::int32_t>(j) ? exact_uniform(g, 4.0) : logit[copy[j]];
        const double top = *std::max_element(logit.begin(), logit.end());
        double sum = 0.0;
        for (double& x : logit) sum += (x = std::exp(x - top));
        std::vector<float> probs(logit.size());
        for (std::size_t j = 0; j < probs.size(); ++j) probs[j] = static_cast<float>(logit[j] / sum);
        policy.observe(l, qh, first + row, {}, probs);
      }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: triattn_keep_sets SEED TRIALS\n");
    return 2;
  }
#if defined(__x86_64__) && defined(__GNUC__)
  // A build for an instruction set this CPU lacks is left out (77), not failed.
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 77;
#endif
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512f")) return 77;
#endif
#endif
  std::mt19937_64 g(std::strtoull(argv[1], nullptr, 10));
  const int trials = std::atoi(argv[2]);
  for (int i = 0; i < trials; ++i) {
    trial t = draw_trial(g);
    std::mt19937_64 inputs(t.seed ^ 0x5eedull);
    {
      test_cache c = make_cache(t);
      triattn::streaming_llm p;
      c.with_view([&](const auto& v) { p.compress(v, t.budget); });
      print_keep(i, "streaming_llm", c);
    }
    // Scores [layers, kv_heads, capacity] of the policies that aggregate their GQA group.
    const auto kv_head_scores = [&](const auto& p) {
      return [&p, group = t.shape.group](const auto& v, std::span<float> out) { p.score(v, out.first(out.size() / group)); };
    };
    const auto accumulated = [&]<class Policy>(const char* name, Policy p) {
      test_cache c = make_cache(t);
      feed_attention(p, t, c, inputs);
      run(i, name, t, p, c, kv_head_scores(p));
    };
    accumulated("h2o", triattn::h2o{});
    accumulated("vatp", triattn::vatp{});
    // The window's queries: one per token, the last few above some keys (the causal mask).
    const auto windowed = [&]<class Policy, class Config>(const char* name, Config cfg) {
      test_cache c = make_cache(t);
      cfg.window = t.window;
      cfg.round.sched = triattn::schedule::every_step();
      Policy p(cfg);
      const auto& s = c.shape();
      std::vector<float> q(static_cast<std::size_t>(s.head_dim));
      c.with_view([&](const auto& v) { p.attach(v); });
      const std::int32_t first = last_position(c) + 1 - t.window / 2;
      for (int r = 0; r < t.window; ++r)
        for (int l = 0; l < s.num_layers; ++l)
          for (int qh = 0; qh < s.num_kv_heads * s.group; ++qh) {
            for (float& x : q) x = static_cast<float>(exact_uniform(inputs));
            p.observe(l, qh, first + r, q);
          }
      run(i, name, t, p, c, kv_head_scores(p));
    };
    windowed.template operator()<triattn::snapkv>("snapkv", triattn::snapkv_config{});
    windowed.template operator()<triattn::rkv>("rkv", triattn::rkv_config{});
    windowed.template operator()<triattn::expected_attention>("expected_attention", triattn::expected_attention_config{});
    {
      test_cache c = make_cache(t);
      triattn::triattention p(random_stats(inputs, c.geometry()));
      const std::int64_t r = last_position(c) + 1;
      run(i, "triattention", t, p, c, [&](const auto& v, std::span<float> out) { p.score(v, r, out); });
    }
    const auto key_only = [&]<class Policy>(const char* name, Policy p) {
      test_cache c = make_cache(t);
      run(i, name, t, p, c, [&](const auto& v, std::span<float> out) { p.score(v, out.first(out.size() / t.shape.group)); });
    };
    key_only("knorm", triattn::knorm{});
    key_only("keydiff", triattn::keydiff{});
  }
  return 0;
}
