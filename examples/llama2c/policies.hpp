/// \file llama2c/policies.hpp
/// \brief triattn policies picked by name at run time, behind one type, for the demo and the
/// tools that drive a `llama2c::session`.
///
/// To add a policy: one line in `policy_registry`. `any_policy` forwards `plan`, `state`,
/// `after_compact`, `set_position`, `attach` and `observe`, so it is itself a triattn policy: `triattn::compress` and
/// `triattn::maybe_compress` take it like the policy it wraps.
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
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/rkv.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/vatp.hpp"

namespace llama2c {

/// Any triattn policy over dense views, type-erased.
class any_policy : public triattn::policy_base<any_policy> {
 public:
  template <class P>
    requires triattn::compression_policy<P, triattn::dense_kv_view>
  explicit any_policy(P policy) : self_(std::make_unique<holder<P>>(std::move(policy))) {}

  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget) {
    return self_->plan(view, budget);
  }
  std::vector<triattn::slot_state> state() { return self_->state(); }
  void after_compact(const triattn::dense_kv_view& view, const triattn::keep_plan& plan) {
    self_->after_compact(view, plan);
  }
  void set_position(std::int64_t next_position) { self_->set_position(next_position); }
  /// Sizes the policy's state for `view` (policies that observe attention keep per-slot state).
  void attach(const triattn::dense_kv_view& view) { self_->attach(view); }
  /// One query row of the engine's attention (see llama2c::observer).
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q, std::span<const float> probs) {
    self_->observe(layer, q_head, position, q, probs);
  }

 private:
  struct base {
    virtual ~base() = default;
    virtual triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget) = 0;
    virtual std::vector<triattn::slot_state> state() = 0;
    virtual void after_compact(const triattn::dense_kv_view& view, const triattn::keep_plan& plan) = 0;
    virtual void set_position(std::int64_t next_position) = 0;
    virtual void attach(const triattn::dense_kv_view& view) = 0;
    virtual void observe(int layer, int q_head, std::int32_t position, std::span<const float> q,
                         std::span<const float> probs) = 0;
  };
  // The optional hooks become no-ops for policies without them, as in triattn::compress.
  template <class P>
  struct holder final : base {
    P policy;
    explicit holder(P p) : policy(std::move(p)) {}
    triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget) override {
      return policy.plan(view, budget);
    }
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
    void set_position(std::int64_t next_position) override {
      if constexpr (requires(P& p) { p.set_position(next_position); }) policy.set_position(next_position);
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

/// Uniformly random keep sets per (layer, kv_head), from a fixed seed: the floor every policy
/// must beat (triattn_eval's `random` row, and the quality test).
class random_eviction : public triattn::policy_base<random_eviction> {
 public:
  explicit random_eviction(std::uint64_t seed) : rng_(seed) {}
  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t keep) {
    const triattn::kv_geometry& g = view.geometry();
    triattn::keep_plan p(g.num_layers, g.num_kv_heads);
    std::vector<std::int32_t> slots;
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const std::int32_t n = view.length(l, h);
        slots.resize(static_cast<std::size_t>(n));
        for (std::int32_t i = 0; i < n; ++i) slots[static_cast<std::size_t>(i)] = i;
        // Partial Fisher-Yates with our own index draw: std::shuffle and the distributions are
        // implementation-defined; this is the same on every standard library.
        const auto k = static_cast<std::size_t>(std::min<std::int64_t>(n, keep));
        for (std::size_t i = 0; i < k; ++i) {
          const std::uint64_t span = slots.size() - i;
          const std::size_t j = i + static_cast<std::size_t>(rng_() % span);
          std::swap(slots[i], slots[j]);
        }
        slots.resize(k);
        std::sort(slots.begin(), slots.end());
        p.push_row(slots);
      }
    return p;
  }

 private:
  std::mt19937_64 rng_;
};

/// What some policies need besides the cache: TriAttention's calibration statistics.
struct policy_inputs {
  const triattn::query_stats* stats = nullptr;
};

/// One name of the registry. `make` is null for `full`, the uncompressed reference.
struct policy_entry {
  std::string_view name;
  std::string_view summary;
  any_policy (*make)(const policy_inputs&);
  bool needs_stats = false;

  /// A fresh policy, or std::nullopt for `full`. Throws `triattn::error` when the policy
  /// needs statistics and `in` has none.
  std::optional<any_policy> create(const policy_inputs& in = {}) const {
    TRIATTN_CHECK(!needs_stats || in.stats != nullptr, "llama2c::policy_entry::create", "policy ", name,
                  " needs calibration statistics (--stats)");
    return make != nullptr ? std::optional(make(in)) : std::nullopt;
  }
};

inline constexpr std::array policy_registry{
    policy_entry{"full", "no compression: the reference cache", nullptr},
    policy_entry{"streaming_llm", "4 attention sinks + the most recent tokens (Xiao et al. 2023)",
                 [](const policy_inputs&) { return any_policy(triattn::streaming_llm{}); }},
    policy_entry{"h2o", "heavy hitters by accumulated attention + the most recent (Zhang et al. 2023)",
                 [](const policy_inputs&) { return any_policy(triattn::h2o{}); }},
    policy_entry{"snapkv", "votes of the last 8 queries, max-pooled (Li et al. 2024; decode-time variant)",
                 [](const policy_inputs&) { return any_policy(triattn::snapkv(triattn::snapkv_config::decode())); }},
    policy_entry{"vatp", "H2O's score x value L1 norm, 4 sinks (Guo et al. 2024)",
                 [](const policy_inputs&) { return any_policy(triattn::vatp{}); }},
    policy_entry{"rkv", "importance minus redundancy of the last 8 queries (Cai et al. 2025)",
                 [](const policy_inputs&) { return any_policy(triattn::rkv(triattn::rkv_config::paper())); }},
    policy_entry{"triattention",
                 "calibrated query centres predict attention from distance (paper defaults: one keep set per KV "
                 "head, offsets to 65536)",
                 [](const policy_inputs& in) { return any_policy(triattn::triattention(*in.stats)); }, true},
};

/// The entry called `name`, or nullptr.
inline const policy_entry* find_policy(std::string_view name) {
  for (const policy_entry& e : policy_registry)
    if (e.name == name) return &e;
  return nullptr;
}

/// "full, streaming_llm, ...": the known names, for messages.
inline std::string policy_names() {
  std::string out;
  for (const policy_entry& e : policy_registry) out += (out.empty() ? "" : ", ") + std::string(e.name);
  return out;
}

}  // namespace llama2c
