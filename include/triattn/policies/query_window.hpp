/// \file triattn/policies/query_window.hpp
/// \brief What the window-scored policies (SnapKV, R-KV) share: the window of the last w
/// post-RoPE queries, the window attention recomputed from it, and the
/// attach / observe / score / plan scaffolding.
///
/// The library never owns the attention computation. The engine's attention loop hands every
/// new query row to `observe`; engines on flash attention never materialise probabilities, so
/// the policy recomputes the window attention from the queries it keeps, as kvpress does
/// (baselines.md §7). For one q-head with m observed queries and a (layer, kv_head) of n keys:
///
///     logits [m, n] = Q Kᵀ / √D,  −inf where the key's position is above the query's,
///     probs  [m, n] = softmax of every row, in fp32 (a fully masked row gives zeros).
///
/// Keys are read through Eigen maps: a strided map straight over the cache for dense f32
/// post-RoPE views, an f32 scratch copy of one (layer, kv_head) otherwise (f16/bf16/fp8 keys,
/// paged views, pre-RoPE keys).
///
/// **Pre-RoPE caches.** The queries are post-RoPE, so keys a `key_state::pre_rope` view stores
/// unrotated are rotated to their positions in the scratch copy before anything compares them:
/// the same tokens are kept whether the cache holds keys before or after RoPE (R-KV's
/// redundancy then also compares the rotated keys, as the reference's post-RoPE cache does).
///
/// **Fewer observed queries than the window.** Scoring uses the m <= w queries observed so far
/// (a prompt shorter than w, a window filled mid-decode); the protected window stays the last w
/// slots. A (layer, kv_head) that must be scored with no observed query, or whose q-heads hold
/// different window rows, is an error.
#pragma once

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN

/// A row-major f32 matrix: one query or key per row, as the cache stores them.
using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// The keys of one (layer, kv_head) [n, head_dim], over the cache or over a scratch copy.
using key_map = Eigen::Map<const row_matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
/// Read-only rows with any row stride: a `row_matrix`, a `key_map`, a block of rows of either.
using const_rows = Eigen::Ref<const row_matrix, 0, Eigen::OuterStride<>>;

/// The last `window` post-RoPE queries of every (layer, q_head), with their positions.
///
/// A ring per (layer, q_head) [layers, q_heads, window, head_dim]: pushing is O(head_dim) and
/// nothing moves. Queries are not per-slot state: compaction leaves the window alone.
class query_window {
 public:
  query_window() = default;
  /// A window of the last `window` queries; `resize` gives it its shape.
  explicit query_window(int window) : window_(window) {
    TRIATTN_CHECK(window >= 1, "triattn::query_window", "window ", window, " must be >= 1");
  }

  /// Shapes the window for `layers` x `q_heads` rows of `head_dim` floats, empty.
  void resize(int layers, int q_heads, int head_dim) {
    TRIATTN_CHECK(layers >= 0 && q_heads >= 0 && head_dim >= 0, "triattn::query_window::resize", "shape ", layers,
                  " x ", q_heads, " x ", head_dim, " must not be negative");
    layers_ = layers;
    q_heads_ = q_heads;
    head_dim_ = head_dim;
    const auto rows = static_cast<std::size_t>(layers) * static_cast<std::size_t>(q_heads);
    queries_.assign(rows * static_cast<std::size_t>(window_) * static_cast<std::size_t>(head_dim), 0.0f);
    positions_.assign(rows * static_cast<std::size_t>(window_), 0);
    pushed_.assign(rows, 0);
  }
  /// Forgets every query (a new sequence); the shape stays.
  void clear() { std::fill(pushed_.begin(), pushed_.end(), 0); }

  int window() const { return window_; }
  int num_layers() const { return layers_; }
  int num_q_heads() const { return q_heads_; }
  int head_dim() const { return head_dim_; }

  /// Queries held for (layer, q_head): min(window, queries pushed since the last clear).
  int count(int layer, int q_head) const {
    check_head("triattn::query_window::count", layer, q_head);
    return held(index(layer, q_head));
  }

