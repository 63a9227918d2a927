// Bad input: every host API throws triattn::error naming itself and the bad value, and a
// rejected call leaves the cache (K, V, positions, lengths) byte-identical.
#include <catch2/catch.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/streaming_llm.hpp"

namespace {

using Catch::Matchers::Contains;
using triattn_test::cache_layout;
using triattn_test::cache_shape;
using triattn_test::test_cache;
using index_list = std::vector<std::int32_t>;
using needles = std::vector<std::string>;

constexpr std::int64_t budget = 4;

/// A cache in which a compression to `budget` has work to do in every (layer, kv_head), so a
/// call that moved anything before validating would show in the snapshot.
test_cache full_cache(std::mt19937_64& g, cache_layout layout, int head_dim = 8) {
  std::uniform_int_distribution<int> type(0, 2);
  cache_shape s;
  s.num_layers = 2;
  s.num_kv_heads = 2;
  s.group = 2;
  s.head_dim = head_dim;
  s.type = triattn_test::all_dtypes[type(g)];
  s.capacity = 12;
  s.layout = layout;
  s.page_size = 3;
  test_cache c(s, g);
  std::uniform_int_distribution<std::int32_t> len(8, 12);
  for (auto& n : c.lengths) n = len(g);
  return c;
}

/// Keeps slots 0, 2, 4, ... of every row except the last, which gets `last` (a valid plan
/// everywhere but at the end, so that a late check would come after moved rows).
triattn::keep_plan plan_with_last_row(test_cache& c, const index_list& last) {
  const auto& s = c.shape();
  triattn::keep_plan plan(s.num_layers, s.num_kv_heads);
  for (int r = 0; r < s.num_layers * s.num_kv_heads - 1; ++r) plan.push_row(index_list{0, 2, 4});
  plan.push_row(last);
  return plan;
}

/// `call` must throw triattn::error whose message holds every needle, and change nothing.
void require_rejected(test_cache& c, const std::function<void()>& call, const needles& want) {
  const auto before = c.snapshot();
  std::string message;
  try {
    call();
  } catch (const triattn::error& e) {
    message = e.what();
  }
  INFO("message: \"" << message << "\"");
  REQUIRE_FALSE(message.empty());  // it threw triattn::error
  for (const auto& n : want) CHECK_THAT(message, Contains(n));
  CHECK(c.snapshot() == before);
}

std::byte* const*& key_bases(triattn::dense_kv_view& v) { return v.k_layers; }
std::byte* const*& key_bases(triattn::paged_kv_view& v) { return v.k_pools; }
std::byte* const*& value_bases(triattn::dense_kv_view& v) { return v.v_layers; }
std::byte* const*& value_bases(triattn::paged_kv_view& v) { return v.v_pools; }

/// A malformation of a view: `mutate` breaks a copy of the view, `want` is what the message
/// must say besides the API name.
template <class V>
struct bad_view {
  std::string name;
  std::function<void(V&)> mutate;
  needles want;
};

/// The entry points that take a whole view, each with the API name it must report.
template <class V>
void reject_everywhere(test_cache& c, const V& view, const needles& want) {
  triattn::streaming_llm policy({2, false});
  const auto plan = plan_with_last_row(c, {0, 1});
  const auto with = [&](const char* api) {
    needles w = want;
    w.push_back(api);
    return w;
  };
  require_rejected(c, [&] { triattn::compact(view, plan); }, with("triattn::compact"));
  require_rejected(c, [&] { triattn::compress(policy, view, budget); }, with("triattn::compress"));
  require_rejected(c, [&] { policy.compress(view, budget); }, with("triattn::compress"));
  std::vector<std::int32_t> freed;
  require_rejected(
      c, [&] { triattn::maybe_compress(policy, view, budget, {.position = 64}, &freed); },
      with("triattn::maybe_compress"));
  CHECK(freed.empty());
}

/// Malformations shared by both view models.
template <class V>
std::vector<bad_view<V>> common_bad_views(test_cache& c, std::vector<std::byte*>& scratch) {
  const auto L = c.shape().num_layers;
  return {
      {"null K layer array", [](V& v) { key_bases(v) = nullptr; }, {"null"}},
      {"null V layer array", [](V& v) { value_bases(v) = nullptr; }, {"null"}},
      {"null K base of the last layer",
       [&scratch, L](V& v) {
         scratch.assign(key_bases(v), key_bases(v) + L);
         scratch.back() = nullptr;
         key_bases(v) = scratch.data();
       },
       {"layer " + std::to_string(L - 1), "null"}},
      {"null V base of the last layer",
       [&scratch, L](V& v) {
         scratch.assign(value_bases(v), value_bases(v) + L);
         scratch.back() = nullptr;
         value_bases(v) = scratch.data();
       },
       {"layer " + std::to_string(L - 1), "null"}},
      {"null lengths", [](V& v) { v.slots.lengths = nullptr; }, {"lengths is null"}},
      {"null positions", [](V& v) { v.slots.positions = nullptr; }, {"positions is null"}},
      {"num_q_heads not a multiple of num_kv_heads", [](V& v) { v.geo.num_q_heads = 3; }, {"num_q_heads 3"}},
      {"zero layers", [](V& v) { v.geo.num_layers = 0; }, {"num_layers 0"}},
      // Issue 15: rows were counted as num_layers * num_kv_heads in int (overflow, then reads
      // of lengths far past their array).
      {"layers x kv_heads past int",
       [](V& v) {
         v.geo.num_layers = 65536;
         v.geo.num_kv_heads = 65536;
         v.geo.num_q_heads = 65536;
       },
       {"num_layers 65536", "below 2^31"}},
      {"odd rotary_dim", [](V& v) { v.geo.rope.rotary_dim = 5; }, {"rotary_dim 5"}},
      {"rotary_dim > head_dim", [](V& v) { v.geo.rope.rotary_dim = 10; }, {"rotary_dim 10"}},
      {"rope theta 1", [](V& v) { v.geo.rope.theta = 1.0; }, {"theta 1"}},
      {"attention_scale 0", [](V& v) { v.geo.rope.attention_scale = 0.0; }, {"attention_scale 0"}},
      {"negative capacity", [](V& v) { v.slots.capacity = -1; }, {"capacity -1"}},
  };
}

}  // namespace

