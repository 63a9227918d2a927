// GPU selection and compaction against the CPU's select_keep and compact: random and
// adversarial scores (ties, NaN, +-0, +-inf, protected slots, budgets 1 and >= n), every
// layout and dtype, batches of sequences, per-slot state, and plans that must move nothing.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/reference.hpp"
#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/select.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

/// Scores drawn to collide: a few distinct values, NaN, signed zeros and infinities.
float adversarial_score(std::mt19937_64& g) {
  static constexpr float pool[] = {1.0f, -1.0f, 0.5f, 0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::uniform_int_distribution<int> pick(0, 9);
  const int i = pick(g);
  if (i < 8) return pool[i];
  return std::normal_distribution<float>(0.0f, 1.0f)(g);
}

/// The GPU keep sets of `count` segments, as rows.
cpu::keep_rows gpu_select(const std::vector<float>& scores, const std::vector<std::int32_t>& lengths,
                          const std::vector<std::int32_t>& positions, std::int64_t capacity,
                          const triattn::protection& prot, std::int32_t budget) {
  const int count = static_cast<int>(lengths.size());
  device_buffer<float> d_scores(scores);
  device_buffer<std::int32_t> d_lengths(lengths), d_positions(positions);
  device_buffer<std::int32_t> keep(static_cast<std::size_t>(count) * budget), kept(static_cast<std::size_t>(count));
  const triattn::cuda::select_segments seg{d_scores.get(), d_lengths.get(), d_positions.get(), count, capacity};
  std::size_t bytes = 0;
  CUDA_REQUIRE(triattn::cuda::select_keep(nullptr, bytes, seg, prot, budget, keep.get(), kept.get(), nullptr));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(triattn::cuda::select_keep(ws.get(), bytes, seg, prot, budget, keep.get(), kept.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const auto k = keep.download();
  const auto n = kept.download();
  cpu::keep_rows out;
  for (int s = 0; s < count; ++s)
    out.emplace_back(k.begin() + static_cast<std::ptrdiff_t>(s) * budget,
                     k.begin() + static_cast<std::ptrdiff_t>(s) * budget + n[static_cast<std::size_t>(s)]);
  return out;
}

TRIATTN_CUDA_TEST("select_keep equals the CPU's on random and adversarial rows") {
  auto g = triattn_test::rng(1);
  for (int trial = 0; trial < 60; ++trial) {
    std::uniform_int_distribution<int> segs(1, 12);
    std::uniform_int_distribution<std::int64_t> cap(1, 700);
    const int count = segs(g);
    const std::int64_t capacity = cap(g);
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(count));
    for (auto& n : lengths) n = static_cast<std::int32_t>(std::uniform_int_distribution<std::int64_t>(0, capacity)(g));
    std::vector<float> scores(static_cast<std::size_t>(count * capacity));
    const bool adversarial = trial % 2 == 0;
    for (auto& x : scores) x = adversarial ? adversarial_score(g) : std::normal_distribution<float>(0.0f, 3.0f)(g);
    std::vector<std::int32_t> positions(scores.size());
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % capacity) * 2;
    std::uniform_int_distribution<std::int64_t> small(0, 8);
    const triattn::protection prot{small(g), small(g), trial % 3 == 0 ? small(g) * 3 : 0};
    const std::int32_t budget = trial % 5 == 0 ? 1 : static_cast<std::int32_t>(cap(g));
    INFO_SCOPE("trial ", trial, ": ", count, " segments of capacity ", capacity, ", budget ", budget, ", protect ",
               prot.first, "/", prot.last, "/", prot.prompt_length);
    const cpu::keep_rows gpu = gpu_select(scores, lengths, positions, capacity, prot, budget);
    for (int s = 0; s < count; ++s) {
      const auto at = static_cast<std::ptrdiff_t>(s * capacity);
      const std::size_t n = static_cast<std::size_t>(lengths[static_cast<std::size_t>(s)]);
      const std::vector<float> row(scores.begin() + at, scores.begin() + at + static_cast<std::ptrdiff_t>(n));
      const std::vector<std::int32_t> pos(positions.begin() + at, positions.begin() + at + static_cast<std::ptrdiff_t>(n));
      const auto expected = cpu::select_keep(row, pos, prot, budget);
      CHECK(gpu[static_cast<std::size_t>(s)] == expected, "segment ", s, " of length ", n);
    }
  }
}

TRIATTN_CUDA_TEST("select_keep rejects a bad budget on the host, naming it") {
  std::size_t bytes = 0;
  const triattn::cuda::select_segments seg{nullptr, nullptr, nullptr, 1, 8};
  const cudaError_t err = triattn::cuda::select_keep(nullptr, bytes, seg, {}, 0, nullptr, nullptr, nullptr);
  CHECK(err == cudaErrorInvalidValue);
  CHECK(triattn::cuda::last_error_message().find("budget 0") != std::string::npos, triattn::cuda::last_error_message());
}

/// Random keep rows for every (layer, kv_head) of every cache: ascending subsets of [0, length).
std::vector<cpu::keep_rows> random_plans(std::vector<triattn_test::test_cache>& caches, std::mt19937_64& g) {
  std::vector<cpu::keep_rows> plans;
  for (auto& c : caches) {
    cpu::keep_rows rows;
    for (int l = 0; l < c.shape().num_layers; ++l)
      for (int h = 0; h < c.shape().num_kv_heads; ++h) {
        std::vector<std::int32_t> row;
        const double p = std::uniform_real_distribution<double>(0.0, 1.0)(g);
        for (std::int32_t s = 0; s < c.length(l, h); ++s)
          if (std::bernoulli_distribution(p)(g)) row.push_back(s);
        rows.push_back(row);
      }
    plans.push_back(rows);
  }
  return plans;
}

/// The plans in the device layout of `device_keep_plan`, with a stride of `capacity`.
struct device_plan {
  device_buffer<std::int32_t> keep, kept;
  std::int32_t stride;
  device_plan(const std::vector<cpu::keep_rows>& plans, std::int64_t capacity)
      : stride(static_cast<std::int32_t>(capacity < 1 ? 1 : capacity)) {
    std::vector<std::int32_t> k, n;
    for (const auto& rows : plans)
      for (const auto& row : rows) {
        n.push_back(static_cast<std::int32_t>(row.size()));
        std::vector<std::int32_t> padded(static_cast<std::size_t>(stride), -1);
        std::copy(row.begin(), row.end(), padded.begin());
        k.insert(k.end(), padded.begin(), padded.end());
      }
    keep = device_buffer<std::int32_t>(k);
    kept = device_buffer<std::int32_t>(n);
  }
  triattn::cuda::device_keep_plan get() const { return {keep.get(), kept.get(), stride}; }
};

template <class V>
void compact_case(const triattn_test::cache_shape& shape, int batch, std::mt19937_64& g) {
  INFO_SCOPE(shape.describe(), " batch ", batch);
  std::vector<triattn_test::test_cache> caches;
  caches.reserve(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) caches.emplace_back(shape, g);
  const device_batch<V> dev(caches);
  const auto plans = random_plans(caches, g);
  const device_plan plan(plans, shape.capacity);

  // Per-slot state, as H2O keeps it: float sums [B, L, q_heads, cap] and int counts [B, L, kv_heads, cap].
  const int L = shape.num_layers, H = shape.num_kv_heads, G = shape.group;
  const std::int64_t cap = shape.capacity;
  const std::int64_t sum_seq = std::int64_t{L} * H * G * cap, count_seq = std::int64_t{L} * H * cap;
  std::vector<float> sums = triattn_test::normal_floats(g, static_cast<std::size_t>(batch * sum_seq));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(batch * count_seq));
  for (auto& c : counts) c = std::uniform_int_distribution<std::int32_t>(0, 1000)(g);
  device_buffer<float> d_sums(sums);
  device_buffer<std::int32_t> d_counts(counts);
  triattn::cuda::device_slot_states states;
  states.items[0] = triattn::make_slot_state(d_sums.get(), H, G, cap);
  states.items[1] = triattn::make_slot_state(d_counts.get(), H, 1, cap);
  states.sequence_stride[0] = sum_seq;
  states.sequence_stride[1] = count_seq;
  states.count = 2;

  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  CUDA_REQUIRE(triattn::cuda::compact(dev.batch(), plan.get(), states, status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(status.download()[0] == 0, "status ", status.download()[0]);

  for (int b = 0; b < batch; ++b) {
    auto& c = caches[static_cast<std::size_t>(b)];
    const triattn::slot_state host_states[] = {triattn::make_slot_state(sums.data() + b * sum_seq, H, G, cap),
                                               triattn::make_slot_state(counts.data() + b * count_seq, H, 1, cap)};
    cpu::compact(c, plans[static_cast<std::size_t>(b)], host_states);
    CHECK(dev.mirror(static_cast<std::size_t>(b)).download() == c.snapshot(), "cache of sequence ", b);
  }
  CHECK(d_sums.download() == sums, "H2O-like sums");
  CHECK(d_counts.download() == counts, "H2O-like counts");
}

/// A plan with a descending row, or a status word already set, moves nothing.
template <class V>
void untouched_case(const triattn_test::cache_shape& shape, std::mt19937_64& g, bool bad_plan) {
  INFO_SCOPE(shape.describe(), bad_plan ? " descending keep row" : " status already failed");
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  auto& c = caches.front();
  c.length(0, 0) = static_cast<std::int32_t>(shape.capacity);
  const device_batch<V> dev(caches);
  auto plans = random_plans(caches, g);
  plans[0][0] = {0, 2, 1};
  const device_plan plan(plans, shape.capacity);
  const std::int32_t initial = bad_plan ? 0 : static_cast<std::int32_t>(triattn::cuda::round_status::non_finite_key);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{initial});
  const triattn_test::cache_bytes before = c.snapshot();
  CUDA_REQUIRE(triattn::cuda::compact(dev.batch(), plan.get(), {}, status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const auto expected = bad_plan ? triattn::cuda::round_status::bad_keep : triattn::cuda::round_status::non_finite_key;
  CHECK(status.download()[0] == static_cast<std::int32_t>(expected), "status ", status.download()[0]);
  CHECK(dev.mirror(0).download() == before, "the cache changed");
}

TRIATTN_CUDA_TEST("compact equals the CPU's in place, for every layout, dtype and GQA group, with state") {
  auto g = triattn_test::rng(2);
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : triattn_test::all_dtypes)
      for (const int group : {1, 2, 4})
        for (int trial = 0; trial < 3; ++trial) {
          triattn_test::cache_shape shape = triattn_test::random_shape(g, layout, type, 1 + trial * 3, group);
          shape.head_dim = trial == 0 ? 128 : shape.head_dim;  // 16-byte units and the 2/4/8-byte fallbacks
          shape.capacity = trial == 0 ? 300 : shape.capacity;
          const int batch = 1 + trial;
          if (triattn_test::is_paged(layout))
            compact_case<triattn::paged_kv_view>(shape, batch, g);
          else
            compact_case<triattn::dense_kv_view>(shape, batch, g);
        }
}

TRIATTN_CUDA_TEST("compact moves nothing for a bad plan or a failed round") {
  auto g = triattn_test::rng(3);
  for (const bool bad_plan : {true, false}) {
    triattn_test::cache_shape shape = triattn_test::random_shape(g, cache_layout::paged_hnd, triattn::dtype::bf16, 4);
    shape.capacity = 16;
    untouched_case<triattn::paged_kv_view>(shape, g, bad_plan);
    shape.layout = cache_layout::dense_nhd;
    untouched_case<triattn::dense_kv_view>(shape, g, bad_plan);
  }
}

TRIATTN_CUDA_TEST("compact moves nothing when a row is not aligned to its 16-byte unit") {
  auto g = triattn_test::rng(4);
  triattn_test::cache_shape shape = triattn_test::random_shape(g, cache_layout::dense_nhd, triattn::dtype::bf16, 4);
  shape.head_dim = 8;  // 16-byte rows: compact moves them as uint4
  shape.capacity = 16;
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  caches.front().length(0, 0) = 16;
  const device_batch<triattn::dense_kv_view> dev(caches);
  // The same cache seen 2 bytes (one element) past each layer's base: every row misaligned.
  triattn::dense_kv_view view = dev.mirror(0).dense_view();
  std::vector<std::byte*> k_layers(static_cast<std::size_t>(shape.num_layers));
  CUDA_REQUIRE(cudaMemcpy(k_layers.data(), view.k_layers, k_layers.size() * sizeof(std::byte*), cudaMemcpyDeviceToHost));
  for (auto& p : k_layers) p += 2;
  device_buffer<std::byte*> shifted(k_layers);
  view.k_layers = shifted.get();
  device_buffer<triattn::dense_kv_view> views(std::vector<triattn::dense_kv_view>{view});
  const triattn::cuda::view_batch<triattn::dense_kv_view> batch{views.get(), 1, dev.batch().geometry, shape.capacity};
  auto plans = random_plans(caches, g);
  plans[0][0] = {1, 3, 5};
  const device_plan plan(plans, shape.capacity);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  const triattn_test::cache_bytes before = dev.mirror(0).download();
  CUDA_REQUIRE(triattn::cuda::compact(batch, plan.get(), {}, status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(status.download()[0] == static_cast<std::int32_t>(triattn::cuda::round_status::misaligned_rows),
        "status ", status.download()[0]);
  CHECK(dev.mirror(0).download() == before, "the cache changed");
}

}  // namespace
