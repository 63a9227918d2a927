// VATP against the oracles of support/baselines_reference.hpp: the H2O score times the value
// L1 norm decoded from f32, f16 and bf16 caches, the always-kept sinks, the reference's H2O and
// Scissorhands settings, and decisions through `compress` on dense and paged views round after
// round; plus ties, edge budgets and the errors that must leave the cache untouched.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/baselines_reference.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/views.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/vatp.hpp"

namespace {

using triattn::gqa_aggregation;
using triattn_test::attention_run;
using triattn_test::cache_layout;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;

using triattn_test::all_aggregations;
using triattn_test::random_budget;
using triattn_test::throws_with;

/// A random cache: 1-3 layers, 1-3 KV heads, capacity 8-24, random lengths and positions.
test_cache make_cache(std::mt19937_64& g, cache_layout layout, int group, triattn::dtype type) {
  const int page = std::uniform_int_distribution<int>(1, 5)(g);
  return test_cache(
      triattn_test::random_shape(g, layout, type, page, group,
                                 {.max_kv_heads = 3, .max_half_dim = 4, .min_capacity = 8, .max_capacity = 24}),
      g);
}

/// A random VATP config: sinks (4 by default), split, aggregation, normalisation and schedule.
triattn::vatp_config random_config(std::mt19937_64& g, std::int64_t capacity) {
  triattn::vatp_config cfg;
  std::uniform_int_distribution<int> coin(0, 1), agg(0, 2), sinks(0, 6), part(0, 3);
  std::uniform_int_distribution<std::int64_t> count(0, capacity);
  if (coin(g)) cfg.sinks = sinks(g);
  if (part(g) == 0) cfg.heavy = count(g);
  if (part(g) == 0) cfg.recent = count(g);
  cfg.gqa = all_aggregations[agg(g)];
  cfg.normalize = coin(g) != 0;
  cfg.round.sched = coin(g) ? triattn::schedule::every_step() : triattn::schedule::aligned_to(3);
  return cfg;
}

}  // namespace

TEST_CASE("VATP defaults, reference settings and budget splits") {
  const triattn::vatp_config d;
  CHECK(d.sinks == 4);
  CHECK_FALSE(d.heavy);
  CHECK_FALSE(d.recent);
  CHECK(d.gqa == gqa_aggregation::mean);
  CHECK_FALSE(d.normalize);
  CHECK(d.prompt == triattn::prompt_scoring::every_row);
  CHECK(d.round.sched.kind == triattn::trigger::every_step);

  triattn::vatp p;
  for (std::int64_t b = 1; b <= 40; ++b) {  // cli.md: 4 sinks, recent = B/2, heavy the rest
    const auto s = p.split(b);
    INFO("budget " << b);
    CHECK(s.recent == b / 2);
    CHECK(s.heavy == b - b / 2);
    CHECK(s.sinks == std::min<std::int64_t>(4, s.heavy));
    CHECK(s.total() == b);
  }

  const auto h = triattn::vatp_config::h2o_setting();
  CHECK(h.heavy_ratio == 0.25);
  CHECK(h.recent_ratio == 0.25);
  CHECK(h.sinks == 20);
  CHECK(h.prompt == triattn::prompt_scoring::every_row);
  triattn::vatp hp(h);
  CHECK(hp.split(1 << 20, 1000).heavy == 250);
  CHECK(hp.split(1 << 20, 1000).recent == 250);
  CHECK(hp.split(1 << 20, 1000).sinks == 20);

  const auto s = triattn::vatp_config::scissorhands_setting(8);
  CHECK(s.recent == 10);
  CHECK_FALSE(s.heavy);
  CHECK(s.sinks == 8);
  CHECK(s.prompt == triattn::prompt_scoring::last_window);
  CHECK(s.scissorhands_window == 400);
  // The reference's budget 2·int(r·L0): 10 recent, the rest heavy (sinks included).
  CHECK(triattn::vatp(s).split(500).heavy == 490);
}

TEST_CASE("VATP scores are the H2O score times the value L1 norm, for every dtype") {
  auto g = triattn_test::rng(1301);
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      for (const int group : {1, 2, 4}) {
        test_cache c = make_cache(g, layout, group, type);
        triattn::vatp_config cfg;
        cfg.gqa = all_aggregations[std::uniform_int_distribution<int>(0, 2)(g)];
        cfg.normalize = std::uniform_int_distribution<int>(0, 1)(g) != 0;
        triattn::vatp policy(cfg);
        INFO(c.shape().describe() << " agg " << triattn::gqa_aggregation_name(cfg.gqa) << " normalize "
                                  << cfg.normalize);
        attention_run<triattn::vatp> run(c, policy, triattn_test::setup_for(cfg, true, 0), g);
        run.prefill_rows();
        run.check_scores();
        run.step();
        run.check_scores();
      }
    }
  }
}

