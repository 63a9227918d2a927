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
/// **Decision** (spec §5–7), through the round pipeline (core/round.hpp). `paper()` (the
/// defaults): z-score each (ℓ, h) row over the candidate (non-protected) slots with the
/// population std floored at 1e-6, max over the GQA group (the row scorer's part), mean over
/// layers (`granularity::per_kv_head`, `row_reduction::mean`), then per KV head the protected
/// slots plus the top of the rest (ties to the lower slot), one keep set per KV head applied to
/// every layer. `seed()`: the reference class's union selection, one keep set for every layer
/// and head (`granularity::whole_sequence`, `row_reduction::max`: the top-k of the largest
/// score over every (layer, q-head) row is exactly the reference's union of per-row top-k
/// sets cut to k). Protected slots (prompt, recent window) count in the budget.
///
/// **Round start** r is the position of the next token: `round_context::position`
/// (`maybe_compress` requires it); a `compress(view, budget)` without it uses 1 + the largest
/// position any slot holds.
///
/// **Beyond the paper** (`triattention_config::value_protect`, `redundancy`, `score_ema`; off
/// by default, no attention read): after the row's z-score and GQA reduction, the score is
/// blended with the slot's previous rounds (score history), lowered by its key redundancy, and
/// raised for the largest values (value-norm protection). With `score_ema` > 0 the policy keeps
/// per-slot state (`state()`, moved by compaction): one object per sequence, like H2O.
///
/// **Without a statistics file** (`online(tokens)`): the statistics of the sequence's own
/// queries at positions [0, tokens), observed post-RoPE and frozen by the first round
/// (calibration/online.hpp); one object per sequence.
///
/// **Non-finite keys**: scoring throws `triattn::error` naming the API and the (layer, kv_head,
/// slot); since scoring runs before compaction, a failed round leaves the cache untouched.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "triattn/calibration/online.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/core/value_weighting.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/redundancy.hpp"
#include "triattn/policies/triattention_config.hpp"
#include "triattn/policies/triattention_math.hpp"

TRIATTN_NAMESPACE_BEGIN

class triattention : public policy_base<triattention> {
 public:
  static constexpr std::string_view name = "triattention";
  static constexpr const char* plan_api = "triattn::triattention::plan";
  /// Predicted logits (z-scored per row by default): a value weight adds ln w.
  static constexpr score_domain domain = score_domain::logit;
  triattention_config config;

  /// A policy for the model `stats` was calibrated on; `stats` is checked for consistency now
  /// and against each view's geometry at every call.
  explicit triattention(query_stats stats, triattention_config c = triattention_config::paper())
      : config(c), stats_(std::move(stats)) {
    const char* api = "triattn::triattention";
    stats_.validate(api);
    validate_config(api);
  }

  /// TriAttention calibrated on the running sequence (calibration/online.hpp): no statistics
  /// file; `attach` the sequence's view, `observe` its query rows (post-RoPE, as for the
  /// policies that read queries), and its first round freezes the statistics of the queries at
  /// positions [0, tokens) (0: every query observed before the round: the prompt, for a round
  /// after the prefill). One object per sequence.
  static triattention online(std::int64_t tokens = 0, triattention_config c = triattention_config::paper()) {
    return triattention(online_query_stats(tokens), c);
  }

  /// The statistics the policy scores with (an online policy's: once its first round froze them).
  const query_stats& stats() const { return online_ ? online_->stats() : stats_; }

