/// \file triattn/cuda/expected_attention.cuh
/// \brief Expected Attention on the GPU: the device scorer of `plan_round` (round.cuh), the
/// formulas of expected_attention.hpp from the batch's kept window queries (the
/// `window_query_batch` SnapKV and R-KV read). Four steps:
/// 1. one block per (sequence, layer, q_head): the queries at positions >= `sinks` rotated back
///    to position 0, their mean and (covariance on) covariance in double, then the round's
///    terms R̄μ/√D and R̄ΣR̄ᵀ/2D (R̄ the RoPE rotation averaged over [round start, + future));
/// 2. one thread per (segment, slot): the logit z = R̄μ·k/√D + kᵀ(R̄ΣR̄ᵀ)k/2D of each q-head of
///    the group, −inf for a protected slot (the sinks, the round's protection);
/// 3. one block per (sequence, layer, q_head): the softmax over the competing slots;
/// 4. one thread per (segment, slot): the group's mean probability, times ‖v‖₂ (+ ε).
/// Post-RoPE keys only (a pre-RoPE batch is refused, as SnapKV's); the round starts
/// (`round_inputs::round_starts`) are needed. Sums run in another order than the CPU's: the
/// scores agree to rounding, not bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/key_scored.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/window_attention.cuh"
#include "triattn/policies/expected_attention_math.hpp"
#include "triattn/policies/key_only_math.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

inline constexpr int ea_threads = 128;

/// What the kernels read besides the batch (passed by value).
struct ea_params {
  expected_attention_config config{};
  window_query_batch q{};
  int terms_rows = 1;  ///< 1 + head_dim with the covariance term, else 1
};

/// Workspace buffers of a round.
struct ea_buffers {
  float* pre = nullptr;     ///< [batch, layers, q_heads, rows, head_dim] the queries before RoPE
  double* cov = nullptr;    ///< [batch, layers, q_heads, head_dim, head_dim] (covariance on)
  float* terms = nullptr;   ///< [batch, layers, q_heads, terms_rows, head_dim]
  float* probs = nullptr;   ///< [batch, layers, q_heads, capacity]
};

/// Step 1: one block per (b, l, qh) = blockIdx.x (see the file comment).
template <KVCacheView V>
__global__ void __launch_bounds__(ea_threads)
    ea_terms(view_batch<V> batch, ea_params p, device_round round, ea_buffers buf, std::int32_t* status) {
  __shared__ double mean[max_head_dim], c[max_head_dim / 2], s[max_head_dim / 2];
  __shared__ int kept;
  const kv_geometry& g = batch.geometry;
  const std::int64_t row = blockIdx.x;  // (b * layers + l) * q_heads + qh
  const int b = segment_of(row, g.num_layers, g.num_q_heads).b;
  const int D = g.head_dim, F = rotary_dims(g.rope, D) / 2, m = p.q.rows;
  const float* q = p.q.queries + row * m * D;
  float* pre = buf.pre + row * m * D;
  const std::int32_t* positions = p.q.positions + std::int64_t{b} * m;
  const double start = static_cast<double>(round.in.round_starts[b]);
  // Each query rotated back, band by band (the unrotated dims copied), and the mean rotation.
  for (int t = static_cast<int>(threadIdx.x); t < m * D; t += ea_threads) pre[t] = q[t];
  __syncthreads();
  for (int t = static_cast<int>(threadIdx.x); t < m * F; t += ea_threads) {
    const int i = t / F, f = t % F;
    int re, im;
    rope_band_dims(g.rope.style, 2 * F, f, re, im);
    rotate_band(pre + i * D, re, im, -positions[i] * inv_freq(g.rope, 2 * F, f), 1.0 / g.rope.attention_scale);
  }
  for (int f = static_cast<int>(threadIdx.x); f < F; f += ea_threads)
    expected_attention_mean_rotation(g.rope, D, f, start, p.config.future, c[f], s[f]);
  if (threadIdx.x == 0) {
    int n = 0;
    for (int i = 0; i < m; ++i) n += positions[i] >= p.config.sinks ? 1 : 0;
    kept = n;
    if (n == 0) fail_round(status, round_status::no_queries);
  }
  __syncthreads();
  const int n = kept;
  if (n == 0) return;
  for (int d = static_cast<int>(threadIdx.x); d < D; d += ea_threads) {
    double acc = 0.0;
    for (int i = 0; i < m; ++i)
      if (positions[i] >= p.config.sinks) acc += pre[i * D + d];
    mean[d] = acc / n;
  }
  __syncthreads();
  float* terms = buf.terms + row * p.terms_rows * D;
  const double root = sqrt(static_cast<double>(D));
  // R̄ x, band by band: rotated entries of band f from (x_re, x_im).
  const auto rotated = [&](double x_re, double x_im, int f, bool first) {
    return first ? c[f] * x_re - s[f] * x_im : s[f] * x_re + c[f] * x_im;
  };
  const auto band_of = [&](int d, int& f, bool& first, int& partner) {
    if (d >= 2 * F) {
      f = -1;
      return;
    }
    int re, im;
    f = g.rope.style == rope_style::half ? (d < F ? d : d - F) : d / 2;
    rope_band_dims(g.rope.style, 2 * F, f, re, im);
    first = d == re;
    partner = first ? im : re;
  };
  for (int d = static_cast<int>(threadIdx.x); d < D; d += ea_threads) {
    int f, partner;
    bool first;
    band_of(d, f, first, partner);
    const double x = f < 0 ? mean[d] : rotated(first ? mean[d] : mean[partner], first ? mean[partner] : mean[d], f, first);
    terms[d] = static_cast<float>(x / root);
  }
  if (p.terms_rows == 1) return;
  double* cov = buf.cov + row * D * D;
  for (int t = static_cast<int>(threadIdx.x); t < D * D; t += ea_threads) {
    const int a = t / D, e = t % D;
    double acc = 0.0;
    for (int i = 0; i < m; ++i)
      if (positions[i] >= p.config.sinks) acc += (pre[i * D + a] - mean[a]) * (pre[i * D + e] - mean[e]);
    cov[t] = acc / n;
  }
  __syncthreads();
  // (R̄ Σ R̄ᵀ)[a][e] = Σ over x in band(a), y in band(e) of R̄[a][x] Σ[x][y] R̄[e][y].
  const auto rbar = [&](int a, int x) {  // R̄[a][x]
    int f, partner;
    bool first;
    band_of(a, f, first, partner);
    if (f < 0) return a == x ? 1.0 : 0.0;
    if (x == a) return c[f];
    if (x != partner) return 0.0;
    return first ? -s[f] : s[f];
  };
  for (int t = static_cast<int>(threadIdx.x); t < D * D; t += ea_threads) {
    const int a = t / D, e = t % D;
    int fa, pa, fe, pe;
    bool first;
    band_of(a, fa, first, pa);
    band_of(e, fe, first, pe);
    const int xs[2] = {a, fa < 0 ? a : pa}, ys[2] = {e, fe < 0 ? e : pe};
    double acc = 0.0;
    for (int xi = 0; xi < (fa < 0 ? 1 : 2); ++xi)
      for (int yi = 0; yi < (fe < 0 ? 1 : 2); ++yi)
        acc += rbar(a, xs[xi]) * cov[xs[xi] * D + ys[yi]] * rbar(e, ys[yi]);
    terms[(1 + a) * D + e] = static_cast<float>(acc / (2.0 * D));
  }
}