TEST_CASE("a malformed dense view is rejected by every entry point, untouched") {
  auto g = triattn_test::rng(601);
  for (const auto layout : {cache_layout::dense_nhd, cache_layout::dense_hnd}) {
    test_cache c = full_cache(g, layout);
    std::vector<std::byte*> scratch;
    for (const auto& bad : common_bad_views<triattn::dense_kv_view>(c, scratch)) {
      INFO(layout_name(layout) << ": " << bad.name);
      auto v = c.dense_view();
      bad.mutate(v);
      reject_everywhere(c, v, bad.want);
    }
  }
}

TEST_CASE("a malformed paged view is rejected by every entry point, untouched") {
  auto g = triattn_test::rng(602);
  for (const auto layout : {cache_layout::paged_nhd, cache_layout::paged_hnd}) {
    test_cache c = full_cache(g, layout);
    std::vector<std::byte*> scratch;
    auto bads = common_bad_views<triattn::paged_kv_view>(c, scratch);
    const auto blocks = static_cast<std::int32_t>(c.block_table.size());
    bads.push_back({"page table one block short",
                    [](triattn::paged_kv_view& v) { --v.num_blocks; },
                    {"page table too short", std::to_string(blocks - 1) + " blocks of 3 slots", "capacity 12"}});
    bads.push_back({"page size 0", [](triattn::paged_kv_view& v) { v.page_size = 0; }, {"page_size 0"}});
    bads.push_back({"null block table", [](triattn::paged_kv_view& v) { v.block_table = nullptr; }, {"block_table is null"}});
    const std::vector<std::int32_t> negative_table = [&] {
      auto t = c.block_table;
      t.back() = -7;
      return t;
    }();
    bads.push_back({"negative page id", [&](triattn::paged_kv_view& v) { v.block_table = negative_table.data(); },
                    {"block_table[" + std::to_string(blocks - 1) + "] = -7"}});
    // Issue 15: an id past the pool segfaulted in compact; a repeated id aliased two blocks.
    const std::vector<std::int32_t> past_pool = [&] {
      auto t = c.block_table;
      t.front() = c.pool_pages();
      return t;
    }();
    bads.push_back({"page id past the pool", [&](triattn::paged_kv_view& v) { v.block_table = past_pool.data(); },
                    {"block_table[0] = " + std::to_string(c.pool_pages()), "[0, " + std::to_string(c.pool_pages()) + ")"}});
    const std::vector<std::int32_t> repeated = [&] {
      auto t = c.block_table;
      t.back() = t.front();
      return t;
    }();
    bads.push_back({"a page id twice", [&](triattn::paged_kv_view& v) { v.block_table = repeated.data(); },
                    {"page " + std::to_string(c.block_table.front()) + " appears twice"}});
    bads.push_back({"no pool size", [](triattn::paged_kv_view& v) { v.num_pages = 0; }, {"num_pages 0"}});
    for (const auto& bad : bads) {
      INFO(layout_name(layout) << ": " << bad.name);
      auto v = c.paged_view();
      bad.mutate(v);
      reject_everywhere(c, v, bad.want);
    }
  }
}

