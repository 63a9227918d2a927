// SnapKV against the double-precision oracle of support/window_reference.hpp: scores on every
// layout, dtype, GQA group and rule; the flash path (votes recomputed from the kept queries)
// against materialised probabilities; decisions through `compress`; ties, budgets, presets,
// triggers and every error that must leave the cache untouched.
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
#include "triattn/policies/snapkv.hpp"

namespace {

using triattn::snapkv_config;
using triattn::snapkv_grouping;
using triattn_test::test_cache;
using triattn_test::window_queries;
namespace ref = triattn_test::ref;
using index_list = std::vector<std::int32_t>;

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr triattn::gqa_aggregation gqa_rules[] = {triattn::gqa_aggregation::mean, triattn::gqa_aggregation::max,
                                                  triattn::gqa_aggregation::sum};

/// A random configuration: window 1-6, kernel 1-7, max or avg pooling, any GQA rule.
snapkv_config random_config(std::mt19937_64& g, bool per_q_head_allowed = true) {
  std::uniform_int_distribution<int> window(1, 6), half_kernel(0, 3), coin(0, 1), rule(0, per_q_head_allowed ? 3 : 2);
  snapkv_config c;
  c.window = window(g);
  c.kernel = 2 * half_kernel(g) + 1;
  c.pool = coin(g) ? triattn::pooling::max : triattn::pooling::avg;
  const int r = rule(g);
  c.grouping = r == 3 ? snapkv_grouping::per_q_head : snapkv_grouping::aggregate;
  c.gqa = gqa_rules[r % 3];
  return c;
}

ref::group_rule oracle_rule(const snapkv_config& c) {
  if (c.grouping == snapkv_grouping::per_q_head) return ref::group_rule::per_q_head;
  switch (c.gqa) {
    case triattn::gqa_aggregation::mean: return ref::group_rule::mean;
    case triattn::gqa_aggregation::max: return ref::group_rule::max;
    case triattn::gqa_aggregation::sum: return ref::group_rule::sum;
  }
  return ref::group_rule::mean;
}

/// The oracle's pooled votes [G][p] and scores [n] of (l, h).
struct expected_row {
  ref::matrix votes;
  std::vector<double> scores;
};

expected_row expect_row(test_cache& c, const window_queries& wq, int l, int h, const snapkv_config& cfg) {
  const auto in = wq.row(c, l, h, cfg.window);
  expected_row e;
  e.votes = ref::snapkv_votes(in, cfg.window, cfg.kernel, cfg.pool == triattn::pooling::max);
  e.scores = ref::snapkv_scores(e.votes, in.k.size(), oracle_rule(cfg));
  return e;
}

/// The oracle's keep set of (l, h) for `budget`, and the margin of the decision.
index_list expect_keep(const expected_row& e, const snapkv_config& cfg, std::int64_t budget, double& margin) {
  const auto n = static_cast<std::int64_t>(e.scores.size());
  index_list keep;
  if (n <= budget) {
    for (std::int32_t s = 0; s < n; ++s) keep.push_back(s);
    return keep;
  }
  if (cfg.grouping == snapkv_grouping::per_q_head && budget > cfg.window) {
    keep = ref::round_robin(e.votes, static_cast<std::size_t>(budget - cfg.window));
    for (std::int64_t s = n - cfg.window; s < n; ++s) keep.push_back(static_cast<std::int32_t>(s));
    std::sort(keep.begin(), keep.end());
    margin = std::min(margin, ref::order_margin(e.votes));
    return keep;
  }
  const auto d = ref::keep_best(e.scores, budget);
  margin = std::min(margin, d.margin);
  return d.keep;
}

/// Runs `policy.score` on `c` into a buffer pre-filled with the untouched marker.
std::vector<float> scores_of(const triattn::snapkv& policy, test_cache& c) {
  const auto& s = c.shape();
  std::vector<float> out(static_cast<std::size_t>(s.num_layers * s.num_kv_heads * s.capacity),
                         triattn_test::untouched_score);
  c.with_view([&](const auto& v) { policy.score(v, out); });
  return out;
}

/// Materialised probabilities [G, m, n] of (l, h) as an eager engine computes them in fp32:
/// float dot products, the causal mask, a float softmax.
std::vector<float> eager_probs(const ref::window_row& in) {
  std::vector<float> probs;
  const auto D = static_cast<float>(in.k[0].size());
  for (const auto& qh : in.q) {
    for (std::size_t i = 0; i < qh.size(); ++i) {
      std::vector<float> z(in.k.size());
      float top = -inf;
      for (std::size_t j = 0; j < in.k.size(); ++j) {
        float dot = 0.0f;
        for (std::size_t d = 0; d < in.k[j].size(); ++d) dot += static_cast<float>(qh[i][d]) * static_cast<float>(in.k[j][d]);
        z[j] = in.k_pos[j] > in.q_pos[i] ? -inf : dot / std::sqrt(D);
        top = std::max(top, z[j]);
      }
      float sum = 0.0f;
      for (float& x : z) sum += x = top == -inf ? 0.0f : std::exp(x - top);
      for (float& x : z) probs.push_back(top == -inf ? 0.0f : x / sum);
    }
  }
  return probs;
}

}  // namespace

