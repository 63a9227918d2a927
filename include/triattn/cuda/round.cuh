/// \file triattn/cuda/round.cuh
/// \brief The one GPU round pipeline every policy runs through, the device twin of
/// core/round.hpp: score, reduce the rows of each decision by granularity, protect, select,
/// expand into the keep plan. A policy only scores (a *device scorer*).
///
/// **A device scorer** `S` (streaming_llm.cuh, triattention.cuh, accumulated.cuh, snapkv.cuh,
/// rkv.cuh) provides:
/// - `TRIATTN_HOST_DEVICE row_rule rule(const round_info& info) const`: its own protected slots
///   (sinks, recent window) and the slots a decision keeps, at most `info.budget`, as the CPU
///   policy's `rule` (the pipeline adds the prompt);
/// - `template <KVCacheView V> cudaError_t score(const char* api, void* workspace,
///   std::size_t& workspace_bytes, const view_batch<V>& batch, const device_round& round,
///   float* scores, std::int32_t* status, cudaStream_t stream) const`: CUB's two-phase
///   protocol (a null workspace validates the scorer's host arguments, naming `api`, and sizes
///   it); otherwise it enqueues kernels writing one score per slot of every (sequence, layer,
///   kv_head) row into `scores` [batch, layers, kv_heads, capacity], after its own GQA
///   reduction and per-row normalisation (over the slots that `rule` and the prompt leave
///   unprotected, as on the CPU). Device failures (a non-finite key) go to `status`;
/// - optionally `static constexpr score_domain domain`, as its CPU policy's (value_weighting.hpp).
///
/// **The pipeline** (`plan_round`), for every sequence of a batch at once:
/// 1. the scorer's kernels fill the score buffer; a value-aware round then weights each row's
///    candidates by their values (`round_weight_values`, the CPU's float);
/// 2. one block per decision (sequence, d) folds its rows (`decision_map::row`, r = 0, 1, ...)
///    with `fold_row_score` into one score per slot, the CPU's float; checks that the rows
///    hold the same length and positions (else `round_status::unequal_rows`); and forms the
///    decision's protection and kept count from the scorer's rule, the prompt and the
///    sequence's budget (`budget_mode::beyond_prompt` adds the prompt's slots, counted with
///    `cub::BlockReduce`);
/// 3. under a budget split (head-adaptive budgets), each pool's decisions are ranked by their
///    own scores, their candidates normalised and sorted across the pool, and each decision's
///    kept count set from what it takes (`split_items`, `split_counts`: the CPU's `split_kept`);
/// 4. `select_keep` per decision (select.cuh), with its own kept count and protection, and
///    `round_options::segments` runs of quotas;
/// 5. shared granularities: each decision's keep set is copied to every row it covers.
/// `compact` (compact.cuh) then applies the plan; given the round's status word, it moves
/// nothing when any step failed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "triattn/core/config.hpp"
#include "triattn/core/granularity.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/core/value_weighting.hpp"
#include "triattn/cuda/common.cuh"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/select.cuh"

TRIATTN_NAMESPACE_BEGIN
namespace cuda {

/// What a round knows per sequence beyond its cache, in device memory: the CPU's
/// `round_context` and budget, one entry per sequence of the batch.
struct round_inputs {
  const std::int32_t* budgets = nullptr;         ///< [batch], each >= 1 and <= the keep plan's stride
  const std::int64_t* round_starts = nullptr;    ///< [batch] next token positions, or null (TriAttention needs them)
  const std::int64_t* prompt_lengths = nullptr;  ///< [batch], or null: no prompt
  /// A value-aware round's output projection (`gram` in device memory), or a null `gram`: the
  /// plain value norms (core/value_weighting.hpp). Not read by other rounds.
  value_projection projection{};
};

/// The round as the kernels see it (passed by value): the inputs, the decisions and how the
/// prompt counts.
struct device_round {
  round_inputs in{};
  decision_map map{};
  row_reduction reduction = row_reduction::mean;
  bool prompt_kept = false;    ///< the prompt's slots are protected (protect_prompt or beyond_prompt)
  bool beyond_prompt = false;  ///< a decision keeps the prompt's slots on top of its budget
  std::int64_t sinks = 0, recent = 0;  ///< `round_options::sinks` and `recent`
  std::int64_t segments = 1;           ///< `round_options::segments`
  budget_split split = budget_split::equal;
  float split_floor = 0.2f;
  score_domain domain = score_domain::weight;  ///< the scorer's, for the value weights

