// H2O against the oracles of support/baselines_reference.hpp: scores (GQA mean, max and sum,
// normalisation, Scissorhands prompt scoring), budget splits, and decisions through `compress`
// on dense and paged views round after round, which holds only if the accumulated state moves
// with the cache; plus ties, edge budgets and every error that must leave the cache untouched.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/baselines_reference.hpp"
#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/policy.hpp"

namespace {

using triattn::gqa_aggregation;
using triattn_test::attention_run;
using triattn_test::cache_layout;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;

using triattn_test::all_aggregations;
using triattn_test::random_budget;
using triattn_test::throws_with;

/// A random cache: 1-3 layers, 1-3 KV heads, capacity 6-24, random lengths and positions.
test_cache make_cache(std::mt19937_64& g, cache_layout layout, int group, triattn::dtype type = triattn::dtype::f32) {
  const int page = std::uniform_int_distribution<int>(1, 5)(g);
  return test_cache(
      triattn_test::random_shape(g, layout, type, page, group,
                                 {.max_kv_heads = 3, .max_half_dim = 4, .min_capacity = 6, .max_capacity = 24}),
      g);
}

/// A softmax row over n slots of random logits: realistic fp32 probabilities.
std::vector<float> softmax_row(std::mt19937_64& g, std::size_t n) {
  const auto logits = triattn_test::normal_floats(g, n, 3.0f);
  const float top = *std::max_element(logits.begin(), logits.end());
  std::vector<float> p(n);
  float total = 0.0f;
  for (std::size_t j = 0; j < n; ++j) total += p[j] = std::exp(logits[j] - top);
  for (auto& x : p) x /= total;
  return p;
}

std::optional<std::int64_t> maybe_count(std::mt19937_64& g, std::int64_t hi) {
  std::uniform_int_distribution<std::int64_t> n(0, hi);
  return std::uniform_int_distribution<int>(0, 2)(g) == 0 ? std::optional<std::int64_t>(n(g)) : std::nullopt;
}

/// A random H2O config: split, sinks, aggregation, normalisation and schedule.
triattn::h2o_config random_config(std::mt19937_64& g, std::int64_t capacity) {
  triattn::h2o_config cfg;
  std::uniform_int_distribution<int> coin(0, 1), agg(0, 2), sinks(0, 3);
  cfg.heavy = maybe_count(g, capacity);
  cfg.recent = maybe_count(g, capacity);
  cfg.sinks = coin(g) ? sinks(g) : 0;
  cfg.gqa = all_aggregations[agg(g)];
  cfg.normalize = coin(g) != 0;
  cfg.round.sched = coin(g) ? triattn::schedule::every_step() : triattn::schedule::aligned_to(3);
  return cfg;
}

}  // namespace

TEST_CASE("H2O defaults and budget splits") {
  const triattn::h2o_config d;
  CHECK_FALSE(d.heavy);
  CHECK_FALSE(d.recent);
  CHECK_FALSE(d.heavy_ratio);
  CHECK_FALSE(d.recent_ratio);
  CHECK(d.sinks == 0);
  CHECK(d.gqa == gqa_aggregation::mean);
  CHECK_FALSE(d.normalize);
  CHECK(d.prompt == triattn::prompt_scoring::every_row);
  CHECK(d.scissorhands_window == 400);
  CHECK(d.round.sched.kind == triattn::trigger::every_step);

  triattn::h2o p;
  for (std::int64_t b = 1; b <= 40; ++b) {  // cli.md: recent = B/2, heavy = B - B/2
    const auto s = p.split(b);
    CHECK(s.recent == b / 2);
    CHECK(s.heavy == b - b / 2);
    CHECK(s.sinks == 0);
    CHECK(s.total() == b);
  }

  auto g = triattn_test::rng(1201);
  for (int i = 0; i < 200; ++i) {
    triattn::h2o_config cfg = random_config(g, 30);
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(1, 40)(g);
    const auto got = triattn::h2o(cfg).split(budget);
    const auto want = ref::split_for(cfg, budget, 0);
    INFO("budget " << budget << " heavy " << cfg.heavy.value_or(-1) << " recent " << cfg.recent.value_or(-1)
                   << " sinks " << cfg.sinks);
    CHECK(got.recent == want.recent);
    CHECK(got.heavy == want.heavy);
    CHECK(got.sinks == want.sinks);
  }

  SECTION("fractions of the prompt length") {
    const auto m = triattn::h2o_config::masking_reference();
    CHECK(m.heavy_ratio == 0.1);
    CHECK(m.recent_ratio == 0.1);
    triattn::h2o masked(m);
    try {
      masked.split(100);
      FAIL("a ratio budget without a prompt length was accepted");
    } catch (const triattn::error& e) {
      CHECK_THAT(e.what(), Catch::Contains("triattn::h2o::split") && Catch::Contains("round_context::prompt_length"));
    }
    masked.set_prompt_length(1000);  // observation only: a split still needs its prompt length
    CHECK_THROWS_WITH(masked.split(100), Catch::Contains("round_context::prompt_length"));
    CHECK(masked.split(1 << 20, 1000).heavy == 100);
    CHECK(masked.split(1 << 20, 1000).recent == 100);
    CHECK(masked.split(150, 1000).recent == 100);  // the budget caps recent first, then heavy
    CHECK(masked.split(150, 1000).heavy == 50);
    CHECK(masked.split(10, 7).total() == 0);  // int(0.7): nothing
    for (int i = 0; i < 100; ++i) {
      std::uniform_real_distribution<double> ratio(0.0, 1.0);
      triattn::h2o_config cfg = triattn::h2o_config::masking_reference(ratio(g));
      cfg.recent_ratio = ratio(g);
      const std::int64_t prompt = std::uniform_int_distribution<std::int64_t>(1, 5000)(g);
      const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(1, 6000)(g);
      triattn::h2o policy(cfg);
      const auto want = ref::split_for(cfg, budget, prompt);
      CHECK(policy.split(budget, prompt).heavy == want.heavy);
      CHECK(policy.split(budget, prompt).recent == want.recent);
    }
  }
}

