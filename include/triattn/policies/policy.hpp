/// \file triattn/policies/policy.hpp
/// \brief What every policy shares: the round pipeline (core/round.hpp) and the member form
/// `policy.compress(view, budget, ctx)`.
///
/// A policy is a scorer (see `round_scorer` in core/round.hpp): it scores slots, states what it
/// protects, and optionally observes the attention loop and keeps per-slot state. Everything
/// else (granularity, protection, selection, compaction) is the pipeline's, once for all.
#pragma once

#include <cstdint>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"

TRIATTN_NAMESPACE_BEGIN

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
