// TriAttention and StreamingLLM on the GPU against the CPU policies: raw scores of every
// (sequence, layer, q_head) within 1e-5 of the row's largest |score|, fp8 caches with a scale
// included; `plan_round` keep plans identical
// wherever the double-precision oracle's decision is not a near-tie, exact ties included;
// whole rounds (plan + compact) byte-identical to the CPU's compress; non-finite keys and bad
// arguments rejected with the cache untouched.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/gpu_plan.cuh"
#include "cuda/reference.hpp"
#include "support/random.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/streaming_llm.cuh"
#include "triattn/cuda/triattention.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn::triattention_config;
using triattn_test::cache_layout;

/// Everything one TriAttention case needs: host caches, their device batch, the stats on both
/// sides and each sequence's round start.
template <class V>
struct tri_case {
  std::vector<triattn_test::test_cache> caches;
  triattn::query_stats stats;
  device_buffer<float> stats_buffer;
  triattn::cuda::triattention_device_stats device_stats{};
  std::vector<std::int64_t> round_starts;
  device_buffer<std::int64_t> d_round_starts;

  tri_case(const triattn_test::cache_shape& shape, int batch, bool same_slots_every_layer, std::mt19937_64& g) {
    caches.reserve(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      caches.emplace_back(shape, g);
      auto& c = caches.back();
      for (int l = 1; l < shape.num_layers && same_slots_every_layer; ++l)  // per_kv_head needs this
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          c.length(l, h) = c.length(0, h);
          for (std::int64_t s = 0; s < shape.capacity; ++s) c.position(l, h, s) = c.position(0, h, s);
        }
      std::int32_t last = 0;
      for (const std::int32_t p : c.positions) last = std::max(last, p);
      round_starts.push_back(last + 1 + std::uniform_int_distribution<std::int64_t>(0, 1000)(g));
    }
    stats = triattn_test::ref::tri_random_stats(g, caches.front().geometry());
    stats_buffer = device_buffer<float>(triattn::cuda::stats_floats(stats));
    CUDA_REQUIRE(triattn::cuda::upload_stats(stats, stats_buffer.get(), nullptr, device_stats));
    d_round_starts = device_buffer<std::int64_t>(round_starts);
  }
};

/// Every element type of the CUDA path; fp8 caches get a per-tensor scale other than 1.
constexpr triattn::dtype gpu_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                         triattn::dtype::fp8_e4m3, triattn::dtype::fp8_e5m2};
bool is_fp8(triattn::dtype t) { return t == triattn::dtype::fp8_e4m3 || t == triattn::dtype::fp8_e5m2; }

/// A random TriAttention shape: every layout and dtype, GQA group, pairing, key state.
triattn_test::cache_shape tri_shape(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int group,
                                    triattn::rope_style style, triattn::key_state keys, int head_dim) {
  triattn_test::cache_shape s = triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 8), group);
  s.head_dim = head_dim;
  s.capacity = std::uniform_int_distribution<std::int64_t>(1, 200)(g);
  s.keys = keys;
  s.rope.style = style;
  s.rope.theta = keys == triattn::key_state::pre_rope ? 1e6 : 1e4;
  if (is_fp8(type)) s.k_scale = 0.25f, s.v_scale = 2.0f;
  return s;
}

