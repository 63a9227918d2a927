/// \file triattn/calibration/online.hpp
/// \brief Query statistics calibrated on the running sequence: the `query_stats` of the
/// queries the engine computes for it anyway, so that a model with no statistics file still
/// gets TriAttention (`triattention::online`).
///
/// The engine observes each (layer, q-head) query row post-RoPE, as it observes them for the
/// policies that read queries; the rows of one token of a layer are gathered and un-rotated
/// into a `query_stats_accumulator` (one trace: the sequence). Rows at positions `tokens` and
/// beyond are not read (0: every position). `freeze` then makes the statistics of the complete
/// tokens observed so far, once: later rows are not read either. A sequence's prompt is the
/// natural span (a round after the prefill freezes on it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "triattn/calibration/accumulator.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"

TRIATTN_NAMESPACE_BEGIN

class online_query_stats {
 public:
  /// Statistics of the queries at positions [0, tokens) (0: every position until `freeze`).
  explicit online_query_stats(std::int64_t tokens = 0) : tokens_(tokens) {
    TRIATTN_CHECK(tokens >= 0, "triattn::online_query_stats", "tokens ", tokens, " must be >= 0 (0: until frozen)");
  }

  /// Starts afresh for a sequence over a cache of geometry `g` (its layers, heads, head_dim and
  /// RoPE).
  void attach(const kv_geometry& g) {
    acc_.emplace(g);
    geometry_ = g;
    rows_.assign(static_cast<std::size_t>(g.num_layers), {});
    for (layer_rows& r : rows_) {
      r.q.assign(static_cast<std::size_t>(g.num_q_heads) * g.head_dim, 0.0f);
      r.seen.assign(static_cast<std::size_t>(g.num_q_heads), 0);
    }
    stats_.reset();
  }

  /// One query row of (layer, q_head) at `position`, post-RoPE [head_dim]. The rows of a
  /// layer's token come together (any head order) before that layer's next token. Ignored once
  /// frozen or past `tokens`. Throws naming the API for a row out of order, a bad index or size.
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope) {
    constexpr const char* api = "triattn::online_query_stats::observe";
    if (stats_ || (tokens_ > 0 && position >= tokens_)) return;
    TRIATTN_CHECK(acc_.has_value(), api, "attach a view before observing queries");
    const kv_geometry& g = geometry_;
    TRIATTN_CHECK(layer >= 0 && layer < g.num_layers && q_head >= 0 && q_head < g.num_q_heads, api, "layer ", layer,
                  " q_head ", q_head, " outside ", g.num_layers, " layers x ", g.num_q_heads, " q_heads");
    TRIATTN_CHECK(std::ssize(q_post_rope) == g.head_dim, api, "query of layer ", layer, " q_head ", q_head, " holds ",
                  q_post_rope.size(), " floats, expected head_dim ", g.head_dim);
    layer_rows& r = rows_[static_cast<std::size_t>(layer)];
    TRIATTN_CHECK(r.count == 0 || r.position == position, api, "layer ", layer, " q_head ", q_head, " at position ",
                  position, " while position ", r.position, " has ", r.count, " of ", g.num_q_heads, " q_heads");
    TRIATTN_CHECK(r.seen[static_cast<std::size_t>(q_head)] == 0, api, "layer ", layer, " q_head ", q_head,
                  " observed twice at position ", position);
    r.position = position;
    r.seen[static_cast<std::size_t>(q_head)] = 1;
    std::copy(q_post_rope.begin(), q_post_rope.end(), r.q.begin() + static_cast<std::ptrdiff_t>(q_head) * g.head_dim);
    if (++r.count < g.num_q_heads) return;
    acc_->add_post_rope(layer, r.q, position);
    r.count = 0;
    std::fill(r.seen.begin(), r.seen.end(), 0);
  }

  /// The statistics of every complete token observed (frozen at the first call), naming `api`
  /// when there is none yet.
  const query_stats& freeze(const char* api) {
    if (stats_) return *stats_;
    bool complete = acc_.has_value();
    for (int l = 0; complete && l < geometry_.num_layers; ++l) complete = acc_->open_tokens(l) > 0;
    TRIATTN_CHECK(complete, api,
                  "online calibration has observed no complete token yet: observe the sequence's queries "
                  "(every q_head of every layer) before its first round");
    acc_->end_trace();
    stats_ = acc_->finish();
    stats_->validate(api);
    return *stats_;
  }

  /// The frozen statistics (`freeze` first).
  const query_stats& stats() const { return *stats_; }

 private:
  struct layer_rows {
    std::vector<float> q;             // [num_q_heads, head_dim] of the token in progress
    std::vector<std::uint8_t> seen;   // [num_q_heads]
    int count = 0;              // q_heads of the token in progress
    std::int32_t position = 0;  // of the token in progress
  };
  std::int64_t tokens_ = 0;
  kv_geometry geometry_{};
  std::optional<query_stats_accumulator> acc_;
  std::vector<layer_rows> rows_;
  std::optional<query_stats> stats_;
};

TRIATTN_NAMESPACE_END
