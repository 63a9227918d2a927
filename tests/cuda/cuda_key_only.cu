// K-norm and KeyDiff on the GPU against the CPU policies: scores of every ranked (sequence,
// layer, kv_head) within 1e-5 of the row's largest |score| on every layout, element type (fp8
// with a scale) and head_dim; `plan_round` keep sets equal to the CPU's plan on f32 keys
// (random normal: no near-ties); a non-finite key fails the round with the cache untouched;
// KeyDiff refuses pre-RoPE keys naming the API.
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
#include "support/views.hpp"
#include "triattn/cuda/keydiff.cuh"
#include "triattn/cuda/knorm.cuh"
#include "triattn/cuda/round.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

constexpr triattn::dtype gpu_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                         triattn::dtype::fp8_e4m3, triattn::dtype::fp8_e5m2};

/// `batch` random caches of `shape`, every row at least 3 slots long (ranked at budget 1; two
/// keys tie in KeyDiff's formula, which fp32 rounds apart differently on each side).
std::vector<triattn_test::test_cache> random_caches(const triattn_test::cache_shape& shape, int batch,
                                                    std::mt19937_64& g) {
  std::vector<triattn_test::test_cache> caches;
  for (int b = 0; b < batch; ++b) {
    caches.emplace_back(shape, g);
    for (auto& n : caches.back().lengths) n = std::max<std::int32_t>(n, 3);
  }
  return caches;
}

triattn_test::cache_shape random_key_shape(std::mt19937_64& g, cache_layout layout, triattn::dtype type, int head_dim) {
  auto s = triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 8), 1 << (g() % 3));
  s.head_dim = head_dim;
  s.capacity = std::uniform_int_distribution<std::int64_t>(3, 300)(g);
  if (type == triattn::dtype::fp8_e4m3 || type == triattn::dtype::fp8_e5m2) s.k_scale = 0.25f, s.v_scale = 2.0f;
  return s;
}

/// The GPU scores of `scorer` in a round of budget 1 (every row ranked) against the CPU's.
template <class V, class S>
void score_case(const triattn_test::cache_shape& shape, int batch, const S& scorer, const char* name,
                std::mt19937_64& g) {
  INFO_SCOPE(name, " ", shape.describe(), " batch ", batch);
  std::vector<triattn_test::test_cache> caches = random_caches(shape, batch, g);
  const device_batch<V> dev(caches);
  const auto per_seq = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads * shape.capacity;
  device_buffer<float> copy(std::vector<float>(per_seq * static_cast<std::size_t>(batch), 0.0f));
  const gpu_plan gpu =
      run_plan(dev.batch(), recording_scorer<S>{scorer, copy.get()}, triattn::round_options{}, nullptr, 0, 1);
  CHECK(gpu.status == 0, "status ", gpu.status);
  const std::vector<float> got = copy.download();
  for (int b = 0; b < batch; ++b) {
    auto& c = caches[static_cast<std::size_t>(b)];
    const std::vector<float> want = cpu::key_only_scores(c, name);
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        const std::size_t row = (static_cast<std::size_t>(l) * shape.num_kv_heads + h) * shape.capacity;
        double scale = 1e-30, worst = 0.0;
        for (std::int32_t s = 0; s < c.length(l, h); ++s) scale = std::max(scale, std::fabs(static_cast<double>(want[row + s])));
        for (std::int32_t s = 0; s < c.length(l, h); ++s)
          worst = std::max(worst, std::fabs(static_cast<double>(got[b * per_seq + row + s]) - want[row + s]));
        CHECK(worst <= 1e-5 * scale + 1e-6, "sequence ", b, " layer ", l, " kv_head ", h, ": |gpu - cpu| ", worst,
              " vs row max ", scale);
      }
  }
}

template <class S>
void for_every_case(const S& scorer, const char* name, std::uint64_t seed) {
  auto g = triattn_test::rng(seed);
  int cases = 0;
  for (const cache_layout layout : triattn_test::all_layouts)
    for (const triattn::dtype type : gpu_dtypes) {
      const int head_dim = std::vector<int>{2, 8, 64, 128, 256}[g() % 5];
      const auto shape = random_key_shape(g, layout, type, head_dim);
      const int batch = 1 + static_cast<int>(g() % 3);
      if (triattn_test::is_paged(layout))
        score_case<triattn::paged_kv_view>(shape, batch, scorer, name, g);
      else
        score_case<triattn::dense_kv_view>(shape, batch, scorer, name, g);
      ++cases;
    }
  CHECK(cases == static_cast<int>(std::size(triattn_test::all_layouts) * std::size(gpu_dtypes)), cases, " cases");
}

