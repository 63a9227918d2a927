// R-KV against the double-precision oracle of support/window_reference.hpp: scores on every
// layout, dtype and GQA group; the flash path (importance recomputed from the kept queries)
// against materialised logits; the redundancy quirk by hand; decisions through `compress`;
// ties, budgets, presets and every error that must leave the cache untouched.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/views.hpp"
#include "support/window_reference.hpp"
#include "triattn/core/error.hpp"
#include "triattn/policies/rkv.hpp"

namespace {

using triattn::rkv_config;
using triattn_test::test_cache;
using triattn_test::window_queries;
namespace ref = triattn_test::ref;
using index_list = std::vector<std::int32_t>;

constexpr float inf = std::numeric_limits<float>::infinity();
/// Cosine similarities closer than this to the threshold may fall on either side in fp32.
constexpr double threshold_guard = 1e-5;

/// A random configuration: window 1-6, kernel 1-7, lambda 0.1, 0.07 or any in [0, 1],
/// threshold 0.5 or any in [-0.3, 0.9].
rkv_config random_config(std::mt19937_64& g) {
  std::uniform_int_distribution<int> window(1, 6), half_kernel(0, 3), pick(0, 2);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f), cosine(-0.3f, 0.9f);
  rkv_config c;
  c.window = window(g);
  c.kernel = 2 * half_kernel(g) + 1;
  const float lambdas[] = {0.1f, 0.07f, unit(g)};
  c.lambda = lambdas[pick(g)];
  c.threshold = pick(g) == 0 ? cosine(g) : 0.5f;
  return c;
}

/// The oracle's scores [n] of (l, h); `threshold_margin` is lowered to the closest cosine.
std::vector<double> expect_row(test_cache& c, const window_queries& wq, int l, int h, const rkv_config& cfg,
                               double& threshold_margin) {
  return ref::rkv_scores(wq.row(c, l, h, cfg.window), cfg.window, cfg.kernel, cfg.lambda, cfg.threshold,
                         threshold_margin);
}

std::vector<float> scores_of(const triattn::rkv& policy, test_cache& c) {
  const auto& s = c.shape();
  std::vector<float> out(static_cast<std::size_t>(s.num_layers * s.num_kv_heads * s.capacity),
                         triattn_test::untouched_score);
  c.with_view([&](const auto& v) { policy.score(v, out); });
  return out;
}

/// Materialised logits [G, m, n] of (l, h) as an eager engine computes them in fp32.
std::vector<float> eager_logits(const ref::window_row& in) {
  std::vector<float> logits;
  const auto D = static_cast<float>(in.k[0].size());
  for (const auto& qh : in.q)
    for (std::size_t i = 0; i < qh.size(); ++i)
      for (std::size_t j = 0; j < in.k.size(); ++j) {
        float dot = 0.0f;
        for (std::size_t d = 0; d < in.k[j].size(); ++d) dot += static_cast<float>(qh[i][d]) * static_cast<float>(in.k[j][d]);
        logits.push_back(in.k_pos[j] > in.q_pos[i] ? -inf : dot / std::sqrt(D));
      }
  return logits;
}

}  // namespace

TEST_CASE("R-KV scores match the oracle on every layout, dtype and group") {
  auto g = triattn_test::rng(1201);
  int compared = 0, skipped = 0;
  for (int t = 0; t < 144; ++t) {
    const int group = 1 << (t / 4 % 3);
    test_cache c = triattn_test::window_cache(g, triattn_test::all_layouts[t % 4], triattn_test::all_dtypes[t / 12 % 3],
                                              group);
    const rkv_config cfg = random_config(g);
    const auto wq = window_queries::random(g, c, cfg.window);
    INFO(c.shape().describe() << " window " << cfg.window << " kernel " << cfg.kernel << " lambda " << cfg.lambda
                              << " threshold " << cfg.threshold);
    triattn::rkv policy(cfg);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    const auto out = scores_of(policy, c);
    compared += triattn_test::check_scores(
        c, out,
        [&](int l, int h) -> std::optional<std::vector<double>> {
          double margin = std::numeric_limits<double>::infinity();
          auto want = expect_row(c, wq, l, h, cfg, margin);
          if (margin <= threshold_guard) {
            ++skipped;
            return std::nullopt;
          }
          return want;
        },
        2e-6, 2e-5);
  }
  INFO("rows skipped for cosines at the threshold: " << skipped);
  CHECK(compared > 100);
  CHECK(skipped * 20 < compared);
}

