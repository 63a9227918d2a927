// TriAttention's decisions against the oracles of support/triattention_reference.hpp (paper
// path, per-(layer, kv_head), union), through `compress` on dense and paged views, plus ties,
// protection, budgets, the round start and every error that must leave the cache untouched.
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
#include "support/reference.hpp"
#include "support/round_checks.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/triattention.hpp"

namespace {

using triattn::granularity;
using triattn_test::cache_layout;
using triattn_test::slot_contents;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;
using index_list = std::vector<std::int32_t>;

/// A random cache whose rows share slots as `gran` requires: every layer holds the slots of
/// layer 0 (per_kv_head), or every (layer, kv_head) those of (0, 0) (whole_sequence, "union").
test_cache make_cache(std::mt19937_64& g, cache_layout layout, int group, granularity gran,
                      triattn::dtype type = triattn::dtype::f32, int min_layers = 1, std::int32_t min_length = 1) {
  const int page = std::uniform_int_distribution<int>(1, 5)(g);
  const triattn_test::cache_shape s = triattn_test::random_shape(
      g, layout, type, page, group, {.min_layers = min_layers, .max_kv_heads = 3, .min_capacity = 6});
  test_cache c(s, g);
  std::uniform_int_distribution<std::int32_t> len(min_length, static_cast<std::int32_t>(s.capacity));
  for (auto& n : c.lengths) n = len(g);
  if (gran != granularity::per_layer)
    for (int l = 0; l < s.num_layers; ++l)
      for (int h = 0; h < s.num_kv_heads; ++h) {
        const int rh = gran == granularity::whole_sequence ? 0 : h;
        c.length(l, h) = c.length(0, rh);
        for (std::int64_t i = 0; i < s.capacity; ++i) c.position(l, h, i) = c.position(0, rh, i);
      }
  return c;
}

std::int64_t longest_row(const test_cache& c) { return *std::max_element(c.lengths.begin(), c.lengths.end()); }

/// The rows of a keep plan, [l * kv_heads + h].
std::vector<index_list> plan_rows(const triattn::keep_plan& p) {
  std::vector<index_list> rows;
  for (int l = 0; l < p.num_layers; ++l)
    for (int h = 0; h < p.num_kv_heads; ++h) rows.emplace_back(p.row(l, h).begin(), p.row(l, h).end());
  return rows;
}

/// 1 + the largest position held.
std::int64_t derived_round_start(test_cache& c) {
  std::int64_t last = -1;
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.shape().num_kv_heads; ++h)
      for (std::int32_t s = 0; s < c.length(l, h); ++s) last = std::max<std::int64_t>(last, c.position(l, h, s));
  return last + 1;
}

std::vector<std::int32_t> row_positions(test_cache& c, int l, int h) {
  std::vector<std::int32_t> p;
  for (std::int32_t s = 0; s < c.length(l, h); ++s) p.push_back(c.position(l, h, s));
  return p;
}

/// The oracle's keep set per (layer, kv_head) [l * kv_heads + h], and the smallest margin.
struct expectation {
  std::vector<index_list> keep;
  double margin = std::numeric_limits<double>::infinity();
  double scale = 0.0;  ///< largest |oracle score|, for margins of raw (not normalised) scores
};

/// Shared decisions under `whole_sequence` are the union selection: max reduction over rows
/// that are GQA-max reduced (the seed preset), which is what `ref::tri_select_union` computes.
expectation expect(test_cache& c, const triattn::query_stats& stats, std::int64_t r,
                   const triattn::triattention_config& cfg, std::int64_t budget, std::int64_t prompt_length = 0) {
  ref::tri_score_options so = ref::tri_options_for(c);
  so.offset_max = cfg.offset_max;
  so.use_max = cfg.aggregation == triattn::offset_aggregation::max;
  ref::tri_select_options o;
  o.group_max = cfg.gqa_reduction == triattn::triattention_gqa_reduction::max;
  o.normalize = cfg.normalize;
  o.window = cfg.window;
  o.prompt_length = cfg.round.protect_prompt ? prompt_length : 0;
  const auto raw = ref::tri_cache_scores(c, stats, r, so);
  const int L = c.shape().num_layers, H = c.shape().num_kv_heads, G = c.shape().group;
  expectation e;
  for (const auto& layer : raw)
    for (const auto& row : layer)
      for (const double x : row) e.scale = std::max(e.scale, std::abs(x));
  const auto add = [&](const ref::tri_keep& k) {
    e.keep.push_back(k.keep);
    e.margin = std::min(e.margin, k.margin);
  };
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      switch (cfg.round.grain) {
        case granularity::per_kv_head:
          add(ref::tri_select_per_kv_head(raw, h, G, row_positions(c, 0, h), budget, o));
          break;
        case granularity::per_layer:
          add(ref::tri_select_per_layer(raw, l, h, G, row_positions(c, l, h), budget, o));
          break;
        case granularity::whole_sequence:
          REQUIRE(cfg.round.reduction == triattn::row_reduction::max);  // the union selection (see above)
          REQUIRE(cfg.gqa_reduction == triattn::triattention_gqa_reduction::max);
          add(ref::tri_select_union(raw, row_positions(c, 0, 0), budget, o));
          break;
      }
    }
  return e;
}

