// GPU SnapKV and R-KV against the double-precision oracle (reference_window.cpp): scores and
// keep plans on random batches of every layout, dtype and GQA group, with fewer observed rows
// than the window, masked keys, budgets 1 to >= length; exact ties of duplicate keys; the
// status word for a non-finite key; host-side argument errors.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/reference.hpp"
#include "cuda/reference_window.hpp"
#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/rkv.cuh"
#include "triattn/cuda/snapkv.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn::rkv_config;
using triattn::snapkv_config;
using triattn_test::cache_layout;

constexpr float untouched = -12345.0f;  // written to the scores beforehand: slots past a length keep it
/// Cosine similarities closer than this to R-KV's threshold may fall on either side in fp32.
constexpr double threshold_guard = 1e-5;
/// Keep sets whose cut is closer than this to a flip are checked for validity only.
constexpr double cut_guard = 1e-4;

/// A batch of caches of one shape and the window queries of every sequence.
struct window_case {
  std::vector<triattn_test::test_cache> caches;
  std::vector<cpu::sequence_queries> queries;
  int rows = 0;
  bool paged = false;

  /// All sequences' queries [batch, layers, q_heads, rows, head_dim] and positions [batch, rows].
  std::vector<float> all_queries() const {
    std::vector<float> q;
    for (const auto& s : queries) q.insert(q.end(), s.q.begin(), s.q.end());
    return q;
  }
  std::vector<std::int32_t> all_positions() const {
    std::vector<std::int32_t> p;
    for (const auto& s : queries) p.insert(p.end(), s.positions.begin(), s.positions.end());
    return p;
  }
  std::string describe() const { return caches.front().shape().describe() + " batch " + std::to_string(caches.size()); }
};

/// `batch` random caches of `shape`, and `rows` random queries per sequence at increasing
/// positions starting in [0, 150]: some keys (positions up to ~50 + 4 x capacity) come after
/// some queries, so the causal mask fires, and some rows may be fully masked.
window_case random_case(std::mt19937_64& g, const triattn_test::cache_shape& shape, int batch, int rows) {
  window_case wc;
  wc.rows = rows;
  wc.paged = triattn_test::is_paged(shape.layout);
  std::uniform_int_distribution<std::int32_t> start(0, 150), gap(1, 3);
  const std::size_t q_floats = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads * shape.group *
                               static_cast<std::size_t>(rows) * static_cast<std::size_t>(shape.head_dim);
  for (int b = 0; b < batch; ++b) {
    wc.caches.emplace_back(shape, g);
    cpu::sequence_queries s;
    s.rows = rows;
    s.q = triattn_test::normal_floats(g, q_floats);
    for (std::int32_t i = 0, p = start(g); i < rows; ++i, p += gap(g)) s.positions.push_back(p);
    wc.queries.push_back(s);
  }
  return wc;
}

template <class V>
cudaError_t score_call(void* ws, std::size_t& bytes, const triattn::cuda::view_batch<V>& batch,
                       const triattn::cuda::window_query_batch& q, const snapkv_config& c, float* scores,
                       std::int32_t* status) {
  return triattn::cuda::snapkv_score(ws, bytes, batch, q, c, scores, status, nullptr);
}
template <class V>
cudaError_t score_call(void* ws, std::size_t& bytes, const triattn::cuda::view_batch<V>& batch,
                       const triattn::cuda::window_query_batch& q, const rkv_config& c, float* scores,
                       std::int32_t* status) {
  return triattn::cuda::rkv_score(ws, bytes, batch, q, c, scores, status, nullptr);
}
/// A per-layer round of SnapKV or R-KV (the policy's device scorer in `plan_round`), every
/// sequence cut to `budget`. The budgets' buffer is freed on return, which waits for the launch.
template <class Scorer, class V>
cudaError_t plan_with(const Scorer& scorer, void* ws, std::size_t& bytes, const triattn::cuda::view_batch<V>& batch,
                      std::int32_t budget, std::int32_t* keep, std::int32_t* kept, std::int32_t* status) {
  const device_buffer<std::int32_t> budgets(std::vector<std::int32_t>(static_cast<std::size_t>(batch.size), budget));
  return triattn::cuda::plan_round(ws, bytes, batch, scorer, triattn::round_options{}, {budgets.get()},
                                   {keep, kept, budget}, status, nullptr);
}
template <class V>
cudaError_t plan_call(void* ws, std::size_t& bytes, const triattn::cuda::view_batch<V>& batch,
                      const triattn::cuda::window_query_batch& q, const snapkv_config& c, std::int32_t budget,
                      std::int32_t* keep, std::int32_t* kept, std::int32_t* status) {
  return plan_with(triattn::cuda::snapkv_scorer{c, q}, ws, bytes, batch, budget, keep, kept, status);
}
template <class V>
cudaError_t plan_call(void* ws, std::size_t& bytes, const triattn::cuda::view_batch<V>& batch,
                      const triattn::cuda::window_query_batch& q, const rkv_config& c, std::int32_t budget,
                      std::int32_t* keep, std::int32_t* kept, std::int32_t* status) {
  return plan_with(triattn::cuda::rkv_scorer{c, q}, ws, bytes, batch, budget, keep, kept, status);
}

