// Expected Attention on the GPU against the CPU policy: scores of every ranked (sequence,
// layer, kv_head) within 1e-4 of the row's largest score on every layout, element type (fp8
// with a scale), GQA group, head_dim and both covariance settings, from each sequence's kept
// window queries and round start; a sequence with no query at or past the sinks sets
// `no_queries` and compact moves nothing; pre-RoPE keys are refused naming the API.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/gpu_plan.cuh"
#include "cuda/reference.hpp"
#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/cuda/expected_attention.cuh"
#include "triattn/cuda/round.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

constexpr triattn::dtype gpu_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                         triattn::dtype::fp8_e4m3, triattn::dtype::fp8_e5m2};

/// A batch's window queries on both sides: [batch, layers, q_heads, rows, head_dim] at
/// positions [batch, rows] from each sequence's round start - rows.
struct queries {
  std::vector<float> host;
  std::vector<std::int32_t> positions;
  device_buffer<float> d_queries;
  device_buffer<std::int32_t> d_positions;
  int rows = 0;
  std::size_t per_sequence = 0;

  queries(const triattn::kv_geometry& g, const std::vector<std::int64_t>& starts, int rows_, std::mt19937_64& gen)
      : rows(rows_) {
    per_sequence = static_cast<std::size_t>(g.num_layers) * g.num_q_heads * rows * g.head_dim;
    host = triattn_test::normal_floats(gen, per_sequence * starts.size());
    for (const std::int64_t s : starts)
      for (int i = 0; i < rows; ++i) positions.push_back(static_cast<std::int32_t>(s - rows + i));
    d_queries = device_buffer<float>(host);
    d_positions = device_buffer<std::int32_t>(positions);
  }
  triattn::cuda::window_query_batch batch() const { return {d_queries.get(), d_positions.get(), rows}; }
  std::span<const float> of(std::size_t b) const { return std::span(host).subspan(b * per_sequence, per_sequence); }
  std::span<const std::int32_t> positions_of(std::size_t b) const {
    return std::span(positions).subspan(b * static_cast<std::size_t>(rows), static_cast<std::size_t>(rows));
  }
};

template <class V>
void score_case(const triattn_test::cache_shape& shape, int batch, const triattn::expected_attention_config& cfg,
                std::mt19937_64& g) {
  INFO_SCOPE(shape.describe(), " batch ", batch, " window ", cfg.window, " future ", cfg.future, " sinks ", cfg.sinks,
             cfg.covariance ? " covariance" : "", cfg.value_norm ? " value_norm" : "");
  std::vector<triattn_test::test_cache> caches;
  std::vector<std::int64_t> starts;
  for (int b = 0; b < batch; ++b) {
    caches.emplace_back(shape, g);
    for (auto& n : caches.back().lengths) n = std::max<std::int32_t>(n, 3);
    starts.push_back(triattn_test::largest_position(caches.back()) + 1 + static_cast<std::int64_t>(g() % 50));
  }
  const int rows = 1 + static_cast<int>(g() % static_cast<unsigned>(cfg.window));
  for (std::int64_t& s : starts) s = std::max<std::int64_t>(s, cfg.sinks + rows);  // every query past the sinks
  const queries q(caches.front().geometry(), starts, rows, g);
  const device_batch<V> dev(caches);
  const device_buffer<std::int64_t> d_starts(starts);
  const auto per_seq = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads * shape.capacity;
  device_buffer<float> copy(std::vector<float>(per_seq * static_cast<std::size_t>(batch), 0.0f));
  const triattn::cuda::expected_attention_scorer scorer{cfg, q.batch()};
  const gpu_plan gpu = run_plan(dev.batch(), recording_scorer<triattn::cuda::expected_attention_scorer>{scorer, copy.get()},
                                triattn::round_options{}, d_starts.get(), 0, 1);
  CHECK(gpu.status == 0, "status ", gpu.status);
  const std::vector<float> got = copy.download();
  for (int b = 0; b < batch; ++b) {
    auto& c = caches[static_cast<std::size_t>(b)];
    const std::vector<float> want = cpu::expected_attention_scores(c, cfg, q.of(static_cast<std::size_t>(b)),
                                                                   q.positions_of(static_cast<std::size_t>(b)), starts[b]);
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        const std::size_t row = (static_cast<std::size_t>(l) * shape.num_kv_heads + h) * shape.capacity;
        double scale = 1e-30, worst = 0.0;
        for (std::int32_t s = static_cast<std::int32_t>(cfg.sinks); s < c.length(l, h); ++s)
          scale = std::max(scale, std::fabs(static_cast<double>(want[row + s])));
        for (std::int32_t s = static_cast<std::int32_t>(cfg.sinks); s < c.length(l, h); ++s)
          worst = std::max(worst, std::fabs(static_cast<double>(got[b * per_seq + row + s]) - want[row + s]));
        CHECK(worst <= 1e-4 * scale + 1e-7, "sequence ", b, " layer ", l, " kv_head ", h, ": |gpu - cpu| ", worst,
              " vs row max ", scale);
      }
  }
}

