/// \file runner/compressed_session.hpp
/// \brief A runner session whose cache a registry policy holds at a budget: the one wiring of
/// session, policy, attention feed and rounds that the demos, the tools, the evaluation and the
/// tests share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "runner/model.hpp"
#include "runner/session.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/registry.hpp"

namespace triattn_runner {

/// Feeds a session's attention to a policy: set it with `session::set_observer` after
/// `policy.attach(session.view())`.
class policy_observer final : public observer {
 public:
  explicit policy_observer(triattn::any_policy& p) : policy_(p) {}
  void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                    std::span<const float> probs) override {
    policy_.observe(layer, q_head, position, q_post_rope, probs);
  }

 private:
  triattn::any_policy& policy_;
};

/// One sequence decoded with its cache held at `budget` by a policy: the policy is attached to
/// the session's cache and observes its attention, and `maybe_compress` runs a round when the
/// policy's schedule says so. Without a policy it is a plain session, the full-cache
/// reference. Pinned in memory: the session's observer points into it.
class compressed_session {
 public:
  compressed_session(const model& m, std::int64_t capacity, std::optional<triattn::any_policy> policy,
                     std::int64_t budget, triattn::dtype cache_type = triattn::dtype::f32)
      : cache_(m, capacity_for(m, capacity, policy, budget), cache_type), policy_(std::move(policy)), budget_(budget) {
    if (policy_) {
      policy_->attach(cache_.view());
      cache_.set_observer(&feed_.emplace(*policy_));
      if (policy_->round().value_aware) projection_ = &m.output_projection();
    }
  }
  /// `capacity`, plus what a budget split lets one row keep beyond `budget`: a pool's rows may
  /// each hold up to the pool's budget (`triattn::row_budget`).
  static std::int64_t capacity_for(const model& m, std::int64_t capacity, const std::optional<triattn::any_policy>& p,
                                   std::int64_t budget) {
    if (!p || p->round().split == triattn::budget_split::equal) return capacity;
    triattn::kv_geometry g;
    g.num_layers = m.config().n_layers;
    g.num_kv_heads = m.config().n_kv_heads;
    return capacity + triattn::row_budget(p->round(), g, budget) - budget;
  }
  compressed_session(const compressed_session&) = delete;
  compressed_session& operator=(const compressed_session&) = delete;

  session& cache() { return cache_; }
  const session& cache() const { return cache_; }
  /// The policy, or nullptr for the full-cache reference.
  triattn::any_policy* policy() { return policy_ ? &*policy_ : nullptr; }
  const triattn::any_policy* policy() const { return policy_ ? &*policy_ : nullptr; }
  /// What feeds the policy: a caller that decodes for this sequence elsewhere (a shared trunk)
  /// forwards the attention it sees here. Only with a policy.
  observer& feed() { return *feed_; }
  std::int64_t budget() const { return budget_; }
  /// K+V bytes, the most the cache held when a round was considered (or `note_bytes` said).
  std::int64_t peak_bytes() const { return peak_; }
  /// Records that the sequence's cache held `bytes` (a sequence decoded elsewhere).
  void note_bytes(std::int64_t bytes) { peak_ = std::max(peak_, bytes); }
  /// Rounds run so far.
  int rounds() const { return rounds_; }
  bool compressed() const { return rounds_ > 0; }

  /// Records the cache's size, then a round when the policy's schedule says so;
  /// `prompt_length` tokens are the prompt. Returns whether a round ran.
  bool maybe_compress(std::int64_t prompt_length = 0) {
    note_bytes(cache_.kv_bytes());
    if (!policy_ ||
        !triattn::maybe_compress(*policy_, cache_.view(), budget_, context(cache_.position(), prompt_length)))
      return false;
    ++rounds_;
    return true;
  }
  /// `token` through the session, then `maybe_compress()`: the logits [vocab], valid until
  /// the session's next forward (a round does not touch them).
  std::span<const float> step(int token) {
    const std::span<const float> logits = cache_.forward(token);
    maybe_compress();
    return logits;
  }
  /// Records the cache's size, then a round now, cutting every (layer, kv_head) to the budget,
  /// when one holds more. Returns whether a round ran.
  bool compress_to_budget() {
    note_bytes(cache_.kv_bytes());
    const triattn::dense_kv_view v = cache_.view();
    bool over = false;
    for (int l = 0; l < v.geometry().num_layers; ++l)
      for (int h = 0; h < v.geometry().num_kv_heads; ++h) over |= v.length(l, h) > budget_;
    if (!policy_ || !over) return false;
    triattn::compress(*policy_, v, budget_, context(cache_.position(), 0));
    ++rounds_;
    return true;
  }

 private:
  /// A round's context: the session's position and prompt, the model's output projection for
  /// a value-aware policy.
  triattn::round_context context(std::int64_t position, std::int64_t prompt_length) const {
    triattn::round_context ctx;
    ctx.position = position;
    ctx.prompt_length = prompt_length;
    ctx.projection = projection_;
    return ctx;
  }

  session cache_;
  std::optional<triattn::any_policy> policy_;
  const triattn::value_projection* projection_ = nullptr;
  std::optional<policy_observer> feed_;
  std::int64_t budget_;
  std::int64_t peak_ = 0;
  int rounds_ = 0;
};

}  // namespace triattn_runner
