// Double-precision oracles of the window-scored policies, SnapKV and R-KV, transcribed from
// the formulas of spec/cli.md and baselines.md §3 and §5 with plain loops (no Eigen, no
// library code), plus the test harness: window queries drawn and fed to a policy, score and
// round checks.
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

#include "support/views.hpp"
#include "triattn/core/error.hpp"

namespace triattn_test {

namespace ref {

using matrix = std::vector<std::vector<double>>;  // [rows][cols]

inline constexpr double inf = std::numeric_limits<double>::infinity();

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t d = 0; d < a.size(); ++d) s += a[d] * b[d];
  return s;
}

/// Softmax of `x` over the entries that are not −inf; all −inf gives zeros.
inline std::vector<double> softmax(const std::vector<double>& x) {
  double top = -inf;
  for (const double v : x) top = std::max(top, v);
  std::vector<double> p(x.size(), 0.0);
  if (top == -inf) return p;
  double sum = 0.0;
  for (std::size_t j = 0; j < x.size(); ++j) sum += p[j] = x[j] == -inf ? 0.0 : std::exp(x[j] - top);
  for (double& v : p) v /= sum;
  return p;
}

/// PyTorch's max_pool1d / avg_pool1d (count_include_pad) with stride 1 and padding k/2.
inline std::vector<double> pool(const std::vector<double>& x, int kernel, bool max_pool) {
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<double> y(x.size());
  for (std::int64_t j = 0; j < n; ++j) {
    double acc = max_pool ? -inf : 0.0;
    for (std::int64_t i = j - kernel / 2; i <= j + kernel / 2; ++i) {
      const double v = i < 0 || i >= n ? (max_pool ? -inf : 0.0) : x[static_cast<std::size_t>(i)];
      acc = max_pool ? std::max(acc, v) : acc + v;
    }
    y[static_cast<std::size_t>(j)] = max_pool ? acc : acc / kernel;
  }
  return y;
}

/// Logits of query q at position qp over keys k [n][D] at positions kp: q·k/√D, −inf where
/// the key's position is above the query's.
inline std::vector<double> logits(const std::vector<double>& q, std::int32_t qp, const matrix& k,
                                  const std::vector<std::int32_t>& kp) {
  std::vector<double> z(k.size());
  for (std::size_t j = 0; j < k.size(); ++j)
    z[j] = kp[j] > qp ? -inf : dot(q, k[j]) / std::sqrt(static_cast<double>(q.size()));
  return z;
}

/// The inputs of one (layer, kv_head): queries [G][m][D] at positions [m], keys [n][D] at
/// positions [n].
struct window_row {
  std::vector<matrix> q;
  std::vector<std::int32_t> q_pos;
  matrix k;
  std::vector<std::int32_t> k_pos;
};

/// SnapKV's pooled votes per q-head [G][p], p = n − window (cli.md `score snapkv`).
inline matrix snapkv_votes(const window_row& in, int window, int kernel, bool max_pool) {
  const std::size_t n = in.k.size(), p = n > static_cast<std::size_t>(window) ? n - window : 0;
  matrix votes;
  for (const auto& qh : in.q) {
    std::vector<double> v(p, 0.0);
    for (std::size_t i = 0; i < qh.size(); ++i) {
      const auto prob = softmax(logits(qh[i], in.q_pos[i], in.k, in.k_pos));
      for (std::size_t j = 0; j < p; ++j) v[j] += prob[j];
    }
    votes.push_back(pool(v, kernel, max_pool));
  }
  return votes;
}

enum class group_rule { mean, max, sum, per_q_head };

/// Rank of every slot in each q-head's order (higher vote first, ties to the lower slot).
inline std::vector<std::vector<std::size_t>> per_head_orders(const matrix& votes) {
  std::vector<std::vector<std::size_t>> orders;
  for (const auto& v : votes) {
    std::vector<std::size_t> o(v.size());
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](std::size_t a, std::size_t b) { return v[a] > v[b]; });
    orders.push_back(o);
  }
  return orders;
}