  /// Appends the query `q` [head_dim] of (layer, q_head) at `position`, dropping the oldest
  /// once `window` are held. Positions of one (layer, q_head) must increase. Throws
  /// `triattn::error` naming `api` (the window unchanged) for a head out of range, a query of
  /// the wrong size or with a non-finite element, or a position that does not increase.
  void push(int layer, int q_head, std::int32_t position, std::span<const float> q,
            const char* api = "triattn::query_window::push") {
    check_head(api, layer, q_head);
    TRIATTN_CHECK(q.size() == static_cast<std::size_t>(head_dim_), api, "query of layer ", layer, " q_head ", q_head,
                  " holds ", q.size(), " floats, expected head_dim ", head_dim_);
    for (std::size_t d = 0; d < q.size(); ++d)
      TRIATTN_CHECK(std::isfinite(q[d]), api, "query of layer ", layer, " q_head ", q_head, " at position ", position,
                    " has ", q[d], " at dim ", d, ": queries must be finite");
    const std::size_t r = index(layer, q_head);
    TRIATTN_CHECK(position >= 0, api, "position ", position, " of layer ", layer, " q_head ", q_head,
                  " must be >= 0");
    if (pushed_[r] > 0) {
      const std::int32_t last = positions_[ring_slot(r, pushed_[r] - 1)];
      TRIATTN_CHECK(position > last, api, "position ", position, " of layer ", layer, " q_head ", q_head,
                    " must be above the last observed position ", last);
    }
    const std::size_t s = ring_slot(r, pushed_[r]);
    std::copy(q.begin(), q.end(), queries_.begin() + static_cast<std::ptrdiff_t>(s * static_cast<std::size_t>(head_dim_)));
    positions_[s] = position;
    ++pushed_[r];
  }

  /// Copies the queries of q-heads [q_head, q_head + heads) of `layer`, oldest first, into `q`
  /// [heads * m, head_dim] (q-head-major) and their positions into `positions` [m]; returns m.
  /// These q-heads must hold m >= 1 queries each, at the same positions (the engine observes
  /// every head of a layer at each token); otherwise throws naming `api`.
  int gather(const char* api, int layer, int q_head, int heads, row_matrix& q,
             std::vector<std::int32_t>& positions) const {
    check_head(api, layer, q_head);
    check_head(api, layer, q_head + heads - 1);
    const std::size_t first = index(layer, q_head);
    const int m = held(first);
    TRIATTN_CHECK(m >= 1, api, "layer ", layer, " q_head ", q_head,
                  " holds no observed query: observe the window's queries before scoring");
    positions.resize(static_cast<std::size_t>(m));
    for (int i = 0; i < m; ++i) positions[i] = positions_[ring_slot(first, oldest(first) + i)];
    q.resize(static_cast<Eigen::Index>(heads) * m, head_dim_);
    for (int k = 0; k < heads; ++k) {
      const std::size_t r = first + static_cast<std::size_t>(k);
      TRIATTN_CHECK(held(r) == m, api, "layer ", layer, " q_head ", q_head + k, " holds ", held(r),
                    " observed queries but q_head ", q_head, " holds ", m, ": every q-head of a group must see the same tokens");
      for (int i = 0; i < m; ++i) {
        const std::size_t s = ring_slot(r, oldest(r) + i);
        TRIATTN_CHECK(positions_[s] == positions[i], api, "layer ", layer, " q_head ", q_head + k, " window row ", i,
                      " is at position ", positions_[s], " but q_head ", q_head, "'s is at ", positions[i],
                      ": every q-head of a group must see the same tokens");
        std::copy_n(queries_.begin() + static_cast<std::ptrdiff_t>(s * static_cast<std::size_t>(head_dim_)), head_dim_,
                    q.row(static_cast<Eigen::Index>(k) * m + i).data());
      }
    }
    return m;
  }

 private:
  int window_ = 1;
  int layers_ = 0, q_heads_ = 0, head_dim_ = 0;
  std::vector<float> queries_;           // [layers, q_heads, window, head_dim], a ring per (layer, q_head)
  std::vector<std::int32_t> positions_;  // [layers, q_heads, window]
  std::vector<std::int64_t> pushed_;     // [layers, q_heads] queries pushed since the last clear

