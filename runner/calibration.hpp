/// \file runner/calibration.hpp
/// \brief TriAttention calibration of a llama2.c model: run windows of tokens through a session
/// and accumulate the query statistics, on given text (`triattn calibrate`) or on text the
/// model samples itself (the demo, which ships no text).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "runner/runner.hpp"
#include "triattn/calibration/accumulator.hpp"
#include "triattn/calibration/query_stats.hpp"

namespace triattn_runner {

/// `progress(done, total)`: called after each calibration window.
using calibration_progress = std::function<void(std::size_t, std::size_t)>;

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

/// A uniform draw in [0, 1) from the top 53 bits of one `rng()` call.
inline double uniform_draw(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

/// The token softmax(logits / temperature) gives the uniform draw `u` in [0, 1), by inverse
/// CDF, over the ids `allowed` marks (empty: every id). Fully specified (no std
/// distribution, whose output is implementation-defined), so the same logits and `u` give the
/// same token everywhere std::exp agrees; and two models that see the same `u` at a step draw
/// the same token exactly when their distributions put it at the same place (what makes a
/// free-running comparison computable from teacher-forced logits). `temperature` must be
/// finite and > 0.
inline int sample_token(std::span<const float> logits, double temperature, double u,
                        std::span<const std::uint8_t> allowed = {}) {
  const char* api = "triattn_runner::sample_token";
  TRIATTN_CHECK(!logits.empty(), api, "no logits");
  TRIATTN_CHECK(temperature > 0.0 && std::isfinite(temperature), api, "temperature ", temperature,
                " must be finite and > 0");
  TRIATTN_CHECK(allowed.empty() || allowed.size() == logits.size(), api, "allowed holds ", allowed.size(),
                " flags for ", logits.size(), " logits");
  const auto ok = [&](std::size_t i) { return allowed.empty() || allowed[i] != 0; };
  double max = -INFINITY;
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (ok(i)) max = std::max(max, static_cast<double>(logits[i]));
  TRIATTN_CHECK(std::isfinite(max), api, "the largest allowed logit is ", max, ", not finite");
  double sum = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (ok(i)) sum += std::exp((logits[i] - max) / temperature);
  // The first token whose cumulative weight passes u * sum; the last one with any weight
  // when rounding leaves the scan short of it.
  const double target = u * sum;
  double cumulative = 0.0;
  int last = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    if (!ok(i)) continue;
    const double w = std::exp((logits[i] - max) / temperature);
    if (w <= 0.0) continue;
    cumulative += w;
    last = static_cast<int>(i);
    if (cumulative > target) return last;
  }
  return last;
}

/// One draw from softmax(logits / temperature) with the next uniform of `rng`.
inline int sample_token(std::span<const float> logits, double temperature, std::mt19937_64& rng,
                        std::span<const std::uint8_t> allowed = {}) {
  return sample_token(logits, temperature, uniform_draw(rng), allowed);
}

/// Sampling of long answers: temperature, the ids `allowed` marks (empty: all), and a
/// repetition penalty over the last `window` tokens drawn (llama.cpp's `repeat_penalty`: the
/// logit of a recent id is divided by `penalty` when positive and multiplied when negative),
/// which keeps a small model's long answers from settling into a loop. `draw` does not
/// change the history, so that a second model can draw with the same history and uniform;
/// `push` records the token the answer goes on with.
class answer_sampler {
 public:
  /// The long-answer setting of the programs (calibration, triattn_eval long): without a
  /// penalty SmolLM2's 2,048-token answers loop; 1.1 over 64 tokens still loops, 1.3 over 256
  /// turns the text to noise.
  static constexpr float default_penalty = 1.2f;
  static constexpr int default_window = 128;

  answer_sampler(double temperature, float penalty, int window, std::span<const std::uint8_t> allowed = {})
      : temperature_(temperature), penalty_(penalty), window_(window), allowed_(allowed) {
    TRIATTN_CHECK(penalty >= 1.0f && std::isfinite(penalty) && window >= 0, "triattn_runner::answer_sampler", "penalty ",
                  penalty, " must be finite and >= 1, window ", window, " >= 0");
  }
  /// The token `logits` give the uniform `u` with the current history.
  int draw(std::span<const float> logits, double u) {
    if (penalty_ == 1.0f || recent_.empty()) return sample_token(logits, temperature_, u, allowed_);
    buf_.assign(logits.begin(), logits.end());
    ids_ = recent_;  // each recent id penalised once
    std::sort(ids_.begin(), ids_.end());
    ids_.erase(std::unique(ids_.begin(), ids_.end()), ids_.end());
    for (const int id : ids_) {
      float& z = buf_.at(static_cast<std::size_t>(id));
      z = z > 0.0f ? z / penalty_ : z * penalty_;
    }
    return sample_token(buf_, temperature_, u, allowed_);
  }
  void push(int token) {
    if (window_ == 0) return;
    recent_.push_back(token);
    if (static_cast<int>(recent_.size()) > window_) recent_.erase(recent_.begin());
  }

