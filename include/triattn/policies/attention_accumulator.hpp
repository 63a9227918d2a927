/// \file triattn/policies/attention_accumulator.hpp
/// \brief Accumulated attention per (layer, q-head, slot): the state that H2O and the policies
/// built on it score.
///
/// The library never owns the attention computation. After each attention the engine hands
/// the probabilities of every new query row to `observe`; the accumulator adds them to a
/// running sum per (layer, q-head, slot) and counts, per (layer, kv_head, slot), the rows that
/// saw the slot. Both arrays are per-slot state: `state()` describes them so that `compact`
/// moves them with the cache, with the same keep indices.
///
/// **Rows.** Every q-head of a query token observes the same slots, so a row is counted once
/// per KV head: when the group's first q-head (q_head % G == 0) observes it. An engine
/// observes every q-head of each row it observes.
///
/// **Slots past the length hold no state.** A new token enters the slot after the last one,
/// where a compaction may have left an evicted token's state; `clear_past_length` zeroes it
/// (the policies call it from `after_compact`, which `compress` runs). `check_view` finds any
/// state there: probabilities longer than the cache, or a cache shortened without it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/accumulated_math.hpp"

TRIATTN_NAMESPACE_BEGIN

class accumulated_attention {
 public:
  /// Sizes the state for `view`'s geometry and capacity, all zero (a new sequence).
  template <KVCacheView V>
  void attach(const char* api, const V& view) {
    view.validate(api);
    const kv_geometry& g = view.geometry();
    layers_ = g.num_layers;
    q_heads_ = g.num_q_heads;
    kv_heads_ = g.num_kv_heads;
    capacity_ = view.capacity();
    const auto cells = static_cast<std::size_t>(layers_) * static_cast<std::size_t>(capacity_);
    sums_.assign(cells * static_cast<std::size_t>(q_heads_), 0.0f);
    counts_.assign(cells * static_cast<std::size_t>(kv_heads_), 0);
    attached_ = true;
  }

  bool attached() const { return attached_; }

  /// Checks one row as `observe` would, without recording it: an attached state, (layer,
  /// q_head) in range, 1 to capacity probabilities, each finite and >= 0.
  void check_row(const char* api, int layer, int q_head, std::span<const float> probs) const {
    TRIATTN_CHECK(attached_, api, "no state: call attach(view) before observing");
    TRIATTN_CHECK(layer >= 0 && layer < layers_, api, "layer ", layer, " is outside [0, ", layers_, ")");
    TRIATTN_CHECK(q_head >= 0 && q_head < q_heads_, api, "q_head ", q_head, " is outside [0, ", q_heads_, ")");
    TRIATTN_CHECK(!probs.empty() && static_cast<std::int64_t>(probs.size()) <= capacity_, api, "probs holds ",
                  probs.size(), " slots, expected 1 to capacity ", capacity_);
    for (std::size_t j = 0; j < probs.size(); ++j)
      TRIATTN_CHECK(std::isfinite(probs[j]) && probs[j] >= 0.0f, api, "probability ", probs[j], " at slot ", j,
                    " of layer ", layer, " q_head ", q_head, " is not a finite number >= 0");
  }

  /// Adds `weight` x `probs` (the row's probabilities over slots [0, probs.size())) to the
  /// sums of (layer, q_head) and, at the group's first q-head, counts the row for those slots.
  /// Throws (recording nothing) for what `check_row` rejects.
  void observe(const char* api, int layer, int q_head, std::span<const float> probs, float weight = 1.0f) {
    check_row(api, layer, q_head, probs);
    float* sums = sums_.data() + sum_row(layer, q_head);
    for (std::size_t j = 0; j < probs.size(); ++j) sums[j] = accumulate_probability(sums[j], weight, probs[j]);
    const int G = q_heads_ / kv_heads_;
    if (q_head % G != 0) return;
    std::int32_t* rows = counts_.data() + count_row(layer, q_head / G);
    for (std::size_t j = 0; j < probs.size(); ++j) ++rows[j];
  }

