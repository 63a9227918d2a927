/// \file llama2c/policies.hpp
/// \brief The roster of triattn policies: every program of this repository that lists,
/// names or builds policies at run time (the demo, `triattn`'s usage and errors,
/// triattn_eval's grid and plots, the runner's tests) takes the list from `policy_registry`.
///
/// To add a policy: its header gives the class a `static constexpr std::string_view name`,
/// and one line of `policy_registry` gives its description and factory. Names come from the
/// class (`roster_entry<P>`), so a policy has one name everywhere.
///
/// `any_policy` erases a policy's type: it forwards `plan(view, budget, ctx)`, `round()`,
/// `state()`, `after_compact`, `attach` and `observe`, so it is itself a triattn policy:
/// `triattn::compress` and `triattn::maybe_compress` take it like the policy it wraps (the
/// round's position and prompt length travel in the `triattn::round_context`).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "llama2c/llama2c.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/rkv.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/vatp.hpp"

namespace llama2c {

/// Any triattn policy over dense views that states its `round()` options, type-erased.
class any_policy : public triattn::policy_base<any_policy> {
 public:
  template <class P>
    requires(triattn::compression_policy<P, triattn::dense_kv_view> &&
             requires(const P& p) { { p.round() } -> std::convertible_to<const triattn::round_options&>; })
  explicit any_policy(P policy) : self_(std::make_unique<holder<P>>(std::move(policy))) {}

  /// The wrapped policy's `name`, or "policy" when its class has none.
  std::string_view name() const { return self_->name(); }
  /// The keep plan of a round (the wrapped policy's; changes nothing).
  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget,
                          const triattn::round_context& ctx = {}) {
    return self_->plan(view, budget, ctx);
  }
  /// The wrapped policy's round options: its schedule is the one `maybe_compress` follows.
  const triattn::round_options& round() const { return self_->round(); }
  std::vector<triattn::slot_state> state() { return self_->state(); }
  void after_compact(const triattn::dense_kv_view& view, const triattn::keep_plan& plan) {
    self_->after_compact(view, plan);
  }
  /// Sizes the policy's state for `view` (policies that observe attention keep per-slot state).
  void attach(const triattn::dense_kv_view& view) { self_->attach(view); }
  /// One query row of the engine's attention (see llama2c::observer).
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q, std::span<const float> probs) {
    self_->observe(layer, q_head, position, q, probs);
  }

 private:
  struct base {
    virtual ~base() = default;
    virtual std::string_view name() const = 0;
    virtual triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget,
                                    const triattn::round_context& ctx) = 0;
    virtual const triattn::round_options& round() const = 0;
    virtual std::vector<triattn::slot_state> state() = 0;
    virtual void after_compact(const triattn::dense_kv_view& view, const triattn::keep_plan& plan) = 0;
    virtual void attach(const triattn::dense_kv_view& view) = 0;
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
    triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget,
                            const triattn::round_context& ctx) override {
      if constexpr (requires { policy.plan(view, budget, ctx); }) {
        return policy.plan(view, budget, ctx);  // the library's policies: policy_base::plan
      } else {
        return triattn::plan_round(policy, view, budget, ctx, "llama2c::any_policy::plan");
      }
    }
    const triattn::round_options& round() const override { return policy.round(); }
    std::vector<triattn::slot_state> state() override {
      if constexpr (requires(P& p) { p.state(); }) {
        return policy.state();
      } else {
        return {};
      }
    }
    void after_compact(const triattn::dense_kv_view& view, const triattn::keep_plan& plan) override {
      if constexpr (requires(P& p) { p.after_compact(view, plan); }) policy.after_compact(view, plan);
    }
    void attach(const triattn::dense_kv_view& view) override {
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

/// Feeds a session's attention to a policy: set it with `session::set_observer` after
/// `policy.attach(session.view())`.
class policy_observer final : public observer {
 public:
  explicit policy_observer(any_policy& p) : policy_(p) {}
  void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                    std::span<const float> probs) override {
    policy_.observe(layer, q_head, position, q_post_rope, probs);
  }

 private:
  any_policy& policy_;
};

/// A plan policy's keep plan with one decision per (layer, kv_head), in (layer, kv_head)
/// order: `choose(n, k, slots)` sets `slots` to the ascending slots that a row of n slots
/// keeps, k = min(n, keep) of them.
template <class Choose>
triattn::keep_plan plan_each_row(const triattn::dense_kv_view& view, std::int64_t keep, Choose&& choose) {
  const triattn::kv_geometry& g = view.geometry();
  triattn::keep_plan p(g.num_layers, g.num_kv_heads);
  std::vector<std::int32_t> slots;
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const std::int32_t n = view.length(l, h);
      choose(n, static_cast<std::int32_t>(std::min<std::int64_t>(n, keep)), slots);
      p.push_row(slots);
    }
  return p;
}

/// Uniformly random keep sets per (layer, kv_head), from a fixed seed: the floor every policy
/// must beat (triattn_eval's `random` row, and the quality test). A plan policy (it builds its
/// own plan): one decision per (layer, kv_head) whatever the granularity, every slot a
/// candidate; `round()` only carries its schedule.
class random_eviction : public triattn::policy_base<random_eviction> {
 public:
  static constexpr std::string_view name = "random";

  explicit random_eviction(std::uint64_t seed, triattn::schedule sched = triattn::schedule::every_step())
      : rng_(seed) {
    round_.sched = sched;
  }

