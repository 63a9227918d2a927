/// \file triattn/policies/expected_attention.hpp
/// \brief Expected Attention (Devoto, Jeblick, Jégou, "Expected Attention: KV Cache
/// Compression by Estimating Attention from Future Queries Distribution", arXiv:2510.00636;
/// kvpress `ExpectedAttentionPress`): the attention future queries are expected to pay each
/// key, in closed form under a Gaussian model of the queries, times the value's norm. Reads
/// no attention: the statistics come from queries the engine computed anyway, or from a
/// calibration file.
///
/// **Score** (docs/attention_free.md), layer l, kv head g holding n slots, post-RoPE keys k_j,
/// for each q-head h of the group:
///
///     μ_h, Σ_h   mean and covariance (population) of the pre-RoPE queries of h: the window's
///                last `window` observed queries at positions >= `sinks`, each rotated back
///                from its position (or the calibration file's E[q], Σ = 0);
///     R̄          the mean of RoPE's rotation over positions [T, T + future), T the round start;
///     z_h[j]     = (R̄ μ_h) · k_j / √D + k_jᵀ (R̄ Σ_h R̄ᵀ) k_j / (2D)     (covariance on),
///     p_h        = softmax of z_h over the slots that compete (the sinks and every slot the
///                  round protects take no part),
///     s[j]       = (mean over h of p_h[j] + ε) · ‖v_j‖₂                (value_norm on).
///
/// exp(z_h[j]) is E[exp(qᵀk_j/√D)] for q ~ N(R̄μ, R̄ΣR̄ᵀ): hence the name. The first `sinks`
/// slots are kept by rule (kvpress pads them with the row's maximum).
///
/// **Differences from kvpress**: kvpress computes the statistics once, at the end of prefill,
/// from every prompt token after the sinks (projecting hidden states with W_q); here they come
/// from the queries observed (`observe`, post-RoPE as the engine has them), the last `window`
/// per head, so that a decode-time round sees recent queries. kvpress' covariance is that of
/// the hidden states projected by W_q, the same matrix. Numbers are fp32 with fixed-order sums
/// (the statistics in double).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/expected_attention_math.hpp"
#include "triattn/policies/key_only_math.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/query_window.hpp"

TRIATTN_NAMESPACE_BEGIN

class expected_attention : public policy_base<expected_attention> {
 public:
  static constexpr std::string_view name = "expected_attention";
  static constexpr const char* plan_api = "triattn::expected_attention::plan";
  expected_attention_config config;

  /// Statistics from the observed queries: `attach` the view, `observe` every query row.
  expected_attention() = default;
  explicit expected_attention(expected_attention_config c) : config(c) { validate_config("triattn::expected_attention"); }
  /// Statistics from calibration: the stats' pre-RoPE query means E[q] (the file holds no
  /// covariance, so the covariance term is off); nothing to observe.
  explicit expected_attention(const query_stats& stats, expected_attention_config c = {})
      : config(c), stats_(std::make_shared<const query_stats>(stats)) {
    validate_config("triattn::expected_attention");
    stats.validate("triattn::expected_attention");
  }

  const round_options& round() const { return config.round; }

  /// The first `sinks` slots are kept (the oldest of them when the budget is smaller).
  row_rule rule(const round_info& info) const { return {protection::sinks_and_recent(config.sinks, 0), info.budget}; }

  /// (Re)sizes the query window for `view`'s geometry, empty: once per sequence, before the
  /// first `observe`. Calibrated policies observe nothing and need no attach.
  template <KVCacheView V>
  void attach(const V& view) {
    const char* api = "triattn::expected_attention::attach";
    validate_config(api);
    view.validate(api);
    const kv_geometry& g = view.geometry();
    window_ = query_window(config.window);
    window_.resize(g.num_layers, g.num_q_heads, g.head_dim);
  }

