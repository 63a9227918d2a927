// The test harness of the window-scored policies, SnapKV and R-KV: window queries drawn and
// fed to a policy, score and round checks, around the double-precision oracles of
// support/window_oracle.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "support/round_checks.hpp"
#include "support/views.hpp"
#include "support/window_oracle.hpp"
#include "triattn/core/error.hpp"

namespace triattn_test {

/// Window queries for every (layer, q_head) of a cache, fed to a policy in token order. The
/// q-heads of a layer share their positions (the engine observes every head at each token).
struct window_queries {
  int head_dim = 0;
  std::vector<std::vector<std::int32_t>> positions;  // [layers][pushed]
  std::vector<std::vector<std::vector<float>>> q;    // [layers][q_heads][pushed * head_dim]

  /// `pushed` queries per layer: random in [1, window + 3] (fewer than the window, or more so
  /// that the ring wraps), at random increasing positions (some before the keys: the mask).
  static window_queries random(std::mt19937_64& g, const test_cache& c, int window) {
    const auto& s = c.shape();
    window_queries w;
    w.head_dim = s.head_dim;
    std::uniform_int_distribution<int> pushed_of(1, window + 3);
    std::uniform_int_distribution<std::int32_t> start(0, 250), gap(1, 3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int l = 0; l < s.num_layers; ++l) {
      const int pushed = pushed_of(g);
      w.positions.emplace_back();
      for (std::int32_t i = 0, p = start(g); i < pushed; ++i, p += gap(g)) w.positions.back().push_back(p);
      w.q.emplace_back();
      for (int h = 0; h < s.num_kv_heads * s.group; ++h) {
        w.q.back().emplace_back(static_cast<std::size_t>(pushed) * static_cast<std::size_t>(s.head_dim));
        for (auto& x : w.q.back().back()) x = normal(g);
      }
    }
    return w;
  }

  std::span<const float> query(int l, int h, std::size_t i) const {
    return std::span<const float>(q[l][h]).subspan(i * static_cast<std::size_t>(head_dim), static_cast<std::size_t>(head_dim));
  }

  /// Attaches `policy` to `view` and observes every query, token by token.
  template <class Policy, class View>
  void feed(Policy& policy, const View& view) const {
    policy.attach(view);
    for (std::size_t i = 0; i < longest(); ++i)
      for (std::size_t l = 0; l < positions.size(); ++l)
        if (i < positions[l].size())
          for (std::size_t h = 0; h < q[l].size(); ++h)
            policy.observe(static_cast<int>(l), static_cast<int>(h), positions[l][i],
                           query(static_cast<int>(l), static_cast<int>(h), i), {});
  }

  /// The oracle's inputs for (l, kv_head h) of `c`: the last min(pushed, window) queries.
  ref::window_row row(test_cache& c, int l, int h, int window) const {
    const int G = c.shape().group;
    const std::size_t pushed = positions[l].size(), m = std::min<std::size_t>(pushed, static_cast<std::size_t>(window));
    ref::window_row r;
    r.q_pos.assign(positions[l].end() - static_cast<std::ptrdiff_t>(m), positions[l].end());
    for (int gi = 0; gi < G; ++gi) {
      r.q.emplace_back();
      for (std::size_t i = pushed - m; i < pushed; ++i) {
        const auto x = query(l, h * G + gi, i);
        r.q.back().emplace_back(x.begin(), x.end());
      }
    }
    for (std::int32_t s = 0; s < c.length(l, h); ++s) {
      r.k.push_back(c.key(l, h, s));
      r.k_pos.push_back(c.position(l, h, s));
    }
    return r;
  }