  /// Sequence `b`'s round, as the CPU's `round_info`.
  TRIATTN_HOST_DEVICE round_info info(int b) const {
    return {in.round_starts != nullptr ? in.round_starts[b] : 0,
            in.prompt_lengths != nullptr ? in.prompt_lengths[b] : 0, in.budgets != nullptr ? in.budgets[b] : 0};
  }
};

/// Sequence `b`'s protection and kept count: the scorer's rule joined with the round's sinks,
/// recent window and prompt (when it is kept), as the CPU's `round_options::protected_slots`.
template <class Scorer>
TRIATTN_HOST_DEVICE row_rule sequence_rule(const Scorer& scorer, const device_round& round, int b) {
  const round_info info = round.info(b);
  row_rule rule = scorer.rule(info);
  rule.prot = rule.prot.joined({round.sinks, round.recent, round.prompt_kept ? info.prompt_length : 0});
  return rule;
}

/// A scorer `plan_round` can run on views of type `V` (see the file comment).
template <class S, class V>
concept device_scorer =
    KVCacheView<V> && requires(const S& s, const round_info& info, const view_batch<V>& batch, const device_round& r,
                               void* ws, std::size_t& bytes, float* scores, std::int32_t* status, cudaStream_t stream) {
      { s.rule(info) } -> std::same_as<row_rule>;
      { s.score("api", ws, bytes, batch, r, scores, status, stream) } -> std::same_as<cudaError_t>;
    };

namespace detail {

/// Value-aware rounds: one block per (sequence, layer, kv_head) row = blockIdx.x; each candidate
/// slot's score weighted by its value (core/value_weighting.hpp, the CPU's float), the
/// protected slots left as they are.
template <int Threads, class Scorer, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    round_weight_values(view_batch<V> batch, Scorer scorer, device_round round, float* scores, std::int32_t* status) {
  const kv_geometry& g = batch.geometry;
  const segment_id id = segment_of(blockIdx.x, g);
  const V& view = batch.views[id.b];
  const std::int32_t n = view.length(id.l, id.h);
  const protection prot = sequence_rule(scorer, round, id.b).prot;
  const value_projection* projection = round.in.projection.gram != nullptr ? &round.in.projection : nullptr;
  float* out = scores + static_cast<std::int64_t>(blockIdx.x) * batch.capacity;
  float value[max_head_dim];
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n && n <= batch.capacity; s += Threads) {
    if (is_protected(prot, s, n, view.position(id.l, id.h, s))) continue;
    load_value_row(view, id.l, id.h, s, value);
    const float w = ::TRIATTN_NAMESPACE::value_weight(value, projection, id.l, id.h, g.group_size(), g.head_dim);
    if (!isfinite(w)) fail_round(status, round_status::non_finite_value);
    out[s] = ::TRIATTN_NAMESPACE::value_weighted(out[s], w, round.domain);
  }
}

/// One block per decision (sequence b, decision d) = blockIdx.x: the folded scores, positions
/// and length of the decision, its protection and kept count (see the file comment, step 2).
template <int Threads, class Scorer, KVCacheView V>
__global__ void __launch_bounds__(Threads)
    round_decide(view_batch<V> batch, Scorer scorer, device_round round, std::int32_t stride, const float* scores,
                 float* seg_scores, std::int32_t* seg_positions, std::int32_t* seg_lengths, std::int32_t* seg_budgets,
                 protection* seg_prot, std::int32_t* status) {
  using reduce = cub::BlockReduce<int, Threads>;
  __shared__ typename reduce::TempStorage temp;
  const kv_geometry& g = batch.geometry;
  const decision_map& map = round.map;
  const int seg = static_cast<int>(blockIdx.x);
  const int b = seg / map.decisions(), d = seg % map.decisions();
  const V& view = batch.views[b];
  const std::int64_t cap = batch.capacity;
  int l0, h0;
  map.row(d, 0, l0, h0);
  std::int32_t n = view.length(l0, h0);
  if (n < 0 || n > cap) {  // the scores stop at capacity: nothing past it can be read
    if (threadIdx.x == 0) fail_round(status, round_status::bad_keep);
    n = 0;
  }
  const row_rule rule = sequence_rule(scorer, round, b);
  const std::int64_t prompt_length = round.info(b).prompt_length;
  bool unequal = false;
  int prompt_slots = 0;
  for (int r = 1; r < map.rows() && threadIdx.x == 0; ++r) {
    int l, h;
    map.row(d, r, l, h);
    unequal = unequal || view.length(l, h) != n;
  }
  for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < n; s += Threads) {
    const std::int32_t position = view.position(l0, h0, s);
    float acc = row_fold_start(round.reduction);
    for (int r = 0; r < map.rows(); ++r) {  // row order: the CPU's float
      int l, h;
      map.row(d, r, l, h);
      unequal = unequal || view.position(l, h, s) != position;
      acc = fold_row_score(acc, scores[((std::int64_t{b} * g.num_layers + l) * g.num_kv_heads + h) * cap + s],
                           round.reduction);
    }
    seg_scores[seg * cap + s] = acc;
    seg_positions[seg * cap + s] = position;
    prompt_slots += position < prompt_length ? 1 : 0;
  }
  if (unequal) fail_round(status, round_status::unequal_rows);
  const int prompt_total = reduce(temp).Sum(prompt_slots);  // valid in thread 0
  if (threadIdx.x != 0) return;
  std::int64_t k = rule.kept + (round.beyond_prompt ? prompt_total : 0);
  if (round.info(b).budget < 1 || k > stride) {
    fail_round(status, round_status::bad_budget);
    k = k > stride ? stride : k;
  }
  seg_budgets[seg] = static_cast<std::int32_t>(k < 0 ? 0 : k);
  seg_prot[seg] = rule.prot;
  seg_lengths[seg] = n;
}