TEST_CASE("H2O scores match the oracle: GQA mean, max, sum and normalisation") {
  auto g = triattn_test::rng(1202);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      for (const auto agg : all_aggregations) {
        for (const bool normalize : {false, true}) {
          test_cache c = make_cache(g, layout, group);
          triattn::h2o_config cfg;
          cfg.gqa = agg;
          cfg.normalize = normalize;
          triattn::h2o policy(cfg);
          INFO(c.shape().describe() << " agg " << triattn::gqa_aggregation_name(agg) << " normalize " << normalize);
          attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(cfg, false, 0), g);
          // Causal rows of softmax probabilities: every q-head of a group sees the same slots.
          for (int l = 0; l < c.shape().num_layers; ++l)
            for (int h = 0; h < c.shape().num_kv_heads; ++h)
              for (std::int32_t m = 1; m <= c.length(l, h); ++m)
                for (int qh = h * group; qh < (h + 1) * group; ++qh)
                  run.observe(l, qh, c.position(l, h, m - 1), softmax_row(g, static_cast<std::size_t>(m)));
          run.check_scores();
        }
      }
    }
  }
}

TEST_CASE("H2O Scissorhands prompt scoring weighs only the prompt's last rows") {
  auto g = triattn_test::rng(1203);
  std::uniform_int_distribution<std::int64_t> window(1, 160);  // positions: shorter than the prompt, or longer
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      test_cache c = make_cache(g, layout, group);
      triattn::h2o_config cfg = random_config(g, c.shape().capacity);
      cfg.prompt = triattn::prompt_scoring::last_window;
      cfg.scissorhands_window = window(g);
      triattn::h2o policy(cfg);
      const std::int64_t budget = random_budget(g, c);
      INFO(c.shape().describe() << " window " << cfg.scissorhands_window << " budget " << budget);
      // Every cached token is the prompt's, every causal row observed; decode steps follow.
      for (auto& n : c.lengths) n = std::max<std::int32_t>(n, 1);  // a prompt of at least a token
      const std::int32_t prompt = triattn_test::cached_prompt_length(c);
      policy.set_prompt_length(prompt);
      attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(cfg, false, prompt), g);
      run.causal_prefill();
      run.decode(cfg.round.sched, budget, ref::split_for(cfg, budget, prompt), 8);
    }
  }
}

TEST_CASE("H2O decisions through compress match the oracle round after round on every layout") {
  auto g = triattn_test::rng(1204);
  int decisions = 0, undecided = 0;
  for (int i = 0; i < 192; ++i) {
    const auto layout = triattn_test::all_layouts[i % 4];
    const int group = 1 << (i / 4 % 3);
    test_cache c = make_cache(g, layout, group);
    const triattn::h2o_config cfg = random_config(g, c.shape().capacity);
    const std::int64_t budget = random_budget(g, c);
    triattn_test::tally_decisions<triattn::h2o>(c, cfg, budget, false, g, decisions, undecided);
  }
  INFO("(layer, kv_head) decisions " << decisions << ", within a near-tie " << undecided);
  CHECK(decisions >= 500);
  CHECK(undecided * 20 <= decisions);
}