  /// Checks that the state was attached for `view`'s geometry and capacity and holds nothing
  /// past any (layer, kv_head)'s length.
  template <KVCacheView V>
  void check_view(const char* api, const V& view) const {
    check_geometry(api, view);
    const int G = q_heads_ / kv_heads_;
    for (int l = 0; l < layers_; ++l) {
      for (int h = 0; h < kv_heads_; ++h) {
        const std::int32_t n = view.length(l, h);
        for (std::int64_t s = n; s < capacity_; ++s) {
          bool any = counts_[count_row(l, h) + static_cast<std::size_t>(s)] != 0;
          for (int qh = h * G; qh < (h + 1) * G; ++qh)
            any = any || sums_[sum_row(l, qh) + static_cast<std::size_t>(s)] != 0.0f;
          TRIATTN_CHECK(!any, api, "layer ", l, " kv_head ", h, " holds ", n, " slots but slot ", s,
                        " has observed attention: probs longer than the cache, or a cache shortened without "
                        "after_compact");
        }
      }
    }
  }

  /// The group score of (layer, kv_head) into `out` [length]: the sums of the group's q-heads
  /// combined by `agg` and, with `normalize`, divided by the rows that saw each slot (0 for a
  /// slot no row saw); `accumulated_score`, which the CUDA path calls too.
  template <KVCacheView V>
  void group_scores(const V& view, int layer, int kv_head, gqa_aggregation agg, bool normalize,
                    std::span<float> out) const {
    const std::int32_t n = view.length(layer, kv_head);
    const int G = q_heads_ / kv_heads_;
    TRIATTN_CHECK(static_cast<std::int64_t>(out.size()) == n, "triattn::accumulated_attention::group_scores",
                  "output holds ", out.size(), " scores, layer ", layer, " kv_head ", kv_head, " holds ", n, " slots");
    const float* sums = sums_.data() + sum_row(layer, kv_head * G);
    const std::int32_t* rows = counts_.data() + count_row(layer, kv_head);
    for (std::int32_t j = 0; j < n; ++j) out[j] = accumulated_score(sums + j, G, capacity_, rows[j], agg, normalize);
  }

  /// The per-slot arrays for `compact`: the sums [layers, q_heads, capacity] (a KV head owns
  /// the G rows of its group) and the row counts [layers, kv_heads, capacity]. Empty before
  /// `attach` and for a capacity of 0.
  std::vector<slot_state> state() {
    if (sums_.empty()) return {};
    return {make_slot_state(sums_.data(), kv_heads_, q_heads_ / kv_heads_, capacity_),
            make_slot_state(counts_.data(), kv_heads_, 1, capacity_)};
  }

  /// Zeroes the state of every slot at or past its (layer, kv_head)'s length, where the next
  /// tokens will enter. Run after every compaction or other shortening of the cache.
  template <KVCacheView V>
  void clear_past_length(const char* api, const V& view) {
    check_geometry(api, view);
    const int G = q_heads_ / kv_heads_;
    for (int l = 0; l < layers_; ++l) {
      for (int h = 0; h < kv_heads_; ++h) {
        const std::int32_t n = view.length(l, h);
        const auto clear = [&](auto* row) { std::fill(row + n, row + capacity_, 0); };
        clear(counts_.data() + count_row(l, h));
        for (int qh = h * G; qh < (h + 1) * G; ++qh) clear(sums_.data() + sum_row(l, qh));
      }
    }
  }

 private:
  bool attached_ = false;
  int layers_ = 0, q_heads_ = 0, kv_heads_ = 0;
  std::int64_t capacity_ = 0;
  std::vector<float> sums_;           // [layers, q_heads, capacity]
  std::vector<std::int32_t> counts_;  // [layers, kv_heads, capacity]

  std::size_t sum_row(int l, int qh) const {
    return (static_cast<std::size_t>(l) * static_cast<std::size_t>(q_heads_) + static_cast<std::size_t>(qh)) *
           static_cast<std::size_t>(capacity_);
  }
  std::size_t count_row(int l, int h) const {
    return (static_cast<std::size_t>(l) * static_cast<std::size_t>(kv_heads_) + static_cast<std::size_t>(h)) *
           static_cast<std::size_t>(capacity_);
  }

  template <KVCacheView V>
  void check_geometry(const char* api, const V& view) const {
    TRIATTN_CHECK(attached_, api, "no state: call attach(view) first");
    const kv_geometry& g = view.geometry();
    TRIATTN_CHECK(g.num_layers == layers_ && g.num_q_heads == q_heads_ && g.num_kv_heads == kv_heads_ &&
                      view.capacity() == capacity_,
                  api, "state attached for ", layers_, " layers x ", q_heads_, " q_heads / ", kv_heads_,
                  " kv_heads x capacity ", capacity_, ", the view has ", g.num_layers, " x ", g.num_q_heads, " / ",
                  g.num_kv_heads, " x ", view.capacity(), ": call attach(view)");
  }
};

TRIATTN_NAMESPACE_END
