/// \file triattn/policies/h2o.hpp
/// \brief H2O, the Heavy-Hitter Oracle (Zhang et al. 2023): keeps the recent window and the
/// slots that have received the most attention.
///
/// **Observation.** The engine hands the probabilities of every new query row to `observe`
/// (attention_accumulator.hpp); the running sums per (layer, q-head, slot) move with the cache.
///
/// **Score** (cli.md), layer l, KV head g, slot j:
///
///     s[l,g,j] = agg over the q-heads h of group(g) of Σ_rows A[l,h,row,j],
///
/// agg = mean (default), max or sum. With `normalize`, each sum is divided by the number of rows
/// that saw j (kvpress ObservedAttentionPress); without it, as in the reference, old tokens are
/// favoured: more rows saw them.
///
/// **Decision**, per decision of the round's granularity (per (layer, kv_head) by default; the
/// shared granularities average the rows' scores): a decision holding more than heavy + recent slots keeps its
/// last `recent` slots, its first `sinks` slots and, up to `heavy` slots with the sinks, the
/// best-scoring others, ties to the lower slot. A budget B splits as recent = B/2, heavy =
/// B − B/2 unless heavy or recent are configured, as slot counts or as fractions of the prompt
/// length; B caps them (recent first, then heavy, then the sinks within heavy).
///
/// **Prompt scoring.** `prompt_scoring::last_window` is Scissorhands as the value-weighted
/// variant's reference repository runs it: of the prompt's rows only the last
/// `scissorhands_window` count, each weighted 1 / window (whatever the prompt's length); decode
/// rows add in full.
///
/// **Differences from the reference** (FMInference/H2O): the sums are fp32 (the reference adds
/// the probabilities in the model's fp16/bf16); a round cuts to exactly heavy + recent (the
/// masking simulation also keeps the current token); evicted tokens are dropped rather than
/// masked (the same decisions: a masked token never returns). Budgets are slot counts by
/// default, as in the real-drop class; the masking runs' fractions of the prompt length
/// (`masking_reference`, 0.1 + 0.1) are an option.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/accumulated_math.hpp"
#include "triattn/policies/attention_accumulator.hpp"
#include "triattn/policies/policy.hpp"

TRIATTN_NAMESPACE_BEGIN

struct h2o_config {
  std::optional<std::int64_t> heavy;   ///< heavy-hitter slots (sinks included); unset: the budget left by recent
  std::optional<std::int64_t> recent;  ///< recent-window slots; unset: budget / 2, or the budget left by heavy
  std::optional<double> heavy_ratio;   ///< instead of `heavy`: int(heavy_ratio x prompt length)
  std::optional<double> recent_ratio;  ///< instead of `recent`: int(recent_ratio x prompt length)
  std::int64_t sinks = 0;              ///< leading slots always kept, counted in heavy
  gqa_aggregation gqa = gqa_aggregation::mean;
  bool normalize = false;  ///< divide each sum by the rows that saw the slot (kvpress ObservedAttentionPress)
  prompt_scoring prompt = prompt_scoring::every_row;
  std::int64_t scissorhands_window = 400;  ///< prompt rows that count with `prompt_scoring::last_window`
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::every_step()};

  /// The budget parts as both paths read them (`h2o_budget`).
  h2o_budget budget_parts() const {
    return {heavy.value_or(-1), recent.value_or(-1), heavy_ratio.value_or(-1.0), recent_ratio.value_or(-1.0), sinks};
  }

  /// The reference's masking runs (utils_hh, the paper's accuracy numbers): heavy = recent =
  /// int(ratio x prompt length), 20 % of the prompt by default. Needs the round's
  /// `round_context::prompt_length`.
  static h2o_config masking_reference(double ratio = 0.1) {
    h2o_config c;
    c.heavy_ratio = ratio;
    c.recent_ratio = ratio;
    return c;
  }
};

namespace detail {

/// Error-message names of a policy built on accumulated attention.
struct accumulated_policy_names {
  const char* construct;
  const char* attach;
  const char* observe;
  const char* score;
  const char* split;
  const char* set_prompt_length;
  const char* after_compact;
};

/// Everything a policy built on accumulated attention shares with H2O: the config, the
/// accumulated attention, prompt scoring, the budget split and the selection. `Derived` names its API (`Derived::names`) and ranks slots
/// with `row_score(api, view, layer, kv_head, out)`.
template <class Derived, class Config>
class accumulated_attention_policy : public policy_base<Derived> {
 public:
  Config config;

