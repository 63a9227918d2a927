// StreamingLLM against the rule of baselines.md §1 (sinks [0, S) plus the last budget - S
// slots), on dense and paged views, with and without re-positioning.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/views.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/streaming_llm.hpp"

namespace {

using triattn_test::cache_layout;
using triattn_test::cache_shape;
using triattn_test::test_cache;
using index_list = std::vector<std::int32_t>;

/// Slots kept from `n`: all when n <= budget, else the first S = min(sinks, budget) and the
/// last budget - S.
index_list streaming_oracle(std::int64_t n, std::int64_t budget, std::int64_t sinks) {
  index_list keep;
  const std::int64_t s = std::min(sinks, budget);
  for (std::int64_t i = 0; i < n; ++i)
    if (n <= budget || i < s || i >= n - (budget - s)) keep.push_back(static_cast<std::int32_t>(i));
  return keep;
}

cache_shape shape_with_group(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int group) {
  std::uniform_int_distribution<int> page(1, 5);
  return triattn_test::random_shape(g, layout, type, page(g), group);
}

using triattn_test::slot_contents;

/// The oracle's view of a round: the slots each (layer, kv_head) keeps, copied beforehand.
struct expected_round {
  std::vector<index_list> keep;             // [layer * kv_heads + kv_head]
  std::vector<std::vector<slot_contents>> kept;  // same rows, the kept slots' contents
  std::vector<std::int32_t> lengths_before;

  expected_round(test_cache& c, std::int64_t budget, std::int64_t sinks) : lengths_before(c.lengths) {
    for (int l = 0; l < c.shape().num_layers; ++l)
      for (int h = 0; h < c.shape().num_kv_heads; ++h) {
        keep.push_back(streaming_oracle(c.length(l, h), budget, sinks));
        kept.emplace_back();
        for (const auto s : keep.back()) kept.back().push_back(c.slot(l, h, s));
      }
  }
};

/// Runs `check(l, h, i, src, before)` on each surviving slot i after checking the lengths.
template <class F>
void for_each_survivor(test_cache& c, const expected_round& e, F&& check) {
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.shape().num_kv_heads; ++h) {
      const auto r = static_cast<std::size_t>(l * c.shape().num_kv_heads + h);
      INFO("layer " << l << " kv_head " << h << " length before " << e.lengths_before[r]);
      REQUIRE(c.length(l, h) == static_cast<std::int32_t>(e.keep[r].size()));
      for (std::size_t i = 0; i < e.keep[r].size(); ++i) {
        INFO("slot " << i << " (was " << e.keep[r][i] << ")");
        check(l, h, static_cast<std::int64_t>(i), e.keep[r][i], e.kept[r][i]);
      }
    }
}

}  // namespace

TEST_CASE("StreamingLLM keeps the sinks and the most recent slots") {
  auto g = triattn_test::rng(701);
  std::uniform_int_distribution<int> type(0, 2);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      for (const std::int64_t sinks : {0, 1, 4, 7}) {
        for (int trial = 0; trial < 8; ++trial) {  // the edge budgets, then random ones
          test_cache c(shape_with_group(g, layout, triattn_test::all_dtypes[type(g)], group), g);
          const std::int64_t cap = c.shape().capacity;
          std::uniform_int_distribution<std::int64_t> any(1, cap + 3);
          const std::int64_t budgets[] = {1, 2, sinks > 1 ? sinks - 1 : 1, sinks + 1, cap, cap + 3};
          const std::int64_t budget = trial < 6 ? budgets[trial] : any(g);
          INFO(c.shape().describe() << " sinks " << sinks << " budget " << budget);
          const expected_round e(c, budget, sinks);
          const auto before = c.snapshot();

          triattn::streaming_llm policy({sinks, false});
          const auto result = c.with_view([&](const auto& v) { return policy.compress(v, budget); });

          for_each_survivor(c, e, [&](int l, int h, std::int64_t i, std::int32_t, const slot_contents& want) {
            REQUIRE(c.slot(l, h, i) == want);
          });
          CHECK(result.freed_pages == triattn_test::expected_freed_pages(c, e.lengths_before));
          const bool all_fit = std::all_of(e.lengths_before.begin(), e.lengths_before.end(),
                                           [&](std::int32_t n) { return n <= budget; });
          if (all_fit) CHECK(c.snapshot() == before);  // nothing to evict: a no-op, byte for byte
        }
      }
    }
  }
}

