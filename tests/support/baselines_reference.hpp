// Slow, double-precision oracles of the accumulated-attention baselines (H2O and VATP),
// transcribed from spec baselines.md §2 and §4 and cli.md, sharing no code with the library.
// The oracle tracks attention by token position, not by slot, so it never needs to know how
// the cache was compacted: a policy whose state did not move with the cache disagrees with it
// at the next round. The library's gqa_aggregation and h2o_config are used only as parameter
// containers.
//
// Also here: `attention_run`, a decode simulation that drives a policy and the oracle with the
// same rows and checks each round's decisions against the oracle.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "support/reference.hpp"
#include "support/round_checks.hpp"
#include "support/views.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/h2o.hpp"

namespace triattn_test {

namespace ref {

/// The attention one sequence has received so far: per (layer, q-head) and token position, the
/// weighted sum of the probabilities the position received and the number of rows that gave them.
class attention_history {
 public:
  attention_history(int layers, int q_heads)
      : q_heads_(q_heads), sums_(static_cast<std::size_t>(layers * q_heads)), rows_(sums_.size()) {}

  /// One row of (layer, q_head): probs[j] went to the token at positions[j].
  void observe(int layer, int q_head, const std::vector<std::int32_t>& positions, std::span<const float> probs,
               double weight) {
    const auto r = index(layer, q_head);
    for (std::size_t j = 0; j < probs.size(); ++j) {
      sums_[r][positions[j]] += weight * static_cast<double>(probs[j]);
      rows_[r][positions[j]] += 1;
    }
  }
  double sum(int layer, int q_head, std::int32_t position) const { return lookup(sums_, layer, q_head, position); }
  double rows(int layer, int q_head, std::int32_t position) const { return lookup(rows_, layer, q_head, position); }

 private:
  int q_heads_;
  std::vector<std::map<std::int32_t, double>> sums_;  // [layer * q_heads + q_head]: position -> sum
  std::vector<std::map<std::int32_t, double>> rows_;  // same index: position -> rows that saw it

