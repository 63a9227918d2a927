// Double-precision oracles of the window-scored policies, SnapKV and R-KV, transcribed from
// the formulas of spec/cli.md and baselines.md §3 and §5 with plain loops (no Eigen, no
// library code, no test framework), so that both the Catch2 tests (window_reference.hpp) and
// the CUDA tests (cuda/reference_window.cpp, built without Eigen and Catch2) use one oracle.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

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

}  // namespace triattn_test
