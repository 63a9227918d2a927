/// \file triattn/policies/policy.hpp
/// \brief What every policy shares: the `compress(view, budget)` round and the schedule check.
///
/// A policy is a class with `plan(view, budget) -> keep_plan`. Optionally it has
/// `state() -> std::vector<slot_state>` (per-slot arrays that move with the cache) and
/// `after_compact(view, plan)` (work on the survivors, such as re-numbering positions).
/// `compress` runs plan, compaction and the hook, in that order; it validates the view, the
/// budget and the plan before anything moves, so a failed call leaves the cache untouched.
#pragma once

#include <cstdint>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/schedule.hpp"

TRIATTN_NAMESPACE_BEGIN

/// A compression policy usable with views of type `V`.
template <class P, class V>
concept compression_policy = KVCacheView<V> && requires(P& p, const V& v, std::int64_t budget) {
  { p.plan(v, budget) } -> std::same_as<keep_plan>;
};

/// One compression round: keeps at most `budget` tokens per (layer, kv_head) of `view`, in
/// place. Keep sets are chosen by `policy`; ties go to the lower slot and survivors keep their
/// order. Throws `triattn::error` (cache untouched) for budget < 1 or a malformed view.
template <class P, KVCacheView V>
  requires compression_policy<P, V>
compaction_result compress(P& policy, const V& view, std::int64_t budget) {
  const char* api = "triattn::compress";
  TRIATTN_CHECK(budget >= 1, api, "budget ", budget, " must be >= 1");
  view.validate(api);
  const keep_plan plan = policy.plan(view, budget);
  std::vector<slot_state> states;
  if constexpr (requires { policy.state(); }) states = policy.state();
  compaction_result result = compact(view, plan, states);
  if constexpr (requires { policy.after_compact(view, plan); }) policy.after_compact(view, plan);
  return result;
}

/// Runs a round when `sched` says so. `position` is the number of tokens processed so far (the
/// position of the next token); a policy with `set_position(position)` is given it first.
/// Returns whether a round ran; freed pages (paged views) are appended to `freed` if given.
template <class P, KVCacheView V>
  requires compression_policy<P, V>
bool maybe_compress(P& policy, const V& view, std::int64_t budget, const schedule& sched, std::int64_t position,
                    std::vector<std::int32_t>* freed = nullptr) {
  view.validate("triattn::maybe_compress");  // max_length reads the lengths: check the view first
  if (!sched.should_compress(max_length(view), budget, position)) return false;
  // Policies that depend on the round's position (TriAttention's round start) receive it here.
  if constexpr (requires { policy.set_position(position); }) policy.set_position(position);
  compaction_result r = compress(policy, view, budget);
  if (freed != nullptr) freed->insert(freed->end(), r.freed_pages.begin(), r.freed_pages.end());
  return true;
}

/// CRTP base giving each policy the member form `policy.compress(view, budget)`.
template <class Derived>
struct policy_base {
  template <KVCacheView V>
  compaction_result compress(const V& view, std::int64_t budget) {
    return ::TRIATTN_NAMESPACE::compress(static_cast<Derived&>(*this), view, budget);
  }
};

TRIATTN_NAMESPACE_END
