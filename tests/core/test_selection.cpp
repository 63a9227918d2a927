// Selection (top-k, union, pooling, protected keep sets) against naive oracles on random
// scores with many ties and NaNs.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/selection.hpp"

namespace {

using index_list = std::vector<std::int32_t>;
constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float qnan = std::numeric_limits<float>::quiet_NaN();

// --- oracles -----------------------------------------------------------------------------

/// Indices in rank order: a stable sort by descending score (so equal scores keep index
/// order), NaNs after every number.
index_list rank_order(const std::vector<float>& scores, const std::vector<bool>& allowed = {}) {
  index_list idx;
  for (std::size_t i = 0; i < scores.size(); ++i)
    if (allowed.empty() || allowed[i]) idx.push_back(static_cast<std::int32_t>(i));
  std::stable_sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) {
    const bool na = std::isnan(scores[a]), nb = std::isnan(scores[b]);
    if (na || nb) return !na && nb;
    return scores[a] > scores[b];
  });
  return idx;
}

/// The first `k` of the rank order (restricted to `allowed`), unsorted.
index_list best(const std::vector<float>& scores, std::int64_t k, const std::vector<bool>& allowed = {}) {
  index_list r = rank_order(scores, allowed);
  r.resize(static_cast<std::size_t>(std::clamp<std::int64_t>(k, 0, static_cast<std::int64_t>(r.size()))));
  return r;
}

index_list sorted(index_list v) {
  std::sort(v.begin(), v.end());
  return v;
}

/// The spec's "union" (triattention.md §5): each row takes its top-k and the rows' picks are
/// united; if the union has >= k members the k best of it by the max-over-rows score are kept,
/// otherwise all of it plus the best of the rest by that score. Ascending.
index_list union_oracle(const std::vector<std::vector<float>>& rows, std::size_t n, std::int64_t k) {
  std::vector<float> combined(n, -inf);
  std::set<std::int32_t> united;
  for (const auto& row : rows) {
    for (std::size_t j = 0; j < n; ++j)
      if (!std::isnan(row[j])) combined[j] = std::max(combined[j], row[j]);
    for (const auto j : best(row, k)) united.insert(j);
  }
  std::vector<bool> in_union(n, false);
  for (const auto j : united) in_union[j] = true;
  if (static_cast<std::int64_t>(united.size()) >= k) return sorted(best(combined, k, in_union));
  index_list out(united.begin(), united.end());
  std::vector<bool> rest(n);
  for (std::size_t j = 0; j < n; ++j) rest[j] = !in_union[j];
  for (const auto j : best(combined, k - static_cast<std::int64_t>(united.size()), rest)) out.push_back(j);
  return sorted(out);
}

/// Pooling over an explicitly padded copy (pad value 0 for avg, -inf for max), in double.
std::vector<double> pool_oracle(const std::vector<float>& x, int kernel, triattn::pooling kind) {
  const auto pad = static_cast<std::size_t>(kernel / 2);
  const double pad_value = kind == triattn::pooling::max ? -HUGE_VAL : 0.0;
  std::vector<double> padded(pad, pad_value);
  padded.insert(padded.end(), x.begin(), x.end());
  padded.insert(padded.end(), pad, pad_value);
  std::vector<double> out(x.size());
  for (std::size_t j = 0; j < x.size(); ++j) {
    double acc = kind == triattn::pooling::max ? -HUGE_VAL : 0.0;
    for (int t = 0; t < kernel; ++t) {
      const double v = padded[j + static_cast<std::size_t>(t)];
      acc = kind == triattn::pooling::max ? std::max(acc, v) : acc + v;
    }
    out[j] = kind == triattn::pooling::max ? acc : acc / kernel;
  }
  return out;
}

/// Protected slots first (the lowest ones if they exceed the budget), then the best others.
index_list keep_oracle(const std::vector<float>& scores, const index_list& positions, const triattn::protection& p,
                       std::int64_t budget) {
  const auto n = static_cast<std::int64_t>(scores.size());
  index_list all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  if (budget >= n) return all;
  index_list keep;
  std::vector<bool> free_slot(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int64_t pos = positions.empty() ? s : positions[s];
    const bool prot = s < p.first || n - s <= p.last || pos < p.prompt_length;
    free_slot[s] = !prot;
    if (prot) keep.push_back(static_cast<std::int32_t>(s));
  }
  if (static_cast<std::int64_t>(keep.size()) >= budget) {
    keep.resize(static_cast<std::size_t>(budget));
    return keep;
  }
  for (const auto j : best(scores, budget - static_cast<std::int64_t>(keep.size()), free_slot)) keep.push_back(j);
  return sorted(keep);
}

// --- inputs ------------------------------------------------------------------------------