TRIATTN_CUDA_TEST("knorm_scorer equals the CPU K-norm on every layout, dtype and head_dim") {
  for_every_case(triattn::cuda::knorm_scorer{}, "knorm", 41);
}

TRIATTN_CUDA_TEST("keydiff_scorer equals the CPU KeyDiff on every layout, dtype and head_dim") {
  for_every_case(triattn::cuda::keydiff_scorer{}, "keydiff", 42);
}

TRIATTN_CUDA_TEST("plan_round keeps the CPU's sets for K-norm and KeyDiff on f32 keys") {
  auto g = triattn_test::rng(43);
  for (int i = 0; i < 24; ++i) {
    const cache_layout layout = triattn_test::all_layouts[static_cast<std::size_t>(i) % std::size(triattn_test::all_layouts)];
    const auto shape = random_key_shape(g, layout, triattn::dtype::f32, i % 2 ? 64 : 128);
    const std::int32_t budget = std::vector<std::int32_t>{1, 5, 40, 400}[g() % 4];
    const char* name = i % 2 ? "knorm" : "keydiff";
    INFO_SCOPE(name, " ", shape.describe(), " budget ", budget);
    std::vector<triattn_test::test_cache> caches = random_caches(shape, 1, g);
    const auto run = [&](const auto& dev) {
      return i % 2 ? run_plan(dev.batch(), triattn::cuda::knorm_scorer{}, triattn::round_options{}, nullptr, 0, budget)
                   : run_plan(dev.batch(), triattn::cuda::keydiff_scorer{}, triattn::round_options{}, nullptr, 0, budget);
    };
    const gpu_plan gpu = triattn_test::is_paged(layout) ? run(device_batch<triattn::paged_kv_view>(caches))
                                                        : run(device_batch<triattn::dense_kv_view>(caches));
    CHECK(gpu.status == 0, "status ", gpu.status);
    const cpu::keep_rows want = cpu::key_only_plan(caches.front(), name, budget);
    for (std::size_t r = 0; r < want.size(); ++r) CHECK(gpu.row(r) == want[r], "row (layer x kv_head) ", r);
  }
}

TRIATTN_CUDA_TEST("a non-finite key fails a K-norm or KeyDiff round and compact moves nothing") {
  auto g = triattn_test::rng(44);
  for (const bool keydiff : {false, true}) {
    auto shape = random_key_shape(g, cache_layout::paged_nhd, triattn::dtype::bf16, 64);
    shape.capacity = 40;
    std::vector<triattn_test::test_cache> caches = random_caches(shape, 1, g);
    auto& c = caches.front();
    c.length(0, 0) = 40;
    std::vector<double> bad = c.key(0, 0, 3);
    bad[5] = std::nan("");
    c.store_key(0, 0, 3, bad);
    const triattn_test::cache_bytes before = c.snapshot();
    const device_batch<triattn::paged_kv_view> dev(caches);
    const gpu_plan gpu = keydiff ? run_plan(dev.batch(), triattn::cuda::keydiff_scorer{}, {}, nullptr, 0, 8, true)
                                 : run_plan(dev.batch(), triattn::cuda::knorm_scorer{}, {}, nullptr, 0, 8, true);
    CHECK(gpu.status == static_cast<std::int32_t>(triattn::cuda::round_status::non_finite_key), "status ", gpu.status);
    CHECK(dev.mirror(0).download() == before, "the cache changed");
  }
}

TRIATTN_CUDA_TEST("keydiff_scorer refuses pre-RoPE keys, naming the API") {
  auto g = triattn_test::rng(45);
  auto shape = random_key_shape(g, cache_layout::dense_nhd, triattn::dtype::f16, 64);
  shape.keys = triattn::key_state::pre_rope;
  std::vector<triattn_test::test_cache> caches = random_caches(shape, 1, g);
  const device_batch<triattn::dense_kv_view> dev(caches);
  std::size_t bytes = 0;
  const cudaError_t err = triattn::cuda::keydiff_scorer{}.score("api::keydiff", nullptr, bytes, dev.batch(),
                                                                triattn::cuda::device_round{}, nullptr, nullptr, nullptr);
  CHECK(err == cudaErrorInvalidValue, cudaGetErrorString(err));
  const std::string& m = triattn::cuda::last_error_message();
  CHECK(m.find("api::keydiff") != std::string::npos && m.find("pre_rope") != std::string::npos, m);
}

}  // namespace
