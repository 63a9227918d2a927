/// \file triattn/cuda/window.cuh
/// \brief SnapKV and R-KV on the GPU: the window attention recomputed from the kept queries,
/// pooling and GQA aggregation, R-KV's redundancy as a tiled similarity computation, and keep
/// plans through `select_keep`, for every layer and head of a batch in one call.
///
/// The formulas are the CPU's (policies/window_math.hpp, pool_at, gqa_combine): each kernel
/// calls the same per-element functions as snapkv.hpp / rkv.hpp, in fp32. A (sequence, layer,
/// kv_head) "segment" of n slots is scored when n > window (and, for a plan, n > budget);
/// its last `window` slots score +inf, and so do all slots of a segment that is not scored.
///
/// **Kernels** (segment s = (b * layers + l) * kv_heads + h, the plan layout of compact.cuh):
/// 1. `window_prepare`: one thread per slot checks the key is finite (else the status word
///    becomes `non_finite_key`) and, for R-KV, stores the divisor of its unit key.
/// 2. `window_attention`: one block per (segment, q-head) for SnapKV, per segment for R-KV
///    (the logit of a (row, key) pair is then the max over the group). For every window row
///    it computes the logits once into a per-block scratch row, block-reduces their max and
///    the sum of the softmax numerators, and adds the probabilities to the row's votes. Every
///    slot j is owned by thread j % threads in all passes, so no two threads touch one entry
///    and no atomics are needed.
/// 3. R-KV only, on 16 x 16 tiles of unit keys in shared memory: `rkv_newest` finds each
///    key's newest near-duplicate, scanning column tiles newest first and stopping once every
///    row of the tile has one; `rkv_column_means` sums every column over all rows in a fixed
///    order; `rkv_redundancy_softmax` normalises them over the n keys.
/// 4. `window_finish`: one thread per slot pools (pool_at), combines the group (gqa_combine)
///    or mixes importance and redundancy (rkv_mix).
/// Every reduction has a fixed order, so a call gives the same scores on every run.
///
/// **Limits.** SnapKV's `per_q_head` grouping (a round-robin merge of per-head orders) is
/// CPU-only: the GPU entry points reject it. All sequences of a batch have the same number of
/// window rows.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/select.cuh"
#include "triattn/policies/window_config.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// The kept window queries of a batch: the last `rows` post-RoPE queries of every (sequence,
/// layer, q_head), oldest first, and their token positions (one set per sequence: the engine
/// observes every layer and head at each token). Queries must be finite.
struct window_query_batch {
  const float* queries = nullptr;           ///< [batch, layers, q_heads, rows, head_dim]
  const std::int32_t* positions = nullptr;  ///< [batch, rows]
  int rows = 0;                             ///< m, 1 <= m <= window
};