/// One thread per (plan row, index): decision keep sets [batch, decisions, stride] copied to
/// every (layer, kv_head) row they cover.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    round_expand(kv_geometry g, decision_map map, int batch, const std::int32_t* seg_keep, const std::int32_t* seg_kept,
                 device_keep_plan plan) {
  const std::int64_t rows = std::int64_t{batch} * g.num_layers * g.num_kv_heads;
  const std::int64_t t = blockIdx.x * std::int64_t{Threads} + threadIdx.x;
  if (t >= rows * plan.stride) return;
  const std::int64_t row = t / plan.stride, i = t % plan.stride;
  const segment_id id = segment_of(row, g);
  const std::int64_t seg = std::int64_t{id.b} * map.decisions() + map.decision_of(id.l, id.h);
  if (i < seg_kept[seg]) plan.keep[t] = seg_keep[seg * plan.stride + i];
  if (i == 0) plan.kept[row] = seg_kept[seg];
}

/// Host checks of the round's options.
inline cudaError_t check_round_options(const char* api, const round_options& o) {
  if (o.grain != granularity::per_layer && o.grain != granularity::per_kv_head &&
      o.grain != granularity::whole_sequence)
    return reject(api, "granularity ", static_cast<int>(o.grain), " is not a triattn::granularity");
  if (o.reduction != row_reduction::mean && o.reduction != row_reduction::max)
    return reject(api, "row reduction ", static_cast<int>(o.reduction), " is not a triattn::row_reduction");
  if (o.budget != budget_mode::with_prompt && o.budget != budget_mode::beyond_prompt)
    return reject(api, "budget mode ", static_cast<int>(o.budget), " is not a triattn::budget_mode");
  if (o.sinks < 0 || o.recent < 0)
    return reject(api, "round sinks ", o.sinks, " and recent ", o.recent, " must be >= 0");
  if (o.segments < 1 || o.segments > max_segments)
    return reject(api, "round segments ", o.segments, " must be in [1, ", max_segments, "]");
  if (o.split == budget_split::equal) return cudaSuccess;
  if (o.split != budget_split::per_layer && o.split != budget_split::per_sequence)
    return reject(api, "budget split ", static_cast<int>(o.split), " is not a triattn::budget_split");
  if (!(o.split_floor >= 0.0f && o.split_floor <= 1.0f))
    return reject(api, "split floor ", o.split_floor, " must be in [0, 1]");
  if (o.grain == granularity::whole_sequence)
    return reject(api, "budget split ", budget_split_name(o.split),
                  " needs decisions to split the budget between, but union granularity makes one keep set");
  if (o.split == budget_split::per_layer && o.grain != granularity::per_layer)
    return reject(api, "budget split per_layer needs per_layer granularity: a ", granularity_name(o.grain),
                  " decision spans every layer (use per_sequence)");
  return cudaSuccess;
}