/// What the GPU returned for a case: scores [batch, layers, kv_heads, capacity] (pre-filled
/// with `untouched`), keep rows per segment, and the two status words.
struct gpu_result {
  std::vector<float> scores;
  cpu::keep_rows keep;
  std::int32_t score_status = -1, plan_status = -1;
};

template <class V, class Config>
gpu_result run_gpu(window_case& wc, const Config& config, std::int32_t budget) {
  const device_batch<V> dev(wc.caches);
  const auto batch = dev.batch();
  device_buffer<float> q(wc.all_queries());
  device_buffer<std::int32_t> positions(wc.all_positions());
  const triattn::cuda::window_query_batch queries{q.get(), positions.get(), wc.rows};
  const std::size_t segments =
      wc.caches.size() * static_cast<std::size_t>(batch.geometry.num_layers * batch.geometry.num_kv_heads);
  device_buffer<float> scores(std::vector<float>(segments * static_cast<std::size_t>(batch.capacity), untouched));
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0, 0});
  device_buffer<std::int32_t> keep(segments * static_cast<std::size_t>(budget)), kept(segments);

  std::size_t bytes = 0;
  CUDA_REQUIRE(score_call(nullptr, bytes, batch, queries, config, scores.get(), status.get()));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(score_call(ws.get(), bytes, batch, queries, config, scores.get(), status.get()));
  std::size_t plan_bytes = 0;
  CUDA_REQUIRE(plan_call(nullptr, plan_bytes, batch, queries, config, budget, keep.get(), kept.get(), status.get() + 1));
  device_buffer<std::byte> plan_ws(plan_bytes);
  CUDA_REQUIRE(plan_call(plan_ws.get(), plan_bytes, batch, queries, config, budget, keep.get(), kept.get(),
                         status.get() + 1));
  CUDA_REQUIRE(cudaDeviceSynchronize());

  gpu_result r;
  r.scores = scores.download();
  const auto st = status.download();
  r.score_status = st[0];
  r.plan_status = st[1];
  const auto k = keep.download();
  const auto n = kept.download();
  for (std::size_t s = 0; s < segments; ++s) {
    const auto at = k.begin() + static_cast<std::ptrdiff_t>(s * static_cast<std::size_t>(budget));
    r.keep.emplace_back(at, at + n[s]);
  }
  return r;
}

/// Whether `keep` is a best-`budget` set of `scores` within `tol` (ascending, the right size,
/// nothing dropped scoring clearly above something kept): the check of a near-tie at the cut.
bool valid_keep(const std::vector<double>& scores, const std::vector<std::int32_t>& keep, std::int64_t budget,
                double tol) {
  const auto n = static_cast<std::int64_t>(scores.size());
  if (static_cast<std::int64_t>(keep.size()) != std::min(budget, n)) return false;
  std::vector<bool> kept(scores.size(), false);
  for (std::size_t i = 0; i < keep.size(); ++i) {
    if (keep[i] < 0 || keep[i] >= n || (i > 0 && keep[i] <= keep[i - 1])) return false;
    kept[static_cast<std::size_t>(keep[i])] = true;
  }
  double weakest = std::numeric_limits<double>::infinity(), best_dropped = -weakest;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    if (kept[j]) weakest = std::min(weakest, scores[j]);
    if (!kept[j]) best_dropped = std::max(best_dropped, scores[j]);
  }
  return weakest >= best_dropped - tol;
}

/// Counts of what a case compared and skipped.
struct tally {
  int rows = 0, scored = 0, keeps_exact = 0, keeps_valid = 0, skipped = 0;
};