/// Scores with many exact ties (a handful of values, both zeros), some NaNs and infinities.
std::vector<float> tied_scores(std::mt19937_64& g, std::size_t n) {
  const float values[] = {-1.5f, -0.0f, 0.0f, 0.25f, 0.25f, 3.0f, 7.0f, inf, -inf, qnan};
  std::uniform_int_distribution<std::size_t> pick(0, std::size(values) - 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::bernoulli_distribution tie(0.6);
  std::vector<float> s(n);
  for (auto& x : s) x = tie(g) ? values[pick(g)] : normal(g);
  return s;
}

/// k values worth trying for n candidates: the edges and a random one.
std::vector<std::int64_t> ks(std::mt19937_64& g, std::int64_t n) {
  std::uniform_int_distribution<std::int64_t> any(0, n + 3);
  return {0, 1, n / 2, n - 1 > 0 ? n - 1 : 0, n, n + 1, n + 7, any(g)};
}

std::string show(const index_list& v) {
  std::string s = "[";
  for (const auto x : v) s += std::to_string(x) + " ";
  return s + "]";
}

}  // namespace

TEST_CASE("top_k takes the best, ties to the lower index, NaN last, ascending output") {
  auto g = triattn_test::rng(301);
  std::uniform_int_distribution<std::size_t> size(0, 64);
  for (int trial = 0; trial < 300; ++trial) {
    const auto scores = tied_scores(g, trial < 3 ? static_cast<std::size_t>(trial) : size(g));
    for (const auto k : ks(g, static_cast<std::int64_t>(scores.size()))) {
      const auto got = triattn::top_k(scores, k);
      const auto want = sorted(best(scores, k));
      INFO("n " << scores.size() << " k " << k << " got " << show(got) << " want " << show(want));
      REQUIRE(got == want);
    }
  }
  // Spelled out: NaN never beats a number, even -inf; ties go to the lower slot.
  const std::vector<float> s = {qnan, -inf, 2.0f, 2.0f, qnan, 2.0f};
  CHECK(triattn::top_k(s, 2) == index_list{2, 3});
  CHECK(triattn::top_k(s, 4) == index_list{1, 2, 3, 5});
  CHECK(triattn::top_k(s, 5) == index_list{0, 1, 2, 3, 5});
}

TEST_CASE("union_select matches the spec's union description") {
  auto g = triattn_test::rng(302);
  std::uniform_int_distribution<std::size_t> size(0, 40);
  std::uniform_int_distribution<int> num_rows(1, 5);
  std::bernoulli_distribution tied(0.5);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t n = size(g);
    const int r = num_rows(g);
    std::vector<std::vector<float>> rows;
    std::vector<float> flat;
    const bool with_ties = tied(g);
    for (int i = 0; i < r; ++i) {
      rows.push_back(with_ties ? tied_scores(g, n) : triattn_test::normal_floats(g, n));
      flat.insert(flat.end(), rows.back().begin(), rows.back().end());
    }
    for (const auto k : ks(g, static_cast<std::int64_t>(n))) {
      const auto got = triattn::union_select(flat, r, static_cast<std::int64_t>(n), k);
      const auto want = union_oracle(rows, n, k);
      INFO("rows " << r << " n " << n << " k " << k << " got " << show(got) << " want " << show(want));
      REQUIRE(got == want);
    }
  }
  // Spelled out: row 0 picks {0, 1}, row 1 picks {2, 3}; combined max = {5, 4, 9, 1}: union
  // has 4 >= 2 members and the best two by combined are 2 and 0.
  CHECK(triattn::union_select(std::vector<float>{5, 4, 0, 0, 0, 0, 9, 1}, 2, 4, 2) == index_list{0, 2});
}

TEST_CASE("pool1d matches a loop over a padded copy") {
  auto g = triattn_test::rng(303);
  std::uniform_int_distribution<std::size_t> size(1, 50);
  for (const int kernel : {1, 3, 5, 7}) {
    for (const auto kind : {triattn::pooling::avg, triattn::pooling::max}) {
      for (int trial = 0; trial < 20; ++trial) {
        const std::size_t n = trial < 4 ? static_cast<std::size_t>(trial + 1) : size(g);  // incl. n < kernel
        const auto x = triattn_test::normal_floats(g, n, 3.0f);
        std::vector<float> out(n, qnan);
        triattn::pool1d(x, out, kernel, kind);
        const auto want = pool_oracle(x, kernel, kind);
        for (std::size_t j = 0; j < n; ++j) {
          INFO("kernel " << kernel << (kind == triattn::pooling::max ? " max" : " avg") << " n " << n << " j " << j);
          if (kind == triattn::pooling::max) {
            REQUIRE(static_cast<double>(out[j]) == want[j]);
          } else {
            REQUIRE(out[j] == Approx(want[j]).margin(1e-6).epsilon(1e-5));
          }
        }
      }
    }
  }
  // Spelled out: the edges count the zero padding in the divisor (PyTorch count_include_pad).
  std::vector<float> out(2);
  triattn::pool1d(std::vector<float>{3.0f, 6.0f}, out, 3, triattn::pooling::avg);
  CHECK(out == std::vector<float>{3.0f, 3.0f});
  triattn::pool1d(std::vector<float>{-3.0f, -6.0f}, out, 5, triattn::pooling::max);
  CHECK(out == std::vector<float>{-3.0f, -3.0f});
}