/// Whether the oracle's decision is far enough from a near-tie for an fp32 scorer to agree (its
/// raw scores are within ~1e-6 of a row's largest |score|, so z-scores within ~1e-5).
bool decisive(const expectation& e, bool normalized) { return e.margin > (normalized ? 2e-4 : 2e-5 * e.scale); }

/// A random decision setup for granularity `gran`: protection, reduction, round start, budget.
struct trial {
  triattn::triattention_config cfg;
  std::int64_t budget = 1;
  std::optional<std::int64_t> round_start;  ///< given as round_context::position, else derived
  std::int64_t prompt_length = 0;           ///< round_context::prompt_length
  triattn::round_context context() const { return {round_start.value_or(-1), prompt_length}; }
};

/// `cfg` with the shared granularity `gran`: union selection (max over GQA-max rows) for
/// `whole_sequence`, the paper's mean over layers for `per_kv_head`.
void set_granularity(triattn::triattention_config& cfg, granularity gran) {
  cfg.round.grain = gran;
  if (gran == granularity::whole_sequence) {
    cfg.round.reduction = triattn::row_reduction::max;
    cfg.gqa_reduction = triattn::triattention_gqa_reduction::max;
  }
}

trial random_trial(std::mt19937_64& g, test_cache& c, granularity gran) {
  trial t;
  std::uniform_int_distribution<int> coin(0, 1), window(0, 4), offsets(0, 2);
  t.cfg.gqa_reduction = coin(g) ? triattn::triattention_gqa_reduction::max : triattn::triattention_gqa_reduction::mean;
  set_granularity(t.cfg, gran);
  t.cfg.window = window(g) < 2 ? 0 : window(g);
  const std::int64_t offset_max[] = {16, 128, 65536};
  t.cfg.offset_max = offset_max[offsets(g)];
  t.cfg.round.protect_prompt = coin(g) != 0;
  if (coin(g)) {  // the prompt ends at the position of a random slot of (0, 0)
    std::uniform_int_distribution<std::int32_t> slot(0, c.length(0, 0) - 1);
    t.prompt_length = c.position(0, 0, slot(g));
  }
  std::uniform_int_distribution<std::int64_t> budget(1, longest_row(c) + 2), later(1, 5000);
  t.budget = budget(g);
  if (coin(g)) t.round_start = derived_round_start(c) + later(g) - 1;
  return t;
}

/// Runs random trials of `gran` on every layout, each through `compress`, against the oracle.
void check_random_trials(granularity gran, std::uint64_t salt, bool seed_preset = false) {
  auto g = triattn_test::rng(salt);
  int ran = 0, skipped = 0;
  for (int i = 0; i < 64; ++i) {
    const auto layout = triattn_test::all_layouts[i % 4];
    const int group = 1 << (i / 4 % 3);
    test_cache c = make_cache(g, layout, group, gran);
    trial t = random_trial(g, c, gran);
    if (seed_preset) t.cfg = triattn::triattention_config::seed(!t.cfg.round.protect_prompt);
    const auto stats = ref::tri_random_stats(g, c.geometry());
    const std::int64_t r = t.round_start.value_or(derived_round_start(c));
    const expectation e = expect(c, stats, r, t.cfg, t.budget, t.prompt_length);
    INFO(c.shape().describe() << " budget " << t.budget << " r " << r << " window " << t.cfg.window << " prompt "
                              << t.cfg.round.protect_prompt << "/" << t.prompt_length << " normalize " << t.cfg.normalize
                              << " offset_max " << t.cfg.offset_max << " gqa_max "
                              << (t.cfg.gqa_reduction == triattn::triattention_gqa_reduction::max));
    if (!decisive(e, t.cfg.normalize)) {
      ++skipped;
      continue;
    }
    ++ran;
    triattn::triattention policy(stats, t.cfg);
    triattn_test::check_round(c, e.keep, [&] {
      return c.with_view([&](const auto& v) { return policy.compress(v, t.budget, t.context()); }).freed_pages;
    });
  }
  INFO("trials skipped for near-ties: " << skipped);
  CHECK(skipped <= 16);
  CHECK(ran > 0);
}

}  // namespace