TEST_CASE("SnapKV scores match the oracle on every layout, dtype, group and GQA rule") {
  auto g = triattn_test::rng(1101);
  int compared = 0, skipped = 0;
  for (int t = 0; t < 144; ++t) {
    const int group = 1 << (t / 4 % 3);
    test_cache c = triattn_test::window_cache(g, triattn_test::all_layouts[t % 4], triattn_test::all_dtypes[t / 12 % 3],
                                              group);
    const snapkv_config cfg = random_config(g);
    const auto wq = window_queries::random(g, c, cfg.window);
    INFO(c.shape().describe() << " window " << cfg.window << " kernel " << cfg.kernel << " rule "
                              << static_cast<int>(oracle_rule(cfg)) << " avg " << (cfg.pool == triattn::pooling::avg));
    triattn::snapkv policy(cfg);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    const auto out = scores_of(policy, c);
    compared += triattn_test::check_scores(
        c, out,
        [&](int l, int h) -> std::optional<std::vector<double>> {
          const auto e = expect_row(c, wq, l, h, cfg);
          // Merge ranks are exact integers, but only as stable as every q-head's vote order.
          if (cfg.grouping == snapkv_grouping::per_q_head && ref::order_margin(e.votes) <= 1e-4) {
            ++skipped;
            return std::nullopt;
          }
          return e.scores;
        },
        2e-5, 2e-5);
  }
  INFO("rows skipped for near-ties of per_q_head orders: " << skipped);
  CHECK(compared > 100);
  CHECK(skipped * 10 < compared);
}

TEST_CASE("SnapKV votes recomputed from the kept queries equal those from materialised probabilities") {
  auto g = triattn_test::rng(1102);
  int compared = 0;
  for (int t = 0; t < 72; ++t) {
    const int group = 1 << (t / 4 % 3);
    test_cache c = triattn_test::window_cache(g, triattn_test::all_layouts[t % 4], triattn_test::all_dtypes[t / 12 % 3],
                                              group);
    const snapkv_config cfg = random_config(g, false);
    const auto wq = window_queries::random(g, c, cfg.window);
    INFO(c.shape().describe() << " window " << cfg.window << " kernel " << cfg.kernel);
    triattn::snapkv policy(cfg);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    const auto out = scores_of(policy, c);
    compared += triattn_test::check_scores(
        c, out,
        [&](int l, int h) -> std::optional<std::vector<double>> {
          const auto in = wq.row(c, l, h, cfg.window);
          if (in.k.empty()) return std::nullopt;
          const auto probs = eager_probs(in);
          std::vector<float> flash(in.k.size());
          triattn::snapkv_scores_from_probs(probs, group, static_cast<int>(in.q_pos.size()),
                                            static_cast<std::int64_t>(in.k.size()), cfg, flash);
          return std::vector<double>(flash.begin(), flash.end());
        },
        1e-6, 1e-5);
  }
  CHECK(compared > 50);
}

TEST_CASE("SnapKV compress keeps the oracle's slots on every layout") {
  triattn_test::check_compress_trials<triattn::snapkv>(
      1103, 12, [](std::mt19937_64& g) { return random_config(g); },
      [](const snapkv_config& cfg) {
        return "window " + std::to_string(cfg.window) + " kernel " + std::to_string(cfg.kernel) + " rule " +
               std::to_string(static_cast<int>(oracle_rule(cfg)));
      },
      [](test_cache& c, const window_queries& wq, const snapkv_config& cfg,
         std::int64_t budget) -> triattn_test::oracle_keep {
        std::vector<index_list> keep;
        double margin = std::numeric_limits<double>::infinity();
        for (int l = 0; l < c.shape().num_layers; ++l)
          for (int h = 0; h < c.shape().num_kv_heads; ++h)
            keep.push_back(expect_keep(expect_row(c, wq, l, h, cfg), cfg, budget, margin));
        if (margin <= 1e-4) return std::nullopt;
        return keep;
      });
}

