/// \file triattn/policies/triattention.hpp
/// \brief TriAttention (Mao et al. 2026): scores each cached key from calibrated pre-RoPE query
/// statistics and the RoPE geometry alone, with no attention computed.
///
/// **Score** (spec triattention.md §4), per (layer ℓ, q-head h) and key of position p, with
/// a = the RoPE attention scale (`rope_desc::attention_scale`, HF `attention_scaling`), κ_f the
/// pre-RoPE key band, q̄_f and m_f the stats, r the round start and O = {1, 2, 4, ..., 2^j <=
/// offset_max}:
///
///     S = agg_{o ∈ O} Σ_f a² |q̄_f| |κ_f| cos((r + o − p) w_f + φ_f) + Σ_f a² (m_f − |q̄_f|) |κ_f|,
///     φ_f = arg(q̄_f conj κ_f),  agg = mean (default) or max.
///
/// This is Hugging Face's definition (the paper path). With a = 1 (every model but YaRN ones)
/// it is the reference's raw score; the reference's vLLM scorer never divides by a and so
/// returns a × S (a uniform factor: same ranking). It is computed in the folded one-pass form
/// of triattention_math.hpp: post-RoPE bands are K_f = a e^{i p w_f} κ_f, so the coefficients
/// carry one factor a for post-RoPE keys and a² for pre-RoPE keys.
///
/// **Decision** (spec §5–7). `paper()` (the defaults): z-score each (ℓ, h) row over the
/// candidate (non-protected) slots with the population std floored at 1e-6, max over the GQA
/// group, mean over layers, then per KV head the protected slots plus the top of the rest
/// (ties to the lower slot), one keep set per KV head applied to every layer. `seed()`: the
/// reference class's union selection, one keep set for every layer and head. Protected slots
/// (prompt, recent window) count in the budget.
///
/// **Round start** r is the position of the next token. `maybe_compress` passes its
/// `position` through `set_position`; a `compress(view, budget)` without it uses 1 + the
/// largest position any slot holds.
///
/// **Non-finite keys**: scoring throws `triattn::error` naming the API and the (layer, kv_head,
/// slot); since scoring runs before compaction, a failed round leaves the cache untouched.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/triattention_math.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the per-offset scores of a key are combined.
enum class offset_aggregation : std::uint8_t {
  mean,  ///< arithmetic mean (reference default); folds into one coefficient set
  max,   ///< largest over the offsets; one coefficient set per offset
};

/// Which slots share one keep set.
enum class triattention_granularity : std::uint8_t {
  per_kv_head,        ///< one set per KV head, the same in every layer (paper runs)
  per_layer_kv_head,  ///< one set per (layer, KV head)
  global_union,       ///< one set for every layer and head, by union selection (reference class default)
};

/// How the q-heads of a GQA group are combined into one score per KV head.
enum class triattention_gqa_reduction : std::uint8_t { max, mean };

struct triattention_config {
  std::int64_t offset_max = 65536;  ///< offsets are the powers of two <= this (17 for 65536)
  offset_aggregation aggregation = offset_aggregation::mean;
  bool disable_trig = false;  ///< ablation: drop the trig term (score = norm term)
  bool disable_norm = false;  ///< ablation: drop the norm term (score = trig term)
  triattention_granularity granularity = triattention_granularity::per_kv_head;
  triattention_gqa_reduction gqa_reduction = triattention_gqa_reduction::max;  ///< not used by global_union
  bool normalize = true;                       ///< z-score each (layer, q-head) row over the candidate slots
  std::int64_t window = 0;                     ///< the last `window` slots are always kept
  bool protect_prompt = true;                  ///< slots holding a position < prompt_length are always kept
  std::int64_t prompt_length = 0;              ///< the prompt's token count; set it after prefill
  schedule sched = schedule::with_slack(128);  ///< the trigger to pass to `maybe_compress`

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
  /// itself, then `set_position(position)` and `compress`.
  static triattention_config seed(bool allow_prefill_compression = false) {
    triattention_config c;
    c.granularity = triattention_granularity::global_union;
    c.normalize = false;
    c.protect_prompt = !allow_prefill_compression;
    c.sched = schedule::aligned_to(128);
    return c;
  }
};