TRIATTN_CUDA_TEST("expected_attention_scorer equals the CPU policy on every layout, dtype, group and head_dim") {
  auto g = triattn_test::rng(51);
  int cases = 0;
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : gpu_dtypes) {
      auto shape = triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 8), 1 << (g() % 3));
      shape.head_dim = std::vector<int>{2, 8, 64, 128}[g() % 4];
      shape.capacity = std::uniform_int_distribution<std::int64_t>(3, 200)(g);
      shape.rope.style = g() % 2 ? triattn::rope_style::half : triattn::rope_style::interleaved;
      if (type == triattn::dtype::fp8_e4m3 || type == triattn::dtype::fp8_e5m2) shape.k_scale = 0.25f, shape.v_scale = 2.0f;
      triattn::expected_attention_config cfg;
      cfg.window = 1 + static_cast<int>(g() % 16);
      cfg.future = std::vector<std::int64_t>{1, 16, 512}[g() % 3];
      cfg.sinks = static_cast<std::int64_t>(g() % 3);
      cfg.covariance = g() % 2 == 0;
      cfg.value_norm = g() % 3 != 0;
      const int batch = 1 + static_cast<int>(g() % 3);
      if (triattn_test::is_paged(layout))
        score_case<triattn::paged_kv_view>(shape, batch, cfg, g);
      else
        score_case<triattn::dense_kv_view>(shape, batch, cfg, g);
      ++cases;
    }
  CHECK(cases == static_cast<int>(std::size(triattn_test::all_layouts) * std::size(gpu_dtypes)), cases, " cases");
}

TRIATTN_CUDA_TEST("a round with no window query past the sinks sets no_queries and compact moves nothing") {
  auto g = triattn_test::rng(52);
  auto shape = triattn_test::random_shape(g, cache_layout::dense_hnd, triattn::dtype::bf16, 1, 2);
  shape.head_dim = 64;
  shape.capacity = 30;
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  for (auto& n : caches.front().lengths) n = 30;
  const triattn_test::cache_bytes before = caches.front().snapshot();
  triattn::expected_attention_config cfg;
  cfg.sinks = 8;
  const std::vector<std::int64_t> starts{7};  // queries at positions 3..6, all below the sinks
  const queries q(caches.front().geometry(), starts, 4, g);
  const device_batch<triattn::dense_kv_view> dev(caches);
  const device_buffer<std::int64_t> d_starts(starts);
  const gpu_plan gpu = run_plan(dev.batch(), triattn::cuda::expected_attention_scorer{cfg, q.batch()}, {}, d_starts.get(), 0,
                                10, true);
  CHECK(gpu.status == static_cast<std::int32_t>(triattn::cuda::round_status::no_queries), "status ", gpu.status);
  CHECK(dev.mirror(0).download() == before, "the cache changed");
}

TRIATTN_CUDA_TEST("expected_attention_scorer refuses pre-RoPE keys and bad configs, naming the API") {
  auto g = triattn_test::rng(53);
  auto shape = triattn_test::random_shape(g, cache_layout::dense_nhd, triattn::dtype::f16, 1, 1);
  shape.head_dim = 64;
  std::vector<triattn_test::test_cache> caches;
  caches.emplace_back(shape, g);
  const device_batch<triattn::dense_kv_view> dev_post(caches);
  const triattn::cuda::window_query_batch none{nullptr, nullptr, 1};
  std::size_t bytes = 0;
  triattn::expected_attention_config cfg;
  cfg.future = 0;
  cudaError_t err = triattn::cuda::expected_attention_scorer{cfg, none}.score(
      "api::ea", nullptr, bytes, dev_post.batch(), triattn::cuda::device_round{}, nullptr, nullptr, nullptr);
  CHECK(err == cudaErrorInvalidValue && triattn::cuda::last_error_message().find("future 0") != std::string::npos,
        triattn::cuda::last_error_message());
  shape.keys = triattn::key_state::pre_rope;
  std::vector<triattn_test::test_cache> pre;
  pre.emplace_back(shape, g);
  const device_batch<triattn::dense_kv_view> dev_pre(pre);
  err = triattn::cuda::expected_attention_scorer{{}, none}.score("api::ea", nullptr, bytes, dev_pre.batch(),
                                                                 triattn::cuda::device_round{}, nullptr, nullptr, nullptr);
  CHECK(err == cudaErrorInvalidValue, cudaGetErrorString(err));
  const std::string& m = triattn::cuda::last_error_message();
  CHECK(m.find("api::ea") != std::string::npos && m.find("pre_rope") != std::string::npos, m);
}

}  // namespace