TEST_CASE("StreamingLLM re-positioning renumbers positions and re-rotates post-RoPE keys") {
  auto g = triattn_test::rng(702);
  std::uniform_int_distribution<int> group_of(0, 2), shift(0, 100000);
  triattn::rope_desc yarn;
  yarn.theta = 1e6;
  yarn.scaling = {triattn::rope_scaling_type::yarn, 4.0, 1.0, 4.0, 64.0, 32.0, 1.0, true};
  yarn.attention_scale = triattn::yarn_attention_scale(4.0);
  triattn::rope_desc partial;  // llama3 rule on 4 of 8 dims: dims 4..7 must not move
  partial.theta = 5e5;
  partial.rotary_dim = 4;
  partial.scaling = {triattn::rope_scaling_type::llama3, 8.0, 1.0, 4.0, 64.0};
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      for (const auto style : {triattn::rope_style::half, triattn::rope_style::interleaved}) {
        for (const auto& base_rope : {triattn::rope_desc{}, yarn, partial}) {
          cache_shape shape = shape_with_group(g, layout, type, 1 << group_of(g));
          shape.head_dim = 8;  // room for the partial rotary dims
          shape.rope = base_rope;
          shape.rope.style = style;
          test_cache c(shape, g);
          // Positions far into a text, so that the shift is a large rotation, then post-RoPE
          // keys written by the reference from known pre-RoPE keys.
          const int offset = shift(g);
          for (auto& p : c.positions) p += offset;
          std::vector<std::vector<double>> pre;  // [(l * H + h) * capacity + s]
          std::normal_distribution<double> normal(0.0, 1.0);
          for (int l = 0; l < shape.num_layers; ++l)
            for (int h = 0; h < shape.num_kv_heads; ++h)
              for (std::int64_t s = 0; s < shape.capacity; ++s) {
                pre.emplace_back(static_cast<std::size_t>(shape.head_dim));
                for (auto& x : pre.back()) x = normal(g);
                c.store_key(l, h, s, triattn_test::ref::rotate(shape.rope, pre.back(), c.position(l, h, s)));
              }
          std::uniform_int_distribution<std::int64_t> budget_of(1, shape.capacity);
          const std::int64_t budget = budget_of(g), sinks = 2;
          INFO(shape.describe() << (style == triattn::rope_style::half ? " half" : " interleaved") << " rope type "
                                << static_cast<int>(shape.rope.scaling.type) << " budget " << budget);
          const expected_round e(c, budget, sinks);

          triattn::streaming_llm policy({sinks, true});
          c.with_view([&](const auto& v) { policy.compress(v, budget); });

          const double u = triattn_test::ref::unit_roundoff(type);
          const int rotary = shape.rope.rotary_dim > 0 ? shape.rope.rotary_dim : shape.head_dim;
          for_each_survivor(c, e, [&](int l, int h, std::int64_t i, std::int32_t src, const slot_contents& was) {
            CHECK(c.position(l, h, i) == i);
            CHECK(c.value_bytes(l, h, i) == was.v);
            const auto& kappa = pre[static_cast<std::size_t>((l * shape.num_kv_heads + h) * shape.capacity + src)];
            const auto want = triattn_test::ref::rotate(shape.rope, kappa, static_cast<double>(i));
            const auto got = c.key(l, h, i);
            // Two roundings to the dtype (the stored key, the re-rotated key), each at most u
            // times the band's modulus; a rotation keeps the modulus.
            for (int f = 0; f < rotary / 2; ++f) {
              const auto [re, im] = triattn_test::ref::band_dims(style, rotary, f);
              const double tol = 3 * u * std::hypot(want[re], want[im]) + (type == triattn::dtype::f16 ? 1e-7 : 0.0);
              INFO("band " << f << " got (" << got[re] << ", " << got[im] << ") want (" << want[re] << ", "
                           << want[im] << ") tol " << tol);
              CHECK(std::fabs(got[re] - want[re]) <= tol);
              CHECK(std::fabs(got[im] - want[im]) <= tol);
            }
            // Dims past the rotary dims keep their bytes.
            const auto bytes = static_cast<std::ptrdiff_t>(rotary * triattn::dtype_bytes(type));
            const auto k = c.key_bytes(l, h, i);
            CHECK(std::equal(k.begin() + bytes, k.end(), was.k.begin() + bytes, was.k.end()));
          });
        }
      }
    }
  }
}