  /// One new query row of (layer, q_head) at `position`, post-RoPE [head_dim]; `probs` is
  /// not read. Ignored by a calibrated policy.
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
               [[maybe_unused]] std::span<const float> probs = {}) {
    if (stats_) return;
    window_.push(layer, q_head, position, q_post_rope, "triattn::expected_attention::observe");
  }

  /// Checks the config and the statistics' source against the view; the returned row scorer
  /// shares the round's per-head terms (R̄μ/√D and R̄ΣR̄ᵀ/2D).
  template <KVCacheView V>
  auto begin_round(const char* api, const V& view, const round_info& info) const {
    validate_config(api);
    return row_scorer<V>{&view, api, std::make_shared<const head_terms>(terms(api, view, info.round_start)), config, {}};
  }

  /// Scores into `out` [num_layers, num_kv_heads, capacity] for a round starting at position
  /// `round_start` (negative: after the last cached position), every slot but the sinks
  /// competing; the sinks score +inf, slots past a length are left as they are.
  template <KVCacheView V>
  void score(const V& view, std::int64_t round_start, std::span<float> out) const {
    const char* api = "triattn::expected_attention::score";
    view.validate(api);
    auto rows = begin_round(api, view, round_info{resolve_round_start(api, view, {round_start}), 0, 1});
    std::vector<std::uint8_t> candidate;
    for_each_score_row(api, view, out, [&](int l, int h, std::span<float> row) {
      const std::int64_t sinks = std::min<std::int64_t>(config.sinks, std::ssize(row));
      candidate.assign(row.size(), 1);
      std::fill_n(candidate.begin(), sinks, 0);
      rows.score(l, h, candidate, row);
      std::fill_n(row.begin(), sinks, INFINITY);
    });
  }

  /// `score` for a round right after the last cached position (what `select` decides with).
  template <KVCacheView V>
  void score(const V& view, std::span<float> out) const {
    score(view, -1, out);
  }

  /// The kept queries (empty for a calibrated policy).
  const query_window& queries() const { return window_; }

 private:
  /// Per (layer, q_head): `rows` rows of head_dim floats [layers, q_heads, rows, head_dim]:
  /// R̄μ/√D, then (covariance on) either the rows of R̄ΣR̄ᵀ/2D, or, `factored`, when the heads
  /// keep fewer queries than head_dim, one row y_i = R̄(x_i − μ)/√(2D·k) per kept query x_i
  /// (zero rows pad a head that keeps fewer): kᵀR̄ΣR̄ᵀk/2D = Σ_i (y_i·k)², k·D products a key
  /// instead of D² (kvpress' default window is all the prompt; a decode-time window is short).
  struct head_terms {
    int rows = 1;
    bool factored = false;
    std::vector<float> data;
  };

  query_window window_;
  std::shared_ptr<const query_stats> stats_;

  void validate_config(const char* api) const {
    const std::string e = expected_attention_config_error(config);
    TRIATTN_CHECK(e.empty(), api, e);
  }

  /// The round's per-head terms (see the file comment), statistics in double.
  template <KVCacheView V>
  head_terms terms(const char* api, const V& view, std::int64_t round_start) const {
    const kv_geometry& g = view.geometry();
    const int D = g.head_dim, F = rotary_dims(g.rope, D) / 2;
    const bool cov = config.covariance && !stats_;
    if (stats_) {
      stats_->check_against(api, g);
    } else {
      TRIATTN_CHECK(window_.num_layers() == g.num_layers && window_.num_q_heads() == g.num_q_heads &&
                        window_.head_dim() == D && window_.window() == config.window,
                    api, "the policy was attached to ", window_.num_layers(), " layers, ", window_.num_q_heads(),
                    " q_heads, head_dim ", window_.head_dim(), ", window ", window_.window(), " but the view has ",
                    g.num_layers, ", ", g.num_q_heads, ", ", D, " and the config window ", config.window,
                    ": call attach(view) first");
    }
    std::vector<double> c(static_cast<std::size_t>(F)), s(static_cast<std::size_t>(F));
    for (int f = 0; f < F; ++f)
      expected_attention_mean_rotation(g.rope, D, f, static_cast<double>(round_start), config.future, c[f], s[f]);
    // R̄ x for a vector x [D]: band by band, unrotated dims as they are.
    const auto apply = [&](double* x) {
      for (int f = 0; f < F; ++f) {
        int re, im;
        rope_band_dims(g.rope.style, 2 * F, f, re, im);
        rotate_band_cs(x, re, im, c[f], s[f]);
      }
    };
    // The queries each head keeps (its window's, rotated back, those past the sinks), all
    // gathered first: their count decides the terms' layout.
    std::vector<std::vector<std::vector<double>>> kept(static_cast<std::size_t>(g.num_layers) * g.num_q_heads);
    std::size_t most = 0;
    if (!stats_) {
      row_matrix q;
      std::vector<std::int32_t> positions;
      std::vector<double> pre(static_cast<std::size_t>(D));
      for (int l = 0; l < g.num_layers; ++l)
        for (int h = 0; h < g.num_q_heads; ++h) {
          auto& k = kept[static_cast<std::size_t>(l) * g.num_q_heads + h];
          const int m = window_.gather(api, l, h, 1, q, positions);
          for (int i = 0; i < m; ++i) {
            if (positions[i] < config.sinks) continue;
            for (int d = 0; d < D; ++d) pre[d] = q(i, d);
            rope_unrotate(g.rope, pre.data(), D, positions[i]);
            k.push_back(pre);
          }
          TRIATTN_CHECK(!k.empty(), api, "layer ", l, " q_head ", h, " holds no observed query at a position >= sinks ",
                        config.sinks, ": observe queries before a round");
          most = std::max(most, k.size());
        }
    }
    head_terms out;
    out.factored = cov && most < static_cast<std::size_t>(D);
    out.rows = !cov ? 1 : out.factored ? 1 + static_cast<int>(most) : 1 + D;
    out.data.assign(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * out.rows * D, 0.0f);
    std::vector<double> mu(static_cast<std::size_t>(D)), sigma(static_cast<std::size_t>(D) * D), col(static_cast<std::size_t>(D));
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_q_heads; ++h) {
        const auto& k = kept[static_cast<std::size_t>(l) * g.num_q_heads + h];
        const auto count = static_cast<double>(k.size());
        std::fill(mu.begin(), mu.end(), 0.0);
        if (stats_) {
          const std::size_t r = stats_->row(l, h);
          for (int f = 0; f < F; ++f) {
            int re, im;
            rope_band_dims(g.rope.style, 2 * F, f, re, im);
            mu[re] = stats_->q_mean_real[r + f];
            mu[im] = stats_->q_mean_imag[r + f];
          }
        } else {
          for (const auto& x : k)
            for (int d = 0; d < D; ++d) mu[d] += x[d] / count;
        }
        float* t = out.data.data() + (static_cast<std::size_t>(l) * g.num_q_heads + h) * out.rows * D;
        if (cov && out.factored) {  // y_i = R̄(x_i − μ)/√(2D·k), μ before its rotation
          for (std::size_t i = 0; i < k.size(); ++i) {
            for (int d = 0; d < D; ++d) col[d] = k[i][d] - mu[d];
            apply(col.data());
            for (int d = 0; d < D; ++d) t[(1 + i) * D + d] = static_cast<float>(col[d] / std::sqrt(2.0 * D * count));
          }
        } else if (cov) {  // R̄ Σ R̄ᵀ/2D: R̄ applied to every column of Σ, then to every row
          std::fill(sigma.begin(), sigma.end(), 0.0);
          for (const auto& x : k)
            for (int a = 0; a < D; ++a)
              for (int b = 0; b < D; ++b) sigma[a * D + b] += (x[a] - mu[a]) * (x[b] - mu[b]) / count;
          for (int b = 0; b < D; ++b) {
            for (int a = 0; a < D; ++a) col[a] = sigma[a * D + b];
            apply(col.data());
            for (int a = 0; a < D; ++a) sigma[a * D + b] = col[a];
          }
          for (int a = 0; a < D; ++a) {
            apply(sigma.data() + a * D);
            for (int b = 0; b < D; ++b) t[(1 + a) * D + b] = static_cast<float>(sigma[a * D + b] / (2.0 * D));
          }
        }
        apply(mu.data());
        const double root = std::sqrt(static_cast<double>(D));
        for (int d = 0; d < D; ++d) t[d] = static_cast<float>(mu[d] / root);
      }
    return out;
  }

  template <KVCacheView V>
  struct row_scorer {
    const V* view;
    const char* api;
    std::shared_ptr<const head_terms> terms;
    expected_attention_config config;
    struct {
      row_matrix keys, products;
      std::vector<float> logits, group, value;
    } sc;

    void score(int layer, int kv_head, std::span<const std::uint8_t> candidate, std::span<float> out) {
      const kv_geometry& g = view->geometry();
      const int D = g.head_dim, G = g.group_size(), R = terms->rows;
      const auto n = static_cast<std::int64_t>(out.size());
      const key_map keys = window_keys(api, *view, layer, kv_head, n, sc.keys);  // [n, D] post-RoPE
      sc.products.resize(R, n);
      sc.logits.resize(static_cast<std::size_t>(n));
      sc.group.assign(static_cast<std::size_t>(n), 0.0f);
      for (int i = 0; i < G; ++i) {
        const float* t = terms->data.data() + (static_cast<std::size_t>(layer) * g.num_q_heads + kv_head * G + i) * R * D;
        // products [R, n]: row 0 the linear term, row 1 + a the a-th entry of (R̄ΣR̄ᵀ/2D) k_j
        fixed_order_dot_block(t, D, R, keys.data(), keys.outerStride(), n, D, sc.products.data(), sc.products.outerStride());
        for (std::int64_t j = 0; j < n; ++j) {
          float z = sc.products(0, j);
          if (terms->factored) {
            for (int a = 1; a < R; ++a) z = multiply_add(sc.products(a, j), sc.products(a, j), z);
          } else {
            for (int a = 1; a < R; ++a) z = multiply_add(keys(j, a - 1), sc.products(a, j), z);
          }
          sc.logits[j] = candidate[j] != 0 ? z : -INFINITY;
        }
        softmax_row(sc.logits.data(), n);
        for (std::int64_t j = 0; j < n; ++j) sc.group[j] += sc.logits[j];
      }
      sc.value.resize(static_cast<std::size_t>(D));
      for (std::int64_t j = 0; j < n; ++j) {
        float norm = 1.0f;
        if (config.value_norm) {
          load_value(*view, layer, kv_head, j, sc.value.data());
          norm = l2_norm(sc.value.data(), D);
          TRIATTN_CHECK(std::isfinite(norm), api, "value of layer ", layer, " kv_head ", kv_head, " slot ", j,
                        " has L2 norm ", norm, ": values must be finite");
        }
        out[j] = expected_attention_score(sc.group[j] / static_cast<float>(G), norm, config.value_norm, config.epsilon);
      }
    }
  };
};

TRIATTN_NAMESPACE_END