TEST_CASE("H2O ties go to the lower slot") {
  auto g = triattn_test::rng(1205);
  for (int i = 0; i < 48; ++i) {
    test_cache c = make_cache(g, triattn_test::all_layouts[i % 4], 1 << (i / 4 % 3));
    triattn::h2o_config cfg;
    cfg.gqa = all_aggregations[i % 3];
    triattn::h2o policy(cfg);
    const std::int64_t budget = random_budget(g, c);
    INFO(c.shape().describe() << " budget " << budget);
    attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(cfg, false, 0), g);
    // Probabilities of 1/256 or 2/256 only: slots tie all the time, and the sums are exact.
    run.simulate(cfg.round.sched, budget, ref::split_for(cfg, budget, 0), 6, i % 2 + 1);
  }
}

TEST_CASE("H2O edge budgets: no-op at or above every length, one slot at budget 1") {
  auto g = triattn_test::rng(1206);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      test_cache c = make_cache(g, layout, group);
      triattn::h2o policy;
      attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(policy.config, false, 0), g);
      run.prefill_rows();
      run.step();
      INFO(c.shape().describe());
      const std::int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
      const auto before = c.snapshot();
      for (const std::int64_t budget : {longest, longest + 5, std::numeric_limits<std::int64_t>::max()}) {
        const auto r = c.with_view([&](const auto& v) { return policy.compress(v, budget); });
        CHECK(r.freed_pages.empty());
        CHECK(c.snapshot() == before);  // nothing to evict: byte for byte
      }
      run.check_scores();
      run.compress_and_check(1, ref::split_for(policy.config, 1, 0));  // the single best slot
      run.step();
      run.check_scores();
    }
  }
}

TEST_CASE("H2O budgets as fractions of the prompt length") {
  auto g = triattn_test::rng(1207);
  std::uniform_real_distribution<double> ratio(0.05, 0.5);
  for (int i = 0; i < 24; ++i) {
    test_cache c = make_cache(g, triattn_test::all_layouts[i % 4], 1 << (i / 4 % 3));
    const triattn::h2o_config cfg = triattn::h2o_config::masking_reference(ratio(g));
    triattn::h2o policy(cfg);
    const std::int64_t prompt = std::uniform_int_distribution<std::int64_t>(1, 60)(g);
    policy.set_prompt_length(prompt);
    const std::int64_t budget = c.shape().capacity - 1;  // the fractions decide, the budget only caps
    INFO(c.shape().describe() << " ratio " << *cfg.heavy_ratio << " prompt " << prompt);
    attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(cfg, false, prompt), g);
    run.simulate(cfg.round.sched, budget, ref::split_for(cfg, budget, prompt), 8);
  }
}

TEST_CASE("H2O state moves with a compaction run by hand, and a missed after_compact is caught") {
  auto g = triattn_test::rng(1208);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = make_cache(g, layout, 2);
    for (auto& n : c.lengths) n = static_cast<std::int32_t>(c.shape().capacity) - 1;
    triattn::h2o policy;
    attention_run<triattn::h2o> run(c, policy, triattn_test::setup_for(policy.config, false, 0), g);
    run.step();  // every slot gets attention
    c.with_view([&](const auto& v) {
      const auto plan = policy.plan(v, 3);
      triattn::compact(v, plan, policy.state());
      // The freed slots still hold evicted tokens' sums: scoring refuses them.
      triattn_test::check_rejected(
          c, [&] { policy.plan(v, 3); }, {"triattn::h2o::plan", "has observed attention", "after_compact"});
      policy.after_compact(v, plan);
    });
    run.step();
    run.check_scores();  // the survivors' state moved with them; the new token's starts at zero
  }
}

TEST_CASE("H2O rejects a bad config") {
  const auto bad = [&](auto edit, const std::vector<std::string>& parts) {
    triattn::h2o_config cfg;
    edit(cfg);
    throws_with([&] { triattn::h2o p(cfg); }, parts);
  };
  bad([](auto& c) { c.heavy = -1; }, {"triattn::h2o", "heavy -1 must be >= 0"});
  bad([](auto& c) { c.recent = -3; }, {"recent -3 must be >= 0"});
  bad([](auto& c) { c.heavy_ratio = 1.5; }, {"heavy_ratio 1.5 must be in [0, 1]"});
  bad([](auto& c) { c.recent_ratio = -0.1; }, {"recent_ratio -0.1 must be in [0, 1]"});
  bad([](auto& c) { c.recent_ratio = std::numeric_limits<double>::quiet_NaN(); }, {"recent_ratio nan"});
  bad(
      [](auto& c) {
        c.heavy = 4;
        c.heavy_ratio = 0.2;
      },
      {"heavy 4 and heavy_ratio 0.2 are both set"});
  bad([](auto& c) { c.sinks = -2; }, {"sinks -2 must be >= 0"});
  bad([](auto& c) { c.scissorhands_window = 0; }, {"scissorhands_window 0 must be >= 1"});
  throws_with([] { triattn::h2o().set_prompt_length(-1); }, {"triattn::h2o::set_prompt_length", "-1"});
}