/// A budget split, step 1: one block per decision (after the per-decision rank order, with
/// one run). Its candidates' normalisation (`split_normalised`: the smallest finite score and
/// the shifted sum, in double), its share of the pool and floor; and one pool-sort key per
/// candidate of its order, `rank << (pool_bits + slot_bits) | decision in pool << slot_bits |
/// i` (i: its place in the decision's order; the floor's keys rank 0, first); unused entries
/// get the largest key. Block 0 of each pool writes the pool's sort bounds.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    split_items(select_segments seg, rank_order order, float floor_share, int per_pool, int pool_bits,
                std::uint64_t* pool_keys, std::int64_t* share, int* pool_begin, int* pool_end) {
  using reduce_f = cub::BlockReduce<float, Threads>;
  using reduce_d = cub::BlockReduce<double, Threads>;
  using reduce_i = cub::BlockReduce<int, Threads>;
  __shared__ union {
    typename reduce_f::TempStorage f;
    typename reduce_d::TempStorage d;
    typename reduce_i::TempStorage i;
  } temp;
  __shared__ float lowest_shared;
  __shared__ double sum_shared;
  __shared__ int finite_shared;
  const int s = static_cast<int>(blockIdx.x);
  const std::int64_t n = seg.lengths[s], row = static_cast<std::int64_t>(s) * seg.capacity;
  const std::int64_t protected_slots = order.protected_count[s], m = n - protected_slots;
  const std::int64_t k = seg.budgets[s];
  const std::uint64_t slot_mask = (std::uint64_t{1} << order.slot_bits) - 1;
  const auto score_of = [&](std::int64_t i) { return seg.scores[row + (order.sorted[row + protected_slots + i] & slot_mask)]; };
  float low = INFINITY;
  int finite = 0;
  for (std::int64_t i = threadIdx.x; i < m; i += Threads) {
    const float x = score_of(i);
    if (isfinite(x)) low = x < low ? x : low, ++finite;
  }
  const float lowest = reduce_f(temp.f).Reduce(low, [](float a, float b) { return b < a ? b : a; });
  __syncthreads();
  const int finite_total = reduce_i(temp.i).Sum(finite);
  if (threadIdx.x == 0) lowest_shared = lowest, finite_shared = finite_total;
  __syncthreads();
  double part = 0.0;
  for (std::int64_t i = threadIdx.x; i < m; i += Threads) {
    const float x = score_of(i);
    if (isfinite(x)) part += static_cast<double>(x) - static_cast<double>(lowest_shared);
  }
  const double sum = reduce_d(temp.d).Sum(part);
  if (threadIdx.x == 0) sum_shared = sum;
  __syncthreads();
  const std::int64_t mine = k > 0 ? k - (protected_slots < k ? protected_slots : k) : 0;
  const std::int64_t floor = k > 0 ? split_floor_count(floor_share, mine, m) : 0;
  const auto local = static_cast<std::uint64_t>(s % per_pool);
  for (std::int64_t i = threadIdx.x; i < seg.capacity; i += Threads) {
    std::uint64_t key = ~std::uint64_t{0};
    if (k > 0 && i < m) {
      const float x = split_normalised(score_of(i), lowest_shared, sum_shared, finite_shared);
      key = static_cast<std::uint64_t>(rank_key(x, i < floor)) << (pool_bits + order.slot_bits) |
            local << order.slot_bits | static_cast<std::uint64_t>(i);
    }
    pool_keys[row + i] = key;
  }
  if (threadIdx.x == 0) {
    share[s] = mine;
    if (local == 0) {
      pool_begin[s / per_pool] = static_cast<int>(row);
      pool_end[s / per_pool] = static_cast<int>(row + std::int64_t{per_pool} * seg.capacity);
    }
  }
}

