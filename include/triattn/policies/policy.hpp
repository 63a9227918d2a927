/// \file triattn/policies/policy.hpp
/// \brief What every policy shares: the round pipeline (core/round.hpp) and the member form
/// `policy.compress(view, budget, ctx)`.
///
/// A policy is a scorer (see `round_scorer` in core/round.hpp): it scores slots, states what it
/// protects, and optionally observes the attention loop and keeps per-slot state. Everything
/// else (granularity, protection, selection, compaction) is the pipeline's, once for all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Calls `f(layer, kv_head, row)` for every (layer, kv_head) of a policy's `score` output
/// `out` [num_layers, num_kv_heads, capacity] over `view`, `row` its slots below the length;
/// throws `triattn::error` naming `api` when `out` has another size.
template <KVCacheView V, class F>
void for_each_score_row(const char* api, const V& view, std::span<float> out, F&& f) {
  const kv_geometry& g = view.geometry();
  const std::int64_t cap = view.capacity();
  TRIATTN_CHECK(out.size() == static_cast<std::size_t>(g.num_layers) * g.num_kv_heads * cap, api, "output holds ",
                out.size(), " scores, expected num_layers ", g.num_layers, " x num_kv_heads ", g.num_kv_heads,
                " x capacity ", cap);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h)
      f(l, h, out.subspan((static_cast<std::size_t>(l) * g.num_kv_heads + h) * cap, static_cast<std::size_t>(view.length(l, h))));
}

/// CRTP base giving each policy the member forms `policy.plan(view, budget, ctx)` and
/// `policy.compress(view, budget, ctx)`.
template <class Derived>
struct policy_base {
  /// The keep plan of a round (see `plan_round`); changes nothing.
  template <KVCacheView V>
  keep_plan plan(const V& view, std::int64_t budget, const round_context& ctx = {}) const {
    return plan_round(static_cast<const Derived&>(*this), view, budget, ctx, Derived::plan_api);
  }
  /// One round in place (see `compress`).
  template <KVCacheView V>
  compaction_result compress(const V& view, std::int64_t budget, const round_context& ctx = {}) {
    return ::TRIATTN_NAMESPACE::compress(static_cast<Derived&>(*this), view, budget, ctx);
  }
};

TRIATTN_NAMESPACE_END