  void check_head(const char* api, int layer, int q_head) const {
    TRIATTN_CHECK(layer >= 0 && layer < layers_, api, "layer ", layer, " is outside [0, ", layers_,
                  layers_ == 0 ? "): attach the policy to a view first" : ")");
    TRIATTN_CHECK(q_head >= 0 && q_head < q_heads_, api, "q_head ", q_head, " is outside [0, ", q_heads_, ")");
  }
  std::size_t index(int layer, int q_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(q_heads_) + static_cast<std::size_t>(q_head);
  }
  int held(std::size_t r) const { return static_cast<int>(std::min<std::int64_t>(pushed_[r], window_)); }
  /// Sequence number of the oldest held query of row r.
  std::int64_t oldest(std::size_t r) const { return pushed_[r] - held(r); }
  /// Ring slot of the query with sequence number `seq` of row r, in [layers * q_heads * window).
  std::size_t ring_slot(std::size_t r, std::int64_t seq) const {
    return r * static_cast<std::size_t>(window_) + static_cast<std::size_t>(seq % window_);
  }
};

/// Window logits: `out` [rows, n] = q kᵀ / √D for queries `q` [rows, D] and keys `k` [n, D] at
/// `k_positions` [n], −inf where a key's position is above the query's (the causal mask
/// inside the window). Query row i is at `q_positions[i % m]` (m = q_positions.size()): the
/// window rows of several q-heads stacked, one product for the whole group. The products are
/// `fixed_order_dot`s, not a BLAS product: a GEMM's summation order follows its SIMD width and
/// its edge handling, so equal keys could get different logits and builds different keep sets.
inline void window_logits(const const_rows& q, std::span<const std::int32_t> q_positions, const const_rows& k,
                          std::span<const std::int32_t> k_positions, row_matrix& out) {
  out.resize(q.rows(), k.rows());
  fixed_order_dot_block(q.data(), q.outerStride(), static_cast<int>(q.rows()), k.data(), k.outerStride(), k.rows(),
                        static_cast<int>(q.cols()), out.data(), out.outerStride());
  const float scale = window_logit_scale(static_cast<int>(q.cols()));
  const auto m = static_cast<Eigen::Index>(q_positions.size());
  for (Eigen::Index i = 0; i < out.rows(); ++i) {
    float* row = out.row(i).data();
    const std::int32_t at = q_positions[static_cast<std::size_t>(i % m)];
    for (Eigen::Index j = 0; j < out.cols(); ++j) row[j] = window_logit(row[j], scale, k_positions[j], at);
  }
}

/// `out` [cols] = the sum of rows `rows` of `x` (`stride` floats apart), added row after row
/// (not Eigen's `colwise().sum()`, whose order differs between its vectorised columns and the
/// tail, which the SIMD width decides).
inline void add_rows(const float* x, std::ptrdiff_t stride, Eigen::Index rows, Eigen::Index cols, float* out) {
  std::fill_n(out, cols, 0.0f);
  for (Eigen::Index r = 0; r < rows; ++r)
    for (Eigen::Index j = 0; j < cols; ++j) out[j] += x[r * stride + j];
}

/// Softmax of `x` [n] in place, in fp32, element by element with the formulas the GPU uses
/// (window_math.hpp). All −inf (every key masked) gives zeros: the row carries no attention.
/// The largest entry and the sum run over 16 partial results in a fixed order, so the loops
/// vectorise and every build sums alike.
inline void softmax_row(float* x, Eigen::Index n) {
  constexpr int lanes = 16;
  float top[lanes], sum[lanes];
  std::fill_n(top, lanes, -INFINITY);
  std::fill_n(sum, lanes, 0.0f);
  Eigen::Index j = 0;
  for (; j + lanes <= n; j += lanes)
    for (int k = 0; k < lanes; ++k) top[k] = x[j + k] > top[k] ? x[j + k] : top[k];
  for (int k = 0; j + k < n; ++k) top[k] = x[j + k] > top[k] ? x[j + k] : top[k];
  for (int k = 1; k < lanes; ++k) top[0] = top[k] > top[0] ? top[k] : top[0];
  for (j = 0; j < n; ++j) x[j] = softmax_numerator(x[j], top[0]);
  for (j = 0; j + lanes <= n; j += lanes)
    for (int k = 0; k < lanes; ++k) sum[k] += x[j + k];
  for (int k = 0; j + k < n; ++k) sum[k] += x[j + k];
  for (int width = lanes / 2; width >= 1; width /= 2)
    for (int k = 0; k < width; ++k) sum[k] += sum[k + width];
  for (j = 0; j < n; ++j) x[j] = softmax_probability(x[j], sum[0]);
}