TEST_CASE("VATP decisions through compress match the oracle round after round on every layout") {
  auto g = triattn_test::rng(1302);
  int decisions = 0, undecided = 0;
  for (int i = 0; i < 144; ++i) {
    const auto layout = triattn_test::all_layouts[i % 4];
    const auto type = triattn_test::all_dtypes[i / 4 % 3];
    const int group = 1 << (i / 12 % 3);
    test_cache c = make_cache(g, layout, group, type);
    const triattn::vatp_config cfg = random_config(g, c.shape().capacity);
    const std::int64_t budget = random_budget(g, c);
    triattn_test::tally_decisions<triattn::vatp>(c, cfg, budget, true, g, decisions, undecided);
  }
  INFO("(layer, kv_head) decisions " << decisions << ", within a near-tie " << undecided);
  CHECK(decisions >= 400);
  CHECK(undecided * 20 <= decisions);
}

TEST_CASE("VATP reference settings: Scissorhands initial score and prompt-fraction budgets") {
  auto g = triattn_test::rng(1303);
  std::uniform_int_distribution<std::int64_t> window(1, 160), sinks(0, 6);
  std::uniform_real_distribution<double> ratio(0.05, 0.5);
  for (int i = 0; i < 24; ++i) {
    const auto layout = triattn_test::all_layouts[i % 4];
    test_cache c = make_cache(g, layout, 1 << (i / 4 % 3), triattn_test::all_dtypes[i % 3]);
    const bool scissorhands = i % 2 == 0;
    triattn::vatp_config cfg = scissorhands ? triattn::vatp_config::scissorhands_setting(sinks(g))
                                            : triattn::vatp_config::h2o_setting(ratio(g), sinks(g));
    if (scissorhands) cfg.scissorhands_window = window(g);  // shorter than the prompt, or longer
    triattn::vatp policy(cfg);
    for (auto& n : c.lengths) n = std::max<std::int32_t>(n, 1);  // a prompt of at least a token
    const std::int32_t prompt = triattn_test::cached_prompt_length(c);  // every cached token is the prompt's
    policy.set_prompt_length(prompt);
    const std::int64_t budget = random_budget(g, c);
    INFO(c.shape().describe() << (scissorhands ? " scissorhands window " : " h2o setting ")
                              << cfg.scissorhands_window << " sinks " << cfg.sinks << " prompt " << prompt
                              << " budget " << budget);
    attention_run<triattn::vatp> run(c, policy, triattn_test::setup_for(cfg, true, prompt), g);
    run.causal_prefill();
    run.decode(cfg.round.sched, budget, ref::split_for(cfg, budget, prompt), 8);
  }
}

TEST_CASE("VATP keeps the sinks whatever their value norms") {
  auto g = triattn_test::rng(1304);
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      test_cache c = make_cache(g, layout, 2, type);
      for (auto& n : c.lengths) n = static_cast<std::int32_t>(c.shape().capacity) - 1;
      // Sinks with near-zero values get far the lowest scores.
      for (int l = 0; l < c.shape().num_layers; ++l)
        for (int h = 0; h < c.shape().num_kv_heads; ++h)
          for (std::int64_t s = 0; s < 4; ++s)
            for (int d = 0; d < c.shape().head_dim; ++d)
              ref::store(c.value_row(l, h, s), type, static_cast<std::size_t>(d), 1e-3 * (d + 1));
      std::vector<std::vector<std::int32_t>> sink_positions;
      for (int l = 0; l < c.shape().num_layers; ++l)
        for (int h = 0; h < c.shape().num_kv_heads; ++h)
          sink_positions.emplace_back(c.positions.begin() + (l * c.shape().num_kv_heads + h) * c.shape().capacity,
                                      c.positions.begin() + (l * c.shape().num_kv_heads + h) * c.shape().capacity + 4);
      triattn::vatp policy;
      attention_run<triattn::vatp> run(c, policy, triattn_test::setup_for(policy.config, true, 0), g);
      run.prefill_rows();
      const std::int64_t budget = 6;  // recent 3, heavy 3: the first 3 sinks
      run.compress_and_check(budget, ref::split_for(policy.config, budget, 0));
      INFO(c.shape().describe());
      for (int l = 0; l < c.shape().num_layers; ++l)
        for (int h = 0; h < c.shape().num_kv_heads; ++h)
          for (std::int64_t s = 0; s < 3; ++s)
            CHECK(c.position(l, h, s) == sink_positions[static_cast<std::size_t>(l * c.shape().num_kv_heads + h)][s]);
      run.step();  // a second round, on the moved state
      run.compress_and_check(budget, ref::split_for(policy.config, budget, 0));
      for (int l = 0; l < c.shape().num_layers; ++l)
        for (int h = 0; h < c.shape().num_kv_heads; ++h)
          for (std::int64_t s = 0; s < 3; ++s)
            CHECK(c.position(l, h, s) == sink_positions[static_cast<std::size_t>(l * c.shape().num_kv_heads + h)][s]);
    }
  }
}