  std::size_t index(int layer, int q_head) const { return static_cast<std::size_t>(layer * q_heads_ + q_head); }
  double lookup(const std::vector<std::map<std::int32_t, double>>& m, int layer, int q_head, std::int32_t p) const {
    const auto& row = m[index(layer, q_head)];
    const auto it = row.find(p);
    return it == row.end() ? 0.0 : it->second;
  }
};

/// The weight of a row at `position` in the score (baselines.md §4): 1 for H2O; with the
/// Scissorhands initial score, 1/window for the last `window` prompt rows, nothing (nullopt)
/// for the prompt rows before them, 1 for decode rows.
inline std::optional<double> row_weight(std::int64_t position, bool scissorhands, std::int64_t prompt_length,
                                        std::int64_t window) {
  if (!scissorhands || position >= prompt_length) return 1.0;
  if (position >= prompt_length - window) return 1.0 / static_cast<double>(window);
  return std::nullopt;
}

/// cli.md `h2o` score of the tokens at `positions` for (layer, kv_head): per q-head h of the
/// group, S_h(j) = Σ_rows A[h, row, j] (with `normalize`, divided by the rows that saw j, 0 when
/// none did), then the mean, max or sum over the group.
inline std::vector<double> h2o_scores(const attention_history& hist, int layer, int kv_head, int group,
                                      const std::vector<std::int32_t>& positions, triattn::gqa_aggregation agg,
                                      bool normalize) {
  std::vector<double> out;
  for (const std::int32_t p : positions) {
    std::vector<double> per_head;
    for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      const double rows = hist.rows(layer, h, p);
      per_head.push_back(!normalize ? hist.sum(layer, h, p) : rows > 0 ? hist.sum(layer, h, p) / rows : 0.0);
    }
    double total = 0.0;
    for (const double x : per_head) total += x;
    switch (agg) {
      case triattn::gqa_aggregation::mean: out.push_back(total / group); break;
      case triattn::gqa_aggregation::sum: out.push_back(total); break;
      case triattn::gqa_aggregation::max: out.push_back(*std::max_element(per_head.begin(), per_head.end())); break;
    }
  }
  return out;
}

/// ‖V[l, g, j, :]‖₁ of the slots [0, length) of (layer, kv_head) as stored, decoded by the reference.
inline std::vector<double> value_l1_norms(test_cache& c, int layer, int kv_head) {
  std::vector<double> out;
  for (std::int32_t s = 0; s < c.length(layer, kv_head); ++s) {
    double norm = 0.0;
    for (const double x : c.value(layer, kv_head, s)) norm += std::fabs(x);
    out.push_back(norm);
  }
  return out;
}

/// The value weights of row (layer, kv_head) of `c` (value-aware rounds), from the definition:
/// the mean over the kv head's q-heads h of ‖W_o,h v‖₂, W_o,h the columns [h·D, (h+1)·D) of the
/// layer's `w_o` [hidden, q_heads·D] (row-major), or ‖v‖₂ when `w_o` is empty.
inline std::vector<double> value_weights(test_cache& c, int layer, int kv_head, const std::vector<double>& w_o) {
  const int D = c.shape().head_dim, G = c.shape().group;
  const std::size_t cols = static_cast<std::size_t>(c.shape().num_kv_heads) * G * D;
  std::vector<double> out;
  for (std::int32_t s = 0; s < c.length(layer, kv_head); ++s) {
    const std::vector<double> v = c.value(layer, kv_head, s);
    double w = 0.0;
    if (w_o.empty()) {
      for (const double x : v) w += x * x;
      w = std::sqrt(w);
    } else {
      for (int gi = 0; gi < G; ++gi) {
        const std::size_t col = static_cast<std::size_t>(kv_head * G + gi) * D;
        double sq = 0.0;
        for (std::size_t i = 0; i < w_o.size() / cols; ++i) {
          double y = 0.0;
          for (int a = 0; a < D; ++a) y += w_o[i * cols + col + a] * v[a];
          sq += y * y;
        }
        w += std::sqrt(sq) / G;
      }
    }
    out.push_back(w);
  }
  return out;
}

/// A budget split (cli.md): the last `recent` slots, then `heavy` slots by score, whose first
/// places go to the `sinks` leading slots (VATP's sinks are its top heavy hitters).
struct split_parts {
  std::int64_t recent = 0, heavy = 0, sinks = 0;
};

/// cli.md's default split of a budget B (H2O: recent B/2, heavy B − B/2; VATP: 4 sinks, recent
/// B/2, heavy the rest), with heavy or recent configured as counts taking precedence (the
/// unset part takes what is left). B caps recent first, then heavy, then the sinks.
inline split_parts split_budget(std::int64_t budget, std::optional<std::int64_t> heavy,
                                std::optional<std::int64_t> recent, std::int64_t sinks) {
  split_parts p;
  if (recent) {
    p.recent = std::min(*recent, budget);
  } else if (heavy) {
    p.recent = std::max<std::int64_t>(budget - *heavy, 0);
  } else {
    p.recent = budget / 2;
  }
  p.heavy = heavy ? std::min(*heavy, budget - p.recent) : budget - p.recent;
  p.sinks = std::min(sinks, p.heavy);
  return p;
}

/// A keep set, the gap between the worst kept and the best passed-over scored slot (+inf when
/// the scores chose nothing) and the largest |score|.
struct keep_decision {
  std::vector<std::int32_t> keep;
  double margin = std::numeric_limits<double>::infinity();
  double scale = 0.0;
};

/// Slots kept from `scores` [n]: every slot when n <= recent + heavy; otherwise the first
/// `sinks`, the last `recent` and the (heavy − sinks) best of the others, ties to the lower slot.
inline keep_decision heavy_recent_keep(const std::vector<double>& scores, const split_parts& p) {
  keep_decision d;
  const auto n = static_cast<std::int64_t>(scores.size());
  for (const double x : scores) d.scale = std::max(d.scale, std::fabs(x));
  std::vector<std::int32_t> others;
  for (std::int64_t s = 0; s < n; ++s) {
    if (n <= p.recent + p.heavy || s < p.sinks || s >= n - p.recent) {
      d.keep.push_back(static_cast<std::int32_t>(s));
    } else {
      others.push_back(static_cast<std::int32_t>(s));
    }
  }
  if (n > p.recent + p.heavy) {
    std::stable_sort(others.begin(), others.end(),
                     [&](std::int32_t a, std::int32_t b) { return scores[a] > scores[b]; });
    const auto k = static_cast<std::size_t>(p.heavy - p.sinks);
    d.keep.insert(d.keep.end(), others.begin(), others.begin() + static_cast<std::ptrdiff_t>(k));
    if (k > 0 && k < others.size()) d.margin = scores[others[k - 1]] - scores[others[k]];
    std::sort(d.keep.begin(), d.keep.end());
  }
  return d;
}

/// The split of `budget` under `cfg`: ratios are int(ratio x prompt length) (Python's int()),
/// then `split_budget`.
inline split_parts split_for(const triattn::h2o_config& cfg, std::int64_t budget, std::int64_t prompt_length) {
  const auto count = [&](std::optional<std::int64_t> n, std::optional<double> ratio) -> std::optional<std::int64_t> {
    if (ratio) return static_cast<std::int64_t>(std::floor(*ratio * static_cast<double>(prompt_length)));
    return n;
  };
  return split_budget(budget, count(cfg.heavy, cfg.heavy_ratio), count(cfg.recent, cfg.recent_ratio), cfg.sinks);
}

}  // namespace ref