/// Step 2: one thread per slot of every ranked segment (grid: slot blocks, layers x kv_heads,
/// batch): each q-head's logit into `buf.probs`, −inf where the slot does not compete.
template <class Scorer, KVCacheView V>
__global__ void __launch_bounds__(ea_threads)
    ea_logits(view_batch<V> batch, Scorer scorer, ea_params p, device_round round, ea_buffers buf,
              std::int32_t* status) {
  const kv_geometry& g = batch.geometry;
  const slot_thread th = slot_of_thread<ea_threads>(batch, round.in.budgets);
  if (!th.active) return;
  const segment_id id = th.id;
  const V& view = batch.views[id.b];
  const std::int64_t s = th.s;
  const int D = g.head_dim, G = g.group_size(), R = p.terms_rows;
  float key[max_head_dim];
  load_key_row(view, id.l, id.h, s, key);
  bool finite = true;
  for (int d = 0; d < D; ++d) finite = finite && isfinite(key[d]);
  if (!finite) fail_round(status, round_status::non_finite_key);
  const protection prot = sequence_rule(scorer, round, id.b).prot;
  const bool competes = !is_protected(prot, s, th.n, view.position(id.l, id.h, s));
  for (int i = 0; i < G; ++i) {
    const std::int64_t row = (std::int64_t{id.b} * g.num_layers + id.l) * g.num_q_heads + id.h * G + i;
    const float* t = buf.terms + row * R * D;
    float z = fixed_order_dot(t, key, D);
    for (int a = 1; a < R; ++a) z = multiply_add(key[a - 1], fixed_order_dot(t + a * D, key, D), z);
    buf.probs[row * batch.capacity + s] = competes ? z : -INFINITY;
  }
}

