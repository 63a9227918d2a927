// Expected Attention against its double-precision oracle (support/attention_free_reference.hpp):
// `score` from observed queries and from calibration statistics, on every layout and element
// type, both RoPE pairings and key states; the statistics' rules (queries below the sinks left
// out, a round with none refused, the cache untouched); config errors; the registry's entry.
// Its decisions through every granularity and view are the round matrix's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "support/attention_free_reference.hpp"
#include "support/random.hpp"
#include "support/round_checks.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "support/window_reference.hpp"
#include "triattn/policies/expected_attention.hpp"
#include "triattn/registry.hpp"

namespace {

using triattn_test::cache_layout;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;

constexpr float untouched = -12345.0f;


/// The oracle's row of (l, h) with the sinks at +inf, from `moments` [G].
std::vector<double> oracle_row(test_cache& c, int l, int h, const std::vector<ref::query_moments>& moments,
                               std::int64_t round_start, const triattn::expected_attention_config& cfg) {
  std::vector<bool> competes(static_cast<std::size_t>(c.length(l, h)));
  for (std::size_t s = 0; s < competes.size(); ++s) competes[s] = static_cast<std::int64_t>(s) >= cfg.sinks;
  auto x = ref::expected_attention_scores(c, l, h, moments, static_cast<double>(round_start), cfg.future, competes,
                                          cfg.value_norm, cfg.epsilon);
  for (std::size_t s = 0; s < x.size(); ++s)
    if (static_cast<std::int64_t>(s) < cfg.sinks) x[s] = ref::inf;
  return x;
}

/// `got` [layers, kv_heads, capacity] against `want(l, h)` within 1e-4 of each row's largest score.
template <class Want>
void check_scores(test_cache& c, const std::vector<float>& got, Want&& want) {
  const auto& s = c.shape();
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_kv_heads; ++h) {
      const std::vector<double> w = want(l, h);
      double scale = 0.0;
      for (const double x : w)
        if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
      const std::size_t row = (static_cast<std::size_t>(l) * s.num_kv_heads + h) * s.capacity;
      for (std::int32_t j = 0; j < c.length(l, h); ++j) {
        INFO("layer " << l << " kv_head " << h << " slot " << j << " got " << got[row + j] << " want " << w[j]);
        if (std::isinf(w[j])) {
          CHECK(got[row + j] == w[j]);
        } else {
          CHECK(std::fabs(got[row + j] - w[j]) <= 1e-4 * scale + 1e-7);
        }
      }
      for (std::int64_t j = c.length(l, h); j < s.capacity; ++j) CHECK(got[row + j] == untouched);
    }
}

test_cache random_cache(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int group,
                        triattn::rope_style style, triattn::key_state keys) {
  auto shape = triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 5), group,
                                          {.max_kv_heads = 3, .max_half_dim = 4, .min_capacity = 6, .max_capacity = 30});
  shape.rope.style = style;
  shape.keys = keys;
  if (ref::is_fp8(type)) shape.k_scale = 0.03f, shape.v_scale = 0.02f;
  return test_cache(shape, g);
}

triattn::expected_attention_config random_config(std::mt19937_64& g) {
  triattn::expected_attention_config cfg;
  cfg.window = 1 + static_cast<int>(g() % 6);
  cfg.future = std::vector<std::int64_t>{1, 9, 512}[g() % 3];
  cfg.sinks = static_cast<std::int64_t>(g() % 5);
  cfg.covariance = g() % 3 != 0;
  cfg.value_norm = g() % 3 != 0;
  cfg.epsilon = g() % 2 ? 0.0f : 0.02f;
  return cfg;
}

}  // namespace