  accumulated_attention_policy() : accumulated_attention_policy(Config{}) {}
  explicit accumulated_attention_policy(Config c) : config(std::move(c)) { validate_config(Derived::names.construct); }

  /// (Re)sizes the state for `view`'s geometry and capacity, zeroed: a new sequence.
  template <KVCacheView V>
  void attach(const V& view) {
    acc_.attach(Derived::names.attach, view);
  }

  /// One new query row of (layer, q_head) at `position`: `probs` over the slots [0, n) it
  /// attends to, n = length(layer, q_head / G) of the cache as it is now (the new token's
  /// slot included; a causal row of a batched prefill passes the slots up to its own, which
  /// matters to `normalize`: the row counts as seen by every slot it covers). Observe every
  /// q-head of a row. `q_post_rope` is not used (it may be empty). Throws, recording nothing,
  /// for an unattached state, a layer or head out of range, n outside [1, capacity], a
  /// probability that is NaN, infinite or negative, or `last_window` prompt scoring without a
  /// prompt length.
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> /*q_post_rope*/,
               std::span<const float> probs) {
    const char* api = Derived::names.observe;
    validate_config(api);
    TRIATTN_CHECK(position >= 0, api, "position ", position, " must be >= 0");
    TRIATTN_CHECK(config.prompt != prompt_scoring::last_window || prompt_length_ > 0, api,
                  "prompt_scoring::last_window weighs the prompt's last rows, but the prompt length is 0: call "
                  "set_prompt_length before observing");
    const float weight = row_weight(config.prompt, position, prompt_length_, config.scissorhands_window);
    if (weight == 0.0f) {
      acc_.check_row(api, layer, q_head, probs);  // before the window: checked, not recorded
      return;
    }
    acc_.observe(api, layer, q_head, probs, weight);
  }