/// Step 3: one block per (b, l, qh) row: the softmax of its logits over the slots below the
/// length (the −inf ones get 0), in place.
template <KVCacheView V>
__global__ void __launch_bounds__(ea_threads) ea_softmax(view_batch<V> batch, device_round round, ea_buffers buf) {
  __shared__ block_all_reduce<ea_threads> reduce;
  const kv_geometry& g = batch.geometry;
  const std::int64_t row = blockIdx.x;
  const segment_id id = segment_of(row, g.num_layers, g.num_q_heads);
  const std::int32_t n = batch.views[id.b].length(id.l, id.h / g.group_size());
  if (!key_segment_scored(round.in.budgets, id.b, n)) return;  // uniform per block
  float* x = buf.probs + row * batch.capacity;
  float top = -INFINITY;
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += ea_threads) top = x[s] > top ? x[s] : top;
  top = reduce.max(top);
  float sum = 0.0f;
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += ea_threads) {
    x[s] = softmax_numerator(x[s], top);
    sum += x[s];
  }
  sum = reduce.sum(sum);
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += ea_threads) x[s] = softmax_probability(x[s], sum);
}

/// Step 4: one thread per slot of every ranked segment: the group's mean probability, times
/// the value's L2 norm (+ ε), into `scores` [batch, layers, kv_heads, capacity].
template <KVCacheView V>
__global__ void __launch_bounds__(ea_threads)
    ea_finish(view_batch<V> batch, ea_params p, device_round round, ea_buffers buf, float* scores) {
  const kv_geometry& g = batch.geometry;
  const slot_thread th = slot_of_thread<ea_threads>(batch, round.in.budgets);
  if (!th.active) return;
  const segment_id id = th.id;
  const V& view = batch.views[id.b];
  const std::int64_t s = th.s, seg = th.seg;
  const int G = g.group_size();
  float sum = 0.0f;
  for (int i = 0; i < G; ++i)
    sum += buf.probs[((std::int64_t{id.b} * g.num_layers + id.l) * g.num_q_heads + id.h * G + i) * batch.capacity + s];
  float norm = 1.0f;
  if (p.config.value_norm) {
    float value[max_head_dim];
    load_value_row(view, id.l, id.h, s, value);
    norm = l2_norm(value, g.head_dim);
  }
  scores[seg * batch.capacity + s] =
      expected_attention_score(sum / static_cast<float>(G), norm, p.config.value_norm, p.config.epsilon);
}

}  // namespace detail

/// Expected Attention's device scorer: `plan_round(..., expected_attention_scorer{config,
/// queries}, ...)` with the round starts in `round_inputs`. Its rule keeps the first
/// `config.sinks` slots. A non-finite key of a ranked segment sets `non_finite_key`; a
/// (sequence, layer, q_head) with no kept query at a position >= `sinks` sets `no_queries`.
struct expected_attention_scorer {
  expected_attention_config config{};
  window_query_batch queries{};

  TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const {
    return {protection::sinks_and_recent(config.sinks, 0), info.budget};
  }

  template <KVCacheView V>
  cudaError_t score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                    const device_round& round, float* scores, std::int32_t* status, cudaStream_t stream) const {
    if (const std::string e = expected_attention_config_error(config); !e.empty()) return detail::reject(api, e);
    if (const cudaError_t err = detail::check_key_scored(api, batch); err != cudaSuccess) return err;
    const kv_geometry& g = batch.geometry;
    if (const cudaError_t err = detail::check_post_rope_keys(api, "Expected Attention", batch); err != cudaSuccess)
      return err;
    if (queries.rows < 1 || queries.rows > config.window)
      return detail::reject(api, "query rows ", queries.rows, " must be in [1, window ", config.window, "]");
    const detail::ea_params p{config, queries, config.covariance ? 1 + g.head_dim : 1};
    const auto heads = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_q_heads;
    const auto D = static_cast<std::size_t>(g.head_dim);
    detail::workspace_carver ws(workspace);
    detail::ea_buffers buf;
    buf.pre = ws.take<float>(heads * static_cast<std::size_t>(queries.rows) * D);
    buf.cov = config.covariance ? ws.take<double>(heads * D * D) : nullptr;
    buf.terms = ws.take<float>(heads * static_cast<std::size_t>(p.terms_rows) * D);
    buf.probs = ws.take<float>(heads * static_cast<std::size_t>(batch.capacity));
    cudaError_t err;
    if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
    if ((err = detail::check_window_pointers(api, scores, status, queries)) != cudaSuccess) return err;
    if (round.in.round_starts == nullptr) return detail::reject(api, "round_starts must not be null");
    constexpr int threads = detail::ea_threads;
    detail::ea_terms<<<static_cast<unsigned>(heads), threads, 0, stream>>>(batch, p, round, buf, status);
    const dim3 slots = detail::key_scored_grid(batch, detail::blocks_for(batch.capacity, threads));
    detail::ea_logits<<<slots, threads, 0, stream>>>(batch, *this, p, round, buf, status);
    detail::ea_softmax<<<static_cast<unsigned>(heads), threads, 0, stream>>>(batch, round, buf);
    detail::ea_finish<<<slots, threads, 0, stream>>>(batch, p, round, buf, scores);
    return cudaGetLastError();
  }
};

}  // namespace cuda
TRIATTN_NAMESPACE_END