TEST_CASE("SnapKV ties go to the lower slot") {
  auto g = triattn_test::rng(1104);
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto grouping : {snapkv_grouping::aggregate, snapkv_grouping::per_q_head}) {
      for (const int group : {1, 2, 4}) {
        triattn_test::cache_shape s = triattn_test::random_shape(g, layout, triattn::dtype::bf16, 3, group);
        s.capacity = 24;
        test_cache c(s, g);
        // Equal keys and queries after every key: every probability is 1/n, every vote equal.
        for (int l = 0; l < s.num_layers; ++l)
          for (int h = 0; h < s.num_kv_heads; ++h) {
            c.length(l, h) = 20;
            for (std::int64_t i = 0; i < s.capacity; ++i) c.store_key(l, h, i, std::vector<double>(s.head_dim, 0.5));
          }
        snapkv_config cfg;
        cfg.window = 4;
        cfg.grouping = grouping;
        auto wq = window_queries::random(g, c, cfg.window);
        for (auto& p : wq.positions)
          for (std::size_t i = 0; i < p.size(); ++i) p[i] = 1000 + static_cast<std::int32_t>(i);
        triattn::snapkv policy(cfg);
        c.with_view([&](const auto& v) { wq.feed(policy, v); });
        INFO(s.describe() << " per_q_head " << (grouping == snapkv_grouping::per_q_head));
        // budget 10: the window [16, 20) and the 6 lowest prefix slots
        index_list want = {0, 1, 2, 3, 4, 5, 16, 17, 18, 19};
        triattn_test::check_round(c, std::vector<index_list>(static_cast<std::size_t>(s.num_layers * s.num_kv_heads), want),
                                  [&] { return c.with_view([&](const auto& v) { return policy.compress(v, 10); }).freed_pages; });
      }
    }
  }
}

TEST_CASE("SnapKV budgets: >= length is a no-op that reads nothing; 1 keeps the oldest window slot") {
  auto g = triattn_test::rng(1105);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = triattn_test::window_cache(g, layout, triattn::dtype::f16, 2);
    const std::int64_t longest = std::max(*std::max_element(c.lengths.begin(), c.lengths.end()), 1);
    triattn::snapkv policy(snapkv_config::decode());
    c.with_view([&](const auto& v) { policy.attach(v); });  // no query observed: none is needed
    const auto before = c.snapshot();
    const auto freed = c.with_view([&](const auto& v) { return policy.compress(v, longest); }).freed_pages;
    CHECK(c.snapshot() == before);
    CHECK(freed.empty());

    triattn_test::check_budget_one(c, policy, g);
  }
}

TEST_CASE("SnapKV presets and triggers") {
  const auto paper = snapkv_config::paper();
  CHECK(paper.window == 32);
  CHECK(paper.kernel == 7);
  CHECK(paper.pool == triattn::pooling::max);
  CHECK(paper.grouping == snapkv_grouping::aggregate);
  CHECK(paper.gqa == triattn::gqa_aggregation::mean);
  CHECK(paper.round.grain == triattn::granularity::per_layer);
  CHECK(paper.round.sched.kind == triattn::trigger::once_after_prompt);
  const auto decode = snapkv_config::decode();
  CHECK(decode.window == 8);
  CHECK(decode.kernel == 7);
  CHECK(decode.pool == triattn::pooling::max);
  CHECK(decode.round.sched.kind == triattn::trigger::slack);
  CHECK(decode.round.sched.slack == 128);

  // the policy's schedule: what maybe_compress asks
  const triattn::snapkv once;
  const auto& o = once.round().sched;
  CHECK(o.should_compress(600, 512, 600, 600));        // right after a prompt longer than the budget
  CHECK_FALSE(o.should_compress(400, 512, 400, 400));  // the prompt fits
  CHECK_FALSE(o.should_compress(700, 512, 700, 600));  // decode: never again
  CHECK_FALSE(o.should_compress(600, 512, 599, 600));  // not yet
  const triattn::snapkv every(decode);
  const auto& e = every.round().sched;
  CHECK_FALSE(e.should_compress(639, 512, 5000, 100));
  CHECK(e.should_compress(640, 512, 5000, 100));  // budget + 128
  CHECK_THROWS_WITH(e.should_compress(640, 0, 5000, 100),
                    Catch::Contains("triattn::schedule::should_compress") && Catch::Contains("budget 0"));
}