template <class V>
void score_case(const triattn_test::cache_shape& shape, int batch, const triattention_config& cfg, std::mt19937_64& g) {
  INFO_SCOPE(shape.describe(), " batch ", batch, cfg.aggregation == triattn::offset_aggregation::max ? " max" : " mean",
             " offset_max ", cfg.offset_max, shape.keys == triattn::key_state::pre_rope ? " pre-RoPE" : " post-RoPE",
             shape.rope.style == triattn::rope_style::half ? " half" : " interleaved");
  tri_case<V> tc(shape, batch, false, g);
  const device_batch<V> dev(tc.caches);
  const triattn::kv_geometry geo = tc.caches.front().geometry();
  const std::size_t per_seq = static_cast<std::size_t>(geo.num_layers) * geo.num_q_heads * shape.capacity;
  device_buffer<float> scores(std::vector<float>(per_seq * static_cast<std::size_t>(batch), 0.0f));
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  std::size_t bytes = 0;
  CUDA_REQUIRE(triattn::cuda::triattention_score(nullptr, bytes, dev.batch(), tc.device_stats, cfg,
                                                 tc.d_round_starts.get(), scores.get(), status.get(), nullptr));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(triattn::cuda::triattention_score(ws.get(), bytes, dev.batch(), tc.device_stats, cfg,
                                                 tc.d_round_starts.get(), scores.get(), status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(status.download()[0] == 0);
  const std::vector<float> gpu = scores.download();
  for (int b = 0; b < batch; ++b) {
    auto& c = tc.caches[static_cast<std::size_t>(b)];
    const std::vector<float> cpu_scores =
        cpu::triattention_scores(c, tc.stats, cfg, tc.round_starts[static_cast<std::size_t>(b)]);
    for (int l = 0; l < geo.num_layers; ++l)
      for (int qh = 0; qh < geo.num_q_heads; ++qh) {
        const std::size_t row = (static_cast<std::size_t>(l) * geo.num_q_heads + qh) * shape.capacity;
        const std::int32_t n = c.length(l, qh / shape.group);
        double scale = 1e-30, worst = 0.0;
        for (std::int32_t s = 0; s < n; ++s) scale = std::max(scale, std::abs(static_cast<double>(cpu_scores[row + s])));
        for (std::int32_t s = 0; s < n; ++s)
          worst = std::max(worst, std::abs(static_cast<double>(gpu[b * per_seq + row + s]) - cpu_scores[row + s]));
        CHECK(worst <= 1e-5 * scale, "sequence ", b, " layer ", l, " q_head ", qh, ": |gpu - cpu| ", worst,
              " vs row max ", scale);
      }
  }
}

TRIATTN_CUDA_TEST("triattention_score equals the CPU scorer on every layout, dtype (fp8 with scale), group, pairing and key state") {
  auto g = triattn_test::rng(11);
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : gpu_dtypes)
      for (const int group : {1, 2, 4}) {
        const auto style = g() % 2 ? triattn::rope_style::half : triattn::rope_style::interleaved;
        const auto keys = g() % 2 ? triattn::key_state::post_rope : triattn::key_state::pre_rope;
        const int head_dim = std::vector<int>{8, 64, 128, 256}[g() % 4];
        triattention_config cfg;
        if (g() % 3 == 0) cfg.aggregation = triattn::offset_aggregation::max;
        cfg.offset_max = g() % 2 ? 65536 : 128;
        const auto shape = tri_shape(g, layout, type, group, style, keys, head_dim);
        const int batch = 1 + static_cast<int>(g() % 3);
        if (triattn_test::is_paged(layout))
          score_case<triattn::paged_kv_view>(shape, batch, cfg, g);
        else
          score_case<triattn::dense_kv_view>(shape, batch, cfg, g);
      }
}

/// A GPU TriAttention round of `dev`: plan, then compact.
template <class V>
gpu_plan run_gpu_round(const device_batch<V>& dev, const tri_case<V>& tc, const triattention_config& cfg,
                       std::int64_t prompt_length, std::int32_t budget) {
  return run_plan(dev.batch(), triattn::cuda::triattention_scorer{tc.device_stats, cfg}, cfg.round,
                  tc.d_round_starts.get(), prompt_length, budget, /*compact=*/true);
}

/// Runs a GPU plan, then compact, and the CPU plan + compact on the host caches; checks the
/// keep sets and the caches wherever the oracle decides clearly. Returns how many sequences
/// were decisive.
template <class V>
int plan_case(const triattn_test::cache_shape& shape, int batch, const triattention_config& cfg,
              std::int64_t prompt_length, std::int32_t budget, bool duplicate_keys, std::mt19937_64& g) {
  INFO_SCOPE(shape.describe(), " batch ", batch, " budget ", budget, " ", triattn::granularity_name(cfg.round.grain),
             cfg.normalize ? " z-scored" : " raw", " window ", cfg.window, " prompt ", prompt_length,
             duplicate_keys ? " duplicated keys" : "");
  tri_case<V> tc(shape, batch, cfg.round.grain != triattn::granularity::per_layer, g);
  if (duplicate_keys)  // exact ties: slot s copies slot s - 1 in every layer, so the scores tie everywhere
    for (auto& c : tc.caches)
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h)
          for (std::int32_t s = 1; s < c.length(l, h); s += 2) c.store_key(l, h, s, c.key(l, h, s - 1));
  const device_batch<V> dev(tc.caches);
  const gpu_plan gpu = run_gpu_round(dev, tc, cfg, prompt_length, budget);
  CHECK(gpu.status == 0);
  int decisive = 0;
  for (int b = 0; b < batch; ++b) {
    auto& c = tc.caches[static_cast<std::size_t>(b)];
    const std::int64_t r = tc.round_starts[static_cast<std::size_t>(b)];
    const double margin = cpu::triattention_margin(c, tc.stats, cfg, r, prompt_length, budget);
    if (margin <= (cfg.normalize ? 2e-4 : 2e-5)) continue;  // a near-tie two fp32 scorers may cut differently
    ++decisive;
    const cpu::keep_rows expected = cpu::triattention_plan(c, tc.stats, cfg, r, prompt_length, budget);
    for (std::size_t row = 0; row < expected.size(); ++row)
      CHECK(gpu.row(static_cast<std::size_t>(b) * expected.size() + row) == expected[row], "sequence ", b,
            " row (layer x kv_head) ", row);
    cpu::compact(c, expected);
    CHECK(dev.mirror(static_cast<std::size_t>(b)).download() == c.snapshot(), "cache of sequence ", b, " after the round");
  }
  return decisive;
}