/// How a test configures the oracle: the scoring of the policy under test.
struct oracle_setup {
  triattn::gqa_aggregation agg = triattn::gqa_aggregation::mean;
  bool normalize = false;
  bool value_norm = false;  ///< VATP
  bool scissorhands = false;
  std::int64_t prompt_length = 0;
  std::int64_t window = 400;
  bool exact = false;  ///< inputs built so that fp32 keeps the oracle's order and ties: compare exactly
};

/// The oracle's options for a policy configured as `cfg`; `value_norm` for VATP.
inline oracle_setup setup_for(const triattn::h2o_config& cfg, bool value_norm, std::int64_t prompt_length) {
  oracle_setup s;
  s.agg = cfg.gqa;
  s.normalize = cfg.normalize;
  s.value_norm = value_norm;
  s.scissorhands = cfg.prompt == triattn::prompt_scoring::last_window;
  s.prompt_length = prompt_length;
  s.window = cfg.scissorhands_window;
  return s;
}

inline constexpr triattn::gqa_aggregation all_aggregations[] = {
    triattn::gqa_aggregation::mean, triattn::gqa_aggregation::max, triattn::gqa_aggregation::sum};

/// A budget below the capacity, so that full rows get cut.
inline std::int64_t random_budget(std::mt19937_64& g, const test_cache& c) {
  return std::uniform_int_distribution<std::int64_t>(1, c.shape().capacity - 1)(g);
}

/// An H2O-family config and budget as one line of a failure message.
inline std::string describe(const triattn::h2o_config& cfg, std::int64_t budget) {
  std::ostringstream os;
  os << "budget " << budget << " heavy " << cfg.heavy.value_or(-1) << " recent " << cfg.recent.value_or(-1)
     << " sinks " << cfg.sinks << " agg " << triattn::gqa_aggregation_name(cfg.gqa) << " normalize " << cfg.normalize;
  return os.str();
}

/// The prompt's length when every cached token is the prompt's: 1 + the largest position held.
inline std::int32_t cached_prompt_length(test_cache& c) {
  std::int32_t p = 0;
  for (int l = 0; l < c.shape().num_layers; ++l)
    for (int h = 0; h < c.shape().num_kv_heads; ++h)
      for (std::int32_t s = 0; s < c.length(l, h); ++s) p = std::max(p, c.position(l, h, s) + 1);
  return p;
}

/// The slots [0, length) of (layer, kv_head), as their positions.
inline std::vector<std::int32_t> slot_positions(test_cache& c, int layer, int kv_head) {
  std::vector<std::int32_t> p;
  for (std::int32_t s = 0; s < c.length(layer, kv_head); ++s) p.push_back(c.position(layer, kv_head, s));
  return p;
}