/// SnapKV scores [n] from pooled votes [G][p]: the group rule on the prefix, +inf on the
/// window. per_q_head: −(r·G + i) for the slot first reached at rank r of q-head i.
inline std::vector<double> snapkv_scores(const matrix& votes, std::size_t n, group_rule rule) {
  const std::size_t G = votes.size(), p = votes[0].size();
  std::vector<double> s(n, inf);
  if (rule == group_rule::per_q_head) {
    const auto orders = per_head_orders(votes);
    for (std::size_t j = 0; j < p; ++j) s[j] = -inf;
    for (std::size_t i = 0; i < G; ++i)
      for (std::size_t r = 0; r < p; ++r)
        s[orders[i][r]] = std::max(s[orders[i][r]], -static_cast<double>(r * G + i));
    return s;
  }
  for (std::size_t j = 0; j < p; ++j) {
    double acc = rule == group_rule::max ? -inf : 0.0;
    for (std::size_t i = 0; i < G; ++i) acc = rule == group_rule::max ? std::max(acc, votes[i][j]) : acc + votes[i][j];
    s[j] = rule == group_rule::mean ? acc / static_cast<double>(G) : acc;
  }
  return s;
}

/// The round-robin merge of per_q_head, literally: rank 0 of every q-head in order, then rank
/// 1, ..., skipping taken slots, until `take` prefix slots are chosen. Returns them unsorted.
inline std::vector<std::int32_t> round_robin(const matrix& votes, std::size_t take) {
  const auto orders = per_head_orders(votes);
  const std::size_t p = votes[0].size();
  std::vector<bool> taken(p, false);
  std::vector<std::int32_t> out;
  for (std::size_t r = 0; r < p && out.size() < take; ++r)
    for (std::size_t i = 0; i < orders.size() && out.size() < take; ++i)
      if (!taken[orders[i][r]]) {
        taken[orders[i][r]] = true;
        out.push_back(static_cast<std::int32_t>(orders[i][r]));
      }
  return out;
}

/// Smallest gap between two different values of any row: how far the orders are from a flip.
inline double order_margin(const matrix& rows) {
  double m = inf;
  for (auto row : rows) {
    std::sort(row.begin(), row.end());
    for (std::size_t j = 1; j < row.size(); ++j)
      if (row[j] != row[j - 1]) m = std::min(m, row[j] - row[j - 1]);
  }
  return m;
}

/// R-KV's redundancy [n] (baselines.md §5, the reference's `cal_similarity`), and the smallest
/// |S_ij − threshold| seen, how far the near-duplicate decisions are from a flip.
inline std::vector<double> rkv_redundancy(const matrix& k, double threshold, double& threshold_margin) {
  const std::size_t n = k.size();
  matrix unit = k;
  for (auto& row : unit) {
    const double norm = std::sqrt(dot(row, row)) + 1e-8;
    for (double& x : row) x /= norm;
  }
  matrix s(n, std::vector<double>(n));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) s[i][j] = i == j ? 0.0 : dot(unit[i], unit[j]);
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t last = 0;  // torch.where(mask, arange, 0).max(): 0 when no entry passes
    for (std::size_t j = 0; j < n; ++j) {
      if (i != j) threshold_margin = std::min(threshold_margin, std::fabs(s[i][j] - threshold));
      if (s[i][j] > threshold) last = j;
    }
    s[i][last] = 0.0;
  }
  std::vector<double> col(n, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    for (std::size_t i = 0; i < n; ++i) col[j] += s[i][j];
    col[j] /= static_cast<double>(n);
  }
  return softmax(col);
}