TRIATTN_CUDA_TEST("plan_round(triattention_scorer) + compact equal the CPU's round per layer and per KV head, ties included") {
  auto g = triattn_test::rng(12);
  int cases = 0, decisive = 0;
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : triattn_test::all_dtypes)
      for (const int group : {1, 2, 4})
        for (const auto granularity : {triattn::granularity::per_kv_head, triattn::granularity::per_layer}) {
          const bool ties = g() % 3 == 0;
          const auto keys = ties ? triattn::key_state::post_rope : triattn::key_state::pre_rope;
          const auto shape = tri_shape(g, layout, type, group, triattn::rope_style::half, keys, g() % 2 ? 64 : 128);
          triattention_config cfg;
          cfg.round.grain = granularity;
          cfg.normalize = g() % 4 != 0;
          cfg.gqa_reduction = g() % 2 ? triattn::triattention_gqa_reduction::max : triattn::triattention_gqa_reduction::mean;
          cfg.window = static_cast<std::int64_t>(g() % 8);
          const std::int64_t prompt_length = g() % 2 ? static_cast<std::int64_t>(g() % 60) : 0;
          const std::int32_t budget = std::vector<std::int32_t>{1, 7, 64, 500}[g() % 4];
          const int batch = 1 + static_cast<int>(g() % 3);
          cases += batch;
          decisive += triattn_test::is_paged(layout)
                          ? plan_case<triattn::paged_kv_view>(shape, batch, cfg, prompt_length, budget, ties, g)
                          : plan_case<triattn::dense_kv_view>(shape, batch, cfg, prompt_length, budget, ties, g);
        }
  CHECK(decisive * 10 >= cases * 8, decisive, " of ", cases, " sequences were decisive: too few to mean anything");
}

TRIATTN_CUDA_TEST("a non-finite key fails the round on the device and compact moves nothing") {
  auto g = triattn_test::rng(13);
  auto shape = tri_shape(g, cache_layout::paged_nhd, triattn::dtype::bf16, 2, triattn::rope_style::half,
                         triattn::key_state::post_rope, 64);
  shape.capacity = 40;
  tri_case<triattn::paged_kv_view> tc(shape, 1, true, g);
  auto& c = tc.caches.front();
  for (int h = 0; h < shape.num_kv_heads; ++h) c.length(0, h) = 40;
  std::vector<double> bad = c.key(0, 0, 3);
  bad[5] = std::nan("");
  c.store_key(0, 0, 3, bad);
  const triattn_test::cache_bytes before = c.snapshot();
  const device_batch<triattn::paged_kv_view> dev(tc.caches);
  triattention_config cfg;
  cfg.round.grain = triattn::granularity::per_layer;
  const gpu_plan gpu = run_gpu_round(dev, tc, cfg, 0, 8);
  CHECK(gpu.status == static_cast<std::int32_t>(triattn::cuda::round_status::non_finite_key));
  CHECK(dev.mirror(0).download() == before, "the cache changed");
}