/// A decode simulation: a test cache, a policy and the oracle's history, fed the same rows.
///
/// Probabilities are multiples of 1/256 ("dyadic"), so that without normalisation, value norms
/// or 1/window weights the library's fp32 sums are exact and its decisions must equal the
/// oracle's bit for bit, ties included; otherwise a decision within a relative 1e-5 of a
/// near-tie may go either way and is checked for being a valid top set instead.
template <class Policy>
class attention_run {
 public:
  attention_run(test_cache& c, Policy& policy, oracle_setup setup, std::mt19937_64& g)
      : c_(c),
        policy_(policy),
        setup_(setup),
        g_(g),
        history_(c.shape().num_layers, c.shape().num_kv_heads * c.shape().group) {
    c_.with_view([&](const auto& v) { policy_.attach(v); });
    for (const std::int32_t p : c_.positions) next_position_ = std::max(next_position_, p + 1);
  }

  int rounds() const { return rounds_; }
  /// (layer, kv_head) decisions checked, and those within a near-tie.
  int decisions() const { return decisions_; }
  int undecided() const { return undecided_; }
  std::int32_t next_position() const { return next_position_; }
  const ref::attention_history& history() const { return history_; }

  /// Dyadic probabilities k/256, k uniform in [1, max_k] (a small max_k makes many ties).
  std::vector<float> random_probs(std::size_t n, int max_k = 32) {
    std::uniform_int_distribution<int> k(1, max_k);
    std::vector<float> p(n);
    for (auto& x : p) x = static_cast<float>(k(g_)) / 256.0f;
    return p;
  }

  /// One row of (layer, q_head) at `position` over the slots [0, n) of its KV head, given to
  /// the policy and, with the oracle's weight, to the history.
  void observe(int layer, int q_head, std::int32_t position, const std::vector<float>& probs) {
    policy_.observe(layer, q_head, position, {}, probs);
    const auto w = ref::row_weight(position, setup_.scissorhands, setup_.prompt_length, setup_.window);
    if (!w) return;
    auto positions = slot_positions(c_, layer, q_head / c_.shape().group);
    positions.resize(probs.size());
    history_.observe(layer, q_head, positions, probs, *w);
  }

  /// A new token at the next position in every (layer, kv_head) with room (fresh random K and
  /// V rows), then its row in every (layer, q_head) over the whole cache.
  void step(int max_k = 32) {
    const std::int32_t pos = next_position_++;
    std::normal_distribution<double> normal(0.0, 1.0);
    for (int l = 0; l < c_.shape().num_layers; ++l)
      for (int h = 0; h < c_.shape().num_kv_heads; ++h) {
        std::int32_t& n = c_.length(l, h);
        if (n >= c_.shape().capacity) continue;
        c_.position(l, h, n) = pos;
        for (int d = 0; d < c_.shape().head_dim; ++d) {
          ref::store(c_.key_row(l, h, n), c_.shape().type, static_cast<std::size_t>(d), normal(g_));
          ref::store(c_.value_row(l, h, n), c_.shape().type, static_cast<std::size_t>(d), normal(g_));
        }
        ++n;
      }
    observe_everything(pos, max_k);
  }

  /// Rows of every (layer, q_head) at `position` over all the slots of its KV head.
  void observe_everything(std::int32_t position, int max_k = 32) {
    const int G = c_.shape().group;
    for (int l = 0; l < c_.shape().num_layers; ++l)
      for (int qh = 0; qh < c_.shape().num_kv_heads * G; ++qh)
        observe(l, qh, position, random_probs(static_cast<std::size_t>(c_.length(l, qh / G)), max_k));
  }

  /// Causal rows over the slots already cached: per (layer, kv_head) one to three prefixes
  /// [0, m), each observed by every q-head of the group at the position of slot m − 1.
  void prefill_rows(int max_k = 32) {
    const int G = c_.shape().group;
    std::uniform_int_distribution<int> rows(1, 3);
    for (int l = 0; l < c_.shape().num_layers; ++l)
      for (int h = 0; h < c_.shape().num_kv_heads; ++h) {
        const std::int32_t n = c_.length(l, h);
        if (n == 0) continue;
        std::uniform_int_distribution<std::int32_t> prefix(1, n);
        for (int r = rows(g_); r > 0; --r) {
          const std::int32_t m = prefix(g_);
          for (int qh = h * G; qh < (h + 1) * G; ++qh)
            observe(l, qh, c_.position(l, h, m - 1), random_probs(static_cast<std::size_t>(m), max_k));
        }
      }
  }