TEST_CASE("odd head_dim and length > capacity are rejected, untouched") {
  auto g = triattn_test::rng(603);
  for (const auto layout : triattn_test::all_layouts) {
    INFO(layout_name(layout));
    test_cache odd = full_cache(g, layout, 7);
    odd.with_view([&](const auto& v) { reject_everywhere(odd, v, {"head_dim 7"}); });
    test_cache c = full_cache(g, layout);
    c.lengths.back() = 13;  // the last (layer, kv_head): a late check would come after moved rows
    c.with_view([&](const auto& v) { reject_everywhere(c, v, {"length 13", "capacity 12"}); });
  }
}

TEST_CASE("a budget below 1 is rejected, untouched") {
  auto g = triattn_test::rng(604);
  for (const auto layout : triattn_test::all_layouts) {
    INFO(layout_name(layout));
    test_cache c = full_cache(g, layout);
    c.with_view([&](const auto& v) {
      triattn::streaming_llm policy;
      for (const std::int64_t b : {0, -3}) {
        const needles want = {"triattn::compress", "budget " + std::to_string(b)};
        require_rejected(c, [&] { triattn::compress(policy, v, b); }, want);
        require_rejected(c, [&] { policy.compress(v, b); }, want);
        // maybe_compress checks the budget once, before its schedule reads it
        require_rejected(c, [&] { triattn::maybe_compress(policy, v, b, {.position = 1000}); },
                         {"triattn::maybe_compress", "budget " + std::to_string(b)});
      }
      require_rejected(c, [&] { (void)policy.plan(v, 0); }, {"triattn::streaming_llm::plan", "budget 0"});
    });
  }
}

TEST_CASE("negative round sinks or recent window are rejected, untouched") {
  auto g = triattn_test::rng(606);
  for (const auto layout : triattn_test::all_layouts) {
    INFO(layout_name(layout));
    test_cache c = full_cache(g, layout);
    c.with_view([&](const auto& v) {
      for (const auto& [sinks, recent] : {std::pair<std::int64_t, std::int64_t>{-1, 0}, {0, -2}}) {
        triattn::streaming_llm_config cfg;
        cfg.round.sinks = sinks;
        cfg.round.recent = recent;
        triattn::streaming_llm policy(cfg);
        const needles want = {"triattn::compress", "round sinks " + std::to_string(sinks),
                              "recent " + std::to_string(recent)};
        require_rejected(c, [&] { triattn::compress(policy, v, budget); }, want);
        require_rejected(c, [&] { triattn::maybe_compress(policy, v, budget, {.position = 1000}); }, want);
      }
    });
  }
}

TEST_CASE("a round start past 2^31 is rejected, untouched: round start + offset must not overflow") {
  // Issue 15, item 6: a round start near INT64_MAX overflowed `round_start + offset` (UBSan in
  // debug builds, a wrong keep set in Release). Cached positions are int32, so every round
  // start above 2^31 is refused, by the round pipeline and by TriAttention's scorer alike.
  auto g = triattn_test::rng(605);
  for (const auto layout : triattn_test::all_layouts) {
    INFO(layout_name(layout));
    test_cache c = full_cache(g, layout);
    c.with_view([&](const auto& v) {
      triattn::streaming_llm policy;
      for (const std::int64_t r : {triattn::max_round_start + 1, std::numeric_limits<std::int64_t>::max()}) {
        const needles want = {"triattn::compress", "round start " + std::to_string(r), "must be <= 2^31"};
        require_rejected(c, [&] { triattn::compress(policy, v, budget, {.position = r}); }, want);
        require_rejected(c, [&] { triattn::maybe_compress(policy, v, budget, {.position = r}); },
                         {"round start " + std::to_string(r)});
      }
      // 2^31 itself is a valid round start: the round runs.
      const auto before = c.snapshot();
      triattn::compress(policy, v, budget, {.position = triattn::max_round_start});
      CHECK_FALSE(c.snapshot() == before);
    });
  }
}