/// R-KV scores [n] (cli.md `score rkv`), +inf on the window.
inline std::vector<double> rkv_scores(const window_row& in, int window, int kernel, double lambda, double threshold,
                                      double& threshold_margin) {
  const std::size_t n = in.k.size();
  std::vector<double> z(n, inf);
  if (n <= static_cast<std::size_t>(window)) return z;
  const std::size_t p = n - window;
  const matrix prefix(in.k.begin(), in.k.begin() + static_cast<std::ptrdiff_t>(p));
  const std::vector<std::int32_t> prefix_pos(in.k_pos.begin(), in.k_pos.begin() + static_cast<std::ptrdiff_t>(p));
  std::vector<double> mean(p, 0.0);
  const std::size_t m = in.q_pos.size();
  for (std::size_t i = 0; i < m; ++i) {
    std::vector<double> top(p, -inf);
    for (const auto& qh : in.q) {
      const auto z_i = logits(qh[i], in.q_pos[i], prefix, prefix_pos);
      for (std::size_t j = 0; j < p; ++j) top[j] = std::max(top[j], z_i[j]);
    }
    const auto a = softmax(top);
    for (std::size_t j = 0; j < p; ++j) mean[j] += a[j] / static_cast<double>(m);
  }
  const auto importance = pool(mean, kernel, true);
  const auto redundancy = rkv_redundancy(in.k, threshold, threshold_margin);
  for (std::size_t j = 0; j < p; ++j) z[j] = lambda * importance[j] - (1 - lambda) * redundancy[j];
  return z;
}

/// The `budget` best slots of `scores` (higher first, ties to the lower slot), ascending, and
/// the margin of the decision: the gap between the weakest kept and the best dropped score,
/// or, when those are equal (one tie group across the cut), the gap to the nearest other value.
struct window_keep {
  std::vector<std::int32_t> keep;
  double margin = inf;
};
inline window_keep keep_best(const std::vector<double>& scores, std::int64_t budget) {
  std::vector<std::int32_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return scores[a] > scores[b]; });
  window_keep d;
  const auto take = static_cast<std::size_t>(std::min<std::int64_t>(budget, static_cast<std::int64_t>(scores.size())));
  d.keep.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(take));
  std::sort(d.keep.begin(), d.keep.end());
  if (take == 0 || take == scores.size()) return d;
  const double weakest = scores[order[take - 1]], best_dropped = scores[order[take]];
  if (weakest == inf) return d;  // the cut falls inside the window: no score decides it
  if (weakest != best_dropped) {
    d.margin = weakest - best_dropped;
  } else {
    for (const double s : scores)
      if (s != weakest) d.margin = std::min(d.margin, std::fabs(s - weakest));
  }
  return d;
}

}  // namespace ref

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

/// Compresses with `run` and checks that every (layer, kv_head) now holds exactly the slots
/// `keep` [l * kv_heads + h] (K, V and positions, in order), and the freed pages.
template <class Run>
void check_round(test_cache& c, const std::vector<std::vector<std::int32_t>>& keep, Run&& run) {
  const int L = c.shape().num_layers, H = c.shape().num_kv_heads;
  std::vector<std::vector<slot_contents>> kept;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      kept.emplace_back();
      for (const auto s : keep[static_cast<std::size_t>(l * H + h)]) kept.back().push_back(c.slot(l, h, s));
    }
  const auto lengths_before = c.lengths;
  const auto freed = run();
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const auto r = static_cast<std::size_t>(l * H + h);
      INFO("layer " << l << " kv_head " << h);
      REQUIRE(c.length(l, h) == static_cast<std::int32_t>(kept[r].size()));
      for (std::size_t i = 0; i < kept[r].size(); ++i) {
        INFO("slot " << i << " (was " << keep[r][i] << ")");
        REQUIRE(c.slot(l, h, static_cast<std::int64_t>(i)) == kept[r][i]);
      }
    }
  CHECK(freed == expected_freed_pages(c, lengths_before));
}

/// Expects `f` to throw a triattn::error containing every part, the cache byte for byte as it was.
template <class F>
void check_rejected(test_cache& c, F&& f, const std::vector<std::string>& parts) {
  const auto before = c.snapshot();
  try {
    f();
    FAIL("no triattn::error thrown");
  } catch (const triattn::error& err) {
    for (const auto& p : parts) CHECK_THAT(err.what(), Catch::Contains(p));
  }
  CHECK(c.snapshot() == before);
}

}  // namespace triattn_test