TEST_CASE("TriAttention presets") {
  const auto paper = triattn::triattention_config::paper();
  CHECK(paper.offset_max == 65536);
  CHECK(paper.aggregation == triattn::offset_aggregation::mean);
  CHECK(paper.round.grain == granularity::per_kv_head);
  CHECK(paper.round.reduction == triattn::row_reduction::mean);
  CHECK(paper.round.budget == triattn::budget_mode::with_prompt);
  CHECK(paper.gqa_reduction == triattn::triattention_gqa_reduction::max);
  CHECK(paper.normalize);
  CHECK(paper.window == 0);
  CHECK(paper.round.protect_prompt);
  CHECK(paper.round.sched.kind == triattn::trigger::slack);
  CHECK(paper.round.sched.slack == 128);
  const auto seed = triattn::triattention_config::seed();
  CHECK(seed.round.grain == granularity::whole_sequence);
  CHECK(seed.round.reduction == triattn::row_reduction::max);
  CHECK(seed.gqa_reduction == triattn::triattention_gqa_reduction::max);
  CHECK_FALSE(seed.normalize);
  CHECK(seed.round.protect_prompt);
  CHECK(seed.round.sched.kind == triattn::trigger::aligned);
  CHECK(seed.round.sched.divide_length == 128);
  CHECK_FALSE(triattn::triattention_config::seed(true).round.protect_prompt);
}

TEST_CASE("TriAttention paper path matches the oracle on every layout") {
  check_random_trials(granularity::per_kv_head, 911);
}

TEST_CASE("TriAttention per-(layer, kv_head) decisions match the oracle") {
  check_random_trials(granularity::per_layer, 912);
}

TEST_CASE("TriAttention union selection matches the oracle") {
  SECTION("z-scored rows") { check_random_trials(granularity::whole_sequence, 913); }
  SECTION("seed preset (raw rows)") { check_random_trials(granularity::whole_sequence, 914, true); }
}

TEST_CASE("TriAttention ties go to the lower slot") {
  auto g = triattn_test::rng(915);
  for (const auto gran : {granularity::per_kv_head, granularity::per_layer,
                          granularity::whole_sequence}) {
    for (int i = 0; i < 12; ++i) {
      test_cache c = make_cache(g, triattn_test::all_layouts[i % 4], 1 << (i % 3), gran);
      const int L = c.shape().num_layers, H = c.shape().num_kv_heads;
      // Duplicated slots (key and position) score bit-identically in the library and the oracle
      // (the oracle's un-rotation would otherwise differ in the last bits between positions).
      std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(c.shape().capacity) - 1);
      const bool all_equal = i % 2 == 0;
      for (int d = 0; d < (all_equal ? 1 : 6); ++d) {
        const std::int32_t from = pick(g);
        for (std::int32_t to = 0; to < static_cast<std::int32_t>(c.shape().capacity); ++to) {
          if (!all_equal && to != pick(g)) continue;
          for (int l = 0; l < L; ++l)
            for (int h = 0; h < H; ++h) {
              c.store_key(l, h, to, c.key(l, h, from));
              c.position(l, h, to) = c.position(l, h, from);
            }
        }
      }
      const auto stats = ref::tri_random_stats(g, c.geometry());
      triattn::triattention_config cfg;
      set_granularity(cfg, gran);
      std::uniform_int_distribution<std::int64_t> budget_of(1, longest_row(c));
      const std::int64_t budget = budget_of(g);
      const expectation e = expect(c, stats, derived_round_start(c), cfg, budget);
      INFO(c.shape().describe() << " budget " << budget << (all_equal ? " all keys equal" : " duplicated keys"));
      if (!decisive(e, true)) continue;
      if (all_equal)
        for (const auto& k : e.keep)
          for (std::size_t j = 0; j < k.size(); ++j) REQUIRE(k[j] == static_cast<std::int32_t>(j));
      triattn::triattention policy(stats, cfg);
      triattn_test::check_round(c, e.keep,
                  [&] { return c.with_view([&](const auto& v) { return policy.compress(v, budget); }).freed_pages; });
    }
  }
}