  const triattn::round_options& round() const { return round_; }

  /// Draws, in (layer, kv_head) order, min(length, keep) slots of each row. The context is
  /// not read: a random keep set depends on nothing but the draw.
  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t keep, const triattn::round_context& = {}) {
    return plan_each_row(view, keep, [&](std::int32_t n, std::int32_t k, std::vector<std::int32_t>& slots) {
      slots.resize(static_cast<std::size_t>(n));
      for (std::int32_t i = 0; i < n; ++i) slots[static_cast<std::size_t>(i)] = i;
      // Partial Fisher-Yates with our own index draw: std::shuffle and the distributions are
      // implementation-defined; this is the same on every standard library.
      for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i) {
        const std::uint64_t span = slots.size() - i;
        const std::size_t j = i + static_cast<std::size_t>(rng_() % span);
        std::swap(slots[i], slots[j]);
      }
      slots.resize(static_cast<std::size_t>(k));
      std::sort(slots.begin(), slots.end());
    });
  }

 private:
  std::mt19937_64 rng_;
  triattn::round_options round_{};
};

/// What some policies need besides the cache, and the caller's overrides.
struct policy_inputs {
  const triattn::query_stats* stats = nullptr;  ///< TriAttention's calibration statistics
  /// When set, the schedule `maybe_compress` follows (`config.round.sched`) instead of the
  /// policy's own: the demo and triattn_eval run every policy on one trigger.
  std::optional<triattn::schedule> sched;
};

/// The name of the uncompressed reference (no policy class).
inline constexpr std::string_view full_name = "full";

/// One policy of the roster. `make` is null for `full`, the uncompressed reference, and only
/// for it.
struct policy_entry {
  std::string_view name;
  std::string_view summary;
  any_policy (*make)(const policy_inputs&) = nullptr;
  bool needs_stats = false;

  /// A fresh policy, or std::nullopt for `full`. Throws `triattn::error` when the policy
  /// needs statistics and `in` has none.
  std::optional<any_policy> create(const policy_inputs& in = {}) const {
    TRIATTN_CHECK(!needs_stats || in.stats != nullptr, "llama2c::policy_entry::create", "policy ", name,
                  " needs calibration statistics (--stats)");
    return make != nullptr ? std::optional(make(in)) : std::nullopt;
  }
  /// Whether the entry compresses (every entry but `full`). By name, not by `make`: comparing
  /// a lambda's function pointer with null is not a constant expression under UBSan.
  constexpr bool compresses() const { return name != full_name; }
};

/// `policy` with the caller's schedule, if any, type-erased.
template <class P>
any_policy configured(P policy, const policy_inputs& in) {
  if (in.sched) policy.config.round.sched = *in.sched;
  return any_policy(std::move(policy));
}

/// The roster entry of policy class `P`: its name is `P::name`.
template <class P>
constexpr policy_entry roster_entry(std::string_view summary, any_policy (*make)(const policy_inputs&),
                                    bool needs_stats = false) {
  return {P::name, summary, make, needs_stats};
}

/// The roster: every policy the programs offer, in the order they list them.
inline constexpr std::array policy_registry{
    policy_entry{full_name, "no compression: the reference cache"},
    roster_entry<triattn::streaming_llm>(
        "4 attention sinks + the most recent tokens (Xiao et al. 2023)",
        [](const policy_inputs& in) { return configured(triattn::streaming_llm{}, in); }),
    roster_entry<triattn::h2o>("heavy hitters by accumulated attention + the most recent (Zhang et al. 2023)",
                               [](const policy_inputs& in) { return configured(triattn::h2o{}, in); }),
    roster_entry<triattn::snapkv>(
        "votes of the last 8 queries, max-pooled (Li et al. 2024; decode-time variant)",
        [](const policy_inputs& in) { return configured(triattn::snapkv(triattn::snapkv_config::decode()), in); }),
    roster_entry<triattn::vatp>("H2O's score x value L1 norm, 4 sinks (Guo et al. 2024)",
                                [](const policy_inputs& in) { return configured(triattn::vatp{}, in); }),
    roster_entry<triattn::rkv>(
        "importance minus redundancy of the last 8 queries (Cai et al. 2025)",
        [](const policy_inputs& in) { return configured(triattn::rkv(triattn::rkv_config::paper()), in); }),
    roster_entry<triattn::triattention>(
        "calibrated query centres predict attention from distance (paper defaults: one keep set per KV head, "
        "offsets to 65536)",
        [](const policy_inputs& in) { return configured(triattn::triattention(*in.stats), in); }, true),
};

/// The entry called `name`, or nullptr.
constexpr const policy_entry* find_policy(std::string_view name) {
  for (const policy_entry& e : policy_registry)
    if (e.name == name) return &e;
  return nullptr;
}

/// The roster's names, in order; without `full` when `compressing_only`.
inline std::vector<std::string_view> policy_name_list(bool compressing_only = false) {
  std::vector<std::string_view> out;
  for (const policy_entry& e : policy_registry)
    if (!compressing_only || e.compresses()) out.push_back(e.name);
  return out;
}

/// "full, streaming_llm, ...": the known names, for messages; without `full` when
/// `compressing_only`.
inline std::string policy_names(bool compressing_only = false) {
  std::string out;
  for (const std::string_view n : policy_name_list(compressing_only)) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

}  // namespace llama2c