  /// Every causal row over the slots already cached: per (layer, kv_head) and m in [1, length],
  /// the prefix [0, m) observed by every q-head of the group at the position of slot m − 1.
  void causal_prefill(int max_k = 32) {
    const int G = c_.shape().group;
    for (int l = 0; l < c_.shape().num_layers; ++l)
      for (int h = 0; h < c_.shape().num_kv_heads; ++h)
        for (std::int32_t m = 1; m <= c_.length(l, h); ++m)
          for (int qh = h * G; qh < (h + 1) * G; ++qh)
            observe(l, qh, c_.position(l, h, m - 1), random_probs(static_cast<std::size_t>(m), max_k));
  }

  /// Decode steps after the rows already observed: per step a token and its rows, the scores
  /// against the oracle, and a checked round of `budget` split as `parts` whenever `sched` fires.
  void decode(const triattn::schedule& sched, std::int64_t budget, const ref::split_parts& parts, int steps,
              int max_k = 32) {
    for (int t = 0; t < steps; ++t) {
      step(max_k);
      check_scores();
      const std::int32_t longest = *std::max_element(c_.lengths.begin(), c_.lengths.end());
      if (sched.should_compress(longest, budget, next_position_)) compress_and_check(budget, parts);
    }
    check_scores();
  }

  /// `prefill_rows`, then `decode`.
  void simulate(const triattn::schedule& sched, std::int64_t budget, const ref::split_parts& parts, int steps,
                int max_k = 32) {
    prefill_rows(max_k);
    decode(sched, budget, parts, steps, max_k);
  }

  /// The oracle's scores of the slots of (layer, kv_head).
  std::vector<double> oracle_scores(int layer, int kv_head) {
    auto s = ref::h2o_scores(history_, layer, kv_head, c_.shape().group, slot_positions(c_, layer, kv_head),
                             setup_.agg, setup_.normalize);
    if (setup_.value_norm) {
      const auto norms = ref::value_l1_norms(c_, layer, kv_head);
      for (std::size_t j = 0; j < s.size(); ++j) s[j] *= norms[j];
    }
    return s;
  }