/// Compares every segment of `wc` with the oracle. `exact_ties`: every keep set must be
/// identical (the scores tie exactly on both sides).
template <class V, class Config>
void check_case(window_case& wc, const Config& config, std::int32_t budget, double abs_tol, double rel_tol,
                bool exact_ties, tally& t) {
  INFO_SCOPE(wc.describe(), " rows ", wc.rows, " window ", config.window, " kernel ", config.kernel, " budget ", budget);
  const gpu_result r = run_gpu<V>(wc, config, budget);
  CHECK(r.score_status == 0, "score status ", r.score_status);
  CHECK(r.plan_status == 0, "plan status ", r.plan_status);
  const auto& shape = wc.caches.front().shape();
  const std::int64_t cap = shape.capacity;
  std::size_t seg = 0;
  for (std::size_t b = 0; b < wc.caches.size(); ++b)
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h, ++seg) {
        auto& c = wc.caches[b];
        const std::int32_t n = c.length(l, h);
        INFO_SCOPE("sequence ", b, " layer ", l, " kv_head ", h, " length ", n);
        ++t.rows;
        const auto row = r.scores.begin() + static_cast<std::ptrdiff_t>(seg * static_cast<std::size_t>(cap));
        for (std::int64_t j = n; j < cap; ++j) CHECK(row[j] == untouched, "slot ", j, " past the length was written");
        const cpu::window_expectation e = cpu::expect(c, wc.queries[b], l, h, config, budget);
        if (e.threshold_margin <= threshold_guard) {
          ++t.skipped;
          continue;
        }
        ++t.scored;
        for (std::int32_t j = 0; j < n; ++j) {
          const double want = e.scores[static_cast<std::size_t>(j)];
          if (std::isinf(want)) {
            CHECK(row[j] == want, "slot ", j, " got ", row[j], " want ", want);
          } else {
            CHECK(std::fabs(row[j] - want) <= abs_tol + rel_tol * std::fabs(want), "slot ", j, " got ", row[j],
                  " want ", want);
          }
        }
        const auto& got = r.keep[seg];
        if (exact_ties || (e.keep_margin > cut_guard && !e.tied_cut)) {
          ++t.keeps_exact;
          CHECK(got == e.keep, "keep set differs (margin ", e.keep_margin, ")");
        } else {
          ++t.keeps_valid;
          CHECK(valid_keep(e.scores, got, budget, abs_tol + rel_tol), "keep set at a near-tie is not a best set");
        }
      }
}

template <class Config>
void dispatch(window_case& wc, const Config& config, std::int32_t budget, double abs_tol, double rel_tol,
              bool exact_ties, tally& t) {
  if (wc.paged)
    check_case<triattn::paged_kv_view>(wc, config, budget, abs_tol, rel_tol, exact_ties, t);
  else
    check_case<triattn::dense_kv_view>(wc, config, budget, abs_tol, rel_tol, exact_ties, t);
}

/// A random shape for trial t: small random ones, and every fourth a large one (head_dim 72
/// or 128, capacity 300: several blocks of slots, several similarity tiles, head_dim chunks
/// with a partial last chunk).
triattn_test::cache_shape trial_shape(std::mt19937_64& g, int t, int group) {
  const cache_layout layout = triattn_test::all_layouts[t % 4];
  const triattn::dtype type = triattn_test::all_dtypes[t / 4 % 3];
  triattn_test::cache_shape shape = triattn_test::random_shape(g, layout, type, 1 + t % 5, group);
  if (t % 4 == 3) {
    shape.head_dim = t % 8 == 3 ? 72 : 128;
    shape.capacity = 300;
    shape.num_layers = 1;
  }
  return shape;
}

/// A budget for trial t: 1, a random one, or one >= every length.
std::int32_t trial_budget(std::mt19937_64& g, int t, std::int64_t capacity) {
  if (t % 3 == 0) return 1;
  if (t % 3 == 1) return static_cast<std::int32_t>(std::uniform_int_distribution<std::int64_t>(1, capacity)(g));
  return static_cast<std::int32_t>(capacity + 1);
}

TRIATTN_CUDA_TEST("snapkv_score and plan_round(snapkv_scorer) match the oracle on every layout, dtype and GQA group") {
  auto g = triattn_test::rng(41);
  tally t;
  for (int trial = 0; trial < 72; ++trial) {
    const int group = 1 << (trial / 12 % 3);
    const triattn_test::cache_shape shape = trial_shape(g, trial, group);
    snapkv_config c;
    c.window = std::uniform_int_distribution<int>(1, 6)(g);
    c.kernel = 2 * std::uniform_int_distribution<int>(0, 3)(g) + 1;
    c.pool = trial % 2 == 0 ? triattn::pooling::max : triattn::pooling::avg;
    constexpr triattn::gqa_aggregation rules[] = {triattn::gqa_aggregation::mean, triattn::gqa_aggregation::max,
                                                  triattn::gqa_aggregation::sum};
    c.gqa = rules[trial / 2 % 3];
    const int rows = std::uniform_int_distribution<int>(1, c.window)(g);
    const int batch = 1 + trial % 3;
    window_case wc = random_case(g, shape, batch, rows);
    INFO_SCOPE("trial ", trial, " gqa ", triattn::gqa_aggregation_name(c.gqa), c.pool == triattn::pooling::max ? " max" : " avg", " pooling");
    dispatch(wc, c, trial_budget(g, trial, shape.capacity), 2e-5, 2e-5, false, t);
  }
  INFO_SCOPE("rows ", t.rows, ", exact keeps ", t.keeps_exact, ", near-tie keeps ", t.keeps_valid);
  CHECK(t.scored > 200);
  CHECK(t.keeps_exact > 100);
}