namespace detail {

enum class window_kind : std::uint8_t { snapkv, rkv };

/// Everything the kernels of one call read besides the batch (passed by value).
struct window_params {
  window_kind kind = window_kind::snapkv;
  int window = 1;
  int rows = 1;
  std::int64_t scored_above = 0;  ///< segments of n <= this are not read (a plan's budget)
  int kernel = 1;
  pooling pool = pooling::max;
  gqa_aggregation gqa = gqa_aggregation::mean;
  float lambda = 0.0f;
  float threshold = 0.0f;
  const float* queries = nullptr;           ///< [batch, layers, q_heads, rows, head_dim]
  const std::int32_t* query_positions = nullptr;  ///< [batch, rows]
};

/// Whether a segment of n slots is scored (else every slot scores +inf and no key is read).
TRIATTN_HOST_DEVICE bool window_scored(const window_params& p, std::int64_t n) {
  return n > p.window && n > p.scored_above;
}

/// Side of R-KV's similarity tiles; the tile kernels run (side x side) threads.
inline constexpr int similarity_tile = 16;

struct max_op {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct sum_op {
  __device__ float operator()(float a, float b) const { return a + b; }
};

/// `op` over the `v` of every thread of the block, in a fixed tree order (the same result on
/// every run). Every thread must call it; `buf` [Threads] is free again on return.
template <int Threads, class Op>
__device__ float block_reduce(float v, float* buf, Op op) {
  static_assert((Threads & (Threads - 1)) == 0, "a power of two");
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int s = Threads / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) buf[threadIdx.x] = op(buf[threadIdx.x], buf[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = buf[0];
  __syncthreads();
  return r;
}

/// q·k in fp32 for a key row of type `t` and a query `q` [head_dim].
__device__ inline float key_dot(const std::byte* key, dtype t, const float* q, int head_dim) {
  float s = 0.0f;
  for (int d = 0; d < head_dim; ++d) s += load_element(key, t, static_cast<std::size_t>(d)) * q[d];
  return s;
}

template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) window_prepare(view_batch<V> batch, window_params p, float* divisors,
                                                          std::int32_t* lengths, std::int32_t* status) {
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  if (blockIdx.y == 0 && threadIdx.x == 0) lengths[s] = n;
  if (!window_scored(p, n)) return;
  const kv_geometry& g = batch.geometry;
  for (std::int64_t j = blockIdx.y * static_cast<std::int64_t>(Threads) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.y) * Threads) {
    const std::byte* key = view.key(id.l, id.h, j);
    float squared = 0.0f;
    bool finite = true;
    for (int d = 0; d < g.head_dim; ++d) {
      const float x = load_element(key, g.type, static_cast<std::size_t>(d));
      finite = finite && isfinite(x);
      squared += x * x;
    }
    if (!finite)
      fail_round(status, round_status::non_finite_key);
    if (divisors != nullptr) divisors[s * batch.capacity + j] = rkv_unit_divisor(squared);
  }
}

/// Votes (SnapKV, q-head blockIdx.y of the group) or mean attention (R-KV, the group's max
/// logit) of the prefix slots of one segment into `acc` [segments, gridDim.y, capacity];
/// `logits` is the block's scratch row of the same layout.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) window_attention(view_batch<V> batch, window_params p, float* logits,
                                                            float* acc) {
  __shared__ float buf[Threads];
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, n)) return;  // the whole block leaves: no barrier is skipped
  const kv_geometry& g = batch.geometry;
  const int group = g.group_size(), head_dim = g.head_dim;
  const bool rkv = p.kind == window_kind::rkv;
  const std::int64_t prefix = n - p.window;
  const std::int64_t keys = rkv ? prefix : n;  // the keys of the softmax
  const int first_head = rkv ? 0 : static_cast<int>(blockIdx.y), heads = rkv ? group : 1;
  const std::int64_t row = (static_cast<std::int64_t>(s) * gridDim.y + blockIdx.y) * batch.capacity;
  float* x = logits + row;
  float* out = acc + row;
  const float scale = window_logit_scale(head_dim);
  for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] = 0.0f;
  for (int i = 0; i < p.rows; ++i) {
    const std::int32_t query_position = p.query_positions[static_cast<std::int64_t>(id.b) * p.rows + i];
    float top = -INFINITY;
    for (std::int64_t j = threadIdx.x; j < keys; j += Threads) {
      const std::byte* key = view.key(id.l, id.h, j);
      const std::int32_t key_position = view.position(id.l, id.h, j);
      float best = -INFINITY;
      for (int k = first_head; k < first_head + heads; ++k) {
        const float* q = p.queries + ((static_cast<std::int64_t>(s) * group + k) * p.rows + i) * head_dim;
        best = fmaxf(best, window_logit(key_dot(key, g.type, q, head_dim), scale, key_position, query_position));
      }
      x[j] = best;
      top = fmaxf(top, best);
    }
    top = block_reduce<Threads>(top, buf, max_op{});
    float sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < keys; j += Threads) sum += x[j] = softmax_numerator(x[j], top);
    sum = block_reduce<Threads>(sum, buf, sum_op{});
    for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] += softmax_probability(x[j], sum);
  }
  if (rkv)
    for (std::int64_t j = threadIdx.x; j < prefix; j += Threads) out[j] = rkv_attention_mean(out[j], p.rows);
}