  /// `policy.score` against the oracle; slots past a row's length must stay untouched.
  void check_scores() {
    const int L = c_.shape().num_layers, H = c_.shape().num_kv_heads;
    const auto cap = static_cast<std::size_t>(c_.shape().capacity);
    constexpr float untouched = -12345.0f;
    std::vector<float> out(static_cast<std::size_t>(L * H) * cap, untouched);
    c_.with_view([&](const auto& v) { policy_.score(v, out); });
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const auto want = oracle_scores(l, h);
        const auto row = static_cast<std::size_t>(l * H + h) * cap;
        double scale = 0.0;
        for (const double x : want) scale = std::max(scale, std::fabs(x));
        for (std::size_t s = 0; s < cap; ++s) {
          INFO("layer " << l << " kv_head " << h << " slot " << s << " of " << want.size());
          if (s >= want.size()) {
            REQUIRE(out[row + s] == untouched);
          } else {
            REQUIRE(std::fabs(out[row + s] - want[s]) <= 1e-5 * std::fabs(want[s]) + 1e-6 * scale);
          }
        }
      }
  }

  /// One round with `budget` split as `parts`, through `compress`: every (layer, kv_head) must
  /// hold the oracle's keep set (or, near a tie, a valid top set), K, V and positions intact.
  void compress_and_check(std::int64_t budget, const ref::split_parts& parts) {
    const int L = c_.shape().num_layers, H = c_.shape().num_kv_heads;
    std::vector<ref::keep_decision> want;
    std::vector<std::vector<double>> scores;
    std::vector<std::vector<slot_contents>> before;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        scores.push_back(oracle_scores(l, h));
        want.push_back(ref::heavy_recent_keep(scores.back(), parts));
        before.emplace_back();
        for (std::int32_t s = 0; s < c_.length(l, h); ++s) before.back().push_back(c_.slot(l, h, s));
      }
    const auto lengths_before = c_.lengths;
    // The prompt's length reaches the round through its context (H2O's ratio budgets read it).
    const triattn::round_context ctx{.position = next_position_, .prompt_length = setup_.prompt_length};
    const auto result = c_.with_view([&](const auto& v) { return policy_.compress(v, budget, ctx); });
    CHECK(result.freed_pages == expected_freed_pages(c_, lengths_before));
    ++rounds_;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const auto r = static_cast<std::size_t>(l * H + h);
        INFO("round " << rounds_ << " layer " << l << " kv_head " << h << " length " << before[r].size()
                      << " budget " << budget << " split recent " << parts.recent << " heavy " << parts.heavy
                      << " sinks " << parts.sinks);
        // The library's keep set, read back from the survivors' positions.
        std::vector<std::int32_t> got;
        for (std::int32_t i = 0; i < c_.length(l, h); ++i) {
          const auto it = std::find_if(before[r].begin(), before[r].end(),
                                       [&](const slot_contents& b) { return b.position == c_.position(l, h, i); });
          REQUIRE(it != before[r].end());
          REQUIRE(c_.slot(l, h, i) == *it);
          got.push_back(static_cast<std::int32_t>(it - before[r].begin()));
        }
        REQUIRE(std::is_sorted(got.begin(), got.end()));
        ++decisions_;
        const bool decisive = exact() || want[r].margin > 1e-5 * want[r].scale;
        if (decisive) {
          REQUIRE(got == want[r].keep);
        } else {
          ++undecided_;
          check_valid_top_set(scores[r], got, want[r], parts);
        }
      }
  }

 private:
  test_cache& c_;
  Policy& policy_;
  oracle_setup setup_;
  std::mt19937_64& g_;
  ref::attention_history history_;
  std::int32_t next_position_ = 0;
  int rounds_ = 0, decisions_ = 0, undecided_ = 0;

  bool exact() const { return setup_.exact || (!setup_.normalize && !setup_.value_norm && !setup_.scissorhands); }

  /// Near a tie: the same count, every protected slot, and no passed-over slot scoring above a
  /// kept one by more than the fp32 error.
  static void check_valid_top_set(const std::vector<double>& scores, const std::vector<std::int32_t>& got,
                                  const ref::keep_decision& want, const ref::split_parts& parts) {
    REQUIRE(got.size() == want.keep.size());
    const auto n = static_cast<std::int32_t>(scores.size());
    double worst_kept = std::numeric_limits<double>::infinity(), best_dropped = -worst_kept;
    for (std::int32_t s = 0; s < n; ++s) {
      const bool kept = std::binary_search(got.begin(), got.end(), s);
      if (s < parts.sinks || s >= n - parts.recent) {
        REQUIRE(kept);
      } else if (kept) {
        worst_kept = std::min(worst_kept, scores[s]);
      } else {
        best_dropped = std::max(best_dropped, scores[s]);
      }
    }
    REQUIRE(best_dropped <= worst_kept + 1e-5 * want.scale);
  }
};

/// One trial of `Policy` (built from `cfg`) through compress against the oracle: 16 decode
/// steps at `budget` on `c`, adding the run's (layer, kv_head) decisions and near-ties.
template <class Policy, class Config>
void tally_decisions(test_cache& c, const Config& cfg, std::int64_t budget, bool value_norm, std::mt19937_64& g,
                     int& decisions, int& undecided) {
  Policy policy(cfg);
  INFO(c.shape().describe() << " " << describe(cfg, budget));
  attention_run<Policy> run(c, policy, setup_for(cfg, value_norm, 0), g);
  run.simulate(cfg.round.sched, budget, ref::split_for(cfg, budget, 0), 16);
  decisions += run.decisions();
  undecided += run.undecided();
}

}  // namespace triattn_test