TRIATTN_CUDA_TEST("rkv_score and plan_round(rkv_scorer) match the oracle on every layout, dtype and GQA group") {
  auto g = triattn_test::rng(42);
  tally t;
  for (int trial = 0; trial < 72; ++trial) {
    const int group = 1 << (trial / 12 % 3);
    const triattn_test::cache_shape shape = trial_shape(g, trial, group);
    rkv_config c;
    c.window = std::uniform_int_distribution<int>(1, 6)(g);
    c.kernel = 2 * std::uniform_int_distribution<int>(0, 3)(g) + 1;
    c.lambda = std::uniform_real_distribution<float>(0.0f, 1.0f)(g);
    // Large shapes: thresholds far from 0, where the cosines of random long keys crowd: 0.5
    // finds no duplicate (every column tile scanned), -0.5 finds one in the newest tile.
    constexpr float large_thresholds[] = {0.5f, -0.5f, 0.5f};
    c.threshold = shape.capacity == 300 ? large_thresholds[trial % 3]
                                        : std::uniform_real_distribution<float>(-0.3f, 0.9f)(g);
    const int rows = std::uniform_int_distribution<int>(1, c.window)(g);
    const int batch = 1 + trial % 3;
    window_case wc = random_case(g, shape, batch, rows);
    INFO_SCOPE("trial ", trial, " lambda ", c.lambda, " threshold ", c.threshold);
    dispatch(wc, c, trial_budget(g, trial, shape.capacity), 1e-5, 1e-4, false, t);
  }
  INFO_SCOPE("rows ", t.rows, ", skipped for cosines at the threshold ", t.skipped, ", exact keeps ", t.keeps_exact,
             ", near-tie keeps ", t.keeps_valid);
  CHECK(t.scored > 200);
  CHECK(t.skipped * 10 < t.rows);
  CHECK(t.keeps_exact > 100);
}

/// Every key of every cache becomes (2, 0, ..., 0), a unit key exactly (2 + 1e-8 rounds to 2),
/// and every query comes after every key: logits, votes, importance and similarities are then
/// exactly equal across slots on both sides, and ties must go to the lower slot.
void duplicate_keys(window_case& wc) {
  for (auto& c : wc.caches) {
    std::vector<float> key(static_cast<std::size_t>(c.shape().head_dim), 0.0f);
    key[0] = 2.0f;
    for (int l = 0; l < c.shape().num_layers; ++l)
      for (int h = 0; h < c.shape().num_kv_heads; ++h)
        for (std::int64_t s = 0; s < c.shape().capacity; ++s)
          c.with_view([&](const auto& v) { triattn::store_key(v, l, h, s, key.data()); });
  }
  for (auto& q : wc.queries)
    for (std::size_t i = 0; i < q.positions.size(); ++i) q.positions[i] = 100000 + static_cast<std::int32_t>(i);
}

TRIATTN_CUDA_TEST("exact ties of duplicate keys go to the lower slot, as on the CPU") {
  auto g = triattn_test::rng(43);
  tally t;
  for (int trial = 0; trial < 24; ++trial) {
    const int group = 1 << (trial % 3);
    const triattn_test::cache_shape shape = trial_shape(g, trial, group);
    const int batch = 1 + trial % 2;
    const std::int32_t budget = trial_budget(g, trial + 1, shape.capacity);
    const int kernel = 2 * (trial % 4) + 1;
    INFO_SCOPE("trial ", trial);
    if (trial % 2 == 0) {
      snapkv_config c;
      c.window = 1 + trial % 5;
      c.kernel = kernel;  // max pooling: constant votes stay constant up to the edges
      window_case wc = random_case(g, shape, batch, c.window);
      duplicate_keys(wc);
      dispatch(wc, c, budget, 2e-5, 2e-5, true, t);
    } else {
      rkv_config c;
      c.window = 1 + trial % 5;
      c.kernel = kernel;
      window_case wc = random_case(g, shape, batch, 1);
      duplicate_keys(wc);
      dispatch(wc, c, budget, 1e-5, 1e-4, true, t);
    }
  }
  CHECK(t.keeps_exact > 50);
}