TEST_CASE("SnapKV rejects bad input and leaves the cache untouched") {
  auto g = triattn_test::rng(1106);
  const auto config_error = [](snapkv_config c, const std::string& what) {
    CHECK_THROWS_WITH(triattn::snapkv(c), Catch::Contains("triattn::snapkv") && Catch::Contains(what));
  };
  snapkv_config bad;
  bad.window = 0;
  config_error(bad, "window 0");
  bad = {};
  bad.kernel = 4;
  config_error(bad, "kernel 4");
  bad.kernel = -1;
  config_error(bad, "kernel -1");

  triattn_test::cache_shape s = triattn_test::random_shape(g, triattn_test::cache_layout::paged_hnd, triattn::dtype::f32, 3, 2);
  s.capacity = 20;
  s.head_dim = 4;
  test_cache c(s, g);
  for (auto& n : c.lengths) n = 12;
  snapkv_config cfg;
  cfg.window = 3;
  triattn::snapkv policy(cfg);
  const auto view = c.paged_view();
  const std::vector<float> q(4, 0.25f);

  SECTION("observe before attach, out of range, wrong size, non-finite, not increasing") {
    CHECK_THROWS_WITH(policy.observe(0, 0, 5, q, {}),
                      Catch::Contains("triattn::snapkv::observe") && Catch::Contains("attach the policy"));
    policy.attach(view);
    CHECK_THROWS_WITH(policy.observe(s.num_layers, 0, 5, q, {}),
                      Catch::Contains("triattn::snapkv::observe") && Catch::Contains("layer " + std::to_string(s.num_layers)));
    CHECK_THROWS_WITH(policy.observe(0, s.num_kv_heads * 2, 5, q, {}),
                      Catch::Contains("q_head " + std::to_string(s.num_kv_heads * 2)));
    CHECK_THROWS_WITH(policy.observe(0, -1, 5, q, {}), Catch::Contains("q_head -1"));
    CHECK_THROWS_WITH(policy.observe(0, 0, 5, std::vector<float>(5, 0.0f), {}),
                      Catch::Contains("holds 5 floats, expected head_dim 4"));
    std::vector<float> nan_q = q;
    nan_q[2] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH(policy.observe(0, 0, 5, nan_q, {}), Catch::Contains("nan") && Catch::Contains("dim 2"));
    CHECK_THROWS_WITH(policy.observe(0, 0, -2, q, {}), Catch::Contains("position -2"));
    policy.observe(0, 0, 5, q, {});
    CHECK_THROWS_WITH(policy.observe(0, 0, 5, q, {}), Catch::Contains("position 5") && Catch::Contains("last observed position 5"));
    CHECK(policy.queries().count(0, 0) == 1);  // the rejected calls left the window as it was
  }
  SECTION("scoring with no observed query, or q-heads of a group that saw different tokens") {
    policy.attach(view);
    triattn_test::check_rejected(c, [&] { policy.compress(view, 8); },
                                 {"triattn::compress", "no observed query"});
    for (int l = 0; l < s.num_layers; ++l)
      for (int h = 0; h < s.num_kv_heads * 2; ++h) policy.observe(l, h, 30, q, {});
    policy.observe(0, 1, 31, q, {});  // q-head 1 is one token ahead of q-head 0
    triattn_test::check_rejected(c, [&] { policy.compress(view, 8); },
                                 {"triattn::compress", "q_head 1 holds 2 observed queries but q_head 0 holds 1"});
  }
  SECTION("non-finite keys, a bad budget, a view it was not attached to, a changed window, a wrong output size") {
    const auto wq = window_queries::random(g, c, cfg.window);
    wq.feed(policy, view);
    c.store_key(1 % s.num_layers, 0, 7, {0.0, std::numeric_limits<double>::infinity(), 0.0, 0.0});
    triattn_test::check_rejected(c, [&] { policy.compress(view, 8); },
                                 {"triattn::compress", "kv_head 0 slot 7", "inf at dim 1", "keys must be finite"});
    c.store_key(1 % s.num_layers, 0, 7, std::vector<double>(4, 1.0));
    triattn_test::check_rejected(c, [&] { policy.compress(view, 0); }, {"budget 0"});
    triattn_test::check_rejected(c, [&] { (void)policy.plan(view, -3); }, {"triattn::snapkv::plan", "budget -3"});

    triattn_test::cache_shape other = s;
    other.head_dim = 6;
    test_cache d(other, g);
    triattn_test::check_rejected(d, [&] { policy.compress(d.paged_view(), 4); },
                                 {"triattn::compress", "head_dim 6", "call attach(view) first"});
    policy.config.window = 5;
    triattn_test::check_rejected(c, [&] { policy.compress(view, 8); },
                                 {"triattn::compress", "window 5 differs from the window 3"});
    policy.config.window = 3;
    std::vector<float> out(7);
    CHECK_THROWS_WITH(policy.score(view, out), Catch::Contains("triattn::snapkv::score") && Catch::Contains("output holds 7"));
    CHECK_NOTHROW(policy.compress(view, 8));
  }
}