TEST_CASE("StreamingLLM re-positioning of pre-RoPE keys changes only the positions") {
  auto g = triattn_test::rng(703);
  std::uniform_int_distribution<int> type(0, 2);
  for (const auto layout : triattn_test::all_layouts) {
    for (const int group : {1, 2, 4}) {
      cache_shape shape = shape_with_group(g, layout, triattn_test::all_dtypes[type(g)], group);
      shape.keys = triattn::key_state::pre_rope;
      test_cache c(shape, g);
      std::uniform_int_distribution<std::int64_t> budget_of(1, shape.capacity);
      const std::int64_t budget = budget_of(g), sinks = 3;
      INFO(shape.describe() << " budget " << budget);
      const expected_round e(c, budget, sinks);

      triattn::streaming_llm policy({sinks, true});
      c.with_view([&](const auto& v) { policy.compress(v, budget); });

      for_each_survivor(c, e, [&](int l, int h, std::int64_t i, std::int32_t, const slot_contents& was) {
        REQUIRE(c.slot(l, h, i) ==
                slot_contents{was.k, was.v, static_cast<std::int32_t>(i)});
      });
    }
  }
}

TEST_CASE("StreamingLLM through maybe_compress fires when the schedule says so") {
  auto g = triattn_test::rng(704);
  for (const auto layout : triattn_test::all_layouts) {
    cache_shape shape = shape_with_group(g, layout, triattn::dtype::bf16, 2);
    shape.capacity = 24;
    test_cache c(shape, g);
    const std::int64_t budget = 6, sinks = 2;
    const auto sched = triattn::schedule::with_slack(4);  // fires at >= 10 tokens
    INFO(shape.describe());
    triattn::streaming_llm_config cfg{sinks, false};
    cfg.round.sched = sched;  // maybe_compress reads the policy's schedule
    triattn::streaming_llm policy(cfg);
    std::uniform_int_distribution<std::int32_t> below(0, 9);
    for (auto& n : c.lengths) n = below(g);
    c.lengths.front() = 9;

    const auto before = c.snapshot();
    std::vector<std::int32_t> freed = {-42};  // freed pages are appended, never assigned
    const bool fired_early =
        c.with_view([&](const auto& v) { return triattn::maybe_compress(policy, v, budget, {.position = 500}, &freed); });
    CHECK_FALSE(fired_early);
    CHECK(c.snapshot() == before);
    CHECK(freed == std::vector<std::int32_t>{-42});

    c.lengths.back() = 10;  // the longest (layer, kv_head) decides
    const expected_round e(c, budget, sinks);
    const bool fired =
        c.with_view([&](const auto& v) { return triattn::maybe_compress(policy, v, budget, {.position = 501}, &freed); });
    CHECK(fired);
    for_each_survivor(c, e, [&](int l, int h, std::int64_t i, std::int32_t, const slot_contents& want) {
      REQUIRE(c.slot(l, h, i) == want);
    });
    auto want_freed = triattn_test::expected_freed_pages(c, e.lengths_before);
    want_freed.insert(want_freed.begin(), -42);
    CHECK(freed == want_freed);
  }
}