 private:
  double temperature_;
  float penalty_;
  int window_;
  std::span<const std::uint8_t> allowed_;
  std::vector<int> recent_, ids_;
  std::vector<float> buf_;
};

/// The generator of sampled window `w` for `seed`: every window has its own stream, so
/// windows can be drawn together in a batch. std::seed_seq's mixing is fully specified.
inline std::mt19937_64 window_rng(std::uint64_t seed, std::size_t w) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(static_cast<std::uint64_t>(w) >> 32)};
  return std::mt19937_64(seq);
}

/// Windows decoded together by `calibrate_windows`: the runner shares each read of the
/// weights between them, and the statistics do not depend on it.
inline constexpr int calibration_batch = 8;

/// Threads of the calibration's decoder (the statistics are the same bits at any count): every
/// core, except for a tiny model (dim < 256, such as stories260K), which gets one. Its products
/// take microseconds, so a team synchronises about a million times per calibration, and where
/// other programs keep the cores busy each synchronisation can wait a scheduler slice for a
/// descheduled member. Measured on the 2-vCPU development machine, stories260K's 100 windows:
/// 1.9 s on 2 threads and 3.3 s on 1 when idle; beside two busy loops, 8 to 25 s on 2 threads
/// and 4.6 s on 1.
inline int calibration_threads(const model& m) {
  constexpr int tiny_dim = 256;
  return m.config().dim < tiny_dim ? 1 : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

namespace detail {

/// The loop every calibration shares: windows [0, count) of `length` tokens, `batch` of them
/// decoded together, each into a fresh session whose every query is collected into the
/// window's own accumulator. `next(w, t, logits)` is token t of window w, given the logits
/// that followed its token t - 1 (empty for t = 0). One window is one trace; traces weigh the
/// same. The windows' accumulators are merged in window order, so the statistics are the same
/// bits for any batch.
template <class Next>
triattn::query_stats calibrate_windows(const model& m, std::size_t count, int length, Next&& next,
                                       const calibration_progress& progress, int batch = calibration_batch) {
  const char* api = "triattn_runner::calibrate_windows";
  TRIATTN_CHECK(length >= 1 && length <= m.config().seq_len, api, "window length ", length, " must be in [1, ",
                m.config().seq_len, "] (the model's context)");
  TRIATTN_CHECK(batch >= 1, api, "batch ", batch, " must be >= 1");
  std::vector<session> sessions;
  for (std::size_t i = 0; i < std::min<std::size_t>(count, static_cast<std::size_t>(batch)); ++i)
    sessions.emplace_back(m, length);
  TRIATTN_CHECK(!sessions.empty(), api, "no windows");
  const triattn::kv_geometry geo = sessions.front().view().geo;
  triattn::query_stats_accumulator total(geo);
  batch_decoder decoder(m, calibration_threads(m));
  for (std::size_t w0 = 0; w0 < count; w0 += sessions.size()) {
    const std::size_t k = std::min(sessions.size(), count - w0);
    std::vector<triattn::query_stats_accumulator> accs(k, triattn::query_stats_accumulator(geo));
    std::vector<query_collector> collectors;
    collectors.reserve(k);  // the sessions point at them
    std::vector<session*> group;
    for (std::size_t i = 0; i < k; ++i) {
      sessions[i].reset();
      sessions[i].set_observer(&collectors.emplace_back(accs[i], m.config()));
      group.push_back(&sessions[i]);
    }
    std::vector<int> tokens(k);
    for (int t = 0; t < length; ++t) {
      for (std::size_t i = 0; i < k; ++i)
        tokens[i] = next(w0 + i, t, t == 0 ? std::span<const float>() : decoder.logits(static_cast<int>(i)));
      decoder.step(group, tokens);
    }
    for (std::size_t i = 0; i < k; ++i) {
      sessions[i].set_observer(nullptr);
      accs[i].end_trace();
      total.merge(accs[i]);
      if (progress) progress(w0 + i + 1, count);
    }
  }
  return total.finish(triattn::merge_mode::per_trace);
}

}  // namespace detail

/// Calibrates on `windows` of tokens (each at most the model's context, all of one length),
/// decoded `calibration_batch` at a time. `progress(done, total)` is called after each window.
inline triattn::query_stats calibrate(const model& m, const std::vector<std::vector<int>>& windows,
                                      const calibration_progress& progress = {}) {
  TRIATTN_CHECK(!windows.empty(), "triattn_runner::calibrate", "no windows");
  const std::size_t length = windows.front().size();
  for (const std::vector<int>& w : windows)
    TRIATTN_CHECK(w.size() == length, "triattn_runner::calibrate", "windows of ", w.size(), " and ", length, " tokens");
  return detail::calibrate_windows(
      m, windows.size(), static_cast<int>(length),
      [&](std::size_t w, int t, std::span<const float>) { return windows[w][static_cast<std::size_t>(t)]; }, progress);
}

/// Calibrates on up to `max_windows` windows of `text` (shared/spec/cli.md: paragraphs split at
/// blank lines, BOS + tokens each, concatenated to the model's context). One window is one
/// trace; traces weigh the same. `progress(done, total)` is called after each window.
inline triattn::query_stats calibrate(const model& m, const tokenizer& tok, std::string_view text, int max_windows,
                                      const calibration_progress& progress = {}) {
  const auto windows = text_windows(tok, text, m.config().seq_len, max_windows);
  TRIATTN_CHECK(!windows.empty(), "triattn_runner::calibrate", "the text holds no full window of ", m.config().seq_len,
                " tokens");
  return calibrate(m, windows, progress);
}

/// Calibrates on `windows` windows of `length` tokens (default: the model's context) that the
/// model samples itself, so that no text is needed: each window starts at BOS, and each next
/// token is drawn (sample_token, at `temperature`) from the logits of the one before; where
/// the model ends a story (it emits BOS) the window goes on with the next story, as
/// text_windows' windows of BOS-separated paragraphs do. Window w draws from
/// window_rng(seed, w): the same seed gives the same statistics, bit for bit.
/// `progress(done, total)` is called after each window.
inline triattn::query_stats calibrate_on_samples(const model& m, int windows, std::uint64_t seed,
                                                 double temperature = 1.0,
                                                 const calibration_progress& progress = {}, int length = 0) {
  TRIATTN_CHECK(windows >= 1, "triattn_runner::calibrate_on_samples", "windows ", windows, " must be >= 1");
  TRIATTN_CHECK(length >= 0, "triattn_runner::calibrate_on_samples", "length ", length, " must be >= 0 (0: the context)");
  std::vector<std::mt19937_64> rngs;
  for (int w = 0; w < windows; ++w) rngs.push_back(window_rng(seed, static_cast<std::size_t>(w)));
  return detail::calibrate_windows(
      m, static_cast<std::size_t>(windows), length > 0 ? length : m.config().seq_len,
      [&](std::size_t w, int t, std::span<const float> logits) {
        return t == 0 ? bos_id : sample_token(logits, temperature, rngs[w]);
      },
      progress);
}

/// Calibrates on the model's own answers, as the paper calibrates on its models' reasoning
/// traces: window w is `prompts[w]` followed by tokens the model samples (at `temperature`,
/// among the ids `allowed` marks; empty: all) until the window holds `length` tokens, so every
/// answer has at least `length` minus the longest prompt tokens, with an optional repetition
/// penalty (`answer_sampler`). Window w draws from window_rng(seed, w). `progress(done, total)` is called after each window.
inline triattn::query_stats calibrate_on_answers(const model& m, const std::vector<std::vector<int>>& prompts,
                                                 int length, std::uint64_t seed, double temperature,
                                                 std::span<const std::uint8_t> allowed = {},
                                                 const calibration_progress& progress = {}, float repeat_penalty = 1.0f,
                                                 int repeat_window = 0) {
  const char* api = "triattn_runner::calibrate_on_answers";
  TRIATTN_CHECK(!prompts.empty(), api, "no prompts");
  for (std::size_t w = 0; w < prompts.size(); ++w)
    TRIATTN_CHECK(!prompts[w].empty() && prompts[w].size() < static_cast<std::size_t>(length), api, "prompt ", w,
                  " has ", prompts[w].size(), " tokens; it must have 1 to length - 1 = ", length - 1);
  std::vector<std::mt19937_64> rngs;
  std::vector<answer_sampler> samplers;
  for (std::size_t w = 0; w < prompts.size(); ++w) {
    rngs.push_back(window_rng(seed, w));
    samplers.emplace_back(temperature, repeat_penalty, repeat_window, allowed);
  }
  return detail::calibrate_windows(
      m, prompts.size(), length,
      [&](std::size_t w, int t, std::span<const float> logits) {
        const auto& p = prompts[w];
        if (static_cast<std::size_t>(t) < p.size()) return p[static_cast<std::size_t>(t)];
        const int next = samplers[w].draw(logits, uniform_draw(rngs[w]));
        samplers[w].push(next);
        return next;
      },
      progress);
}

}  // namespace triattn_runner
