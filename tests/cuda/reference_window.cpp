// CPU references of the SnapKV and R-KV kernels: the double-precision oracle (host C++ only,
// no Eigen, no Catch2).
#include "cuda/reference_window.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>

#include "support/window_oracle.hpp"

namespace triattn_cuda_test::cpu {

namespace {

namespace ref = triattn_test::ref;

/// The oracle's inputs for (l, kv_head h): the group's queries [G][rows][D] and the keys.
ref::window_row row_of(triattn_test::test_cache& cache, const sequence_queries& queries, int l, int h) {
  const auto& s = cache.shape();
  const auto D = static_cast<std::size_t>(s.head_dim), rows = static_cast<std::size_t>(queries.rows);
  const std::size_t q_heads = static_cast<std::size_t>(s.num_kv_heads) * static_cast<std::size_t>(s.group);
  ref::window_row r;
  r.q_pos = queries.positions;
  for (int gi = 0; gi < s.group; ++gi) {
    const std::size_t head = static_cast<std::size_t>(h) * static_cast<std::size_t>(s.group) + static_cast<std::size_t>(gi);
    r.q.emplace_back();
    for (std::size_t i = 0; i < rows; ++i) {
      const auto at = queries.q.begin() + static_cast<std::ptrdiff_t>(((static_cast<std::size_t>(l) * q_heads + head) * rows + i) * D);
      r.q.back().emplace_back(at, at + static_cast<std::ptrdiff_t>(D));
    }
  }
  for (std::int32_t slot = 0; slot < cache.length(l, h); ++slot) {
    r.k.push_back(cache.key(l, h, slot));
    r.k_pos.push_back(cache.position(l, h, slot));
  }
  return r;
}

/// The plan of `scores` for `budget` into `e` (everything when the row fits).
void plan_into(window_expectation& e, std::int64_t budget) {
  const auto n = static_cast<std::int64_t>(e.scores.size());
  e.keep_margin = std::numeric_limits<double>::infinity();
  if (n <= budget) {
    e.keep.resize(static_cast<std::size_t>(n));
    std::iota(e.keep.begin(), e.keep.end(), 0);
    return;
  }
  const ref::window_keep d = ref::keep_best(e.scores, budget);
  e.keep = d.keep;
  e.keep_margin = d.margin;
  // The weakest kept and the best dropped: the kept slot of lowest score vs the dropped of highest.
  double weakest = ref::inf, best_dropped = -ref::inf;
  std::vector<bool> kept(static_cast<std::size_t>(n), false);
  for (const auto s : d.keep) kept[static_cast<std::size_t>(s)] = true;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    if (kept[j]) weakest = std::min(weakest, e.scores[j]);
    if (!kept[j]) best_dropped = std::max(best_dropped, e.scores[j]);
  }
  e.tied_cut = weakest == best_dropped && weakest != ref::inf;  // +inf: the cut falls inside the window
}

ref::group_rule rule_of(triattn::gqa_aggregation a) {
  switch (a) {
    case triattn::gqa_aggregation::max: return ref::group_rule::max;
    case triattn::gqa_aggregation::sum: return ref::group_rule::sum;
    case triattn::gqa_aggregation::mean: break;
  }
  return ref::group_rule::mean;
}

}  // namespace

window_expectation expect(triattn_test::test_cache& cache, const sequence_queries& queries, int l, int h,
                          const triattn::snapkv_config& config, std::int64_t budget) {
  const ref::window_row in = row_of(cache, queries, l, h);
  window_expectation e;
  const ref::matrix votes = ref::snapkv_votes(in, config.window, config.kernel, config.pool == triattn::pooling::max);
  e.scores = ref::snapkv_scores(votes, in.k.size(), rule_of(config.gqa));
  e.threshold_margin = ref::inf;
  plan_into(e, budget);
  return e;
}

window_expectation expect(triattn_test::test_cache& cache, const sequence_queries& queries, int l, int h,
                          const triattn::rkv_config& config, std::int64_t budget) {
  const ref::window_row in = row_of(cache, queries, l, h);
  window_expectation e;
  e.threshold_margin = ref::inf;
  e.scores = ref::rkv_scores(in, config.window, config.kernel, config.lambda, config.threshold, e.threshold_margin);
  plan_into(e, budget);
  return e;
}

}  // namespace triattn_cuda_test::cpu