TEST_CASE("TriAttention budgets: >= length is a no-op, 1 keeps the best or the oldest protected slot") {
  auto g = triattn_test::rng(916);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = make_cache(g, layout, 2, granularity::per_kv_head, triattn::dtype::f16);
    const auto stats = ref::tri_random_stats(g, c.geometry());
    triattn::triattention policy(stats);
    const auto before = c.snapshot();
    const auto freed = c.with_view([&](const auto& v) { return policy.compress(v, longest_row(c)); });
    CHECK(c.snapshot() == before);
    CHECK(freed.freed_pages.empty());

    for (const std::int64_t window : {0, 3}) {
      test_cache d = make_cache(g, layout, 2, granularity::per_kv_head, triattn::dtype::bf16);
      triattn::triattention_config cfg;
      cfg.window = window;
      triattn::triattention p(ref::tri_random_stats(g, d.geometry()), cfg);
      const expectation e = expect(d, p.stats(), derived_round_start(d), cfg, 1);
      if (!decisive(e, true)) continue;
      for (std::size_t r = 0; r < e.keep.size(); ++r) {
        REQUIRE(e.keep[r].size() == 1);
        // with a window, its slots are protected and a budget of 1 keeps the lowest of them
        if (window > 0) CHECK(e.keep[r][0] == std::max<std::int64_t>(0, d.lengths[r] - window));
      }
      triattn_test::check_round(d, e.keep, [&] { return d.with_view([&](const auto& v) { return p.compress(v, 1); }).freed_pages; });
    }
  }
}

TEST_CASE("TriAttention round start: round_context::position, derived, and fed by maybe_compress") {
  auto g = triattn_test::rng(917);
  int differing = 0;
  for (int i = 0; i < 24; ++i) {
    test_cache c = make_cache(g, triattn_test::all_layouts[i % 4], 2, granularity::per_layer);
    const auto stats = ref::tri_random_stats(g, c.geometry());
    triattn::triattention_config cfg;
    cfg.round.grain = granularity::per_layer;  // per-row decisions react most to r
    cfg.round.sched = triattn::schedule::every_step();
    cfg.offset_max = 16;
    const std::int64_t derived = derived_round_start(c), later = derived + 37 + i * 101;
    const std::int64_t budget = std::max<std::int64_t>(1, longest_row(c) / 2);
    const expectation at_derived = expect(c, stats, derived, cfg, budget);
    const expectation at_later = expect(c, stats, later, cfg, budget);
    if (!decisive(at_derived, true) || !decisive(at_later, true)) continue;
    differing += at_derived.keep != at_later.keep;

    triattn::triattention policy(stats, cfg);
    const auto plan = [&](triattn::round_context ctx) {
      return plan_rows(c.with_view([&](const auto& v) { return policy.plan(v, budget, ctx); }));
    };
    CHECK(plan({}) == at_derived.keep);
    CHECK(plan({.position = derived}) == at_derived.keep);
    CHECK(plan({.position = later}) == at_later.keep);
    CHECK(plan({}) == at_derived.keep);  // the policy keeps no round start between calls

    // not the position of a next token
    triattn_test::check_rejected(
        c, [&] { c.with_view([&](const auto& v) { policy.compress(v, budget, {.position = derived - 1}); }); },
        {"triattn::compress", "round start " + std::to_string(derived - 1)});
    triattn_test::check_rejected(c, [&] { c.with_view([&](const auto& v) { (void)policy.plan(v, budget, {.position = derived - 1}); }); },
                                 {"triattn::triattention::plan", "round start " + std::to_string(derived - 1)});

    // maybe_compress hands its position to the round (the policy's schedule: every_step)
    triattn_test::check_round(c, at_later.keep, [&] {
      std::vector<std::int32_t> freed;
      const bool due = longest_row(c) > budget;
      const bool ran = c.with_view(
          [&](const auto& v) { return triattn::maybe_compress(policy, v, budget, {.position = later}, &freed); });
      CHECK(ran == due);
      return freed;
    });
  }
  CHECK(differing > 0);
}

namespace {
/// A cache with >= 2 layers and >= 4 slots in every row, all rows holding the same slots.
test_cache error_cache(std::mt19937_64& g, cache_layout layout) {
  return make_cache(g, layout, 2, granularity::whole_sequence, triattn::dtype::f32, 2, 4);
}

/// Compresses `c` to 2 tokens with a fresh policy.
void compress_with(test_cache& c, const triattn::query_stats& stats, const triattn::triattention_config& cfg) {
  triattn::triattention p(stats, cfg);
  c.with_view([&](const auto& v) { p.compress(v, 2); });
}

std::string row_name(int l, int h) { return "layer " + std::to_string(l) + " kv_head " + std::to_string(h); }
}  // namespace

