/// \file triattn/registry.hpp
/// \brief The registry of triattn's policies: one entry per policy with its name, a one-line
/// summary, the inputs it needs and its factory. Every list of policies in this repository
/// (the CLI's usage, errors and dispatch, `triattn_eval`, the demos, the plots, the runner's
/// tests) reads it, so a new policy is its scorer plus one line here.
///
/// `basic_any_policy<View>` erases a policy's type: it forwards `plan(view, budget, ctx)`,
/// `score`, `round()`, `state()`, `after_compact`, `attach` and `observe`, so it is itself a
/// triattn policy: `triattn::compress` and `triattn::maybe_compress` take it like the policy
/// it wraps (the round's position and prompt length travel in the `triattn::round_context`).
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/expected_attention.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/keydiff.hpp"
#include "triattn/policies/knorm.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/rkv.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/vatp.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Any triattn policy over views of type `View` that states its `round()` options, type-erased.
template <KVCacheView View>
class basic_any_policy : public policy_base<basic_any_policy<View>> {
 public:
  template <class P>
    requires(compression_policy<P, View> &&
             requires(const P& p) { { p.round() } -> std::convertible_to<const round_options&>; })
  explicit basic_any_policy(P policy) : self_(std::make_unique<holder<P>>(std::move(policy))) {}

  /// The wrapped policy's `name`, or "policy" when its class has none.
  std::string_view name() const { return self_->name(); }
  /// The keep plan of a round (the wrapped policy's; changes nothing).
  keep_plan plan(const View& view, std::int64_t budget, const round_context& ctx = {}) {
    return self_->plan(view, budget, ctx);
  }
  /// The wrapped policy's scores [num_layers x num_kv_heads x num_tokens] (see each policy's
  /// `score`); throws `triattn::error` for a policy that has none (it keeps slots by
  /// position alone).
  void score(const View& view, std::span<float> out) const { self_->score(view, out); }
  /// The wrapped policy's round options: its schedule is the one `maybe_compress` follows.
  const round_options& round() const { return self_->round(); }
  /// Sets the wrapped policy's round options (granularity, schedule) before its first round.
  void set_round(const round_options& r) { self_->set_round(r); }
  std::vector<slot_state> state() { return self_->state(); }
  void after_compact(const View& view, const keep_plan& plan) { self_->after_compact(view, plan); }
  /// Sizes the policy's state for `view` (policies that observe attention keep per-slot state).
  void attach(const View& view) { self_->attach(view); }
  /// One query row of the engine's attention: `q` [head_dim] post-RoPE, `probs` [length].
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q, std::span<const float> probs) {
    self_->observe(layer, q_head, position, q, probs);
  }

 private:
  struct base {
    virtual ~base() = default;
    virtual std::string_view name() const = 0;
    virtual keep_plan plan(const View& view, std::int64_t budget, const round_context& ctx) = 0;
    virtual void score(const View& view, std::span<float> out) const = 0;
    virtual const round_options& round() const = 0;
    virtual void set_round(const round_options& r) = 0;
    virtual std::vector<slot_state> state() = 0;
    virtual void after_compact(const View& view, const keep_plan& plan) = 0;
    virtual void attach(const View& view) = 0;
    virtual void observe(int layer, int q_head, std::int32_t position, std::span<const float> q,
                         std::span<const float> probs) = 0;
  };
  // The optional hooks become no-ops for policies without them, as in triattn::compress.
  template <class P>
  struct holder final : base {
    P policy;
    explicit holder(P p) : policy(std::move(p)) {}
    std::string_view name() const override {
      if constexpr (requires { P::name; }) {
        return P::name;
      } else {
        return "policy";
      }
    }
    keep_plan plan(const View& view, std::int64_t budget, const round_context& ctx) override {
      if constexpr (requires { policy.plan(view, budget, ctx); }) {
        return policy.plan(view, budget, ctx);  // the library's policies: policy_base::plan
      } else {
        return plan_round(policy, view, budget, ctx, "triattn::any_policy::plan");
      }
    }
    void score(const View& view, std::span<float> out) const override {
      if constexpr (requires { policy.score(view, out); }) {
        policy.score(view, out);
      } else {
        TRIATTN_CHECK(false, "triattn::any_policy::score", "policy ", name(), " has no score");
      }
    }
    const round_options& round() const override { return policy.round(); }
    void set_round(const round_options& r) override {
      if constexpr (requires { policy.config.round; }) {
        policy.config.round = r;
      } else {
        TRIATTN_CHECK(false, "triattn::any_policy::set_round", "policy ", name(), " has fixed round options");
      }
    }
    std::vector<slot_state> state() override {
      if constexpr (requires(P& p) { p.state(); }) {
        return policy.state();
      } else {
        return {};
      }
    }
    void after_compact(const View& view, const keep_plan& plan) override {
      if constexpr (requires(P& p) { p.after_compact(view, plan); }) policy.after_compact(view, plan);
    }
    void attach(const View& view) override {
      if constexpr (requires(P& p) { p.attach(view); }) policy.attach(view);
    }
    void observe(int layer, int q_head, std::int32_t position, std::span<const float> q,
                 std::span<const float> probs) override {
      if constexpr (requires(P& p) { p.observe(layer, q_head, position, q, probs); })
        policy.observe(layer, q_head, position, q, probs);
    }
  };
  std::unique_ptr<base> self_;
};