TEST_CASE("VATP ties go to the lower slot") {
  auto g = triattn_test::rng(1305);
  for (int i = 0; i < 36; ++i) {
    test_cache c = make_cache(g, triattn_test::all_layouts[i % 4], 1 << (i / 4 % 3), triattn_test::all_dtypes[i % 3]);
    // Every value row of a (layer, kv_head) equal: equal attention gives bit-equal scores.
    for (int l = 0; l < c.shape().num_layers; ++l)
      for (int h = 0; h < c.shape().num_kv_heads; ++h)
        for (std::int64_t s = 1; s < c.shape().capacity; ++s) {
          const auto v0 = c.value_bytes(l, h, 0);
          std::copy(v0.begin(), v0.end(), c.value_row(l, h, s));
        }
    triattn::vatp_config cfg;
    cfg.gqa = all_aggregations[i % 3];
    cfg.sinks = i % 5;
    triattn::vatp policy(cfg);
    const std::int64_t budget = random_budget(g, c);
    INFO(c.shape().describe() << " budget " << budget << " sinks " << cfg.sinks);
    auto setup = triattn_test::setup_for(cfg, true, 0);
    setup.exact = true;  // one norm per row times dyadic sums: fp32 keeps the oracle's order and ties
    attention_run<triattn::vatp> run(c, policy, setup, g);
    run.prefill_rows(1);  // every probability 1/256
    const std::int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    if (longest > budget) run.compress_and_check(budget, ref::split_for(cfg, budget, 0));
  }
}

TEST_CASE("VATP edge budgets: no-op at or above every length, the first sink at budget 1") {
  auto g = triattn_test::rng(1306);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      test_cache c = make_cache(g, layout, group, triattn::dtype::bf16);
      triattn::vatp policy;
      attention_run<triattn::vatp> run(c, policy, triattn_test::setup_for(policy.config, true, 0), g);
      run.prefill_rows();
      run.step();
      INFO(c.shape().describe());
      const std::int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
      const auto before = c.snapshot();
      for (const std::int64_t budget : {longest, std::numeric_limits<std::int64_t>::max()}) {
        c.with_view([&](const auto& v) { policy.compress(v, budget); });
        CHECK(c.snapshot() == before);
      }
      const auto first = c.positions;
      run.compress_and_check(1, ref::split_for(policy.config, 1, 0));
      for (int l = 0; l < c.shape().num_layers; ++l)
        for (int h = 0; h < c.shape().num_kv_heads; ++h)
          if (c.length(l, h) == 1)
            CHECK(c.position(l, h, 0) == first[static_cast<std::size_t>(l * c.shape().num_kv_heads + h) *
                                               static_cast<std::size_t>(c.shape().capacity)]);
      run.step();
      run.check_scores();
    }
  }
}

TEST_CASE("VATP rejects bad values and config, leaving the cache untouched") {
  auto g = triattn_test::rng(1307);
  throws_with(
      [] {
        triattn::vatp_config cfg;
        cfg.sinks = -1;
        triattn::vatp p(cfg);
      },
      {"triattn::vatp", "sinks -1 must be >= 0"});
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      test_cache c = make_cache(g, layout, 2, type);
      for (auto& n : c.lengths) n = std::max<std::int32_t>(n, 3);
      triattn::vatp policy;
      attention_run<triattn::vatp> run(c, policy, triattn_test::setup_for(policy.config, true, 0), g);
      run.step();
      INFO(c.shape().describe());
      const double bad = type == triattn::dtype::f32 && c.shape().num_layers > 1
                             ? std::numeric_limits<double>::infinity()
                             : std::numeric_limits<double>::quiet_NaN();
      const int l = c.shape().num_layers - 1;
      ref::store(c.value_row(l, 0, 1), type, 0, bad);
      c.with_view([&](const auto& v) {
        // Without sinks, budget 1 is decided by score (with VATP's 4 sinks, protection alone
        // would settle it, and the round pipeline never scores a settled decision).
        policy.config.sinks = 0;
        triattn_test::check_rejected(
            c, [&] { policy.compress(v, 1); },
            {"triattn::compress", "value of layer " + std::to_string(l) + " kv_head 0 slot 1", "must be finite"});
        std::vector<float> out(c.lengths.size() * static_cast<std::size_t>(c.shape().capacity));
        policy.config.sinks = 4;
        throws_with([&] { policy.score(v, out); }, {"triattn::vatp::score", "must be finite"});
        triattn_test::check_rejected(c, [&] { policy.plan(v, 0); }, {"triattn::vatp::plan", "budget 0"});
        throws_with([&] { policy.observe(0, 0, 0, {}, std::vector<float>{0.5f, -1.0f}); },
                    {"triattn::vatp::observe", "probability -1"});
        policy.config.prompt = triattn::prompt_scoring::last_window;
        throws_with([&] { policy.observe(0, 0, 0, {}, std::vector<float>{0.5f}); },
                    {"triattn::vatp::observe", "set_prompt_length"});
      });
    }
  }
}