/// A budget split, step 2: one block per pool (after the pool sort). The pool takes the first
/// min(pool, candidates) keys: the floors, then the best normalised scores; each decision's
/// kept count becomes its protected slots (at most its count) plus what it took, or its whole
/// length when the pool's slots fit its counts. `taken` [decisions] starts at 0.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    split_counts(select_segments seg, rank_order order, int per_pool, int pool_bits, const std::uint64_t* pool_sorted,
                 const std::int64_t* share, int* taken, std::int32_t* budgets) {
  __shared__ std::int64_t take_shared;
  __shared__ bool fits_shared;
  const int pool = static_cast<int>(blockIdx.x), first = pool * per_pool;
  if (threadIdx.x == 0) {
    std::int64_t held = 0, kept = 0, rest = 0, candidates = 0;
    for (int d = first; d < first + per_pool; ++d)
      if (budgets[d] > 0) {
        held += seg.lengths[d];
        kept += budgets[d];
        rest += share[d];
        candidates += seg.lengths[d] - order.protected_count[d];
      }
    fits_shared = held <= kept;
    take_shared = rest < candidates ? rest : candidates;
  }
  __syncthreads();
  const std::uint64_t pool_mask = (std::uint64_t{1} << pool_bits) - 1;
  const std::int64_t base = static_cast<std::int64_t>(first) * seg.capacity;
  for (std::int64_t t = threadIdx.x; t < take_shared && !fits_shared; t += Threads) {
    // An unused entry's key (all ones) can tie a NaN score's; its decision field is then past
    // the pool, and it takes nothing.
    const auto local = static_cast<int>(pool_sorted[base + t] >> order.slot_bits & pool_mask);
    if (local < per_pool) atomicAdd(&taken[first + local], 1);
  }
  __syncthreads();
  for (int d = first + static_cast<int>(threadIdx.x); d < first + per_pool; d += Threads) {
    const std::int32_t k = budgets[d];
    if (k <= 0) continue;
    const std::int32_t p = order.protected_count[d];
    budgets[d] = fits_shared ? seg.lengths[d] : (p < k ? p : k) + taken[d];
  }
}

}  // namespace detail

/// The round of `batch` under `options` as its kernels see it, for a scorer of `domain`.
template <KVCacheView V>
device_round make_device_round(const view_batch<V>& batch, const round_options& options, const round_inputs& inputs,
                               score_domain domain) {
  const kv_geometry& g = batch.geometry;
  return {inputs,          decision_map{options.grain, g.num_layers, g.num_kv_heads},
          options.reduction, options.keeps_prompt(),
          options.budget == budget_mode::beyond_prompt,
          options.sinks,   options.recent,
          options.segments, options.split,
          options.split_floor, domain};
}

/// The keep plan of one round of `scorer` over every sequence of `batch`: the CPU's
/// `plan_round` (core/round.hpp) for each sequence b, with budget `inputs.budgets[b]` and the
/// context `inputs.round_starts[b]`, `inputs.prompt_lengths[b]`, under `options` (granularity,
/// row reduction, budget mode, prompt protection, sinks and recent window; its schedule is
/// the caller's business).
/// Writes `plan.keep` [batch, layers, kv_heads, plan.stride] and `plan.kept` [batch, layers,
/// kv_heads], the plan `compact` reads; `plan.stride` must hold every decision's kept count
/// (the largest budget, plus the prompt with `beyond_prompt`). CUB-style workspace (see
/// common.cuh). Device failures go to `status` (required, zeroed by the caller): a
/// non-finite key, rows of a shared decision that hold different slots (`unequal_rows`), a
/// budget < 1 or a kept count above the stride (`bad_budget`); `compact` given that word then
/// moves nothing. Under a budget split (`round_options::split`) a decision may keep every slot
/// it holds: `plan.stride` must hold the capacity, and the rows of a pool keep different
/// lengths.
template <class Scorer, KVCacheView V>
  requires device_scorer<Scorer, V>
