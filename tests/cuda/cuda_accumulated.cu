// H2O and VATP on the GPU against the oracles of reference_accumulated.cpp: accumulation bit
// for bit, scores within a tolerance, keep sets identical (except at a near-tie of random
// scores; always with exact ties), then a whole round (compact with the state, clear past the
// lengths, accumulate again), on every layout and dtype, GQA groups 1, 2 and 4, batches of 1
// to 3 sequences. Plus non-finite values, a split of nothing, and host argument errors.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/reference.hpp"
#include "cuda/reference_accumulated.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/views.hpp"
#include "triattn/cuda/accumulated.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/compact.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

constexpr triattn::gqa_aggregation all_aggregations[] = {triattn::gqa_aggregation::mean, triattn::gqa_aggregation::max,
                                                         triattn::gqa_aggregation::sum};
constexpr double score_tolerance = 5e-5;   // relative: float combining and a float L1 norm of <= 128 elements
constexpr double tie_tolerance = 2e-4;     // a cut closer than this may fall either way in float

/// What one case varies besides the shape.
struct case_options {
  triattn::cuda::accumulated_scoring scoring;
  bool exact_ties = false;  ///< probabilities k/256, weights powers of two, values +-1: exact, tied sums
  std::int64_t budget = 1;
  std::int64_t sinks = 0;
  std::optional<std::int64_t> heavy, recent;
};

/// The probability rows of one step for a batch: [batch, layers, q_heads, capacity], each row
/// over the slots below its length; NaN past it, which a kernel reading there would spread.
std::vector<float> random_probs(std::vector<triattn_test::test_cache>& caches, bool exact, std::mt19937_64& g) {
  const triattn_test::cache_shape& s = caches.front().shape();
  const int Hq = s.num_kv_heads * s.group;
  std::vector<float> out;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> k(1, 2);
  for (auto& c : caches)
    for (int l = 0; l < s.num_layers; ++l)
      for (int qh = 0; qh < Hq; ++qh) {
        const std::int32_t n = c.length(l, qh / s.group);
        std::vector<float> row(static_cast<std::size_t>(s.capacity), std::nanf(""));
        const auto valid = row.begin() + n;
        float total = 0.0f;
        for (auto p = row.begin(); p != valid; ++p) total += *p = exact ? static_cast<float>(k(g)) / 256.0f : u(g);
        if (!exact)
          for (auto p = row.begin(); p != valid; ++p) *p /= total;  // a softmax-like row
        out.insert(out.end(), row.begin(), row.end());
      }
  return out;
}

/// A row weight per sequence: Scissorhands-like fractions (1/3 rounds), 0 (the row is not
/// recorded) and 1; only powers of two with exact ties, so that every sum stays exact.
std::vector<float> random_weights(int batch, bool exact, std::mt19937_64& g) {
  static constexpr float any[] = {1.0f, 1.0f, 0.5f, 0.25f, 0.0f, 1.0f / 3.0f};
  std::uniform_int_distribution<int> pick(0, exact ? 4 : 5);
  std::vector<float> w(static_cast<std::size_t>(batch));
  for (auto& x : w) x = any[pick(g)];
  return w;
}

/// The concatenated oracle state of a batch, in the device layout.
template <class Member>
auto concat(const std::vector<cpu::accumulated_sums>& states, Member member) {
  std::remove_cvref_t<decltype(states.front().*member)> out;
  for (const auto& s : states) out.insert(out.end(), (s.*member).begin(), (s.*member).end());
  return out;
}

/// The device's accumulated state and one step of accumulation on both sides.
struct accumulation {
  std::vector<cpu::accumulated_sums> oracle;
  device_buffer<float> sums;
  device_buffer<std::int32_t> counts;

  explicit accumulation(std::vector<triattn_test::test_cache>& caches) {
    for (const auto& c : caches) oracle.emplace_back(c);
    sums = device_buffer<float>(concat(oracle, &cpu::accumulated_sums::sums));
    counts = device_buffer<std::int32_t>(concat(oracle, &cpu::accumulated_sums::counts));
  }
  triattn::cuda::accumulated_state state() const { return {sums.get(), counts.get()}; }