class triattention : public policy_base<triattention> {
 public:
  triattention_config config;

  /// A policy for the model `stats` was calibrated on; `stats` is checked for consistency now
  /// and against each view's geometry at every call.
  explicit triattention(query_stats stats, triattention_config c = triattention_config::paper())
      : config(c), stats_(std::move(stats)) {
    const char* api = "triattn::triattention";
    stats_.validate(api);
    validate_config(api);
  }

  const query_stats& stats() const { return stats_; }

  /// Sets the round start r (the position of the next token) for the next `plan` only.
  void set_position(std::int64_t next_position) {
    TRIATTN_CHECK(next_position >= 0, "triattn::triattention::set_position", "position ", next_position,
                  " must be >= 0");
    next_position_ = next_position;
  }
  /// The round start set for the next `plan`, if any.
  std::optional<std::int64_t> next_position() const { return next_position_; }

  /// Raw scores (not normalised) at round start `round_start`, into `out`
  /// [num_layers, num_q_heads, capacity]; slots >= length of their (layer, kv_head) are left
  /// as they are. What `triattn score triattention` writes.
  template <KVCacheView V>
  void score(const V& view, std::int64_t round_start, std::span<float> out) const {
    const char* api = "triattn::triattention::score";
    check_inputs(api, view);
    const kv_geometry& g = view.geometry();
    const auto want = static_cast<std::size_t>(g.num_layers) * g.num_q_heads * view.capacity();
    TRIATTN_CHECK(out.size() == want, api, "output holds ", out.size(), " scores, expected num_layers ", g.num_layers,
                  " x num_q_heads ", g.num_q_heads, " x capacity ", view.capacity());
    score_into(api, view, round_start, out);
  }

  /// Keep plan for a round cutting `view` to `budget` tokens per (layer, kv_head). Uses and
  /// clears the position given to `set_position`; without one, r = 1 + the largest position
  /// held. Throws (and changes nothing) for a bad budget or view, stats that do not match the
  /// view, non-finite keys, a round start not above every cached position, or, with a shared
  /// granularity, (layer, kv_head) rows that do not hold the same positions.
  template <KVCacheView V>
  keep_plan plan(const V& view, std::int64_t budget) {
    const char* api = "triattn::triattention::plan";
    const std::optional<std::int64_t> given = std::exchange(next_position_, std::nullopt);
    TRIATTN_CHECK(budget >= 1, api, "budget ", budget, " must be >= 1");
    check_inputs(api, view);
    if (config.granularity != triattention_granularity::per_layer_kv_head) check_shared_slots(api, view);

    const kv_geometry& g = view.geometry();
    const std::int64_t last = largest_position(view);
    TRIATTN_CHECK(!given || *given > last, api, "round start ", given.value_or(0),
                  " must be above the largest cached position ", last);
    const std::int64_t round_start = given ? *given : last + 1;

    // [layers, q_heads, capacity]
    std::vector<float> scores(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * view.capacity());
    score_into(api, view, round_start, scores);
    if (config.granularity == triattention_granularity::per_layer_kv_head) return plan_per_layer(view, budget, scores);
    if (config.granularity == triattention_granularity::global_union) return plan_union(view, budget, scores);
    return plan_per_kv_head(view, budget, scores);
  }

 private:
  query_stats stats_;
  std::optional<std::int64_t> next_position_;

  void validate_config(const char* api) const {
    TRIATTN_CHECK(config.offset_max >= 1, api, "offset_max ", config.offset_max, " must be >= 1");
    TRIATTN_CHECK(config.window >= 0, api, "window ", config.window, " must be >= 0");
    TRIATTN_CHECK(config.prompt_length >= 0, api, "prompt_length ", config.prompt_length, " must be >= 0");
  }