TEST_CASE("Expected Attention scores equal the oracle from observed queries and from calibration") {
  auto g = triattn_test::rng(4200);
  INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed());
  int rows = 0;
  for (int i = 0; i < 48; ++i) {
    const auto layout = triattn_test::all_layouts[static_cast<std::size_t>(i) % std::size(triattn_test::all_layouts)];
    const auto type = std::vector<triattn::dtype>{triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                                  triattn::dtype::fp8_e4m3}[static_cast<std::size_t>(i / 4) % 4];
    const auto style = i % 2 ? triattn::rope_style::interleaved : triattn::rope_style::half;
    const auto keys = i % 3 ? triattn::key_state::post_rope : triattn::key_state::pre_rope;
    test_cache c = random_cache(g, layout, type, 1 << (i % 3), style, keys);
    triattn::expected_attention_config cfg = random_config(g);
    const bool calibrated = i % 4 == 3;
    const std::int64_t round_start = g() % 2 ? -1 : triattn_test::largest_position(c) + 1 + static_cast<std::int64_t>(g() % 100);
    const std::int64_t T = round_start >= 0 ? round_start : triattn_test::largest_position(c) + 1;
    INFO(c.shape().describe() << " window " << cfg.window << " future " << cfg.future << " sinks " << cfg.sinks
                              << " covariance " << cfg.covariance << " value_norm " << cfg.value_norm << " epsilon "
                              << cfg.epsilon << (calibrated ? " calibrated" : "") << " round start " << round_start);
    std::vector<float> got(static_cast<std::size_t>(c.shape().num_layers) * c.shape().num_kv_heads * c.shape().capacity,
                           untouched);
    const int G = c.shape().group, D = c.shape().head_dim;
    if (calibrated) {
      const triattn::query_stats stats = ref::tri_random_stats(g, c.geometry());
      const triattn::expected_attention p(stats, cfg);
      c.with_view([&](const auto& v) { p.score(v, round_start, got); });
      check_scores(c, got, [&](int l, int h) {
        std::vector<ref::query_moments> m;
        for (int gi = 0; gi < G; ++gi) {
          ref::query_moments x{std::vector<double>(static_cast<std::size_t>(D)),
                               std::vector<double>(static_cast<std::size_t>(D) * D, 0.0)};
          const std::size_t row = stats.row(l, h * G + gi);
          for (int f = 0; f < D / 2; ++f) {
            const auto [re, im] = ref::band_dims(style, D, f);
            x.mean[re] = stats.q_mean_real[row + f];
            x.mean[im] = stats.q_mean_imag[row + f];
          }
          m.push_back(x);
        }
        ++rows;
        return oracle_row(c, l, h, m, T, cfg);
      });
    } else {
      const auto wq = triattn_test::window_queries::random(g, c, cfg.window);
      for (const auto& p : wq.positions) cfg.sinks = std::min<std::int64_t>(cfg.sinks, p.back());
      triattn::expected_attention p(cfg);
      c.with_view([&](const auto& v) {
        wq.feed(p, v);
        p.score(v, round_start, got);
      });
      check_scores(c, got, [&](int l, int h) {
        const ref::window_row in = wq.row(c, l, h, cfg.window);
        std::vector<ref::query_moments> m;
        for (int gi = 0; gi < G; ++gi) {
          m.push_back(ref::moments_of(c.shape().rope, in.q[gi], in.q_pos, cfg.sinks, cfg.covariance));
        }
        ++rows;
        return oracle_row(c, l, h, m, T, cfg);
      });
    }
  }
  CHECK(rows >= 48);
}