TEST_CASE("TriAttention rejects rows holding different slots under a shared granularity, cache untouched") {
  auto g = triattn_test::rng(918);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = error_cache(g, layout);
    const auto stats = ref::tri_random_stats(g, c.geometry());
    const int l = c.shape().num_layers - 1, h = c.shape().num_kv_heads - 1;
    const auto paper = triattn::triattention_config::paper();
    c.position(l, h, 2) += 1000;
    triattn_test::check_rejected(c, [&] { compress_with(c, stats, paper); },
                   {"triattn::compress", row_name(l, h) + " slot 2", "per_kv_head", "granularity"});
    c.position(l, h, 2) -= 1000;
    c.length(l, h) -= 1;
    triattn_test::check_rejected(c, [&] { compress_with(c, stats, paper); },
                   {"triattn::compress", row_name(l, h), "per_kv_head", "granularity"});
    triattn_test::check_rejected(c, [&] { compress_with(c, stats, triattn::triattention_config::seed()); },
                                 {"triattn::compress", "union granularity"});
    // per-(layer, kv_head) decisions take rows of any length
    triattn::triattention_config per_layer;
    per_layer.round.grain = granularity::per_layer;
    compress_with(c, stats, per_layer);
    CHECK(c.length(l, h) == 2);
  }
}

TEST_CASE("TriAttention rejects non-finite keys, naming the slot, cache untouched") {
  auto g = triattn_test::rng(919);
  for (const auto layout : triattn_test::all_layouts) {
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()}) {
      test_cache c = error_cache(g, layout);
      const auto stats = ref::tri_random_stats(g, c.geometry());
      const int l = c.shape().num_layers - 1, h = c.shape().num_kv_heads - 1;
      auto k = c.key(l, h, 3);
      k[0] = bad;
      c.store_key(l, h, 3, k);
      triattn_test::check_rejected(c, [&] { compress_with(c, stats, triattn::triattention_config::paper()); },
                     {"triattn::compress", row_name(l, h) + " slot 3", "finite"});
    }
  }
}

TEST_CASE("TriAttention rejects stats that do not describe the model, naming the field, cache untouched") {
  auto g = triattn_test::rng(920);
  for (const auto layout : triattn_test::all_layouts) {
    test_cache c = error_cache(g, layout);
    const auto stats = ref::tri_random_stats(g, c.geometry());
    const auto mismatch = [&](const triattn::query_stats& other, const std::string& field) {
      INFO(field);
      triattn_test::check_rejected(c, [&] { compress_with(c, other, triattn::triattention_config::paper()); },
                     {"triattn::compress", field});
    };
    const auto stats_for = [&](auto&& change) {
      auto geo = c.geometry();
      change(geo);
      return ref::tri_random_stats(g, geo);
    };
    mismatch(stats_for([](auto& geo) { geo.num_layers += 1; }), "num_layers");
    mismatch(stats_for([](auto& geo) { geo.num_q_heads *= 2; }), "num_q_heads");
    mismatch(stats_for([](auto& geo) { geo.num_kv_heads = geo.num_q_heads; }), "num_kv_heads");  // group 2: differs
    mismatch(stats_for([](auto& geo) { geo.head_dim += 2; }), "head_dim");
    auto other = stats;
    other.inv_freq[0] *= 1.001;
    mismatch(other, "inv_freq");
    other = stats;
    other.style = triattn::rope_style::interleaved;
    mismatch(other, "rope_style");
    other = stats;
    other.attention_scale = 2.0;
    mismatch(other, "attention_scale");
  }
}

TEST_CASE("TriAttention rejects a bad budget, configuration or position") {
  auto g = triattn_test::rng(921);
  test_cache c = error_cache(g, cache_layout::dense_nhd);
  const auto stats = ref::tri_random_stats(g, c.geometry());
  triattn_test::check_rejected(c, [&] { triattn::triattention(stats).plan(c.dense_view(), 0); },
                 {"triattn::triattention::plan", "budget 0"});
  triattn::triattention_config cfg;
  cfg.offset_max = 0;
  CHECK_THROWS_WITH(triattn::triattention(stats, cfg),
                    Catch::Contains("triattn::triattention") && Catch::Contains("offset_max 0"));
  triattn::triattention p(stats);
  p.config.window = -1;
  triattn_test::check_rejected(c, [&] { p.plan(c.dense_view(), 2); }, {"triattn::triattention::plan", "window -1"});
  p.config.window = 0;
  triattn_test::check_rejected(c, [&] { p.plan(c.dense_view(), 2, {.prompt_length = -3}); },
                               {"triattn::triattention::plan", "prompt_length -3"});
  // a given round start must be above every cached position (0 is below the cache's)
  triattn_test::check_rejected(c, [&] { p.plan(c.dense_view(), 2, {.position = 0}); },
                               {"triattn::triattention::plan", "round start 0", "largest cached position"});
}