/// The tile of unit-key dot products S[r0 + ty, c0 + tx] for this thread (ty, tx) =
/// (threadIdx.x / side, threadIdx.x % side): rows r0.. go through `a`, rows c0.. through `b`,
/// head_dim in chunks of `side`, zero outside [0, n). Every thread of the block must call it.
/// The sum runs over d in order, so S[r, j] and S[j, r] are the same float.
template <KVCacheView V>
__device__ float unit_dot_tile(const V& view, int l, int h, const kv_geometry& g, const float* divisors, std::int64_t n,
                               std::int64_t r0, std::int64_t c0, float (&a)[similarity_tile][similarity_tile + 1],
                               float (&b)[similarity_tile][similarity_tile + 1]) {
  constexpr int side = similarity_tile;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  const std::int64_t ra = r0 + ty, rb = c0 + ty;
  float s = 0.0f;
  for (int d0 = 0; d0 < g.head_dim; d0 += side) {
    const int d = d0 + tx;
    a[ty][tx] = ra < n && d < g.head_dim
                    ? load_element(view.key(l, h, ra), g.type, static_cast<std::size_t>(d)) / divisors[ra]
                    : 0.0f;
    b[ty][tx] = rb < n && d < g.head_dim
                    ? load_element(view.key(l, h, rb), g.type, static_cast<std::size_t>(d)) / divisors[rb]
                    : 0.0f;
    __syncthreads();
    for (int k = 0; k < side; ++k) s += a[ty][k] * b[tx][k];
    __syncthreads();
  }
  return s;
}

/// `newest` [segments, capacity]: for every key r of a scored segment, its newest
/// near-duplicate (rkv_duplicate_candidate), 0 when none. Grid (segments, row tiles).
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_newest(view_batch<V> batch, window_params p, const float* divisors,
                                                      std::int32_t* newest) {
  constexpr int side = similarity_tile;
  static_assert(Threads == side * side, "one thread per tile cell");
  __shared__ float a[side][side + 1], b[side][side + 1];
  __shared__ int best[side];
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, n)) return;
  const std::int64_t seg_row = s * batch.capacity, tiles = (n + side - 1) / side;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  for (std::int64_t rt = blockIdx.y; rt < tiles; rt += gridDim.y) {
    const std::int64_t r0 = rt * side, r = r0 + ty;
    if (static_cast<int>(threadIdx.x) < side) best[threadIdx.x] = 0;  // visible after unit_dot_tile's first barrier
    for (std::int64_t ct = tiles - 1; ct >= 0; --ct) {
      const std::int64_t j = ct * side + tx;
      const float dot = unit_dot_tile(view, id.l, id.h, batch.geometry, divisors + seg_row, n, r0, ct * side, a, b);
      if (r < n && j < n && rkv_duplicate_candidate(rkv_similarity(dot, r, j), j, p.threshold))
        atomicMax(&best[ty], static_cast<int>(j));
      __syncthreads();
      // Older column tiles hold only smaller j: once every row has a candidate, none can win.
      if (__syncthreads_and(r >= n || best[ty] > 0)) break;
    }
    if (static_cast<int>(threadIdx.x) < side && r0 + threadIdx.x < n) newest[seg_row + r0 + threadIdx.x] = best[threadIdx.x];
    __syncthreads();  // `best` is reset by the next row tile
  }
}