  template <KVCacheView V>
  void check_inputs(const char* api, const V& view) const {
    validate_config(api);
    view.validate(api);
    stats_.check_against(api, view.geometry());
  }

  /// Shared granularities apply one index set to several (layer, kv_head) rows, which is only
  /// meaningful when those rows hold the same positions in the same slots.
  template <KVCacheView V>
  void check_shared_slots(const char* api, const V& view) const {
    const kv_geometry& g = view.geometry();
    const bool global = config.granularity == triattention_granularity::global_union;
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const int rh = global ? 0 : h;  // the reference row is (layer 0, rh)
        const std::int32_t n = view.length(l, h), rn = view.length(0, rh);
        TRIATTN_CHECK(n == rn, api, "layer ", l, " kv_head ", h, " holds ", n, " slots but layer 0 kv_head ", rh,
                      " holds ", rn, global ? ": global_union" : ": per_kv_head",
                      " granularity needs every layer to hold the same slots");
        for (std::int32_t s = 0; s < n; ++s)
          TRIATTN_CHECK(view.position(l, h, s) == view.position(0, rh, s), api, "layer ", l, " kv_head ", h, " slot ",
                        s, " holds position ", view.position(l, h, s), " but layer 0 kv_head ", rh, " holds ",
                        view.position(0, rh, s), global ? ": global_union" : ": per_kv_head",
                        " granularity needs every layer to hold the same slots");
      }
    }
  }

  template <KVCacheView V>
  static std::int64_t largest_position(const V& view) {
    std::int64_t last = -1;
    for (int l = 0; l < view.geometry().num_layers; ++l)
      for (int h = 0; h < view.geometry().num_kv_heads; ++h)
        for (std::int32_t s = 0; s < view.length(l, h); ++s)
          last = std::max<std::int64_t>(last, view.position(l, h, s));
    return last;
  }

  /// The folded scorer: coefficients once per (layer, q-head), key bands and moduli once per
  /// (layer, kv_head, slot) and shared by the q-heads of the group.
  template <KVCacheView V>
  void score_into(const char* api, const V& view, std::int64_t round_start, std::span<float> out) const {
    const kv_geometry& g = view.geometry();
    const int F = g.head_dim / 2, G = g.group_size();
    const std::int64_t cap = view.capacity();
    // w from the view's RoPE, which rotated the keys; the stats' copy is only checked against it.
    std::vector<double> w(static_cast<std::size_t>(F));
    for (int f = 0; f < F; ++f) w[f] = inv_freq(g.rope, g.head_dim, f);
    const int num_offsets = triattention_num_offsets(config.offset_max);
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(num_offsets));
    for (int j = 0; j < num_offsets; ++j) offsets[j] = triattention_offset(j);
    // Mean aggregation folds every offset into one phasor set; max needs one set per offset.
    const int sets = config.aggregation == offset_aggregation::mean ? 1 : num_offsets;
    const int per_set = num_offsets / sets;
    std::vector<double> w_re(static_cast<std::size_t>(sets) * F), w_im(w_re.size());  // [sets, F]
    for (int j = 0; j < sets; ++j)
      triattention_phasors(w.data(), F, round_start, offsets.data() + j * per_set, per_set, w_re.data() + j * F,
                           w_im.data() + j * F);
    const double scale = triattention_coefficient_scale(stats_.attention_scale, g.keys);

    std::vector<float> c_re(static_cast<std::size_t>(G) * sets * F, 0.0f), c_im(c_re.size(), 0.0f);  // [G, sets, F]
    std::vector<float> e(static_cast<std::size_t>(G) * F, 0.0f);                                     // [G, F]
    std::vector<float> key(static_cast<std::size_t>(g.head_dim)), k_re(F), k_im(F), k_abs(F);
    for (int l = 0; l < g.num_layers; ++l) {
      for (int kvh = 0; kvh < g.num_kv_heads; ++kvh) {
        for (int gi = 0; gi < G; ++gi) {
          const std::size_t row = stats_.row(l, kvh * G + gi);
          const float *qr = stats_.q_mean_real.data() + row, *qi = stats_.q_mean_imag.data() + row;
          for (int j = 0; j < sets && !config.disable_trig; ++j)
            triattention_trig_coefficients(qr, qi, w_re.data() + j * F, w_im.data() + j * F, F, scale,
                                           c_re.data() + (gi * sets + j) * F, c_im.data() + (gi * sets + j) * F);
          if (!config.disable_norm)
            triattention_norm_coefficients(qr, qi, stats_.q_abs_mean.data() + row, F, scale, e.data() + gi * F);
        }
        for (std::int32_t s = 0; s < view.length(l, kvh); ++s) {
          load_key(view, l, kvh, s, key.data());
          for (int d = 0; d < g.head_dim; ++d)
            TRIATTN_CHECK(std::isfinite(key[d]), api, "key of layer ", l, " kv_head ", kvh, " slot ", s, " has ",
                          key[d], " at dim ", d, ": keys must be finite");
          triattention_key_bands(key.data(), g.head_dim, g.rope.style, k_re.data(), k_im.data(), k_abs.data());
          if (g.keys == key_state::pre_rope)
            triattention_rotate_bands(k_re.data(), k_im.data(), w.data(), F, view.position(l, kvh, s));
          for (int gi = 0; gi < G; ++gi)
            out[(static_cast<std::size_t>(l) * g.num_q_heads + kvh * G + gi) * cap + s] =
                triattention_key_score(c_re.data() + gi * sets * F, c_im.data() + gi * sets * F, sets,
                                       e.data() + gi * F, k_re.data(), k_im.data(), k_abs.data(), F);
        }
      }
    }
  }

  protection protected_slots() const { return {0, config.window, config.protect_prompt ? config.prompt_length : 0}; }

  /// Positions [n] and candidate flags [n] (1 = not protected) of the first n slots of (l, h).
  template <KVCacheView V>
  void slot_info(const V& view, int l, int h, std::vector<std::int32_t>& positions,
                 std::vector<std::uint8_t>& candidate) const {
    const std::int32_t n = view.length(l, h);
    const protection prot = protected_slots();
    positions.resize(static_cast<std::size_t>(n));
    candidate.resize(static_cast<std::size_t>(n));
    for (std::int32_t s = 0; s < n; ++s) {
      positions[s] = view.position(l, h, s);
      candidate[s] = is_protected(prot, s, n, positions[s]) ? 0 : 1;
    }
  }

  /// z-scores `row` over its candidate slots: population std, floored at 1e-6 (the HF path).
  /// The row statistics accumulate in double: n reaches 10^5 and the mean can dwarf the spread.
  static void normalize_row(std::span<float> row, std::span<const std::uint8_t> candidate) {
    double sum = 0.0, sq = 0.0;
    std::int64_t n = 0;
    for (std::size_t s = 0; s < row.size(); ++s)
      if (candidate[s]) {
        sum += row[s];
        ++n;
      }
    if (n == 0) return;
    const double mean = sum / static_cast<double>(n);
    for (std::size_t s = 0; s < row.size(); ++s)
      if (candidate[s]) sq += triattention_squared_deviation(row[s], mean);
    const double std_dev = triattention_row_std(sq, n);
    for (float& x : row) x = triattention_zscore(x, mean, std_dev);
  }

  /// The row of (l, q-head) in the score buffer [layers, q_heads, capacity], first n slots.
  template <KVCacheView V>
  static std::span<float> score_row(const V& view, std::span<float> scores, int l, int qh, std::int32_t n) {
    const auto at = (static_cast<std::size_t>(l) * view.geometry().num_q_heads + qh) * view.capacity();
    return scores.subspan(at, static_cast<std::size_t>(n));
  }

  /// Adds `weight` x the GQA reduction of the q-head rows of (l, kv_head h) to `acc` [n].
  template <KVCacheView V>
  void add_group_score(const V& view, std::span<float> scores, int l, int h, float weight, std::span<float> acc) const {
    const int G = view.geometry().group_size();
    const bool max = config.gqa_reduction == triattention_gqa_reduction::max;
    const auto first = score_row(view, scores, l, h * G, static_cast<std::int32_t>(acc.size()));
    for (std::size_t s = 0; s < acc.size(); ++s)
      acc[s] += triattention_group_term(first.data() + s, G, view.capacity(), max, weight);
  }
  /// z-scores the q-head rows of (l, kv_head h) when `normalize` is on.
  template <KVCacheView V>
  void normalize_rows(const V& view, std::span<float> scores, int l, int h,
                      std::span<const std::uint8_t> candidate) const {
    if (!config.normalize) return;
    const int G = view.geometry().group_size();
    for (int gi = 0; gi < G; ++gi)
      normalize_row(score_row(view, scores, l, h * G + gi, static_cast<std::int32_t>(candidate.size())), candidate);
  }

  template <KVCacheView V>
  keep_plan plan_per_kv_head(const V& view, std::int64_t budget, std::span<float> scores) const {
    const kv_geometry& g = view.geometry();
    std::vector<std::vector<std::int32_t>> keep(static_cast<std::size_t>(g.num_kv_heads));
    std::vector<std::int32_t> positions;
    std::vector<std::uint8_t> candidate;
    std::vector<float> acc;
    for (int h = 0; h < g.num_kv_heads; ++h) {
      slot_info(view, 0, h, positions, candidate);  // every layer holds the same slots
      acc.assign(positions.size(), 0.0f);
      for (int l = 0; l < g.num_layers; ++l) {
        normalize_rows(view, scores, l, h, candidate);
        add_group_score(view, scores, l, h, triattention_layer_weight(g.num_layers), acc);
      }
      keep[h] = select_keep(acc, positions, protected_slots(), budget);
    }
    keep_plan p(g.num_layers, g.num_kv_heads);
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) p.push_row(keep[h]);
    return p;
  }

  template <KVCacheView V>
  keep_plan plan_per_layer(const V& view, std::int64_t budget, std::span<float> scores) const {
    const kv_geometry& g = view.geometry();
    keep_plan p(g.num_layers, g.num_kv_heads);
    std::vector<std::int32_t> positions;
    std::vector<std::uint8_t> candidate;
    std::vector<float> acc;
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        slot_info(view, l, h, positions, candidate);
        acc.assign(positions.size(), 0.0f);
        normalize_rows(view, scores, l, h, candidate);
        add_group_score(view, scores, l, h, 1.0f, acc);
        p.push_row(select_keep(acc, positions, protected_slots(), budget));
      }
    }
    return p;
  }

  /// Union selection over every (layer, q-head) row. Protected slots get +inf in every row
  /// (as the vLLM runtime guards them), so each row's top-k and the combined top-k take them
  /// first, lowest slots first when they alone exceed the budget: the rule of `select_keep`.
  template <KVCacheView V>
  keep_plan plan_union(const V& view, std::int64_t budget, std::span<float> scores) const {
    const kv_geometry& g = view.geometry();
    std::vector<std::int32_t> positions;
    std::vector<std::uint8_t> candidate;
    slot_info(view, 0, 0, positions, candidate);  // every (layer, kv_head) holds the same slots
    const auto n = static_cast<std::int32_t>(positions.size());
    std::vector<float> rows;  // [layers * q_heads, n]
    rows.reserve(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * n);
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) normalize_rows(view, scores, l, h, candidate);
      for (int qh = 0; qh < g.num_q_heads; ++qh) {
        const auto row = score_row(view, scores, l, qh, n);
        for (std::int32_t s = 0; s < n; ++s)
          rows.push_back(candidate[s] ? row[s] : std::numeric_limits<float>::infinity());
      }
    }
    const auto keep = union_select(rows, std::int64_t{g.num_layers} * g.num_q_heads, n, budget);
    return keep_plan::shared(g.num_layers, g.num_kv_heads, keep);
  }
};

TRIATTN_NAMESPACE_END