TEST_CASE("Expected Attention leaves queries below the sinks out and refuses a round with none, the cache untouched") {
  auto g = triattn_test::rng(4201);
  test_cache c = random_cache(g, cache_layout::paged_nhd, triattn::dtype::bf16, 2, triattn::rope_style::half,
                              triattn::key_state::post_rope);
  triattn::expected_attention_config cfg;
  cfg.window = 4;
  cfg.sinks = 4;
  triattn::expected_attention p(cfg);
  const auto view = c.paged_view();
  p.attach(view);
  std::vector<float> q(static_cast<std::size_t>(c.shape().head_dim), 0.5f);
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.geometry().num_q_heads; ++h)
      for (std::int32_t pos = 0; pos < 4; ++pos) p.observe(l, h, pos, q);
  triattn_test::check_rejected(c, [&] { p.compress(view, 1); },
                               {"triattn::compress", "layer 0 q_head 0", "holds no observed query at a position >= sinks 4"});
  // A query at position 4 is enough: its statistics alone (a covariance of zero).
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.geometry().num_q_heads; ++h) p.observe(l, h, 4, q);
  std::vector<float> got(static_cast<std::size_t>(c.shape().num_layers) * c.shape().num_kv_heads * c.shape().capacity, untouched);
  p.score(view, -1, got);
  check_scores(c, got, [&](int l, int h) {
    std::vector<ref::query_moments> m(static_cast<std::size_t>(c.shape().group));
    for (auto& x : m) {
      x.mean = ref::moments_of(c.shape().rope, {std::vector<double>(q.begin(), q.end())}, {4}, 4, true).mean;
      x.cov.assign(static_cast<std::size_t>(c.shape().head_dim) * c.shape().head_dim, 0.0);
    }
    return oracle_row(c, l, h, m, triattn_test::largest_position(c) + 1, cfg);
  });
}

TEST_CASE("Expected Attention refuses bad configs and an unattached view, naming the value") {
  triattn::expected_attention_config cfg;
  cfg.window = 0;
  triattn_test::throws_with([&] { triattn::expected_attention{cfg}; }, {"triattn::expected_attention", "window 0"});
  cfg = {};
  cfg.future = 0;
  triattn_test::throws_with([&] { triattn::expected_attention{cfg}; }, {"future 0"});
  cfg = {};
  cfg.epsilon = -1.0f;
  triattn_test::throws_with([&] { triattn::expected_attention{cfg}; }, {"epsilon -1"});
  auto g = triattn_test::rng(4202);
  test_cache c = random_cache(g, cache_layout::dense_nhd, triattn::dtype::f32, 1, triattn::rope_style::half,
                              triattn::key_state::post_rope);
  triattn::expected_attention p;
  triattn_test::check_rejected(c, [&] { p.compress(c.dense_view(), 1); }, {"triattn::compress", "call attach(view) first"});
}

TEST_CASE("the registry's expected_attention reads values and queries, or calibration in their place") {
  const triattn::policy_entry* e = triattn::find_policy("expected_attention");
  REQUIRE(e != nullptr);
  CHECK(e->needs.values);
  CHECK(e->needs.queries);
  CHECK(!e->needs.stats);
  CHECK(e->queries_from_stats);
  CHECK(!triattn::find_policy("snapkv")->queries_from_stats);  // its queries are more than statistics
  CHECK(!triattn::find_policy("triattention")->queries_from_stats);
  triattn::policy_inputs in;
  in.calibrated_queries = true;
  triattn_test::throws_with([&] { (void)e->create(in); }, {"expected_attention", "needs calibration statistics"});
  auto g = triattn_test::rng(4203);
  test_cache c = random_cache(g, cache_layout::dense_hnd, triattn::dtype::f16, 2, triattn::rope_style::half,
                              triattn::key_state::post_rope);
  const triattn::query_stats stats = ref::tri_random_stats(g, c.geometry());
  in.stats = &stats;
  triattn_test::throws_with([&] { (void)triattn::find_policy("snapkv")->create(in); },
                            {"snapkv", "cannot take its queries from calibration statistics"});
  // Calibrated through the registry: the keep sets of the class built from the same stats.
  auto any = *e->create(in);
  const triattn::keep_plan got = any.plan(c.dense_view(), 4);
  const triattn::keep_plan want = triattn::expected_attention(stats, triattn::expected_attention_config::decode())
                                         .plan(c.dense_view(), 4);
  CHECK(got.indices == want.indices);
  CHECK(got.offsets == want.offsets);
}
