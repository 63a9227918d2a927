/// \file triattn/policies/triattention_config.hpp
/// \brief TriAttention's options and presets (the policy is in triattention.hpp): shared by the
/// CPU policy and the CUDA scorer, so it needs neither Eigen nor CUDA.
#pragma once

#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/granularity.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the per-offset scores of a key are combined.
enum class offset_aggregation : std::uint8_t {
  mean,  ///< arithmetic mean (reference default); folds into one coefficient set
  max,   ///< largest over the offsets; one coefficient set per offset
};

/// How the q-heads of a GQA group are combined into one score per KV head.
enum class triattention_gqa_reduction : std::uint8_t { max, mean };

struct triattention_config {
  std::int64_t offset_max = 65536;  ///< offsets are the powers of two <= this (17 for 65536)
  offset_aggregation aggregation = offset_aggregation::mean;
  bool disable_trig = false;  ///< ablation: drop the trig term (score = norm term)
  bool disable_norm = false;  ///< ablation: drop the norm term (score = trig term)
  triattention_gqa_reduction gqa_reduction = triattention_gqa_reduction::max;
  bool normalize = true;    ///< z-score each (layer, q-head) row over the candidate slots
  std::int64_t window = 0;  ///< the last `window` slots are always kept

  /// Beyond the paper: three attention-free fixes of score-based eviction, each off at 0. They
  /// act on each (layer, kv_head) row's decision score, after the z-score and the GQA
  /// reduction, in this order: score_ema, then redundancy, then value_protect.
  ///
  /// value_protect: the ceil(value_protect x budget) candidates of the row with the largest
  /// value L2 norm (ties to the lower slot) get `triattention_value_bonus` added. In a per-row
  /// decision they outrank every other candidate; in a decision shared by several rows (the
  /// paper's mean over layers) each row's bonus is a vote. In [0, 1].
  double value_protect = 0.0;
  /// redundancy: δ >= 0. The row's score minus δ x the z-score (over the candidates) of R-KV's
  /// key redundancy of the row (`rkv_redundancy`: mean cosine similarity to the other keys, the
  /// newest near-duplicate spared), with `redundancy_threshold` for near-duplicates.
  float redundancy = 0.0f;
  float redundancy_threshold = 0.5f;
  /// score_ema: β in [0, 1). A slot scored by an earlier round decides on β x its previous
  /// decision score + (1 − β) x this round's; new slots on this round's alone. The history is
  /// per-slot state that moves with compaction, so a policy with β > 0 serves one sequence.
  float score_ema = 0.0f;
  /// One keep set per KV head shared by every layer, the prompt protected (the round's
  /// `prompt_length`), a round when the cache reaches budget + 128.
  round_options round{granularity::per_kv_head, row_reduction::mean, budget_mode::with_prompt, true,
                      schedule::with_slack(128)};

  /// The paper runs (`scripts/cli.py` defaults): the defaults above. Slack trigger: when the
  /// cache reaches budget + 128 tokens, cut it to budget (prompt included).
  static triattention_config paper() { return {}; }

  /// The reference class defaults, as the project's seed article describes them: union
  /// selection over every (layer, q-head) row, one keep set for all layers and heads, raw
  /// (not z-scored) rows as in the class (`normalize_scores=False`), the prompt protected
  /// unless `allow_prefill_compression`, and a round when the decode tokens reach the budget
  /// and the absolute position is a multiple of 128.
  ///
  /// Approximation: the trigger maps to `schedule::aligned_to(128)`, which compares the whole
  /// cache (prompt included) with the budget, whereas the reference counts only the decode
  /// (non-prompt) tokens; with a P-token prompt the first rounds may so fire before the decode
  /// tokens alone reach the budget. Both keep `budget` tokens in total. An engine that wants
  /// the exact rule calls `sched.should_compress(length - prompt_length, budget, position)`
  /// itself, then `compress` with the round's `round_context`.
  static triattention_config seed(bool allow_prefill_compression = false) {
    triattention_config c;
    c.normalize = false;
    c.round.grain = granularity::whole_sequence;
    c.round.reduction = row_reduction::max;
    c.round.protect_prompt = !allow_prefill_compression;
    c.round.sched = schedule::aligned_to(128);
    return c;
  }
};

/// What value_protect adds to a protected slot's score. A z-score of n slots is at most
/// sqrt(n - 1) in magnitude, so 1e4 outranks every unprotected slot of rows up to 10^8 slots,
/// and stays a clear vote when a shared decision averages it over 30 or more layers.
inline constexpr float triattention_value_bonus = 1.0e4f;

TRIATTN_NAMESPACE_END