/// Softmax of every row of `x` in place (see `softmax_row`).
inline void softmax_rows(row_matrix& x) {
  for (Eigen::Index i = 0; i < x.rows(); ++i) softmax_row(x.row(i).data(), x.cols());
}

/// The first `n` keys of (layer, kv_head), post-RoPE, as an f32 [n, head_dim] matrix: a strided
/// map over the cache for dense f32 post-RoPE views, else a copy into `scratch` (rotated to
/// each slot's position for pre-RoPE views). Throws naming `api` and the slot when a key is not
/// finite.
template <KVCacheView V>
key_map window_keys(const char* api, const V& view, int layer, int kv_head, std::int64_t n, row_matrix& scratch) {
  const kv_geometry& g = view.geometry();
  // Every row checked as it is read (`check_key_finite` vectorises; Eigen's allFinite over a
  // strided map does not).
  const auto check_row = [&](std::int64_t s, const float* row) {
    check_key_finite(api, row, g.head_dim, layer, kv_head, s);
  };
  if constexpr (std::is_same_v<V, dense_kv_view>) {
    if (g.type == dtype::f32 && g.k_scale == 1.0f && g.keys == key_state::post_rope) {
      // rows of one (layer, kv_head) are `token` floats apart
      const auto* base = reinterpret_cast<const float*>(view.key(layer, kv_head, 0));
      for (std::int64_t s = 0; s < n; ++s) check_row(s, base + s * view.k_stride.token);
      return key_map(base, n, g.head_dim, Eigen::OuterStride<>(view.k_stride.token));
    }
  }
  scratch.resize(n, g.head_dim);
  const auto decode = [&](const auto& keys) {
    for (std::int64_t s = 0; s < n; ++s) {
      float* row = scratch.row(s).data();
      keys.load(view.key(layer, kv_head, s), g.head_dim, row);
      check_row(s, row);
      if (g.keys == key_state::pre_rope) rope_rotate(g.rope, row, g.head_dim, view.position(layer, kv_head, s));
    }
  };
  with_key_accessor(view, layer, decode);  // one dispatch per (layer, kv_head)
  return key_map(scratch.data(), n, g.head_dim, Eigen::OuterStride<>(g.head_dim));
}

/// Error prefixes of a window policy's calls ("triattn::snapkv::plan", ...).
struct window_policy_names {
  const char* attach;
  const char* observe;
  const char* score;
};

/// What a window policy scores for one (layer, kv_head) holding n > window slots.
struct window_inputs {
  key_map keys;                                   ///< [n, head_dim], finite
  std::span<const std::int32_t> key_positions;    ///< [n]
  const row_matrix& queries;                      ///< [group * rows, head_dim], q-head-major, oldest row first
  std::span<const std::int32_t> query_positions;  ///< [rows]
  int group;                                      ///< q-heads of the kv_head
  int rows;                                       ///< observed window rows m, 1 <= m <= window
  std::int64_t prefix;                            ///< n - window: the slots that compete
};

/// The API shared by SnapKV and R-KV: `attach`, `observe`, `score`, `plan` (and `compress`
/// from `policy_base`). `Derived` provides `names` (window_policy_names), `window_size()`,
/// `validate_config(api)` and `score_prefix(const window_inputs&, std::span<float> out)`
/// writing the scores of the prefix slots [0, n - window).
///
/// Every decision keeps its last `window` slots (protected, counted in the budget) and the
/// best-scoring of the older ones; ties go to the lower slot. Decisions that already fit the
/// budget are neither read nor scored (the round pipeline, core/round.hpp).
template <class Derived>
class window_policy : public policy_base<Derived> {
 public:
  /// (Re)sizes the query window for `view`'s geometry, empty. Call it once per sequence
  /// before the first `observe`.
  template <KVCacheView V>
  void attach(const V& view) {
    const char* api = Derived::names.attach;
    derived().validate_config(api);
    view.validate(api);
    const kv_geometry& g = view.geometry();
    window_ = query_window(derived().window_size());
    window_.resize(g.num_layers, g.num_q_heads, g.head_dim);
    num_kv_heads_ = g.num_kv_heads;
  }