TEST_CASE("R-KV scores recomputed from the kept queries equal those from materialised logits") {
  auto g = triattn_test::rng(1202);
  int compared = 0;
  for (int t = 0; t < 72; ++t) {
    const int group = 1 << (t / 4 % 3);
    test_cache c = triattn_test::window_cache(g, triattn_test::all_layouts[t % 4], triattn_test::all_dtypes[t / 12 % 3],
                                              group);
    const rkv_config cfg = random_config(g);
    const auto wq = window_queries::random(g, c, cfg.window);
    INFO(c.shape().describe() << " window " << cfg.window << " kernel " << cfg.kernel << " lambda " << cfg.lambda);
    triattn::rkv policy(cfg);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    const auto out = scores_of(policy, c);
    compared += triattn_test::check_scores(
        c, out,
        [&](int l, int h) -> std::optional<std::vector<double>> {
          const auto in = wq.row(c, l, h, cfg.window);
          double margin = std::numeric_limits<double>::infinity();
          if (in.k.empty() || (ref::rkv_redundancy(in.k, cfg.threshold, margin), margin <= threshold_guard))
            return std::nullopt;
          std::vector<float> keys;
          for (const auto& k : in.k) keys.insert(keys.end(), k.begin(), k.end());
          std::vector<float> flash(in.k.size());
          triattn::rkv_scores_from_logits(eager_logits(in), group, static_cast<int>(in.q_pos.size()), keys,
                                          c.shape().head_dim, cfg, flash);
          return std::vector<double>(flash.begin(), flash.end());
        },
        1e-6, 1e-5);
  }
  CHECK(compared > 50);
}

TEST_CASE("R-KV redundancy spares the newest near-duplicate, and token 0 when a row has none") {
  // k0 = (1, 0), k1 at cosine 0.3 from it, k2 = k0. Rows: 0 -> newest match 2; 1 -> no match,
  // so the reference zeroes S[1][0] (the quirk); 2 -> newest match 0.
  const double c01 = 0.3, s01 = std::sqrt(1 - c01 * c01);
  const std::vector<float> keys = {1.0f, 0.0f, static_cast<float>(c01), static_cast<float>(s01), 1.0f, 0.0f};
  std::vector<float> got(3);
  triattn::rkv_redundancy(Eigen::Map<const triattn::row_matrix>(keys.data(), 3, 2), 0.5f, got);
  // Column sums after zeroing: col 0 = S10 (zeroed) + S20 (zeroed) = 0; col 1 = S01 + S21 =
  // 0.6; col 2 = S02 (zeroed) + S12 = 0.3. Means over 3 rows, then a softmax.
  const double z[] = {0.0, 0.6 / 3, 0.3 / 3};
  const double sum = std::exp(z[0]) + std::exp(z[1]) + std::exp(z[2]);
  for (int j = 0; j < 3; ++j) CHECK(got[j] == Approx(std::exp(z[j]) / sum).epsilon(1e-6));
  double margin = std::numeric_limits<double>::infinity();
  const auto oracle = ref::rkv_redundancy({{1, 0}, {c01, s01}, {1, 0}}, 0.5, margin);
  for (int j = 0; j < 3; ++j) CHECK(got[j] == Approx(oracle[j]).epsilon(1e-6));
}

