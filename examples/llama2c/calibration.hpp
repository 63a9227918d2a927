/// \file llama2c/calibration.hpp
/// \brief TriAttention calibration of a llama2.c model: run text windows through a session
/// and accumulate the query statistics. Used by `triattn calibrate` and the demo.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "llama2c/llama2c.hpp"
#include "triattn/calibration/accumulator.hpp"
#include "triattn/calibration/query_stats.hpp"

namespace llama2c {

/// Feeds every (layer, q-head) query of a session to a stats accumulator, one layer at a time
/// (the accumulator takes all q-heads of a layer together).
class query_collector final : public observer {
 public:
  query_collector(triattn::query_stats_accumulator& acc, const config& c)
      : acc_(acc), q_heads_(c.n_heads), head_dim_(c.head_dim),
        layer_q_(static_cast<std::size_t>(c.n_heads) * static_cast<std::size_t>(c.head_dim)) {}

  void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                    std::span<const float>) override {
    std::copy(q_post_rope.begin(), q_post_rope.end(), layer_q_.begin() + q_head * head_dim_);
    if (q_head == q_heads_ - 1) acc_.add_post_rope(layer, layer_q_, position);  // the layer's last head
  }

 private:
  triattn::query_stats_accumulator& acc_;
  int q_heads_, head_dim_;
  std::vector<float> layer_q_;  // [q_heads, head_dim]
};

/// Calibrates on up to `max_windows` windows of `text` (shared/spec/cli.md: paragraphs split at
/// blank lines, BOS + tokens each, concatenated to the model's context). One window is one
/// trace; traces weigh the same. `progress(done, total)` is called after each window.
inline triattn::query_stats calibrate(const model& m, const tokenizer& tok, std::string_view text, int max_windows,
                                      const std::function<void(std::size_t, std::size_t)>& progress = {}) {
  const auto windows = text_windows(tok, text, m.config().seq_len, max_windows);
  TRIATTN_CHECK(!windows.empty(), "llama2c::calibrate", "the text holds no full window of ", m.config().seq_len,
                " tokens");
  session s(m, m.config().seq_len);
  triattn::query_stats_accumulator acc(s.view().geo);
  query_collector collector(acc, m.config());
  s.set_observer(&collector);
  for (std::size_t w = 0; w < windows.size(); ++w) {
    s.reset();
    for (const int token : windows[w]) s.forward(token);
    acc.end_trace();
    if (progress) progress(w + 1, windows.size());
  }
  return acc.finish(triattn::merge_mode::per_trace);
}

}  // namespace llama2c