TEST_CASE("a bad keep plan is rejected before any row moves") {
  auto g = triattn_test::rng(605);
  for (const auto layout : triattn_test::all_layouts) {
    INFO(layout_name(layout));
    test_cache c = full_cache(g, layout);
    const std::int32_t n = c.lengths.back();
    const auto& s = c.shape();
    c.with_view([&](const auto& v) {
      const auto compact = [&](const triattn::keep_plan& p) { return [&v, p] { triattn::compact(v, p); }; };
      require_rejected(c, compact(plan_with_last_row(c, {0, n})),
                       {"triattn::compact", "keep index " + std::to_string(n), "[0, " + std::to_string(n) + ")"});
      require_rejected(c, compact(plan_with_last_row(c, {-1, 3})), {"triattn::compact", "keep index -1"});
      require_rejected(c, compact(plan_with_last_row(c, {0, 3, 2})), {"triattn::compact", "3 then 2"});
      require_rejected(c, compact(plan_with_last_row(c, {0, 1, 1})), {"triattn::compact", "1 then 1"});

      triattn::keep_plan short_plan(s.num_layers, s.num_kv_heads);
      for (int r = 0; r < s.num_layers * s.num_kv_heads - 1; ++r) short_plan.push_row(index_list{0});
      require_rejected(c, compact(short_plan), {"triattn::compact", "keep plan has 3 rows"});
      auto long_plan = plan_with_last_row(c, {0});
      long_plan.push_row(index_list{0});
      require_rejected(c, compact(long_plan), {"triattn::compact", "keep plan has 5 rows"});
      auto other_shape = triattn::keep_plan::shared(1, 4, index_list{0});
      require_rejected(c, compact(other_shape), {"triattn::compact", "1 layers x 4 kv_heads"});

      const triattn::slot_state null_state{};
      require_rejected(c, [&] { triattn::compact(v, plan_with_last_row(c, {0}), {&null_state, 1}); },
                       {"triattn::compact", "slot_state is null"});

      // A policy whose plan is bad: compress must validate it before moving anything.
      struct bad_policy {
        triattn::keep_plan p;
        triattn::keep_plan plan(const std::decay_t<decltype(v)>&, std::int64_t, const triattn::round_context&) const {
          return p;
        }
      } bad{plan_with_last_row(c, {2, 1})};
      require_rejected(c, [&] { triattn::compress(bad, v, budget); }, {"triattn::compact", "2 then 1"});
    });
  }
}

TEST_CASE("APIs without a cache name themselves and the bad value") {
  CHECK_THROWS_WITH(triattn::streaming_llm({-1, false}), Contains("triattn::streaming_llm") && Contains("sinks -1"));
  const std::vector<float> scores = {1, 2, 3};
  CHECK_THROWS_WITH(triattn::top_k(scores, -1), Contains("triattn::top_k") && Contains("k -1"));
  CHECK_THROWS_WITH(triattn::union_select(scores, 2, 2, 1), Contains("triattn::union_select") && Contains("rows holds 3"));
  CHECK_THROWS_WITH(triattn::union_select(scores, 1, 3, -2), Contains("triattn::union_select") && Contains("k -2"));
  CHECK_THROWS_WITH(triattn::select_keep(scores, {}, {}, 0), Contains("triattn::select_keep") && Contains("budget 0"));
  CHECK_THROWS_WITH(triattn::select_keep(scores, std::vector<std::int32_t>{1}, {0, 0, 5}, 1),
                    Contains("triattn::select_keep") && Contains("positions holds 1"));
  CHECK_THROWS_WITH(triattn::validate_rope("triattn::test", triattn::rope_desc{}, 9),
                    Contains("triattn::test") && Contains("head_dim 9"));
}