/// `means` [segments, capacity]: column j's redundancy before the softmax, the mean over all
/// rows r of rkv_column_term. Grid (segments, column tiles); each column is summed in a fixed
/// order (per tile row, then over the tile's rows).
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_column_means(view_batch<V> batch, window_params p, const float* divisors,
                                                            const std::int32_t* newest, float* means) {
  constexpr int side = similarity_tile;
  static_assert(Threads == side * side, "one thread per tile cell");
  __shared__ float a[side][side + 1], b[side][side + 1], part[side][side + 1];
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const V& view = batch.views[id.b];
  const std::int64_t n = view.length(id.l, id.h);
  if (!window_scored(p, n)) return;
  const std::int64_t seg_row = s * batch.capacity, tiles = (n + side - 1) / side;
  const int tx = static_cast<int>(threadIdx.x) % side, ty = static_cast<int>(threadIdx.x) / side;
  for (std::int64_t ct = blockIdx.y; ct < tiles; ct += gridDim.y) {
    const std::int64_t c0 = ct * side, j = c0 + tx;
    float sum = 0.0f;
    for (std::int64_t rt = 0; rt < tiles; ++rt) {
      const std::int64_t r = rt * side + ty;
      const float dot = unit_dot_tile(view, id.l, id.h, batch.geometry, divisors + seg_row, n, rt * side, c0, a, b);
      if (r < n && j < n) sum += rkv_column_term(rkv_similarity(dot, r, j), j, newest[seg_row + r]);
    }
    part[ty][tx] = sum;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < side && c0 + threadIdx.x < n) {
      float column = 0.0f;
      for (int k = 0; k < side; ++k) column += part[k][threadIdx.x];
      means[seg_row + c0 + threadIdx.x] = rkv_column_mean(column, n);
    }
    __syncthreads();  // `part` is rewritten by the next column tile
  }
}

/// R-KV's redundancy in place: the softmax over the n column means of each scored segment.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) rkv_redundancy_softmax(view_batch<V> batch, window_params p, float* means) {
  __shared__ float buf[Threads];
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const std::int64_t n = batch.views[id.b].length(id.l, id.h);
  if (!window_scored(p, n)) return;
  float* x = means + s * batch.capacity;
  float top = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) top = fmaxf(top, x[j]);
  top = block_reduce<Threads>(top, buf, max_op{});
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) sum += x[j] = softmax_numerator(x[j], top);
  sum = block_reduce<Threads>(sum, buf, sum_op{});
  for (std::int64_t j = threadIdx.x; j < n; j += Threads) x[j] = softmax_probability(x[j], sum);
}

/// `scores` [segments, capacity] for the slots below each length: the pooled and combined
/// votes (SnapKV, through `pooled` [segments, group, capacity]) or the mix of the pooled
/// importance and the redundancy (R-KV); +inf on the window and in unscored segments.
template <int Threads, KVCacheView V>
__global__ void __launch_bounds__(Threads) window_finish(view_batch<V> batch, window_params p, const float* acc,
                                                         float* pooled, const float* redundancy, float* scores) {
  const int s = static_cast<int>(blockIdx.x);
  const segment_id id = segment_of(s, batch.geometry);
  const std::int64_t n = batch.views[id.b].length(id.l, id.h);
  const std::int64_t prefix = window_scored(p, n) ? n - p.window : 0;
  const int group = batch.geometry.group_size();
  const std::int64_t cap = batch.capacity, seg_row = s * cap;
  for (std::int64_t j = blockIdx.y * static_cast<std::int64_t>(Threads) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.y) * Threads) {
    float score = INFINITY;
    if (j < prefix && p.kind == window_kind::rkv) {
      score = rkv_mix(pool_at(acc + seg_row, prefix, j, p.kernel, pooling::max), redundancy[seg_row + j], p.lambda);
    } else if (j < prefix) {
      // Thread j writes and then reads only column j of its segment's pooled rows.
      for (int k = 0; k < group; ++k)
        pooled[(seg_row * group) + k * cap + j] = pool_at(acc + seg_row * group + k * cap, prefix, j, p.kernel, p.pool);
      gqa_combine(pooled + seg_row * group + j, group, cap, 1, p.gqa, &score);
    }
    scores[seg_row + j] = score;
  }
}