  template <class V>
  void step(const device_batch<V>& dev, std::vector<triattn_test::test_cache>& caches, bool exact,
            std::mt19937_64& g) {
    const std::vector<float> probs = random_probs(caches, exact, g);
    const std::vector<float> weights = random_weights(static_cast<int>(caches.size()), exact, g);
    const device_buffer<float> d_probs(probs), d_weights(weights);
    const bool unit = std::all_of(weights.begin(), weights.end(), [](float w) { return w == 1.0f; });
    CUDA_REQUIRE(triattn::cuda::accumulate_attention(dev.batch(), d_probs.get(), unit ? nullptr : d_weights.get(),
                                                     state(), nullptr));  // null weights: all 1
    CUDA_REQUIRE(cudaDeviceSynchronize());  // before the rows' buffers go
    const std::size_t per_sequence = probs.size() / caches.size();
    for (std::size_t b = 0; b < caches.size(); ++b)
      cpu::accumulate(caches[b], probs.data() + b * per_sequence, weights[b], oracle[b]);
  }

  /// Sums and counts bit for bit.
  void check() const {
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CHECK(sums.download() == concat(oracle, &cpu::accumulated_sums::sums), "accumulated sums");
    CHECK(counts.download() == concat(oracle, &cpu::accumulated_sums::counts), "row counts");
  }
};

/// Every value row +-1: an L1 norm of exactly head_dim, in every dtype.
void unit_values(triattn_test::test_cache& c, std::mt19937_64& g) {
  const triattn_test::cache_shape& s = c.shape();
  std::bernoulli_distribution sign(0.5);
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_kv_heads; ++h)
      for (std::int64_t j = 0; j < s.capacity; ++j)
        for (int d = 0; d < s.head_dim; ++d)
          triattn_test::ref::store(c.value_row(l, h, j), s.type, static_cast<std::size_t>(d), sign(g) ? 1.0 : -1.0);
}

/// The GPU plan of a batch: the device plan, as `compact` takes it, and its keep rows, one per
/// (sequence, layer, kv_head) in order.
struct gpu_plan {
  std::int32_t stride;
  device_buffer<std::int32_t> keep, kept;
  cpu::keep_rows rows;

  template <class V>
  gpu_plan(const device_batch<V>& dev, const accumulation& acc, const case_options& o, const triattn::h2o_split& split,
           device_buffer<std::int32_t>& status, std::size_t count)
      : stride(split.total() < 1 ? 1 : static_cast<std::int32_t>(split.total())),
        keep(count * static_cast<std::size_t>(stride)),
        kept(count) {
    // The split's counts as the scorer's config; a budget of its total resolves to that split.
    const triattn::cuda::accumulated_scorer scorer{acc.state(), o.scoring, {split.heavy, split.recent, -1.0, -1.0, split.sinks}};
    const device_buffer<std::int32_t> budgets(std::vector<std::int32_t>(static_cast<std::size_t>(dev.batch().size), stride));
    const triattn::cuda::device_keep_plan plan{keep.get(), kept.get(), stride};
    std::size_t bytes = 0;
    CUDA_REQUIRE(triattn::cuda::plan_round(nullptr, bytes, dev.batch(), scorer, triattn::round_options{},
                                           {budgets.get()}, plan, status.get(), nullptr));
    device_buffer<std::byte> ws(bytes);
    CUDA_REQUIRE(triattn::cuda::plan_round(ws.get(), bytes, dev.batch(), scorer, triattn::round_options{},
                                           {budgets.get()}, plan, status.get(), nullptr));
    const std::vector<std::int32_t> k = keep.download(), n = kept.download();
    for (std::size_t r = 0; r < count; ++r)
      rows.emplace_back(k.begin() + static_cast<std::ptrdiff_t>(r * stride),
                        k.begin() + static_cast<std::ptrdiff_t>(r * stride) + n[r]);
  }
  triattn::cuda::device_keep_plan device() const { return {keep.get(), kept.get(), stride}; }
};