/// The type-erased policy over the library's dense views, which the programs use.
using any_policy = basic_any_policy<dense_kv_view>;

/// What a policy reads besides the cache's keys at a round, so that a caller knows what to
/// feed it: the values, the queries of a recent window (`observe` with a query and no
/// probabilities), rows of attention probabilities (`observe` with probabilities), or
/// calibration statistics (`policy_inputs::stats`).
struct policy_needs {
  bool values = false;
  bool queries = false;
  bool attention = false;
  bool stats = false;
};

/// The protection a comparison runs every policy under (`policy_inputs::protocol`): it
/// replaces each policy's own prompt protection, and its sinks and recent window join each
/// policy's own rule (`round_options::sinks`, `recent`).
struct round_protocol {
  bool protect_prompt = false;
  std::int64_t sinks = 0;
  std::int64_t recent = 0;
};

/// How every policy of a comparison selects (`policy_inputs::selection`): the round's segment
/// quotas, head-adaptive budgets and value-aware correction (`round_options::segments`,
/// `split`, `split_floor`, `value_aware`).
struct round_selection {
  std::int64_t segments = 1;
  budget_split split = budget_split::equal;
  float split_floor = 0.2f;
  bool value_aware = false;
};

/// What some policies need besides the cache, and the caller's overrides.
struct policy_inputs {
  const query_stats* stats = nullptr;  ///< TriAttention's calibration statistics
  /// When set, the schedule `maybe_compress` follows (`config.round.sched`) instead of the
  /// policy's own: the demo and triattn_eval run every policy on one trigger.
  std::optional<schedule> sched;
  /// When set, how the policies that aggregate over a GQA group do it (the CLI's --gqa).
  std::optional<gqa_aggregation> gqa;
  /// When set, the recent queries that the policies reading queries score with and always
  /// keep (the CLI sets it to the rows of --queries).
  std::optional<int> window;
  /// When set, the protection every round applies, the same for every policy (triattn_eval's
  /// harmonised setting); unset, each policy keeps its own defaults.
  std::optional<round_protocol> protocol;
  /// When set, the selection every round uses (segment quotas, budget split).
  std::optional<round_selection> selection;
  /// Policies that can (`policy_entry::queries_from_stats`) take their query statistics from
  /// `stats` instead of observed queries do (the CLI's `--stats` without `--queries`).
  bool calibrated_queries = false;
};

/// The name of the uncompressed reference (no policy class).
inline constexpr std::string_view full_name = "full";

/// One policy of the registry. `make` is null for `full`, the uncompressed reference, and
/// only for it.
template <KVCacheView View>
struct basic_policy_entry {
  std::string_view name;
  std::string_view summary;
  basic_any_policy<View> (*make)(const policy_inputs&) = nullptr;
  policy_needs needs{};
  /// Whether `policy_inputs::gqa` applies: the policy combines a GQA group's scores by a
  /// `gqa_aggregation` (read off its config, not listed by hand).
  bool takes_gqa = false;
  /// Whether the policy reads observed queries for their statistics alone, so that calibration
  /// statistics can stand in for them (`policy_inputs::calibrated_queries`; read off the
  /// class: it reads queries and is constructible from a `query_stats`).
  bool queries_from_stats = false;

  /// A fresh policy, or std::nullopt for `full`. Throws `triattn::error` when the policy
  /// needs statistics and `in` has none.
  std::optional<basic_any_policy<View>> create(const policy_inputs& in = {}) const {
    TRIATTN_CHECK((!needs.stats && !in.calibrated_queries) || in.stats != nullptr, "triattn::policy_entry::create",
                  "policy ", name, " needs calibration statistics (--stats)");
    TRIATTN_CHECK(!in.calibrated_queries || queries_from_stats, "triattn::policy_entry::create", "policy ", name,
                  " cannot take its queries from calibration statistics");
    return make != nullptr ? std::optional(make(in)) : std::nullopt;
  }
  /// Whether the entry compresses (every entry but `full`). By name, not by `make`: comparing
  /// a lambda's function pointer with null is not a constant expression under UBSan.
  constexpr bool compresses() const { return name != full_name; }
};

using policy_entry = basic_policy_entry<dense_kv_view>;