/// The workspace buffers of one scoring pass (null while sizing, and where the policy needs
/// none).
struct window_buffers {
  float* logits = nullptr;          ///< [segments, heads, capacity], heads = group (SnapKV) or 1
  float* acc = nullptr;             ///< [segments, heads, capacity]
  float* pooled = nullptr;          ///< [segments, group, capacity], SnapKV
  float* divisors = nullptr;        ///< [segments, capacity], R-KV
  std::int32_t* newest = nullptr;   ///< [segments, capacity], R-KV
  float* means = nullptr;           ///< [segments, capacity], R-KV: column means, then redundancy
  std::int32_t* lengths = nullptr;  ///< [segments]
};

template <KVCacheView V>
std::int64_t segments_of(const view_batch<V>& batch) {
  return std::int64_t{batch.size} * batch.geometry.num_layers * batch.geometry.num_kv_heads;
}

template <KVCacheView V>
window_buffers carve_window(workspace_carver& ws, const view_batch<V>& batch, const window_params& p) {
  const auto segments = static_cast<std::size_t>(segments_of(batch));
  const auto cap = static_cast<std::size_t>(batch.capacity);
  const auto group = static_cast<std::size_t>(batch.geometry.group_size());
  const bool rkv = p.kind == window_kind::rkv;
  const std::size_t rows = segments * (rkv ? 1 : group) * cap;
  window_buffers b;
  b.logits = ws.take<float>(rows);
  b.acc = ws.take<float>(rows);
  if (rkv) {
    b.divisors = ws.take<float>(segments * cap);
    b.newest = ws.take<std::int32_t>(segments * cap);
    b.means = ws.take<float>(segments * cap);
  } else {
    b.pooled = ws.take<float>(segments * group * cap);
  }
  b.lengths = ws.take<std::int32_t>(segments);
  return b;
}

/// Enqueues the scoring kernels (see the file comment) writing `scores` [segments, capacity].
template <KVCacheView V>
cudaError_t launch_window(const view_batch<V>& batch, const window_params& p, const window_buffers& b, float* scores,
                          std::int32_t* status, cudaStream_t stream) {
  constexpr int threads = similarity_tile * similarity_tile;
  const auto segments = static_cast<unsigned>(segments_of(batch));
  const auto capped = [](unsigned blocks) { return blocks < 65535u ? blocks : 65535u; };  // grid-stride beyond
  const dim3 per_slot(segments, capped(blocks_for(batch.capacity, threads)));
  const dim3 per_tile(segments, capped(blocks_for(batch.capacity, similarity_tile)));
  const bool rkv = p.kind == window_kind::rkv;
  window_prepare<threads><<<per_slot, threads, 0, stream>>>(batch, p, b.divisors, b.lengths, status);
  const dim3 per_head(segments, rkv ? 1u : static_cast<unsigned>(batch.geometry.group_size()));
  window_attention<threads><<<per_head, threads, 0, stream>>>(batch, p, b.logits, b.acc);
  if (rkv) {
    rkv_newest<threads><<<per_tile, threads, 0, stream>>>(batch, p, b.divisors, b.newest);
    rkv_column_means<threads><<<per_tile, threads, 0, stream>>>(batch, p, b.divisors, b.newest, b.means);
    rkv_redundancy_softmax<threads><<<segments, threads, 0, stream>>>(batch, p, b.means);
  }
  window_finish<threads><<<per_slot, threads, 0, stream>>>(batch, p, b.acc, b.pooled, b.means, scores);
  return cudaGetLastError();
}