TEST_CASE("H2O rejects bad input and leaves the cache and its state untouched") {
  auto g = triattn_test::rng(1209);
  for (const auto layout : triattn_test::all_layouts) {
    for (int mode = 0; mode < 4; ++mode) {
      test_cache c = make_cache(g, layout, 2);
      for (auto& n : c.lengths) n = std::max<std::int32_t>(n, 2);
      const int L = c.shape().num_layers, Hq = c.shape().num_kv_heads * 2;
      const auto cap = static_cast<std::size_t>(c.shape().capacity);
      triattn::h2o policy;
      INFO(c.shape().describe() << " mode " << mode);
      c.with_view([&](const auto& v) {
        const std::vector<float> row(static_cast<std::size_t>(c.length(0, 0)), 0.25f);
        if (mode == 0) {  // no attach
          throws_with([&] { policy.observe(0, 0, 0, {}, row); }, {"triattn::h2o::observe", "attach"});
          triattn_test::check_rejected(c, [&] { policy.compress(v, 1); }, {"triattn::compress", "attach"});
          return;
        }
        policy.attach(v);
        policy.observe(0, 0, 0, {}, row);
        std::vector<float> out(static_cast<std::size_t>(L * c.shape().num_kv_heads) * cap);
        policy.score(v, out);
        const auto scores_before = out;
        if (mode == 1) {  // rows
          auto bad_row = row;
          throws_with([&] { policy.observe(-1, 0, 0, {}, row); }, {"triattn::h2o::observe", "layer -1"});
          throws_with([&] { policy.observe(L, 0, 0, {}, row); }, {"layer ", "is outside"});
          throws_with([&] { policy.observe(0, Hq, 0, {}, row); }, {"q_head ", "is outside"});
          throws_with([&] { policy.observe(0, -1, 0, {}, row); }, {"q_head -1"});
          throws_with([&] { policy.observe(0, 0, -4, {}, row); }, {"position -4"});
          throws_with([&] { policy.observe(0, 0, 0, {}, {}); }, {"probs holds 0 slots"});
          const std::vector<float> long_row(cap + 1, 0.1f);
          throws_with([&] { policy.observe(0, 0, 0, {}, long_row); }, {"probs holds", "capacity"});
          bad_row.back() = std::numeric_limits<float>::quiet_NaN();
          throws_with([&] { policy.observe(0, 1, 0, {}, bad_row); }, {"probability nan at slot"});
          bad_row.back() = -0.5f;
          throws_with([&] { policy.observe(0, 1, 0, {}, bad_row); }, {"probability -0.5"});
          bad_row.back() = std::numeric_limits<float>::infinity();
          throws_with([&] { policy.observe(0, 1, 0, {}, bad_row); }, {"probability inf"});
          policy.config.prompt = triattn::prompt_scoring::last_window;
          throws_with([&] { policy.observe(0, 0, 0, {}, row); }, {"last_window", "set_prompt_length"});
          policy.config.prompt = triattn::prompt_scoring::every_row;
        } else if (mode == 2) {  // rounds
          triattn_test::check_rejected(c, [&] { policy.compress(v, 0); }, {"budget 0 must be >= 1"});
          triattn_test::check_rejected(c, [&] { policy.plan(v, -2); }, {"triattn::h2o::plan", "budget -2"});
          throws_with([&] { policy.split(0); }, {"triattn::h2o::split", "budget 0"});
          std::vector<float> small(out.size() - 1);
          throws_with([&] { policy.score(v, small); }, {"triattn::h2o::score", "output holds"});
          policy.config.heavy = -5;  // edited after construction: checked at every call
          triattn_test::check_rejected(c, [&] { policy.compress(v, 1); }, {"heavy -5"});
          policy.config.heavy.reset();
          policy.config.heavy_ratio = 0.5;
          triattn_test::check_rejected(c, [&] { policy.compress(v, 1); },
                                       {"triattn::compress", "heavy_ratio 0.5", "round_context::prompt_length"});
          policy.config.heavy_ratio.reset();
        } else {  // the state and the view disagree
          c.length(0, 0) -= 1;  // the observed row is now longer than the cache
          triattn_test::check_rejected(c, [&] { policy.compress(v, 1); },
                                        {"triattn::compress", "layer 0 kv_head 0", "has observed attention"});
          c.length(0, 0) += 1;
          triattn_test::cache_shape other = c.shape();
          other.capacity += 1;
          test_cache d(other, g);
          d.with_view([&](const auto& w) {
            triattn_test::check_rejected(d, [&] { policy.compress(w, 1); }, {"capacity", "call attach(view)"});
          });
        }
        std::vector<float> now(out.size());
        policy.score(v, now);
        CHECK(now == scores_before);  // nothing rejected was recorded
      });
    }
  }
}