  /// Starts an online policy's calibration afresh for `view`'s sequence; nothing otherwise.
  template <KVCacheView V>
  void attach(const V& view) {
    if (!online_) return;
    const char* api = "triattn::triattention::attach";
    view.validate(api);
    online_->attach(view.geometry());
  }
  /// One query row of an online policy's sequence (see `online`); ignored otherwise.
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
               [[maybe_unused]] std::span<const float> probs = {}) {
    if (online_) online_->observe(layer, q_head, position, q_post_rope);
  }
  const round_options& round() const { return config.round; }

  /// The last `window` slots are protected.
  row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(0, config.window), info.budget};
  }

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
    row_scorer<V> rows(*this, api, view, round_start, 0);  // raw scores: no budget, no extensions
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) {
        rows.raw_scores(l, h);
        const std::int32_t n = view.length(l, h);
        for (int gi = 0; gi < g.group_size(); ++gi)
          std::copy_n(rows.raw.begin() + static_cast<std::ptrdiff_t>(gi) * n, n,
                      out.begin() + static_cast<std::ptrdiff_t>(((std::int64_t{l} * g.num_q_heads) + h * g.group_size() + gi) *
                                                                view.capacity()));
      }
  }

  /// Checks the config and the stats against the view (which the pipeline has validated) for a
  /// round at `info.round_start`; its rows score with the folded scorer, z-scored and GQA-reduced.
  template <KVCacheView V>
  auto begin_round(const char* api, const V& view, const round_info& info) const {
    validate_config(api);
    round_stats(api).check_against(api, view.geometry());
    if (config.score_ema > 0.0f) start_history(view);
    return row_scorer<V>(*this, api, view, info.round_start, info.budget);
  }

  /// Whether one object may serve many sequences (`compress_batch` with one policy): only
  /// score_ema keeps per-sequence state.
  bool stateless() const { return config.score_ema <= 0.0f && !online_; }
  /// score_ema's history, moved by `compact` with the slots (empty when β = 0).
  std::vector<slot_state> state() {
    if (config.score_ema <= 0.0f || pending_.empty()) return {};
    return {make_slot_state(pending_.data(), num_kv_heads_, 1, capacity_)};
  }
  /// The round's blended scores become the history; slots past each row's new length have none.
  template <KVCacheView V>
  void after_compact(const V& view, const keep_plan&) {
    if (config.score_ema <= 0.0f || pending_.empty()) return;
    history_.swap(pending_);
    for (int l = 0; l < view.geometry().num_layers; ++l)
      for (int h = 0; h < num_kv_heads_; ++h) {
        float* row = history_row(history_, l, h);
        std::fill(row + view.length(l, h), row + capacity_, std::numeric_limits<float>::quiet_NaN());
      }
  }

 private:
  explicit triattention(online_query_stats online, triattention_config c) : config(c), online_(std::move(online)) {
    validate_config("triattn::triattention::online");
  }

  query_stats stats_;
  // An online policy's calibration. Mutable: its first round (planning is const) freezes it.
  mutable std::optional<online_query_stats> online_;

  /// The round's statistics: an online policy's frozen now if they are not yet.
  const query_stats& round_stats(const char* api) const { return online_ ? online_->freeze(api) : stats_; }
  // score_ema: the last committed decision score per slot [layers, kv_heads, capacity] (NaN:
  // none) and the round in progress. Mutable: planning (const) writes only `pending_`, which
  // becomes the history only once the round's compaction has succeeded.
  mutable std::vector<float> history_, pending_;
  mutable std::int64_t capacity_ = 0;
  mutable int num_kv_heads_ = 0;

  float* history_row(std::vector<float>& h, int l, int kvh) const {
    return h.data() + (static_cast<std::int64_t>(l) * num_kv_heads_ + kvh) * capacity_;
  }

  /// Sizes the history for `view` (a view of another shape starts it again) and copies it into
  /// the round's scores.
  template <KVCacheView V>
  void start_history(const V& view) const {
    const kv_geometry& g = view.geometry();
    const auto size = static_cast<std::size_t>(g.num_layers) * g.num_kv_heads * view.capacity();
    if (history_.size() != size || capacity_ != view.capacity() || num_kv_heads_ != g.num_kv_heads) {
      history_.assign(size, std::numeric_limits<float>::quiet_NaN());
      capacity_ = view.capacity();
      num_kv_heads_ = g.num_kv_heads;
    }
    pending_ = history_;
  }

  void validate_config(const char* api) const {
    TRIATTN_CHECK(config.offset_max >= 1, api, "offset_max ", config.offset_max, " must be >= 1");
    TRIATTN_CHECK(config.window >= 0, api, "window ", config.window, " must be >= 0");
    TRIATTN_CHECK(config.value_protect >= 0.0 && config.value_protect <= 1.0, api, "value_protect ",
                  config.value_protect, " must be in [0, 1]");
    TRIATTN_CHECK(config.redundancy >= 0.0f && std::isfinite(config.redundancy), api, "redundancy ", config.redundancy,
                  " must be finite and >= 0");
    TRIATTN_CHECK(config.redundancy_threshold >= -1.0f && config.redundancy_threshold <= 1.0f, api,
                  "redundancy_threshold ", config.redundancy_threshold, " must be in [-1, 1]");
    TRIATTN_CHECK(config.score_ema >= 0.0f && config.score_ema < 1.0f, api, "score_ema ", config.score_ema,
                  " must be in [0, 1)");
  }

  template <KVCacheView V>
  void check_inputs(const char* api, const V& view) const {
    validate_config(api);
    view.validate(api);
    round_stats(api).check_against(api, view.geometry());
  }

  /// The folded scorer of one round: phasors once per round, coefficients once per (layer,
  /// q-head), key bands and moduli once per (layer, kv_head, slot), shared by the q-heads of
  /// the group.
  template <KVCacheView V>
  class row_scorer {
   public:
    std::vector<float> raw;  ///< [group, n] raw scores of the last row scored

    row_scorer(const triattention& p, const char* api, const V& view, std::int64_t round_start, std::int64_t budget)
        : p_(p), api_(api), view_(view), g_(view.geometry()),
          value_protected_(static_cast<std::int64_t>(std::ceil(p.config.value_protect * static_cast<double>(budget)))) {
      // round start + offset is formed in int64: both bounded, it cannot overflow
      TRIATTN_CHECK(round_start >= 0 && round_start <= max_round_start, api_, "round start ", round_start,
                    " must be in [0, 2^31]");
      const int F = g_.head_dim / 2;
      // w from the view's RoPE, which rotated the keys; the stats' copy is only checked against it.
      std::vector<double> w(static_cast<std::size_t>(F));
      for (int f = 0; f < F; ++f) w[f] = inv_freq(g_.rope, g_.head_dim, f);
      const int num_offsets = triattention_num_offsets(p_.config.offset_max);
      std::vector<std::int64_t> offsets(static_cast<std::size_t>(num_offsets));
      for (int j = 0; j < num_offsets; ++j) offsets[j] = triattention_offset(j);
      // Mean aggregation folds every offset into one phasor set; max needs one set per offset.
      sets_ = p_.config.aggregation == offset_aggregation::mean ? 1 : num_offsets;
      const int per_set = num_offsets / sets_;
      w_re_.resize(static_cast<std::size_t>(sets_) * F);  // [sets, F]
      w_im_.resize(w_re_.size());
      for (int j = 0; j < sets_; ++j)
        triattention_phasors(w.data(), F, round_start, offsets.data() + j * per_set, per_set, w_re_.data() + j * F,
                             w_im_.data() + j * F);
      scale_ = triattention_coefficient_scale(p_.stats().attention_scale, g_.keys);
      if (g_.keys == key_state::pre_rope) build_chunk_tables(w);
    }

    /// The raw scores of (l, kv_head) into `raw` [group, length].
    void raw_scores(int l, int kvh) {
      const int D = g_.head_dim, F = D / 2, G = g_.group_size(), R = triattention_coefficient_row(sets_, F);
      coef_.assign(static_cast<std::size_t>(G) * R, 0.0f);  // [G, R]
      for (int gi = 0; gi < G; ++gi) {
        const std::size_t row = p_.stats().row(l, kvh * G + gi);
        const float *qr = p_.stats().q_mean_real.data() + row, *qi = p_.stats().q_mean_imag.data() + row;
        float* c = coef_.data() + static_cast<std::ptrdiff_t>(gi) * R;
        for (int j = 0; j < sets_ && !p_.config.disable_trig; ++j)
          triattention_trig_coefficients(qr, qi, w_re_.data() + j * F, w_im_.data() + j * F, F, scale_, c + 2 * j * F,
                                         c + 2 * j * F + F);
        if (!p_.config.disable_norm)
          triattention_norm_coefficients(qr, qi, p_.stats().q_abs_mean.data() + row, F, scale_, c + 2 * sets_ * F);
      }
      const std::int32_t n = view_.length(l, kvh);
      raw.resize(static_cast<std::size_t>(G) * n);
      with_key_accessor(view_, l, [&](const auto& keys) { score_keys(keys, l, kvh, n, R); });
    }

    /// The raw scores of the n keys of (l, kvh), read through `keys`: blocks of keys, their
    /// features side by side [block, 3F], then every q-head against the block.
    template <class Accessor>
    void score_keys(const Accessor& keys, int l, int kvh, std::int32_t n, int R) {
      constexpr int block = 16;
      const int D = g_.head_dim, F = D / 2, G = g_.group_size();
      const std::size_t row_bytes = static_cast<std::size_t>(D) * dtype_bytes(g_.type);
      key_.resize(static_cast<std::size_t>(D));
      x_.resize(static_cast<std::size_t>(block) * 3 * F);  // [block, 3F]
      for (std::int32_t s0 = 0; s0 < n; s0 += block) {
        const int m = static_cast<int>(std::min<std::int32_t>(block, n - s0));
        for (int k = 0; k < m; ++k) {
          const std::int32_t s = s0 + k;
          float* x = x_.data() + static_cast<std::ptrdiff_t>(k) * 3 * F;
          // half pairing: the row is already [re | im], decoded straight into the features
          float* row = g_.rope.style == rope_style::half ? x : key_.data();
          if (s + block < n) prefetch_bytes(view_.key(l, kvh, s + block), row_bytes);
          keys.load(view_.key(l, kvh, s), D, row);
          if (row != x) triattention_key_features(row, D, g_.rope.style, x);
          if (g_.keys == key_state::pre_rope) rotate_to(view_.position(l, kvh, s), x);
          triattention_key_moduli(x, F);
        }
        float* to = raw.data() + s0;
        if (sets_ == 1) {
          fixed_order_dot_block(coef_.data(), R, G, x_.data(), 3 * F, m, 3 * F, to, n);
        } else {
          for (int gi = 0; gi < G; ++gi)
            for (int k = 0; k < m; ++k)
              to[static_cast<std::ptrdiff_t>(gi) * n + k] = triattention_key_score(
                  coef_.data() + static_cast<std::ptrdiff_t>(gi) * R, sets_, x_.data() + k * 3 * F, F);
        }
        // A non-finite element makes every score of its key non-finite (NaN or inf times any
        // coefficient, 0 included, is not finite; its modulus too), so the scores are checked
        // instead of the elements; a finite key whose score overflows is not an error.
        for (int gi = 0; gi < G; ++gi)
          if (!all_finite(to + static_cast<std::ptrdiff_t>(gi) * n, m))
            for (int k = 0; k < m; ++k) {
              keys.load(view_.key(l, kvh, s0 + k), D, key_.data());
              check_key_finite(api_, key_.data(), D, l, kvh, s0 + k);
            }
      }
    }

    /// The decision score of (l, kv_head) into `out` [length]: each q-head row z-scored over
    /// the candidates (when `normalize`), then the GQA reduction.
    void score(int l, int kvh, std::span<const std::uint8_t> candidate, std::span<float> out) {
      raw_scores(l, kvh);
      const int G = g_.group_size();
      const auto n = static_cast<std::int64_t>(out.size());
      if (p_.config.normalize)
        for (int gi = 0; gi < G; ++gi) normalize_row({raw.data() + gi * n, out.size()}, candidate);
      const bool max = p_.config.gqa_reduction == triattention_gqa_reduction::max;
      for (std::int64_t s = 0; s < n; ++s) out[s] = triattention_group_term(raw.data() + s, G, n, max, 1.0f);
      if (p_.config.score_ema > 0.0f) blend_history(l, kvh, out);
      if (p_.config.redundancy > 0.0f) subtract_redundancy(l, kvh, candidate, out);
      if (value_protected_ > 0) protect_values(l, kvh, candidate, out);
    }

   private:
    const triattention& p_;
    const char* api_;
    const V& view_;
    const kv_geometry& g_;
    std::int64_t value_protected_;  ///< candidates per row that value_protect boosts
    int sets_ = 1;
    double scale_ = 1.0;
    std::vector<double> w_re_, w_im_;
    std::vector<float> coef_, key_, x_, extra_;
    std::vector<std::int32_t> order_;
    // Pre-RoPE keys: e^{i v 256^k w_f} [chunk, byte value, F] (re and im), built once per round
    // for the bytes the cache's positions use and shared by the workers' copies.
    std::shared_ptr<const std::vector<float>> chunk_re_, chunk_im_;
    int chunks_ = 0;

    void build_chunk_tables(const std::vector<double>& w) {
      const int F = g_.head_dim / 2;
      chunks_ = triattention_position_chunks(std::max<std::int64_t>(detail::largest_position(view_), 0));
      const auto size = static_cast<std::size_t>(chunks_) * triattention_chunk_values * F;
      auto re = std::make_shared<std::vector<float>>(size), im = std::make_shared<std::vector<float>>(size);
      for (int k = 0; k < chunks_; ++k)
        for (int v = 0; v < triattention_chunk_values; ++v)
          for (int f = 0; f < F; ++f) {
            const std::size_t at = (static_cast<std::size_t>(k) * triattention_chunk_values + v) * F + f;
            triattention_chunk_phasor(w[f], k, v, (*re)[at], (*im)[at]);
          }
      chunk_re_ = std::move(re);
      chunk_im_ = std::move(im);
    }

    /// Rotates the bands in `x` to position p (pre-RoPE keys): the product of p's byte factors.
    void rotate_to(std::int64_t p, float* x) const {
      const int F = g_.head_dim / 2;
      const int c = triattention_position_chunks(p);
      TRIATTN_CHECK(p >= 0 && c <= chunks_, api_, "position ", p, " is outside the cache's positions");
      const float* re[triattention_max_chunks];
      const float* im[triattention_max_chunks];
      for (int k = 0; k < c; ++k) {
        const auto at = static_cast<std::size_t>(k * triattention_chunk_values + ((p >> (triattention_chunk_bits * k)) & 0xff)) * F;
        re[k] = chunk_re_->data() + at;
        im[k] = chunk_im_->data() + at;
      }
      switch (c) {
        case 1: triattention_rotate_by_chunks<1>(x, re, im, F); break;
        case 2: triattention_rotate_by_chunks<2>(x, re, im, F); break;
        case 3: triattention_rotate_by_chunks<3>(x, re, im, F); break;
        default: triattention_rotate_by_chunks<4>(x, re, im, F); break;
      }
    }

    void blend_history(int l, int kvh, std::span<float> out) {
      const float beta = p_.config.score_ema;
      const float* past = p_.history_row(p_.history_, l, kvh);
      float* next = p_.history_row(p_.pending_, l, kvh);
      for (std::size_t s = 0; s < out.size(); ++s) {
        if (!std::isnan(past[s])) out[s] = multiply_add(beta, past[s], (1.0f - beta) * out[s]);
        next[s] = out[s];
      }
    }

    void subtract_redundancy(int l, int kvh, std::span<const std::uint8_t> candidate, std::span<float> out) {
      const auto n = static_cast<Eigen::Index>(out.size());
      row_matrix keys(n, g_.head_dim);  // [n, head_dim]
      for (Eigen::Index s = 0; s < n; ++s) load_key(view_, l, kvh, s, keys.row(s).data());
      extra_.resize(out.size());
      rkv_redundancy(keys, p_.config.redundancy_threshold, extra_);
      normalize_row(extra_, candidate);
      for (std::size_t s = 0; s < out.size(); ++s) out[s] = multiply_add(-p_.config.redundancy, extra_[s], out[s]);
    }

    void protect_values(int l, int kvh, std::span<const std::uint8_t> candidate, std::span<float> out) {
      extra_.resize(out.size());  // value L2 norms
      order_.clear();
      key_.resize(static_cast<std::size_t>(g_.head_dim));
      for (std::size_t s = 0; s < out.size(); ++s) {
        if (!candidate[s]) continue;
        load_value(view_, l, kvh, static_cast<std::int64_t>(s), key_.data());
        double sq = 0.0;
        for (const float x : key_) sq += static_cast<double>(x) * x;
        extra_[s] = static_cast<float>(std::sqrt(sq));
        order_.push_back(static_cast<std::int32_t>(s));
      }
      const auto m = static_cast<std::ptrdiff_t>(std::min<std::int64_t>(value_protected_, std::ssize(order_)));
      std::partial_sort(order_.begin(), order_.begin() + m, order_.end(), [&](std::int32_t a, std::int32_t b) {
        return extra_[a] > extra_[b] || (extra_[a] == extra_[b] && a < b);
      });
      for (std::ptrdiff_t i = 0; i < m; ++i) out[order_[i]] += triattention_value_bonus;
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
  };
};

TRIATTN_NAMESPACE_END