TRIATTN_CUDA_TEST("a non-finite key of a scored row sets the status word") {
  auto g = triattn_test::rng(44);
  triattn_test::cache_shape shape = triattn_test::random_shape(g, cache_layout::paged_nhd, triattn::dtype::f32, 3, 2);
  shape.capacity = 20;
  window_case wc = random_case(g, shape, 2, 2);
  auto& c = wc.caches[1];
  c.length(0, 0) = 12;
  std::vector<float> key(static_cast<std::size_t>(shape.head_dim), 1.0f);
  key.back() = std::numeric_limits<float>::quiet_NaN();
  c.with_view([&](const auto& v) { triattn::store_key(v, 0, 0, 5, key.data()); });
  for (const bool snap : {true, false}) {
    INFO_SCOPE(snap ? "snapkv" : "rkv");
    const auto non_finite = static_cast<std::int32_t>(triattn::cuda::round_status::non_finite_key);
    const gpu_result r = snap ? run_gpu<triattn::paged_kv_view>(wc, snapkv_config{.window = 4}, 8)
                              : run_gpu<triattn::paged_kv_view>(wc, rkv_config{.window = 4}, 8);
    CHECK(r.score_status == non_finite, "score status ", r.score_status);
    CHECK(r.plan_status == non_finite, "plan status ", r.plan_status);
  }
}

TRIATTN_CUDA_TEST("bad host arguments return cudaErrorInvalidValue naming the value") {
  const triattn::dense_kv_view* views = reinterpret_cast<const triattn::dense_kv_view*>(std::uintptr_t{256});
  triattn::cuda::view_batch<triattn::dense_kv_view> batch{views, 1, {}, 16};
  batch.geometry.num_layers = 1;
  batch.geometry.num_q_heads = 2;
  batch.geometry.num_kv_heads = 1;
  batch.geometry.head_dim = 8;
  std::size_t bytes = 0;
  const auto expect_error = [&](cudaError_t err, const std::string& part) {
    CHECK(err == cudaErrorInvalidValue, cudaGetErrorString(err));
    CHECK(triattn::cuda::last_error_message().find(part) != std::string::npos, triattn::cuda::last_error_message(),
          " lacks '", part, "'");
  };
  const triattn::cuda::window_query_batch no_rows{nullptr, nullptr, 0};
  expect_error(triattn::cuda::snapkv_score(nullptr, bytes, batch, no_rows, snapkv_config{}, nullptr, nullptr, nullptr),
               "query rows 0");
  const triattn::cuda::window_query_batch rows{nullptr, nullptr, 2};
  snapkv_config per_head;
  per_head.grouping = triattn::snapkv_grouping::per_q_head;
  expect_error(triattn::cuda::snapkv_score(nullptr, bytes, batch, rows, per_head, nullptr, nullptr, nullptr),
               "per_q_head");
  rkv_config bad_lambda;
  bad_lambda.lambda = 2.0f;
  expect_error(triattn::cuda::rkv_score(nullptr, bytes, batch, rows, bad_lambda, nullptr, nullptr, nullptr),
               "lambda 2 must be in [0, 1]");
  expect_error(triattn::cuda::plan_round(nullptr, bytes, batch, triattn::cuda::rkv_scorer{rkv_config{}, rows},
                                         triattn::round_options{}, {}, {nullptr, nullptr, 0}, nullptr, nullptr),
               "stride 0");
  batch.geometry.keys = triattn::key_state::pre_rope;
  expect_error(triattn::cuda::snapkv_score(nullptr, bytes, batch, rows, snapkv_config{}, nullptr, nullptr, nullptr),
               "SnapKV on the GPU needs post-RoPE keys: the batch's key_state is pre_rope");
  expect_error(triattn::cuda::rkv_score(nullptr, bytes, batch, rows, rkv_config{}, nullptr, nullptr, nullptr),
               "R-KV on the GPU needs post-RoPE keys");
  batch.geometry.keys = triattn::key_state::post_rope;
  std::size_t small = 1;
  void* not_null = reinterpret_cast<void*>(std::uintptr_t{256});
  expect_error(triattn::cuda::rkv_score(not_null, small, batch, rows, rkv_config{}, nullptr, nullptr, nullptr),
               "workspace holds 1 bytes");
}

}  // namespace