/// `policy` with the caller's overrides in `in` (schedule, GQA aggregation, window, protocol,
/// selection),
/// if any, type-erased: what the registry's factories return, for a policy configured by hand.
template <KVCacheView View = dense_kv_view, class P>
basic_any_policy<View> configured_policy(P policy, const policy_inputs& in) {
  if (in.sched) policy.config.round.sched = *in.sched;
  if (in.protocol) {
    policy.config.round.protect_prompt = in.protocol->protect_prompt;
    policy.config.round.sinks = in.protocol->sinks;
    policy.config.round.recent = in.protocol->recent;
  }
  if (in.selection) {
    policy.config.round.segments = in.selection->segments;
    policy.config.round.split = in.selection->split;
    policy.config.round.split_floor = in.selection->split_floor;
    policy.config.round.value_aware = in.selection->value_aware;
  }
  if constexpr (requires { policy.config.gqa; }) {
    if (in.gqa) policy.config.gqa = *in.gqa;
  }
  if constexpr (requires { policy.config.window; }) {
    if (in.window) policy.config.window = *in.window;
  }
  return basic_any_policy<View>(std::move(policy));
}

namespace detail {

/// The registry entry of policy class `P`: its name is `P::name`, and `make_policy()` its
/// default configuration.
template <KVCacheView View, class P, auto make_policy>
constexpr basic_policy_entry<View> entry(std::string_view summary, policy_needs needs = {}) {
  return {P::name, summary, [](const policy_inputs& in) { return configured_policy<View>(make_policy(in), in); }, needs,
          requires(P p) { p.config.gqa = gqa_aggregation::mean; },
          needs.queries && std::is_constructible_v<P, const query_stats&>};
}

}  // namespace detail

/// The registry: every policy the programs offer, in the order they list them, for views of
/// type `View` (`policy_registry` for the library's dense views).
template <KVCacheView View>
inline constexpr std::array policy_registry_for{
    basic_policy_entry<View>{.name = full_name, .summary = "no compression: the reference cache"},
    detail::entry<View, streaming_llm, [](const policy_inputs&) { return streaming_llm{}; }>(
        "4 attention sinks + the most recent tokens (Xiao et al. 2023)"),
    detail::entry<View, h2o, [](const policy_inputs&) { return h2o{}; }>(
        "heavy hitters by accumulated attention + the most recent (Zhang et al. 2023)", {.attention = true}),
    detail::entry<View, snapkv, [](const policy_inputs&) { return snapkv(snapkv_config::decode()); }>(
        "votes of the last 8 queries, max-pooled (Li et al. 2024; decode-time variant)", {.queries = true}),
    detail::entry<View, vatp, [](const policy_inputs&) { return vatp{}; }>(
        "H2O's score x value L1 norm, 4 sinks (Guo et al. 2024)", {.values = true, .attention = true}),
    detail::entry<View, rkv, [](const policy_inputs&) { return rkv(rkv_config::paper()); }>(
        "importance minus redundancy of the last 8 queries (Cai et al. 2025)", {.queries = true}),
    detail::entry<View, triattention, [](const policy_inputs& in) { return triattention(*in.stats); }>(
        "calibrated query centres predict attention from distance (paper defaults: one keep set per KV head, "
        "offsets to 65536)",
        {.stats = true}),
    detail::entry<View, knorm, [](const policy_inputs&) { return knorm{}; }>(
        "the smallest key L2 norms (Devoto et al. 2024); reads the keys alone"),
    detail::entry<View, keydiff, [](const policy_inputs&) { return keydiff{}; }>(
        "the keys least like the average key direction (Park et al. 2025); reads the keys alone"),
    detail::entry<View, expected_attention,
                  [](const policy_inputs& in) {
                    // decode(): a round every `slack` tokens looks 16 positions ahead, not 512.
                    const auto c = expected_attention_config::decode();
                    return in.calibrated_queries ? expected_attention(*in.stats, c) : expected_attention(c);
                  }>("expected softmax of Gaussian future queries (mean, covariance of the last 128) x value L2 norm, "
                     "4 sinks (Devoto et al. 2025; decode-time variant)",
                     {.values = true, .queries = true}),
};

inline constexpr const auto& policy_registry = policy_registry_for<dense_kv_view>;

/// The entry called `name`, or nullptr.
template <KVCacheView View = dense_kv_view>
constexpr const basic_policy_entry<View>* find_policy(std::string_view name) {
  for (const basic_policy_entry<View>& e : policy_registry_for<View>)
    if (e.name == name) return &e;
  return nullptr;
}

/// The registry's names, in order; without `full` when `compressing_only`.
inline std::vector<std::string_view> policy_name_list(bool compressing_only = false) {
  std::vector<std::string_view> out;
  for (const policy_entry& e : policy_registry)
    if (!compressing_only || e.compresses()) out.push_back(e.name);
  return out;
}

/// "h2o, vatp": the names of the entries for which `pick(entry)` holds, in order, for messages
/// and usage texts.
template <class Pick>
std::string policy_names_where(Pick pick) {
  std::string out;
  for (const policy_entry& e : policy_registry)
    if (pick(e)) out += (out.empty() ? "" : ", ") + std::string(e.name);
  return out;
}

/// "full, streaming_llm, ...": the known names, for messages; without `full` when
/// `compressing_only`.
inline std::string policy_names(bool compressing_only = false) {
  return policy_names_where([=](const policy_entry& e) { return !compressing_only || e.compresses(); });
}

TRIATTN_NAMESPACE_END