  /// The policy's scores into `out` [layers, kv_heads, capacity]; slots >= length of their
  /// (layer, kv_head) are left as they are. What `triattn score` writes for the policy.
  template <KVCacheView V>
  void score(const V& view, std::span<float> out) const {
    const char* api = Derived::names.score;
    check_inputs(api, view);
    const kv_geometry& g = view.geometry();
    const auto cap = static_cast<std::size_t>(view.capacity());
    TRIATTN_CHECK(out.size() == static_cast<std::size_t>(g.num_layers) * static_cast<std::size_t>(g.num_kv_heads) * cap,
                  api, "output holds ", out.size(), " scores, expected num_layers ", g.num_layers, " x num_kv_heads ",
                  g.num_kv_heads, " x capacity ", cap);
    std::size_t row = 0;  // (l * num_kv_heads + h) * capacity
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h, row += cap)
        derived().row_score(api, view, l, h, out.subspan(row, static_cast<std::size_t>(view.length(l, h))));
  }

  const round_options& round() const { return config.round; }

  /// The protected recent window and sinks, and the heavy + recent slots a decision keeps.
  /// The round has checked the budget and, in `begin_round`, the config.
  row_rule rule(const round_info& info) const {
    const h2o_split sp = config.budget_parts().split(info.budget, info.prompt_length);
    return {sp.protected_slots(), sp.total()};
  }

  /// Checks the config and the state against the view for a round whose budget and view the
  /// pipeline has checked; its rows score with `row_score`.
  template <KVCacheView V>
  auto begin_round(const char* api, const V& view, const round_info& info) const {
    check_split(api, info.prompt_length);
    acc_.check_view(api, view);
    return row_scorer<V>{&derived(), &view, api};
  }

  /// The per-slot state that `compress` moves with the cache.
  std::vector<slot_state> state() { return acc_.state(); }

  /// Zeroes the state of the slots freed by a compaction, where new tokens will enter.
  /// `compress` calls it; an engine that compacts or shortens the cache itself calls it after.
  template <KVCacheView V>
  void after_compact(const V& view, const keep_plan&) {
    acc_.clear_past_length(Derived::names.after_compact, view);
  }

  /// The prompt's token count for observation: the base of `last_window` prompt scoring,
  /// which weighs rows as they are observed, before any round. (Rounds take the prompt length
  /// from their `round_context`, like every policy's.)
  void set_prompt_length(std::int64_t n) {
    TRIATTN_CHECK(n >= 0, Derived::names.set_prompt_length, "prompt length ", n, " must be >= 0");
    prompt_length_ = n;
  }
  std::int64_t prompt_length() const { return prompt_length_; }

  /// The split of `budget` slots per decision under this config, for a prompt of
  /// `prompt_length` tokens (see the file comment). Throws for budget < 1, a bad config, or a
  /// ratio budget without a prompt length.
  h2o_split split(std::int64_t budget, std::int64_t prompt_length = 0) const {
    const char* api = Derived::names.split;
    TRIATTN_CHECK(budget >= 1, api, "budget ", budget, " must be >= 1");
    check_split(api, prompt_length);
    return config.budget_parts().split(budget, prompt_length);
  }

 protected:
  /// The accumulated-attention (H2O) score of (layer, kv_head) into `out` [length].
  template <KVCacheView V>
  void attention_score(const V& view, int layer, int kv_head, std::span<float> out) const {
    acc_.group_scores(view, layer, kv_head, config.gqa, config.normalize, out);
  }

 private:
  accumulated_attention acc_;
  std::int64_t prompt_length_ = 0;

  template <KVCacheView V>
  struct row_scorer {
    const Derived* policy;
    const V* view;
    const char* api;
    void score(int layer, int kv_head, std::span<const std::uint8_t>, std::span<float> out) const {
      policy->row_score(api, *view, layer, kv_head, out);
    }
  };

  const Derived& derived() const { return static_cast<const Derived&>(*this); }

  void validate_config(const char* api) const {
    const auto check_part = [&](const std::optional<std::int64_t>& count, const std::optional<double>& ratio,
                                const char* count_name, const char* ratio_name) {
      TRIATTN_CHECK(!count || *count >= 0, api, count_name, " ", count.value_or(0), " must be >= 0");
      TRIATTN_CHECK(!ratio || (*ratio >= 0.0 && *ratio <= 1.0), api, ratio_name, " ", ratio.value_or(0.0),
                    " must be in [0, 1]");
      TRIATTN_CHECK(!count || !ratio, api, count_name, " ", *count, " and ", ratio_name, " ", *ratio,
                    " are both set: give one");
    };
    check_part(config.heavy, config.heavy_ratio, "heavy", "heavy_ratio");
    check_part(config.recent, config.recent_ratio, "recent", "recent_ratio");
    TRIATTN_CHECK(config.sinks >= 0, api, "sinks ", config.sinks, " must be >= 0");
    TRIATTN_CHECK(config.scissorhands_window >= 1, api, "scissorhands_window ", config.scissorhands_window,
                  " must be >= 1");
  }

  template <KVCacheView V>
  void check_inputs(const char* api, const V& view) const {
    validate_config(api);
    view.validate(api);
    acc_.check_view(api, view);
  }

  /// Checks what a split needs besides the budget: the config, and a prompt length for ratios.
  void check_split(const char* api, std::int64_t prompt_length) const {
    validate_config(api);
    const auto check_ratio = [&](const std::optional<std::int64_t>& count, const std::optional<double>& ratio,
                                 const char* ratio_name) {
      TRIATTN_CHECK(count || !ratio || prompt_length > 0, api, ratio_name, " ", ratio.value_or(0.0),
                    " is a fraction of the prompt length, which is 0: give round_context::prompt_length");
    };
    check_ratio(config.heavy, config.heavy_ratio, "heavy_ratio");
    check_ratio(config.recent, config.recent_ratio, "recent_ratio");
  }
};

}  // namespace detail

/// H2O. Per (layer, kv_head) decisions by default; state per (layer, q-head, slot).
class h2o : public detail::accumulated_attention_policy<h2o, h2o_config> {
 public:
  static constexpr detail::accumulated_policy_names names{"triattn::h2o",
                                                          "triattn::h2o::attach",
                                                          "triattn::h2o::observe",
                                                          "triattn::h2o::score",
                                                          "triattn::h2o::split",
                                                          "triattn::h2o::set_prompt_length",
                                                          "triattn::h2o::after_compact"};

  static constexpr std::string_view name = "h2o";
  static constexpr const char* plan_api = "triattn::h2o::plan";

  using accumulated_attention_policy::accumulated_attention_policy;

  /// The score the decision ranks, of (layer, kv_head), into `out` [length]: the accumulated
  /// attention combined over the GQA group.
  template <KVCacheView V>
  void row_score(const char* /*api*/, const V& view, int layer, int kv_head, std::span<float> out) const {
    attention_score(view, layer, kv_head, out);
  }
};

TRIATTN_NAMESPACE_END