TEST_CASE("R-KV compress keeps the oracle's slots on every layout") {
  triattn_test::check_compress_trials<triattn::rkv>(
      1203, 16, random_config,
      [](const rkv_config& cfg) {
        return "window " + std::to_string(cfg.window) + " kernel " + std::to_string(cfg.kernel) + " lambda " +
               std::to_string(cfg.lambda) + " threshold " + std::to_string(cfg.threshold);
      },
      [](test_cache& c, const window_queries& wq, const rkv_config& cfg, std::int64_t budget) -> triattn_test::oracle_keep {
        std::vector<index_list> keep;
        double margin = std::numeric_limits<double>::infinity(), threshold_margin = margin;
        for (int l = 0; l < c.shape().num_layers; ++l)
          for (int h = 0; h < c.shape().num_kv_heads; ++h) {
            const auto d = ref::keep_best(expect_row(c, wq, l, h, cfg, threshold_margin), budget);
            keep.push_back(d.keep);
            margin = std::min(margin, d.margin);
          }
        if (margin <= 2e-5 || threshold_margin <= threshold_guard) return std::nullopt;
        return keep;
      });
}

TEST_CASE("R-KV ties go to the lower slot") {
  auto g = triattn_test::rng(1204);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      triattn_test::cache_shape s = triattn_test::random_shape(g, layout, triattn::dtype::f16, 2, group);
      s.capacity = 24;
      test_cache c(s, g);
      // Zero keys: every logit is 0 (uniform importance) and every cosine is 0 (no
      // near-duplicate; the quirk zeroes S[i][0], already 0), so every score is equal.
      for (int l = 0; l < s.num_layers; ++l)
        for (int h = 0; h < s.num_kv_heads; ++h) {
          c.length(l, h) = 20;
          for (std::int64_t i = 0; i < s.capacity; ++i) c.store_key(l, h, i, std::vector<double>(s.head_dim, 0.0));
        }
      triattn::rkv policy;
      const auto wq = window_queries::random(g, c, policy.config.window);
      c.with_view([&](const auto& v) { wq.feed(policy, v); });
      INFO(s.describe());
      // budget 11: the window [12, 20) and the 3 lowest prefix slots
      const index_list want = {0, 1, 2, 12, 13, 14, 15, 16, 17, 18, 19};
      triattn_test::check_round(c, std::vector<index_list>(static_cast<std::size_t>(s.num_layers * s.num_kv_heads), want),
                                [&] { return c.with_view([&](const auto& v) { return policy.compress(v, 11); }).freed_pages; });
    }
  }
}

TEST_CASE("R-KV budgets: >= length is a no-op that reads nothing; 1 keeps the oldest window slot") {
  auto g = triattn_test::rng(1205);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = triattn_test::window_cache(g, layout, triattn::dtype::bf16, 4);
    const std::int64_t longest = std::max(*std::max_element(c.lengths.begin(), c.lengths.end()), 1);
    triattn::rkv policy(rkv_config::reference_code());
    c.with_view([&](const auto& v) { policy.attach(v); });
    const auto before = c.snapshot();
    CHECK(c.with_view([&](const auto& v) { return policy.compress(v, longest + 5); }).freed_pages.empty());
    CHECK(c.snapshot() == before);

    triattn_test::check_budget_one(c, policy, g);
  }
}

TEST_CASE("R-KV presets") {
  const auto paper = rkv_config::paper();
  CHECK(paper.window == 8);
  CHECK(paper.kernel == 7);
  CHECK(paper.lambda == 0.1f);
  CHECK(paper.threshold == 0.5f);
  CHECK(paper.round.grain == triattn::granularity::per_layer);
  CHECK(paper.round.sched.kind == triattn::trigger::slack);
  CHECK(paper.round.sched.slack == 128);
  CHECK(rkv_config::reference_code().lambda == 0.07f);
  CHECK(triattn::rkv().config.lambda == 0.1f);
}