 private:
  std::size_t longest() const {
    std::size_t m = 0;
    for (const auto& p : positions) m = std::max(m, p.size());
    return m;
  }
};

/// A random cache for a window-policy trial (random_shape, random page size).
inline test_cache window_cache(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int group) {
  std::uniform_int_distribution<int> page(1, 5);
  return test_cache(random_shape(g, layout, type, page(g), group), g);
}

/// Value written to the score output beforehand: slots past a row's length must keep it.
inline constexpr float untouched_score = -12345.0f;

/// Checks a policy's `score` output [layers, kv_heads, capacity] against `want(l, h)`: an
/// oracle row [length] (or nullopt to skip the row), +inf exactly, finite values within
/// `abs_tol + rel_tol * |want|`; slots past the length untouched. Returns the rows compared.
template <class Want>
int check_scores(test_cache& c, const std::vector<float>& out, Want&& want, double abs_tol, double rel_tol) {
  const auto& s = c.shape();
  int compared = 0;
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_kv_heads; ++h) {
      const auto row = out.begin() + static_cast<std::ptrdiff_t>((l * s.num_kv_heads + h) * s.capacity);
      const std::int32_t n = c.length(l, h);
      INFO("layer " << l << " kv_head " << h << " length " << n);
      for (std::int64_t j = n; j < s.capacity; ++j) REQUIRE(row[j] == untouched_score);
      const std::optional<std::vector<double>> w = want(l, h);
      if (!w) continue;
      ++compared;
      for (std::int32_t j = 0; j < n; ++j) {
        INFO("slot " << j << " got " << row[j] << " want " << (*w)[j]);
        if (std::isinf((*w)[j])) {
          REQUIRE(row[j] == (*w)[j]);
        } else {
          REQUIRE(std::fabs(row[j] - (*w)[j]) <= abs_tol + rel_tol * std::fabs((*w)[j]));
        }
      }
    }
  return compared;
}

/// What the oracle expects of one compress: the keep rows [l * kv_heads + h], or nothing when
/// its decision sits within a near-tie an fp32 policy may cut either way.
using oracle_keep = std::optional<std::vector<std::vector<std::int32_t>>>;

/// 96 trials of a window policy through `compress`: every layout and dtype, GQA groups 1, 2
/// and 4, budgets 1, window, window + 1, the longest row and random ones. Each trial draws a
/// config with `make_config(g)`, labels it with `describe(config)`, and compares the cache
/// after the round with `expect(cache, queries, config, budget)`. Fails when more than
/// `max_skipped` trials are near-ties, or none ran.
template <class Policy, class MakeConfig, class Describe, class Expect>
void check_compress_trials(std::uint64_t salt, int max_skipped, MakeConfig&& make_config, Describe&& describe,
                           Expect&& expect) {
  auto g = rng(salt);
  int ran = 0, skipped = 0;
  for (int t = 0; t < 96; ++t) {
    const int group = 1 << (t / 4 % 3);
    test_cache c = window_cache(g, all_layouts[t % 4], all_dtypes[t / 12 % 3], group);
    const auto cfg = make_config(g);
    const auto wq = window_queries::random(g, c, cfg.window);
    const std::int64_t longest = std::max(*std::max_element(c.lengths.begin(), c.lengths.end()), 1);
    std::uniform_int_distribution<std::int64_t> any(1, longest + 2);
    const std::int64_t budgets[] = {1, cfg.window, cfg.window + 1, longest};
    const std::int64_t budget = t % 8 < 4 ? budgets[t % 8] : any(g);
    INFO(c.shape().describe() << " " << describe(cfg) << " budget " << budget);
    const oracle_keep keep = expect(c, wq, cfg, budget);
    if (!keep) {
      ++skipped;
      continue;
    }
    ++ran;
    Policy policy(cfg);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    check_round(c, *keep,
                [&] { return c.with_view([&](const auto& v) { return policy.compress(v, budget); }).freed_pages; });
  }
  INFO("trials skipped for near-ties: " << skipped);
  CHECK(skipped <= max_skipped);
  CHECK(ran > 0);
}

/// Budget 1 on a window policy fed with random window queries: every non-empty row keeps only
/// its oldest window slot.
template <class Policy>
void check_budget_one(test_cache& c, Policy& policy, std::mt19937_64& g) {
  const auto wq = window_queries::random(g, c, policy.config.window);
  c.with_view([&](const auto& v) { wq.feed(policy, v); });
  std::vector<std::vector<std::int32_t>> keep;
  for (const std::int32_t n : c.lengths)
    keep.push_back(n == 0 ? std::vector<std::int32_t>{} : std::vector<std::int32_t>{std::max(n - policy.config.window, 0)});
  INFO(c.shape().describe());
  check_round(c, keep, [&] { return c.with_view([&](const auto& v) { return policy.compress(v, 1); }).freed_pages; });
}

}  // namespace triattn_test