/// Accumulate, score, plan, compact with the state, clear, accumulate again: each against the
/// oracle. Returns the rows whose keep set was not compared (a near-tie at the cut).
template <class V>
int round_case(const triattn_test::cache_shape& shape, int batch, const case_options& o, std::mt19937_64& g) {
  const triattn::h2o_split split = triattn::split_budget(o.budget, o.heavy, o.recent, o.sinks);
  INFO_SCOPE(shape.describe(), " batch ", batch, " agg ", triattn::gqa_aggregation_name(o.scoring.gqa), " normalize ",
             o.scoring.normalize, " vatp ", o.scoring.value_weighted, " exact ties ", o.exact_ties, " budget ",
             o.budget, " -> recent ", split.recent, " heavy ", split.heavy, " sinks ", split.sinks);
  std::vector<triattn_test::test_cache> caches;
  caches.reserve(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    caches.emplace_back(shape, g);
    if (o.exact_ties) unit_values(caches.back(), g);
  }
  const device_batch<V> dev(caches);
  accumulation acc(caches);
  const int steps = std::uniform_int_distribution<int>(1, 5)(g);
  for (int t = 0; t < steps; ++t) acc.step(dev, caches, o.exact_ties, g);
  acc.check();

  // Scores, against the oracle's doubles; slots past a length keep the sentinel.
  const std::size_t rows = static_cast<std::size_t>(batch) * shape.num_layers * shape.num_kv_heads;
  const std::size_t cap = static_cast<std::size_t>(shape.capacity);
  constexpr float sentinel = -7.0f;
  device_buffer<float> scores(std::vector<float>(rows * cap, sentinel));
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  CUDA_REQUIRE(
      triattn::cuda::score_accumulated(dev.batch(), acc.state(), o.scoring, scores.get(), status.get(), nullptr));
  const std::vector<float> got = scores.download();
  std::vector<double> want;
  for (std::size_t b = 0; b < caches.size(); ++b) {
    const auto s = cpu::accumulated_scores(caches[b], acc.oracle[b], o.scoring.gqa, o.scoring.normalize,
                                           o.scoring.value_weighted);
    want.insert(want.end(), s.begin(), s.end());
  }
  int bad_scores = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t n = caches[r / (rows / caches.size())].lengths[r % (rows / caches.size())];
    for (std::size_t j = 0; j < cap; ++j) {
      const double x = got[r * cap + j], y = j < static_cast<std::size_t>(n) ? want[r * cap + j] : sentinel;
      if (!(std::fabs(x - y) <= score_tolerance * std::fabs(y) + 1e-30) && bad_scores++ < 5)
        CHECK(false, "score of row ", r, " slot ", j, " (length ", n, "): GPU ", x, ", oracle ", y);
    }
  }
  CHECK(bad_scores == 0, bad_scores, " scores off");

  // Keep sets, from the same state.
  const gpu_plan plan(dev, acc, o, split, status, rows);
  CHECK(status.download()[0] == 0, "status ", status.download()[0], " with finite values");
  int skipped = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t n = caches[r / (rows / caches.size())].lengths[r % (rows / caches.size())];
    const cpu::oracle_keep expected = cpu::accumulated_keep(want.data() + r * cap, n, split, tie_tolerance);
    if (expected.near_tie && !o.exact_ties) {  // exact ties are exact in float too: never skipped
      ++skipped;
      continue;
    }
    CHECK(plan.rows[r] == expected.keep, "keep set of row ", r, " (length ", n, ")");
  }

  // The round goes on: the plan compacts the cache with the state, which is then cleared past
  // the new lengths, on both sides; the next row accumulates onto the moved state.
  CUDA_REQUIRE(triattn::cuda::compact(dev.batch(), plan.device(),
                                      triattn::cuda::accumulated_slot_states(dev.batch(), acc.state()), status.get(),
                                      nullptr));
  CUDA_REQUIRE(triattn::cuda::clear_past_length(dev.batch(), acc.state(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const std::size_t per_sequence = rows / caches.size();
  for (std::size_t b = 0; b < caches.size(); ++b) {
    const cpu::keep_rows mine(plan.rows.begin() + static_cast<std::ptrdiff_t>(b * per_sequence),
                              plan.rows.begin() + static_cast<std::ptrdiff_t>((b + 1) * per_sequence));
    const triattn::slot_state host_states[] = {
        triattn::make_slot_state(acc.oracle[b].sums.data(), shape.num_kv_heads, shape.group, shape.capacity),
        triattn::make_slot_state(acc.oracle[b].counts.data(), shape.num_kv_heads, 1, shape.capacity)};
    cpu::compact(caches[b], mine, host_states);
    cpu::clear_past_length(caches[b], acc.oracle[b]);
    CHECK(dev.mirror(b).download() == caches[b].snapshot(), "cache of sequence ", b, " after the round");
  }
  acc.check();
  acc.step(dev, caches, o.exact_ties, g);
  acc.check();
  return skipped;
}

TRIATTN_CUDA_TEST("H2O and VATP accumulate, score, plan and compact as the oracle: layouts, dtypes, GQA, options") {
  auto g = triattn_test::rng(11);
  int combo = 0, rows = 0, undecided = 0;
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : triattn_test::all_dtypes)
      for (const int group : {1, 2, 4})
        for (int trial = 0; trial < 4; ++trial, ++combo) {
          triattn_test::cache_shape shape = triattn_test::random_shape(g, layout, type, 1 + trial * 2, group);
          if (trial == 1) {  // 16-byte value loads and longer rows
            shape.head_dim = 128;
            shape.capacity = 97;
          }
          case_options o;
          o.scoring.gqa = all_aggregations[(combo + trial) % 3];
          o.scoring.normalize = (trial & 1) != 0;
          o.scoring.value_weighted = ((trial >> 1) & 1) != 0;
          o.exact_ties = combo % 2 == 0;
          std::uniform_int_distribution<std::int64_t> budget(1, shape.capacity), small(0, 4);
          o.budget = trial == 0 ? 1 : trial == 3 ? shape.capacity + 3 : budget(g);
          o.sinks = small(g);
          if (combo % 3 == 1) o.recent = small(g);
          if (combo % 5 == 2) o.heavy = budget(g);
          const int batch = 1 + combo % 3;
          rows += batch * shape.num_layers * shape.num_kv_heads;
          undecided += triattn_test::is_paged(layout) ? round_case<triattn::paged_kv_view>(shape, batch, o, g)
                                                      : round_case<triattn::dense_kv_view>(shape, batch, o, g);
        }
  CHECK(undecided * 20 <= rows, undecided, " of ", rows, " keep sets within a near-tie: the comparison says little");
}

/// One sequence with accumulated rows and a value row of `bad` at (layer 0, kv_head 0, slot 0).
template <class V>
void non_finite_case(float bad, bool ranked, std::mt19937_64& g) {
  triattn_test::cache_shape shape = triattn_test::random_shape(g, cache_layout::paged_nhd, triattn::dtype::bf16, 3, 2);
  shape.capacity = 12;
  INFO_SCOPE(shape.describe(), " value ", bad, ranked ? " in a ranked row" : " in a row kept whole");
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  auto& c = caches.front();
  for (auto& n : c.lengths) n = 10;
  triattn_test::ref::store(c.value_row(0, 0, 0), shape.type, 1, bad);
  const device_batch<V> dev(caches);
  accumulation acc(caches);
  acc.step(dev, caches, false, g);
  case_options o;
  o.scoring.value_weighted = true;
  const triattn::h2o_split split = triattn::split_budget(ranked ? 4 : 10, std::nullopt, std::nullopt, 0);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  const std::size_t rows = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads;
  const gpu_plan plan(dev, acc, o, split, status, rows);
  const auto expected = ranked ? triattn::cuda::round_status::non_finite_key : triattn::cuda::round_status::ok;
  CHECK(status.download()[0] == static_cast<std::int32_t>(expected), "status ", status.download()[0]);
  CHECK(plan.rows.front().size() == (ranked ? 4u : 10u), "kept ", plan.rows.front().size());
}

TRIATTN_CUDA_TEST("VATP flags a non-finite value norm in a ranked row only, as the CPU throws") {
  auto g = triattn_test::rng(12);
  for (const float bad : {INFINITY, -INFINITY, NAN})
    for (const bool ranked : {true, false}) non_finite_case<triattn::paged_kv_view>(bad, ranked, g);
}

TRIATTN_CUDA_TEST("a split of no slots keeps nothing, and a null workspace only sizes") {
  auto g = triattn_test::rng(13);
  const auto shape = triattn_test::random_shape(g, cache_layout::dense_hnd, triattn::dtype::f16, 4, 4);
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  caches.emplace_back(shape, g);
  const device_batch<triattn::dense_kv_view> dev(caches);
  accumulation acc(caches);
  acc.step(dev, caches, false, g);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  const std::size_t rows = 2u * static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads;
  const gpu_plan plan(dev, acc, case_options{}, triattn::h2o_split{}, status, rows);
  for (std::size_t r = 0; r < rows; ++r) CHECK(plan.rows[r].empty(), "row ", r, " keeps ", plan.rows[r].size());
  std::size_t bytes = 0;
  CUDA_REQUIRE(triattn::cuda::plan_round(nullptr, bytes, dev.batch(), triattn::cuda::accumulated_scorer{},
                                         triattn::round_options{}, {}, {nullptr, nullptr, 1}, nullptr, nullptr));
  CHECK(bytes > 0, "a null workspace must never be what the call needs");
}

TRIATTN_CUDA_TEST("host argument errors are refused before any launch, naming the value") {
  auto g = triattn_test::rng(14);
  const auto shape = triattn_test::random_shape(g, cache_layout::dense_nhd, triattn::dtype::f32, 4, 2);
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  const device_batch<triattn::dense_kv_view> dev(caches);
  accumulation acc(caches);
  const auto refused = [](cudaError_t err, const char* needle) {
    CHECK(err == cudaErrorInvalidValue, "returned ", cudaGetErrorString(err));
    CHECK(triattn::cuda::last_error_message().find(needle) != std::string::npos, triattn::cuda::last_error_message());
  };
  std::size_t bytes = 0;
  triattn::cuda::accumulated_scorer negative_sinks{acc.state(), {}, {}};
  negative_sinks.split.parts.sinks = -3;
  refused(triattn::cuda::plan_round(nullptr, bytes, dev.batch(), negative_sinks, triattn::round_options{}, {},
                                    {nullptr, nullptr, 1}, nullptr, nullptr),
          "sinks -3");
  refused(triattn::cuda::accumulate_attention(dev.batch(), nullptr, nullptr, acc.state(), nullptr), "probs is null");
  triattn::cuda::accumulated_scoring vatp;
  vatp.value_weighted = true;
  device_buffer<float> scores(static_cast<std::size_t>(shape.num_layers * shape.num_kv_heads * shape.capacity));
  refused(triattn::cuda::score_accumulated(dev.batch(), acc.state(), vatp, scores.get(), nullptr, nullptr),
          "status is null");
  refused(triattn::cuda::clear_past_length(dev.batch(), {nullptr, acc.counts.get()}, nullptr), "state sums");
  auto bad = dev.batch();
  bad.geometry.num_q_heads = 0;
  refused(triattn::cuda::accumulate_attention(bad, acc.sums.get(), nullptr, acc.state(), nullptr), "q_heads");
  acc.check();  // nothing was launched: the state is still zero
}

}  // namespace