/// Host checks shared by every entry point: the batch, the queries' shape, the config (its
/// CPU validation, turned from an exception into this API's error).
template <KVCacheView V, class Validate>
cudaError_t check_window(const char* api, const view_batch<V>& batch, const window_query_batch& q, int window,
                         Validate&& validate) {
  try {
    validate();
  } catch (const error& e) {
    last_error_message() = e.what();
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t err = check_batch(api, batch); err != cudaSuccess) return err;
  if (q.rows < 1 || q.rows > window)
    return reject(api, "query rows ", q.rows, " must be in [1, window ", window, "]");
  if (segments_of(batch) > INT32_MAX)
    return reject(api, "batch of ", batch.size, " x ", batch.geometry.num_layers, " layers x ",
                  batch.geometry.num_kv_heads, " kv_heads exceeds 2^31 segments");
  return cudaSuccess;
}

template <KVCacheView V>
cudaError_t window_score(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                         const window_params& p, float* scores, std::int32_t* status, cudaStream_t stream) {
  workspace_carver ws(workspace);
  const window_buffers b = carve_window(ws, batch, p);
  cudaError_t err;
  if (!workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (scores == nullptr || status == nullptr || p.queries == nullptr || p.query_positions == nullptr)
    return reject(api, "scores, status, queries and query positions must not be null");
  return launch_window(batch, p, b, scores, status, stream);
}

template <KVCacheView V>
cudaError_t window_plan(const char* api, void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                        window_params p, std::int32_t budget, std::int32_t* keep, std::int32_t* kept,
                        std::int32_t* status, cudaStream_t stream) {
  if (budget < 1) return reject(api, "budget ", budget, " must be >= 1");
  p.scored_above = budget;  // segments that fit are kept whole, unread (as on the CPU)
  workspace_carver ws(workspace);
  const window_buffers b = carve_window(ws, batch, p);
  float* scores = ws.take<float>(static_cast<std::size_t>(segments_of(batch) * batch.capacity));
  const select_segments seg{scores, b.lengths, nullptr, static_cast<int>(segments_of(batch)), batch.capacity};
  const protection window_slots{0, p.window, 0};
  std::size_t select_bytes = 0;
  cudaError_t err = select_keep(nullptr, select_bytes, seg, window_slots, budget, keep, kept, stream);
  if (err != cudaSuccess) return err;
  void* select_workspace = ws.take<std::byte>(select_bytes);
  if (!workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (keep == nullptr || kept == nullptr || status == nullptr || p.queries == nullptr || p.query_positions == nullptr)
    return reject(api, "keep, kept, status, queries and query positions must not be null");
  if ((err = launch_window(batch, p, b, scores, status, stream)) != cudaSuccess) return err;
  return select_keep(select_workspace, select_bytes, seg, window_slots, budget, keep, kept, stream);
}

inline window_params snapkv_params(const snapkv_config& c, const window_query_batch& q) {
  window_params p;
  p.kind = window_kind::snapkv;
  p.window = c.window;
  p.rows = q.rows;
  p.kernel = c.kernel;
  p.pool = c.pool;
  p.gqa = c.gqa;
  p.queries = q.queries;
  p.query_positions = q.positions;
  return p;
}

inline window_params rkv_params(const rkv_config& c, const window_query_batch& q) {
  window_params p;
  p.kind = window_kind::rkv;
  p.window = c.window;
  p.rows = q.rows;
  p.kernel = c.kernel;
  p.lambda = c.lambda;
  p.threshold = c.threshold;
  p.queries = q.queries;
  p.query_positions = q.positions;
  return p;
}

/// SnapKV's host checks: the CPU's, and `aggregate` grouping only.
template <KVCacheView V>
cudaError_t check_snapkv(const char* api, const view_batch<V>& batch, const window_query_batch& q,
                         const snapkv_config& c) {
  const cudaError_t err = check_window(api, batch, q, c.window, [&] { ::TRIATTN_NAMESPACE::detail::validate_snapkv_config(api, c); });
  if (err != cudaSuccess) return err;
  if (c.grouping != snapkv_grouping::aggregate)
    return reject(api, "grouping per_q_head is CPU-only: the GPU supports snapkv_grouping::aggregate");
  return cudaSuccess;
}

/// R-KV's host checks: the CPU's.
template <KVCacheView V>
cudaError_t check_rkv(const char* api, const view_batch<V>& batch, const window_query_batch& q, const rkv_config& c) {
  return check_window(api, batch, q, c.window, [&] { ::TRIATTN_NAMESPACE::detail::validate_rkv_config(api, c); });
}

}  // namespace detail

/// SnapKV scores of every (sequence, layer, kv_head) of `batch` into `scores` [batch, layers,
/// kv_heads, capacity]: the GQA-aggregated pooled votes of the window queries on the prefix,
/// +inf on the last `config.window` slots (and on every slot of a segment of n <= window);
/// slots at or past a length are not written. A non-finite key of a scored segment sets
/// `*status` to `non_finite_key` (its scores are then meaningless and `compact` moves
/// nothing). `config.grouping` must be `aggregate`.
template <KVCacheView V>
cudaError_t snapkv_score(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                         const window_query_batch& queries, const snapkv_config& config, float* scores,
                         std::int32_t* status, cudaStream_t stream) {
  const char* api = "triattn::cuda::snapkv_score";
  if (const cudaError_t err = detail::check_snapkv(api, batch, queries, config); err != cudaSuccess) return err;
  return detail::window_score(api, workspace, workspace_bytes, batch, detail::snapkv_params(config, queries), scores,
                              status, stream);
}

/// SnapKV keep plan cutting every (sequence, layer, kv_head) to `budget` slots, in the layout
/// of `device_keep_plan` with stride `budget`: `keep` [batch, layers, kv_heads, budget] and
/// `kept` [batch, layers, kv_heads]. As the CPU's `snapkv::plan`: the last `window` slots
/// (the oldest of them when budget < window), then the best-scoring older ones, ascending;
/// a segment of n <= budget keeps everything and its keys are not read.
template <KVCacheView V>
cudaError_t snapkv_plan(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                        const window_query_batch& queries, const snapkv_config& config, std::int32_t budget,
                        std::int32_t* keep, std::int32_t* kept, std::int32_t* status, cudaStream_t stream) {
  const char* api = "triattn::cuda::snapkv_plan";
  if (const cudaError_t err = detail::check_snapkv(api, batch, queries, config); err != cudaSuccess) return err;
  return detail::window_plan(api, workspace, workspace_bytes, batch, detail::snapkv_params(config, queries), budget,
                             keep, kept, status, stream);
}

/// R-KV scores (λ·importance − (1 − λ)·redundancy on the prefix, +inf on the window) into
/// `scores` [batch, layers, kv_heads, capacity]; otherwise as `snapkv_score`.
template <KVCacheView V>
cudaError_t rkv_score(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                      const window_query_batch& queries, const rkv_config& config, float* scores, std::int32_t* status,
                      cudaStream_t stream) {
  const char* api = "triattn::cuda::rkv_score";
  if (const cudaError_t err = detail::check_rkv(api, batch, queries, config); err != cudaSuccess) return err;
  return detail::window_score(api, workspace, workspace_bytes, batch, detail::rkv_params(config, queries), scores,
                              status, stream);
}

/// R-KV keep plan, as `snapkv_plan`.
template <KVCacheView V>
cudaError_t rkv_plan(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                     const window_query_batch& queries, const rkv_config& config, std::int32_t budget,
                     std::int32_t* keep, std::int32_t* kept, std::int32_t* status, cudaStream_t stream) {
  const char* api = "triattn::cuda::rkv_plan";
  if (const cudaError_t err = detail::check_rkv(api, batch, queries, config); err != cudaSuccess) return err;
  return detail::window_plan(api, workspace, workspace_bytes, batch, detail::rkv_params(config, queries), budget, keep,
                             kept, status, stream);
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