TRIATTN_CUDA_TEST("triattention calls reject bad arguments on the host, naming the value") {
  auto g = triattn_test::rng(14);
  const auto shape = tri_shape(g, cache_layout::dense_nhd, triattn::dtype::f16, 2, triattn::rope_style::half,
                               triattn::key_state::post_rope, 64);
  tri_case<triattn::dense_kv_view> tc(shape, 1, true, g);
  const device_batch<triattn::dense_kv_view> dev(tc.caches);
  std::size_t bytes = 0;
  const auto expect_rejected = [&](cudaError_t err, const std::string& needle) {
    CHECK(err == cudaErrorInvalidValue, cudaGetErrorString(err));
    CHECK(triattn::cuda::last_error_message().find(needle) != std::string::npos, triattn::cuda::last_error_message());
  };
  triattention_config cfg;
  const triattn::cuda::triattention_scorer scorer{tc.device_stats, cfg};
  device_buffer<std::int32_t> budgets(std::vector<std::int32_t>{4}), status(std::vector<std::int32_t>{0});
  expect_rejected(triattn::cuda::plan_round(nullptr, bytes, dev.batch(), scorer, cfg.round, {budgets.get()},
                                            {nullptr, nullptr, 0}, status.get(), nullptr),
                  "stride 0");
  auto wrong = tc.device_stats;
  wrong.num_q_heads *= 2;
  expect_rejected(triattn::cuda::triattention_score(nullptr, bytes, dev.batch(), wrong, cfg, nullptr, nullptr, nullptr,
                                                    nullptr),
                  std::to_string(wrong.num_q_heads) + " q_heads");
  const std::size_t rows = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads;
  device_buffer<std::int32_t> keep(rows * 4), kept(rows);
  const triattn::cuda::device_keep_plan plan{keep.get(), kept.get(), 4};
  CUDA_REQUIRE(triattn::cuda::plan_round(nullptr, bytes, dev.batch(), scorer, cfg.round, {budgets.get()}, plan,
                                         status.get(), nullptr));
  device_buffer<std::byte> ws(bytes);
  expect_rejected(triattn::cuda::plan_round(ws.get(), bytes, dev.batch(), scorer, cfg.round, {budgets.get()}, plan,
                                            status.get(), nullptr),
                  "round_starts is null");
  std::size_t small = 1;
  device_buffer<std::byte> one(1);
  cfg = {};
  expect_rejected(triattn::cuda::triattention_score(one.get(), small, dev.batch(), tc.device_stats, cfg, nullptr,
                                                    nullptr, nullptr, nullptr),
                  "workspace holds 1 bytes");
}

template <class V>
void streaming_case(const triattn_test::cache_shape& shape, int batch, std::int64_t sinks, std::int32_t budget,
                    std::mt19937_64& g) {
  INFO_SCOPE(shape.describe(), " batch ", batch, " sinks ", sinks, " budget ", budget);
  std::vector<triattn_test::test_cache> caches;
  caches.reserve(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) caches.emplace_back(shape, g);
  const device_batch<V> dev(caches);
  const gpu_plan gpu = run_plan(dev.batch(), triattn::cuda::streaming_llm_scorer{sinks},
                                triattn::streaming_llm_config{}.round, nullptr, 0, budget, /*compact=*/true);
  CHECK(gpu.status == 0);
  for (int b = 0; b < batch; ++b) {
    auto& c = caches[static_cast<std::size_t>(b)];
    const cpu::keep_rows expected = cpu::streaming_plan(c, sinks, budget);
    for (std::size_t row = 0; row < expected.size(); ++row)
      CHECK(gpu.row(static_cast<std::size_t>(b) * expected.size() + row) == expected[row], "sequence ", b,
            " row ", row);
    cpu::compact(c, expected);
    CHECK(dev.mirror(static_cast<std::size_t>(b)).download() == c.snapshot(), "cache of sequence ", b);
  }
}

TRIATTN_CUDA_TEST("plan_round(streaming_llm_scorer) + compact equal the CPU's round") {
  auto g = triattn_test::rng(15);
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : triattn_test::all_dtypes)
      for (const int group : {1, 2, 4}) {
        const auto shape = triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 6), group);
        const std::int64_t sinks = static_cast<std::int64_t>(g() % 6);
        const auto budget = static_cast<std::int32_t>(1 + g() % 45);
        const int batch = 1 + static_cast<int>(g() % 3);
        if (triattn_test::is_paged(layout))
          streaming_case<triattn::paged_kv_view>(shape, batch, sinks, budget, g);
        else
          streaming_case<triattn::dense_kv_view>(shape, batch, sinks, budget, g);
      }
}

}  // namespace