  /// One new query row of (layer, q_head) at `position`: the post-RoPE query [head_dim].
  /// `probs` is not read (the window attention is recomputed from the kept queries); it may
  /// be empty. Positions of one (layer, q_head) must increase.
  void observe(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
               [[maybe_unused]] std::span<const float> probs = {}) {
    window_.push(layer, q_head, position, q_post_rope, Derived::names.observe);
  }

  /// Scores into `out` [num_layers, num_kv_heads, capacity]: the policy's score per slot after
  /// GQA aggregation, +inf for the last `window` slots of each (layer, kv_head); slots >= the
  /// length are left as they are.
  template <KVCacheView V>
  void score(const V& view, std::span<float> out) const {
    const char* api = Derived::names.score;
    check_ready(api, view);
    scratch sc;
    for_each_score_row(api, view, out, [&](int l, int h, std::span<float> row) { score_row(api, view, l, h, row, sc); });
  }

  const round_options& round() const { return derived().config.round; }

  /// The last `window` slots are protected (the oldest of them when budget < window).
  row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(0, derived().window_size()), info.budget};
  }

  /// Checks the config and the attached window for a round (the pipeline has validated the
  /// view); its rows are scored by the policy's `score_prefix` (the window slots, protected,
  /// score +inf).
  template <KVCacheView V>
  auto begin_round(const char* api, const V& view, const round_info&) const {
    derived().validate_config(api);
    check_attached(api, view.geometry());
    return row_scorer<V>{this, &view, api, {}};
  }

  /// The kept queries.
  const query_window& queries() const { return window_; }

 private:
  query_window window_;
  int num_kv_heads_ = 0;

  /// Buffers reused across the (layer, kv_head) rows of one call.
  struct scratch {
    row_matrix keys, queries;
    std::vector<std::int32_t> key_positions, query_positions;
  };

  template <KVCacheView V>
  struct row_scorer {
    const window_policy* policy;
    const V* view;
    const char* api;
    scratch sc;
    void score(int layer, int kv_head, std::span<const std::uint8_t>, std::span<float> out) {
      policy->score_row(api, *view, layer, kv_head, out, sc);
    }
  };

  const Derived& derived() const { return static_cast<const Derived&>(*this); }

  template <KVCacheView V>
  void check_ready(const char* api, const V& view) const {
    derived().validate_config(api);
    view.validate(api);
    check_attached(api, view.geometry());
  }
  /// Checks that the policy was attached to a view of geometry `g`, with its current window.
  void check_attached(const char* api, const kv_geometry& g) const {
    TRIATTN_CHECK(g.num_layers == window_.num_layers() && g.num_q_heads == window_.num_q_heads() &&
                      g.num_kv_heads == num_kv_heads_ && g.head_dim == window_.head_dim(),
                  api, "the view has ", g.num_layers, " layers, ", g.num_q_heads, " q_heads, ", g.num_kv_heads,
                  " kv_heads, head_dim ", g.head_dim, " but the policy was attached to ", window_.num_layers(), ", ",
                  window_.num_q_heads(), ", ", num_kv_heads_, ", ", window_.head_dim(), ": call attach(view) first");
    TRIATTN_CHECK(window_.window() == derived().window_size(), api, "window ", derived().window_size(),
                  " differs from the window ", window_.window(), " the policy was attached with");
  }

  /// Scores of the `out.size()` slots of (l, h): the prefix by the policy, the window +inf.
  template <KVCacheView V>
  void score_row(const char* api, const V& view, int l, int h, std::span<float> out, scratch& sc) const {
    const auto n = static_cast<std::int64_t>(out.size());
    const std::int64_t prefix = recent_window_begin(n, derived().window_size());
    std::fill(out.begin() + prefix, out.end(), std::numeric_limits<float>::infinity());
    if (prefix == 0) return;
    const int group = view.geometry().group_size();
    const key_map keys = window_keys(api, view, l, h, n, sc.keys);
    sc.key_positions.resize(static_cast<std::size_t>(n));
    for (std::int64_t s = 0; s < n; ++s) sc.key_positions[s] = view.position(l, h, s);
    const int rows = window_.gather(api, l, h * group, group, sc.queries, sc.query_positions);
    derived().score_prefix(window_inputs{keys, sc.key_positions, sc.queries, sc.query_positions, group, rows, prefix},
                           out.first(static_cast<std::size_t>(prefix)));
  }
};

TRIATTN_NAMESPACE_END
