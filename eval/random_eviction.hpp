/// \file eval/random_eviction.hpp
/// \brief Uniformly random eviction: the floor every policy must beat (triattn_eval's `random`
/// row and the quality tests), and `plan_each_row`, the plan of a policy that decides each
/// (layer, kv_head) on its own.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/policies/policy.hpp"

namespace triattn_eval {

/// A plan policy's keep plan with one decision per (layer, kv_head), in (layer, kv_head)
/// order: `choose(n, k, slots)` sets `slots` to the ascending slots that a row of n slots
/// keeps, k = min(n, budget) of them.
template <class Choose>
triattn::keep_plan plan_each_row(const triattn::dense_kv_view& view, std::int64_t budget, Choose&& choose) {
  const triattn::kv_geometry& g = view.geometry();
  triattn::keep_plan p(g.num_layers, g.num_kv_heads);
  std::vector<std::int32_t> slots;
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const std::int32_t n = view.length(l, h);
      choose(n, static_cast<std::int32_t>(std::min<std::int64_t>(n, budget)), slots);
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

  /// Draws, in (layer, kv_head) order, min(length, budget) slots of each row. The context is
  /// not read: a random keep set depends on nothing but the draw.
  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget, const triattn::round_context& = {}) {
    return plan_each_row(view, budget, [&](std::int32_t n, std::int32_t k, std::vector<std::int32_t>& slots) {
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

}  // namespace triattn_eval
