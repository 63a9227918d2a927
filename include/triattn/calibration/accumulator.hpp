/// \file triattn/calibration/accumulator.hpp
/// \brief Builds `query_stats` from a model's queries: per (layer, q-head, band f) the sums
/// of the complex band z_f of the pre-RoPE query and of its modulus |z_f|, in double.
///
/// Feed one token at a time per layer (pre-RoPE queries, or post-RoPE ones with their
/// position, which are un-rotated first), close each calibration sequence with `end_trace()`,
/// and `finish()`. Accumulators of disjoint trace sets `merge()`, so calibration can run in
/// parallel. `finish` weighs each trace equally by default (the mean of the per-trace means,
/// as the reference's multi-trace aggregation does) or, optionally, each token equally.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How `query_stats_accumulator::finish` combines traces of different lengths.
enum class merge_mode : std::uint8_t {
  per_trace,  ///< every trace weighs the same: mean over traces of the trace's mean (reference default)
  per_token,  ///< every token weighs the same: total sums over total tokens
};

/// Accumulates TriAttention's query statistics. Not thread-safe; use one per thread and `merge`.
class query_stats_accumulator {
 public:
  /// A model of `num_layers` layers, `num_q_heads` query heads sharing `num_kv_heads` KV heads,
  /// heads of `head_dim` dims, rotated as `rope` describes (every dim must be rotated).
  query_stats_accumulator(int num_layers, int num_q_heads, int num_kv_heads, int head_dim, const rope_desc& rope)
      : num_layers_(num_layers),
        num_q_heads_(num_q_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        style_(rope.style),
        attention_scale_(rope.attention_scale) {
    constexpr const char* api = "triattn::query_stats_accumulator";
    TRIATTN_CHECK(num_layers > 0, api, "num_layers ", num_layers, " must be >= 1");
    TRIATTN_CHECK(num_kv_heads > 0, api, "num_kv_heads ", num_kv_heads, " must be >= 1");
    TRIATTN_CHECK(num_q_heads > 0 && num_q_heads % num_kv_heads == 0, api, "num_q_heads ", num_q_heads,
                  " must be a positive multiple of num_kv_heads ", num_kv_heads);
    validate_rope(api, rope, head_dim);
    // The statistics have head_dim/2 bands, each of which rotates; unrotated dims have no band.
    TRIATTN_CHECK(rotary_dims(rope, head_dim) == head_dim, api, "rotary_dim ", rope.rotary_dim, " < head_dim ",
                  head_dim, ": TriAttention needs every dim rotated");
    inv_freq_.resize(static_cast<std::size_t>(head_dim / 2));
    for (int f = 0; f < head_dim / 2; ++f) inv_freq_[static_cast<std::size_t>(f)] = inv_freq(rope, head_dim, f);
    const std::size_t n = static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_q_heads) *
                          static_cast<std::size_t>(head_dim / 2);
    open_.assign(n, {});
    trace_means_.assign(n, {});
    totals_.assign(n, {});
    open_tokens_.assign(static_cast<std::size_t>(num_layers), 0);
  }

  /// The geometry of `g` (layers, heads, head_dim, RoPE); its dtype and key state do not matter.
  explicit query_stats_accumulator(const kv_geometry& g)
      : query_stats_accumulator(g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.rope) {}

  /// Adds one token's pre-RoPE queries of `layer`: `q` [num_q_heads, head_dim].
  void add_pre_rope(int layer, std::span<const float> q) {
    check_token("triattn::query_stats_accumulator::add_pre_rope", layer, q);
    for (int h = 0; h < num_q_heads_; ++h) add_head(layer, h, q.data() + head_offset(h));
    ++open_tokens_[static_cast<std::size_t>(layer)];
  }

  /// Adds one token's post-RoPE queries of `layer`, `q` [num_q_heads, head_dim], rotated to
  /// `position`: each head is un-rotated (in double) before it is accumulated.
  void add_post_rope(int layer, std::span<const float> q, std::int64_t position) {
    constexpr const char* api = "triattn::query_stats_accumulator::add_post_rope";
    check_token(api, layer, q);
    TRIATTN_CHECK(position >= 0, api, "position ", position, " must be >= 0");
    // The frequencies computed once in the constructor, owned here (a caller's table may not outlive us).
    rope_desc r;
    r.style = style_;
    r.attention_scale = attention_scale_;
    r.inv_freq_table = inv_freq_.data();
    std::vector<double> x(static_cast<std::size_t>(head_dim_));
    for (int h = 0; h < num_q_heads_; ++h) {
      const float* src = q.data() + head_offset(h);
      for (int d = 0; d < head_dim_; ++d) x[static_cast<std::size_t>(d)] = src[d];
      rope_unrotate(r, x.data(), head_dim_, static_cast<double>(position));
      add_head(layer, h, x.data());
    }
    ++open_tokens_[static_cast<std::size_t>(layer)];
  }

