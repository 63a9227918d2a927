// Shared by the `select` tests of tests/tools: a keep row of the CLI against an expected keep
// set computed by the test, allowing near-ties. A slot may differ from the expected set only
// if the expected set chose it by score (not a sink, recent or window slot) and its score is
// within `tie_tolerance` x (the row's largest finite |score|) of the weakest expected score
// kept by score; and no slot chosen by score that the CLI drops may beat one it keeps by more
// than that.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace triattn_test::cli {

/// An expected keep set, ascending, and which slots it ranked by score.
struct expected_keep {
  std::vector<std::int64_t> keep;
  std::vector<bool> ranked;
};

/// The largest finite |s[j]|.
inline double finite_scale(const std::vector<double>& s) {
  double m = 0.0;
  for (const double x : s)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

/// `got` (one row of the CLI's output) against `want` under scores `s`; returns how many slots
/// differ (each at a near-tie).
inline int check_keep(const std::vector<std::int64_t>& got, const std::vector<double>& s, const expected_keep& want,
                      double tie_tolerance) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  const auto n = static_cast<std::int64_t>(s.size());
  REQUIRE(got.size() == want.keep.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(got[i] >= 0);
    REQUIRE(got[i] < n);
    if (i > 0) REQUIRE(got[i] > got[i - 1]);  // ascending, no repeats
  }
  const double tol = tie_tolerance * finite_scale(s);
  std::vector<bool> kept(s.size(), false), want_kept(s.size(), false);
  for (const auto j : got) kept[j] = true;
  for (const auto j : want.keep) want_kept[j] = true;
  double worst_kept = inf, best_dropped = -inf, cut = inf;
  for (std::int64_t j = 0; j < n; ++j) {
    if (!want.ranked[j]) continue;
    if (kept[j]) worst_kept = std::min(worst_kept, s[j]);
    if (!kept[j]) best_dropped = std::max(best_dropped, s[j]);
    if (want_kept[j]) cut = std::min(cut, s[j]);
  }
  INFO("worst kept ranked score " << worst_kept << ", best dropped " << best_dropped << ", tolerance " << tol);
  if (worst_kept < inf && best_dropped > -inf) CHECK(best_dropped - worst_kept <= tol);
  int differ = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    if (kept[j] == want_kept[j]) continue;
    ++differ;
    INFO("slot " << j << ": the CLI " << (kept[j] ? "keeps" : "drops") << " it; expected score " << s[j]
                 << ", expected cut " << cut);
    CHECK(want.ranked[j]);  // a protected slot never differs
    CHECK(std::fabs(s[j] - cut) <= tol);
  }
  return differ;
}

}  // namespace triattn_test::cli