TEST_CASE("R-KV rejects bad input and leaves the cache untouched") {
  auto g = triattn_test::rng(1206);
  const auto config_error = [](rkv_config c, const std::string& what) {
    CHECK_THROWS_WITH(triattn::rkv(c), Catch::Contains("triattn::rkv") && Catch::Contains(what));
  };
  rkv_config bad;
  bad.window = 0;
  config_error(bad, "window 0");
  bad = {};
  bad.kernel = 6;
  config_error(bad, "kernel 6");
  bad = {};
  bad.lambda = 1.5f;
  config_error(bad, "lambda 1.5");
  bad.lambda = std::numeric_limits<float>::quiet_NaN();
  config_error(bad, "lambda nan");
  bad = {};
  bad.threshold = std::numeric_limits<float>::infinity();
  config_error(bad, "threshold inf");

  triattn_test::cache_shape s = triattn_test::random_shape(g, triattn_test::cache_layout::dense_nhd, triattn::dtype::f32, 3, 4);
  s.capacity = 20;
  s.head_dim = 4;
  test_cache c(s, g);
  for (auto& n : c.lengths) n = 15;
  triattn::rkv policy;
  const auto view = c.dense_view();
  const std::vector<float> q(4, 0.25f);

  SECTION("observe") {
    CHECK_THROWS_WITH(policy.observe(0, 0, 1, q, {}), Catch::Contains("triattn::rkv::observe"));
    policy.attach(view);
    CHECK_THROWS_WITH(policy.observe(-1, 0, 1, q, {}), Catch::Contains("triattn::rkv::observe") && Catch::Contains("layer -1"));
    CHECK_THROWS_WITH(policy.observe(0, 0, 1, std::vector<float>(3, 0.0f), {}), Catch::Contains("holds 3 floats"));
    CHECK_THROWS_WITH(policy.observe(0, 0, 1, std::vector<float>{0.0f, -inf, 0.0f, 0.0f}, {}), Catch::Contains("-inf at dim 1"));
  }
  SECTION("non-finite keys, no observed query, a bad budget, a wrong output size") {
    policy.attach(view);
    triattn_test::check_rejected(c, [&] { policy.compress(view, 10); }, {"triattn::compress", "no observed query"});
    const auto wq = window_queries::random(g, c, policy.config.window);
    wq.feed(policy, view);
    c.store_key(0, s.num_kv_heads - 1, 2, {std::numeric_limits<double>::quiet_NaN(), 0.0, 0.0, 0.0});
    triattn_test::check_rejected(c, [&] { policy.compress(view, 10); },
                                 {"triattn::compress", "kv_head " + std::to_string(s.num_kv_heads - 1) + " slot 2",
                                  "keys must be finite"});
    c.store_key(0, s.num_kv_heads - 1, 2, {1.0, 0.0, 0.0, 0.0});
    triattn_test::check_rejected(c, [&] { (void)policy.plan(view, 0); }, {"triattn::rkv::plan", "budget 0"});
    std::vector<float> out(3);
    CHECK_THROWS_WITH(policy.score(view, out), Catch::Contains("triattn::rkv::score") && Catch::Contains("output holds 3"));
    CHECK_NOTHROW(policy.compress(view, 10));
  }
  SECTION("materialised inputs of the wrong size") {
    std::vector<float> out(5);
    CHECK_THROWS_WITH(triattn::rkv_importance_from_logits(std::vector<float>(7), 1, 1, 12, policy.config, out),
                      Catch::Contains("triattn::rkv_importance_from_logits") && Catch::Contains("logits holds 7"));
    CHECK_THROWS_WITH(triattn::rkv_scores_from_logits({}, 1, 1, std::vector<float>(7), 4, policy.config, out),
                      Catch::Contains("triattn::rkv_scores_from_logits") && Catch::Contains("head_dim 4"));
  }
}