TEST_CASE("pool1d rejects an even kernel and a wrong output size") {
  const std::vector<float> x = {1, 2, 3, 4};
  std::vector<float> out(4);
  for (const int kernel : {0, 2, 4, -1}) {
    INFO("kernel " << kernel);
    CHECK_THROWS_MATCHES(triattn::pool1d(x, out, kernel, triattn::pooling::avg), triattn::error,
                         Catch::Matchers::Message("triattn::pool1d: kernel " + std::to_string(kernel) +
                                                  " must be odd and >= 1"));
  }
  std::vector<float> short_out(3);
  CHECK_THROWS_WITH(triattn::pool1d(x, short_out, 3, triattn::pooling::max),
                    Catch::Matchers::Contains("triattn::pool1d") && Catch::Matchers::Contains("output size 3"));
}

TEST_CASE("select_keep keeps protected slots first, then the best others") {
  auto g = triattn_test::rng(304);
  std::uniform_int_distribution<std::int64_t> size(0, 48);
  std::bernoulli_distribution with_positions(0.7), tied(0.5);
  for (int trial = 0; trial < 1500; ++trial) {
    const std::int64_t n = size(g);
    const auto scores = tied(g) ? tied_scores(g, static_cast<std::size_t>(n))
                                : triattn_test::normal_floats(g, static_cast<std::size_t>(n));
    std::uniform_int_distribution<std::int64_t> upto(0, n + 2);
    triattn::protection p{upto(g) / 2, upto(g) / 2, 0};
    index_list positions;
    if (with_positions(g)) {  // ascending positions with gaps, as after earlier rounds
      std::uniform_int_distribution<std::int32_t> gap(1, 3);
      std::int32_t at = gap(g) - 1;
      for (std::int64_t s = 0; s < n; ++s, at += gap(g)) positions.push_back(at);
      std::uniform_int_distribution<std::int64_t> prompt(0, at + 1);
      p.prompt_length = prompt(g);
    }
    std::uniform_int_distribution<std::int64_t> budget_of(1, n + 3);
    const std::int64_t budget = budget_of(g);
    const auto got = triattn::select_keep(scores, positions, p, budget);
    const auto want = keep_oracle(scores, positions, p, budget);
    INFO("n " << n << " budget " << budget << " first " << p.first << " last " << p.last << " prompt "
              << p.prompt_length << " got " << show(got) << " want " << show(want));
    REQUIRE(got == want);
  }
  // Spelled out: 6 protected slots {0, 1, 2, 7, 8, 9} and a budget of 4 keep the lowest four,
  // however well slot 5 scores.
  const std::vector<float> s = {0, 0, 0, 0, 0, 100, 0, 0, 0, 0};
  CHECK(triattn::select_keep(s, {}, {3, 3, 0}, 4) == index_list{0, 1, 2, 7});
  CHECK(triattn::select_keep(s, {}, {1, 1, 0}, 3) == index_list{0, 5, 9});
  const index_list pos = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  CHECK(triattn::select_keep(s, pos, {0, 0, 12}, 3) == index_list{0, 1, 5});
  CHECK(triattn::select_keep(s, {}, {0, 0, 0}, 10) == index_list{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("rank_key sorts as ranks_before: protected first, NaN last, -0 ties +0") {
  auto g = triattn_test::rng(41);
  const float special[] = {0.0f, -0.0f, inf, -inf, qnan, -qnan, 1.0f, -1.0f, 1e-45f, -1e-45f,
                           std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest()};
  std::normal_distribution<float> normal(0.0f, 10.0f);
  std::uniform_int_distribution<int> pick(0, 15);
  for (int trial = 0; trial < 20000; ++trial) {
    const auto draw = [&] { const int i = pick(g); return i < 12 ? special[i] : normal(g); };
    const float a = draw(), b = draw();
    const bool pa = pick(g) == 0, pb = pick(g) == 0;
    const std::int64_t ia = trial % 7, ib = trial % 5;
    // ranks_before over (protected, score, slot): protected slots first, by slot.
    const bool expected = pa != pb ? pa : (pa ? ia < ib : triattn::ranks_before(a, ia, b, ib));
    const std::uint32_t ka = triattn::rank_key(a, pa), kb = triattn::rank_key(b, pb);
    INFO("a " << a << (pa ? " protected" : "") << " slot " << ia << ", b " << b << (pb ? " protected" : "") << " slot " << ib);
    CHECK((ka < kb || (ka == kb && ia < ib)) == expected);
  }
}