cudaError_t plan_round(void* workspace, std::size_t& workspace_bytes, const view_batch<V>& batch,
                       const Scorer& scorer, const round_options& options, const round_inputs& inputs,
                       const device_keep_plan& plan, std::int32_t* status, cudaStream_t stream) {
  const char* api = "triattn::cuda::plan_round";
  if (const cudaError_t err = detail::check_batch(api, batch); err != cudaSuccess) return err;
  if (const cudaError_t err = detail::check_round_options(api, options); err != cudaSuccess) return err;
  if (plan.stride < 1) return detail::reject(api, "keep plan stride ", plan.stride, " must be >= 1");
  const bool split = options.split != budget_split::equal;
  if (holds_equal_lengths<V>() && options.grain != granularity::whole_sequence)
    return detail::reject(api, "granularity ", granularity_name(options.grain),
                          " decides more than one keep set, but this view's rows hold the same tokens (equal_lengths): "
                          "use union (whole_sequence)");
  if (options.value_aware && inputs.projection.gram != nullptr)
    if (const std::string e = inputs.projection.error(batch.geometry); !e.empty()) return detail::reject(api, e);
  if (split && plan.stride < batch.capacity)
    return detail::reject(api, "keep plan stride ", plan.stride, " must hold the capacity ", batch.capacity,
                          " under a budget split: a decision may keep every slot it holds");
  const device_round round = make_device_round(batch, options, inputs, score_domain_of<Scorer>());
  const kv_geometry& g = batch.geometry;
  const bool shared = round.map.rows() > 1;
  const std::int64_t decisions = std::int64_t{batch.size} * round.map.decisions();
  const auto rows = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_kv_heads;
  const auto cap = static_cast<std::size_t>(batch.capacity);
  const auto segs = static_cast<std::size_t>(decisions);

  detail::workspace_carver ws(workspace);
  auto* scores = ws.take<float>(rows * cap);          // [batch, layers, kv_heads, capacity]
  auto* seg_scores = ws.take<float>(segs * cap);      // [batch, decisions, capacity]
  auto* seg_positions = ws.take<std::int32_t>(segs * cap);
  auto* seg_lengths = ws.take<std::int32_t>(segs);
  auto* seg_budgets = ws.take<std::int32_t>(segs);
  auto* seg_prot = ws.take<protection>(segs);
  // A per-layer decision is its plan row: select straight into the plan.
  auto* seg_keep = shared ? ws.take<std::int32_t>(segs * static_cast<std::size_t>(plan.stride)) : plan.keep;
  auto* seg_kept = shared ? ws.take<std::int32_t>(segs) : plan.kept;
  std::size_t scorer_bytes = 0;
  cudaError_t err = scorer.score(api, nullptr, scorer_bytes, batch, round, nullptr, status, stream);
  if (err != cudaSuccess) return err;
  void* scorer_ws = ws.take<std::byte>(scorer_bytes);
  const select_segments seg{seg_scores, seg_lengths, seg_positions, static_cast<int>(decisions),
                            batch.capacity, seg_budgets, seg_prot, options.segments};
  // A budget split: the decisions' own rank order (one run), the pool keys and their sort.
  const int per_pool = pool_decisions(round.split, round.map), pools = static_cast<int>(decisions / per_pool);
  const int pool_bits = detail::bits_for(per_pool);
  select_segments by_rank = seg;
  by_rank.runs = 1;
  detail::rank_order order;
  std::uint64_t* pool_keys = nullptr;
  std::uint64_t* pool_sorted = nullptr;
  std::int64_t* share = nullptr;
  int *taken = nullptr, *pool_begin = nullptr, *pool_end = nullptr;
  void* pool_tmp = nullptr;
  std::size_t pool_bytes = 0;
  if (split) {
    if (32 + pool_bits + detail::bits_for(batch.capacity) > 64)
      return detail::reject(api, "budget split over ", per_pool, " decisions of capacity ", batch.capacity,
                            " needs more than the 32 bits a 64-bit sort key leaves for them");
    if ((err = order.carve(ws, by_rank, stream)) != cudaSuccess) return err;
    pool_keys = ws.take<std::uint64_t>(segs * cap);
    pool_sorted = ws.take<std::uint64_t>(segs * cap);
    share = ws.take<std::int64_t>(segs);
    taken = ws.take<int>(segs);
    pool_begin = ws.take<int>(static_cast<std::size_t>(pools));
    pool_end = ws.take<int>(static_cast<std::size_t>(pools));
    err = cub::DeviceSegmentedRadixSort::SortKeys(nullptr, pool_bytes, pool_keys, pool_sorted,
                                                  static_cast<int>(segs * cap), pools, pool_begin, pool_end, 0,
                                                  32 + pool_bits + order.slot_bits, stream);
    if (err != cudaSuccess) return err;
    pool_tmp = ws.take<std::byte>(pool_bytes);
  }
  std::size_t select_bytes = 0;
  if ((err = select_keep(nullptr, select_bytes, seg, {}, plan.stride, seg_keep, seg_kept, stream)) != cudaSuccess)
    return err;
  void* select_ws = ws.take<std::byte>(select_bytes);
  if (!detail::workspace_ready(api, workspace, workspace_bytes, ws, err)) return err;
  if (plan.keep == nullptr || plan.kept == nullptr || status == nullptr || inputs.budgets == nullptr)
    return detail::reject(api, "plan.keep, plan.kept, status and inputs.budgets must not be null");

  if ((err = scorer.score(api, scorer_ws, scorer_bytes, batch, round, scores, status, stream)) != cudaSuccess)
    return err;
  constexpr int threads = 256;
  if (options.value_aware) {
    detail::round_weight_values<threads><<<static_cast<unsigned>(rows), threads, 0, stream>>>(batch, scorer, round,
                                                                                            scores, status);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  detail::round_decide<threads><<<static_cast<unsigned>(decisions), threads, 0, stream>>>(
      batch, scorer, round, plan.stride, scores, seg_scores, seg_positions, seg_lengths, seg_budgets, seg_prot, status);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (split) {  // the decisions' kept counts from their pool (core/round.hpp, `split_kept`)
    if ((err = order.run(by_rank, {}, stream)) != cudaSuccess) return err;
    detail::split_items<threads><<<static_cast<unsigned>(decisions), threads, 0, stream>>>(
        by_rank, order, options.split_floor, per_pool, pool_bits, pool_keys, share, pool_begin, pool_end);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    std::size_t bytes = pool_bytes;
    err = cub::DeviceSegmentedRadixSort::SortKeys(pool_tmp, bytes, pool_keys, pool_sorted, static_cast<int>(segs * cap),
                                                  pools, pool_begin, pool_end, 0, 32 + pool_bits + order.slot_bits,
                                                  stream);
    if (err != cudaSuccess) return err;
    if ((err = cudaMemsetAsync(taken, 0, segs * sizeof(int), stream)) != cudaSuccess) return err;
    detail::split_counts<threads><<<static_cast<unsigned>(pools), threads, 0, stream>>>(
        by_rank, order, per_pool, pool_bits, pool_sorted, share, taken, seg_budgets);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if ((err = select_keep(select_ws, select_bytes, seg, {}, plan.stride, seg_keep, seg_kept, stream)) != cudaSuccess)
    return err;
  if (!shared) return cudaSuccess;
  const std::int64_t items = static_cast<std::int64_t>(rows) * plan.stride;
  detail::round_expand<threads><<<detail::blocks_for(items, threads), threads, 0, stream>>>(
      g, round.map, batch.size, seg_keep, seg_kept, plan);
  return cudaGetLastError();
}

}  // namespace cuda
TRIATTN_NAMESPACE_END