  /// Closes the current trace (one calibration sequence). Every layer must have received the
  /// same, non-zero number of tokens since the previous `end_trace`.
  void end_trace() {
    constexpr const char* api = "triattn::query_stats_accumulator::end_trace";
    const std::int64_t n = open_tokens_[0];
    for (int l = 1; l < num_layers_; ++l)
      TRIATTN_CHECK(open_tokens_[static_cast<std::size_t>(l)] == n, api, "layer ", l, " received ",
                    open_tokens_[static_cast<std::size_t>(l)], " tokens in this trace but layer 0 received ", n);
    TRIATTN_CHECK(n > 0, api, "the trace holds no tokens");
    const double inv_n = 1.0 / static_cast<double>(n);
    for (std::size_t i = 0; i < open_.size(); ++i) {
      trace_means_[i].add(open_[i], inv_n);
      totals_[i].add(open_[i], 1.0);
      open_[i] = {};
    }
    num_tokens_ += n;
    ++num_traces_;
    open_tokens_.assign(open_tokens_.size(), 0);
  }

  /// Adds the closed traces of `other`, which must describe the same model (layers, heads,
  /// head_dim, pairing, inverse frequencies, attention scale), have no open trace and be
  /// another object (`a.merge(a)` is refused).
  /// This accumulator's open trace, if any, stays open.
  void merge(const query_stats_accumulator& other) {
    constexpr const char* api = "triattn::query_stats_accumulator::merge";
    // a.merge(a) would count every trace twice, silently
    TRIATTN_CHECK(&other != this, api, "an accumulator cannot merge itself: its traces would count twice");
    TRIATTN_CHECK(other.num_layers_ == num_layers_, api, "num_layers ", other.num_layers_, " != ", num_layers_);
    TRIATTN_CHECK(other.num_q_heads_ == num_q_heads_, api, "num_q_heads ", other.num_q_heads_, " != ", num_q_heads_);
    TRIATTN_CHECK(other.num_kv_heads_ == num_kv_heads_, api, "num_kv_heads ", other.num_kv_heads_,
                  " != ", num_kv_heads_);
    TRIATTN_CHECK(other.head_dim_ == head_dim_, api, "head_dim ", other.head_dim_, " != ", head_dim_);
    TRIATTN_CHECK(other.style_ == style_, api, "rope style ", style_name(other.style_), " != ", style_name(style_));
    TRIATTN_CHECK(other.attention_scale_ == attention_scale_, api, "rope attention_scale ", other.attention_scale_,
                  " != ", attention_scale_);
    // Two descriptions that yield the same frequencies describe the same rotation.
    for (std::size_t f = 0; f < inv_freq_.size(); ++f)
      TRIATTN_CHECK(other.inv_freq_[f] == inv_freq_[f], api, "inv_freq[", f, "] ", other.inv_freq_[f],
                    " != ", inv_freq_[f]);
    const std::int64_t pending = other.open_trace_tokens();
    TRIATTN_CHECK(pending == 0, api, "the merged accumulator has an open trace of ", pending,
                  " tokens: call end_trace() on it first");
    for (std::size_t i = 0; i < totals_.size(); ++i) {
      trace_means_[i].add(other.trace_means_[i], 1.0);
      totals_[i].add(other.totals_[i], 1.0);
    }
    num_tokens_ += other.num_tokens_;
    num_traces_ += other.num_traces_;
  }

  /// The statistics of the closed traces, weighted as `mode` says, with the inverse
  /// frequencies of the RoPE (double), its pairing and attention scale, and
  /// `info["num_tokens"]`, `info["num_traces"]`.
  query_stats finish(merge_mode mode = merge_mode::per_trace) const {
    constexpr const char* api = "triattn::query_stats_accumulator::finish";
    TRIATTN_CHECK(num_traces_ > 0, api, "the accumulator holds no closed trace");
    const std::int64_t pending = open_trace_tokens();
    TRIATTN_CHECK(pending == 0, api, "a trace of ", pending, " tokens is still open: call end_trace() first");
    query_stats s;
    s.num_layers = num_layers_;
    s.num_q_heads = num_q_heads_;
    s.num_kv_heads = num_kv_heads_;
    s.head_dim = head_dim_;
    s.style = style_;
    s.attention_scale = attention_scale_;
    s.inv_freq = inv_freq_;
    const bool by_trace = mode == merge_mode::per_trace;
    const std::vector<band_sums>& sums = by_trace ? trace_means_ : totals_;
    const double inv_count = 1.0 / static_cast<double>(by_trace ? num_traces_ : num_tokens_);
    s.q_mean_real.resize(sums.size());
    s.q_mean_imag.resize(sums.size());
    s.q_abs_mean.resize(sums.size());
    for (std::size_t i = 0; i < sums.size(); ++i) {
      s.q_mean_real[i] = static_cast<float>(sums[i].re * inv_count);
      s.q_mean_imag[i] = static_cast<float>(sums[i].im * inv_count);
      s.q_abs_mean[i] = static_cast<float>(sums[i].abs * inv_count);
    }
    s.info["num_tokens"] = std::to_string(num_tokens_);
    s.info["num_traces"] = std::to_string(num_traces_);
    s.validate(api);  // catches non-finite queries fed in
    return s;
  }

  /// Closed traces so far.
  std::int64_t num_traces() const { return num_traces_; }
  /// Tokens (per layer) of the closed traces so far.
  std::int64_t num_tokens() const { return num_tokens_; }
  /// Tokens `layer` has received in the open trace.
  std::int64_t open_tokens(int layer) const { return open_tokens_[static_cast<std::size_t>(layer)]; }

 private:
  /// Per (layer, q-head, band): Re, Im of the complex band and its modulus, summed.
  struct band_sums {
    double re = 0.0, im = 0.0, abs = 0.0;
    void add(const band_sums& o, double weight) {
      re += o.re * weight;
      im += o.im * weight;
      abs += o.abs * weight;
    }
  };

  static const char* style_name(rope_style s) { return s == rope_style::half ? "half" : "interleaved"; }

  std::size_t head_offset(int h) const { return static_cast<std::size_t>(h) * static_cast<std::size_t>(head_dim_); }

  /// The largest token count any layer has received in the open trace (0 when none is open).
  std::int64_t open_trace_tokens() const {
    std::int64_t n = 0;
    for (const std::int64_t t : open_tokens_) n = t > n ? t : n;
    return n;
  }

  void check_token(const char* api, int layer, std::span<const float> q) const {
    TRIATTN_CHECK(layer >= 0 && layer < num_layers_, api, "layer ", layer, " is outside [0, ", num_layers_, ")");
    const std::size_t expected = head_offset(num_q_heads_);
    TRIATTN_CHECK(q.size() == expected, api, "q holds ", q.size(),
                  " values, expected num_q_heads x head_dim = ", num_q_heads_, " x ", head_dim_, " = ", expected);
  }

  /// Accumulates the bands of one pre-RoPE head vector `x` [head_dim].
  template <class T>
  void add_head(int layer, int h, const T* x) {
    band_sums* out = open_.data() + (static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_q_heads_) +
                                     static_cast<std::size_t>(h)) *
                                        static_cast<std::size_t>(head_dim_ / 2);
    for (int f = 0; f < head_dim_ / 2; ++f) {
      int i_re, i_im;
      rope_band_dims(style_, head_dim_, f, i_re, i_im);
      const double re = x[i_re], im = x[i_im];
      out[f].re += re;
      out[f].im += im;
      out[f].abs += std::sqrt(re * re + im * im);  // inputs are floats: no overflow in double
    }
  }

  int num_layers_, num_q_heads_, num_kv_heads_, head_dim_;
  rope_style style_;
  double attention_scale_;
  std::vector<double> inv_freq_;           ///< [head_dim/2]
  std::vector<band_sums> open_;            ///< [layers, q_heads, bands] sums of the open trace
  std::vector<band_sums> trace_means_;     ///< [layers, q_heads, bands] sum over closed traces of the trace mean
  std::vector<band_sums> totals_;          ///< [layers, q_heads, bands] sums over all tokens of closed traces
  std::vector<std::int64_t> open_tokens_;  ///< [layers] tokens received in the open trace
  std::int64_t num_tokens_ = 0;
  std::int64_t num_traces_ = 0;
};

TRIATTN_NAMESPACE_END
