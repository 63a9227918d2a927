// One TriAttention round on a Qwen3-8B-shaped cache (36 layers, 8 kv-heads, 32 q-heads, 128
// dims, bf16, dense HND), timed with CUDA events: scoring, the whole plan (`plan_round` with
// TriAttention's device scorer: scoring + z-score + reductions + selection) and the in-place compaction, each as achieved bytes per second next
// to a device-to-device copy and a plain read of the same keys measured in the same run.
// Usage: triattn_bench_gpu [tokens (32768)] [budget (2048)] [repetitions (7)]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/triattention.cuh"

namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorString(err), triattn::cuda::last_error_message().c_str());
  std::exit(1);
}

/// A deterministic pseudo-random float in [-1, 1) from an index (no cuRAND needed).
__device__ float hash_unit(std::uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdull;
  i ^= i >> 33;
  i *= 0xc4ceb9fe1a85ec53ull;
  i ^= i >> 33;
  return static_cast<float>(i >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

__global__ void fill_bf16(std::uint16_t* x, std::int64_t n, std::uint64_t salt) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    x[i] = triattn::float_to_bf16_bits(hash_unit(static_cast<std::uint64_t>(i) * 2654435761ull + salt));
}

__global__ void fill_stats(float* re, float* im, float* abs_mean, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    re[i] = hash_unit(3 * static_cast<std::uint64_t>(i));
    im[i] = hash_unit(3 * static_cast<std::uint64_t>(i) + 1);
    abs_mean[i] = 1.5f * sqrtf(re[i] * re[i] + im[i] * im[i]) + 0.01f;
  }
}

/// Every (layer, kv_head) full again, slot s at position s: the state before a round.
__global__ void reset_slots(std::int32_t* lengths, std::int32_t* positions, int rows, std::int32_t tokens) {
  const std::int64_t n = std::int64_t{rows} * tokens;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    positions[i] = static_cast<std::int32_t>(i % tokens);
    if (i % tokens == 0) lengths[i / tokens] = tokens;
  }
}

/// A plain read of `n` 16-byte words, folded into one word so that the loads are not dead.
__global__ void read_all(const uint4* x, std::int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // almost never: keeps the loads without a write per thread
}

/// Median milliseconds of `reps` runs of `body`, each between two events; `before` runs untimed.
template <class Before, class Body>
float median_ms(int reps, Before before, Body body) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> ms;
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
    before();
    check(cudaEventRecord(start), "cudaEventRecord");
    body();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0.0f;
    check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    if (r > 0) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <class T>
T* device_alloc(std::size_t n) {
  T* p = nullptr;
  check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int32_t tokens = argc > 1 ? std::atoi(argv[1]) : 32768;
  const std::int32_t budget = argc > 2 ? std::atoi(argv[2]) : 2048;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 7;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  // Qwen3-8B: 36 layers, 32 q-heads over 8 kv-heads, head_dim 128, RoPE theta 1e6, bf16.
  triattn::kv_geometry geo;
  geo.num_layers = 36;
  geo.num_q_heads = 32;
  geo.num_kv_heads = 8;
  geo.head_dim = 128;
  geo.type = triattn::dtype::bf16;
  geo.rope.theta = 1e6;
  const int L = geo.num_layers, H = geo.num_kv_heads, D = geo.head_dim;
  const std::size_t layer_elems = static_cast<std::size_t>(H) * tokens * D;  // [kv_heads, tokens, head_dim]
  const std::size_t key_bytes = layer_elems * L * 2;
  std::printf("device: %s (sm_%d%d, %d SMs, %.0f GiB)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  std::printf("cache: %d layers x %d kv-heads (%d q-heads) x %d tokens x %d dims, bf16, dense HND; K = %.2f GiB, "
              "budget %d\n",
              L, H, geo.num_q_heads, tokens, D, static_cast<double>(key_bytes) / (1 << 30), budget);

  auto* k_all = device_alloc<std::uint16_t>(layer_elems * L);
  auto* v_all = device_alloc<std::uint16_t>(layer_elems * L);
  auto* copy_dst = device_alloc<std::uint16_t>(layer_elems * L);
  fill_bf16<<<4096, 256>>>(k_all, static_cast<std::int64_t>(layer_elems * L), 1);
  fill_bf16<<<4096, 256>>>(v_all, static_cast<std::int64_t>(layer_elems * L), 2);
  std::vector<std::byte*> k_layers, v_layers;
  for (int l = 0; l < L; ++l) {
    k_layers.push_back(reinterpret_cast<std::byte*>(k_all + l * layer_elems));
    v_layers.push_back(reinterpret_cast<std::byte*>(v_all + l * layer_elems));
  }
  auto* d_k_layers = device_alloc<std::byte*>(L);
  auto* d_v_layers = device_alloc<std::byte*>(L);
  check(cudaMemcpy(d_k_layers, k_layers.data(), L * sizeof(std::byte*), cudaMemcpyHostToDevice), "copy layers");
  check(cudaMemcpy(d_v_layers, v_layers.data(), L * sizeof(std::byte*), cudaMemcpyHostToDevice), "copy layers");
  auto* lengths = device_alloc<std::int32_t>(static_cast<std::size_t>(L) * H);
  auto* positions = device_alloc<std::int32_t>(static_cast<std::size_t>(L) * H * tokens);
  const auto reset = [&] { reset_slots<<<4096, 256>>>(lengths, positions, L * H, tokens); };
  reset();
  const triattn::kv_strides st = triattn::kv_strides::hnd(tokens, D);
  const triattn::dense_kv_view host_view{geo, d_k_layers, d_v_layers, st, st, {lengths, positions, tokens}};
  auto* d_view = device_alloc<triattn::dense_kv_view>(1);
  check(cudaMemcpy(d_view, &host_view, sizeof host_view, cudaMemcpyHostToDevice), "copy view");
  const triattn::cuda::view_batch<triattn::dense_kv_view> batch{d_view, 1, geo, tokens};

  const std::size_t stat_rows = static_cast<std::size_t>(L) * geo.num_q_heads * (D / 2);
  auto* stats_buf = device_alloc<float>(3 * stat_rows);
  fill_stats<<<1024, 256>>>(stats_buf, stats_buf + stat_rows, stats_buf + 2 * stat_rows, static_cast<std::int64_t>(stat_rows));
  const triattn::cuda::triattention_device_stats stats{
      stats_buf, stats_buf + stat_rows, stats_buf + 2 * stat_rows, L, geo.num_q_heads, H, D, geo.rope.style, 1.0};
  const std::int64_t round_start = tokens;
  auto* d_round = device_alloc<std::int64_t>(1);
  check(cudaMemcpy(d_round, &round_start, sizeof round_start, cudaMemcpyHostToDevice), "copy round start");
  const triattn::triattention_config cfg = triattn::triattention_config::paper();
  const triattn::cuda::triattention_scorer scorer{stats, cfg};
  auto* d_budget = device_alloc<std::int32_t>(1);
  check(cudaMemcpy(d_budget, &budget, sizeof budget, cudaMemcpyHostToDevice), "copy budget");
  const triattn::cuda::round_inputs inputs{d_budget, d_round};

  auto* scores = device_alloc<float>(static_cast<std::size_t>(L) * geo.num_q_heads * tokens);
  auto* keep = device_alloc<std::int32_t>(static_cast<std::size_t>(L) * H * budget);
  auto* kept = device_alloc<std::int32_t>(static_cast<std::size_t>(L) * H);
  auto* status = device_alloc<std::int32_t>(1);
  const triattn::cuda::device_keep_plan plan{keep, kept, budget};
  const auto plan_round = [&](void* w, std::size_t& b) {
    return triattn::cuda::plan_round(w, b, batch, scorer, cfg.round, inputs, plan, status, nullptr);
  };
  auto* sink = device_alloc<unsigned>(1);
  std::size_t score_bytes = 0, plan_bytes = 0;
  check(triattn::cuda::triattention_score(nullptr, score_bytes, batch, stats, cfg, d_round, scores, status, nullptr), "score size");
  check(plan_round(nullptr, plan_bytes), "plan size");
  const std::size_t ws_bytes = std::max(score_bytes, plan_bytes);
  auto* ws = device_alloc<std::byte>(ws_bytes);
  check(cudaMemset(status, 0, sizeof(std::int32_t)), "cudaMemset");
  check(cudaDeviceSynchronize(), "fill");

  const auto nothing = [] {};
  const float copy_ms = median_ms(reps, nothing, [&] {
    check(cudaMemcpyAsync(copy_dst, k_all, key_bytes, cudaMemcpyDeviceToDevice), "copy");
  });
  const float read_ms = median_ms(reps, nothing, [&] {
    read_all<<<prop.multiProcessorCount * 8, 512>>>(reinterpret_cast<const uint4*>(k_all),
                                                     static_cast<std::int64_t>(key_bytes / 16), sink);
  });
  const float score_ms = median_ms(reps, nothing, [&] {
    std::size_t b = ws_bytes;
    check(triattn::cuda::triattention_score(ws, b, batch, stats, cfg, d_round, scores, status, nullptr), "score");
  });
  const float plan_ms = median_ms(reps, nothing, [&] {
    std::size_t b = ws_bytes;
    check(plan_round(ws, b), "plan");
  });
  const float compact_ms = median_ms(
      reps,
      [&] {
        reset();
        std::size_t b = ws_bytes;
        check(plan_round(ws, b), "plan");
      },
      [&] { check(triattn::cuda::compact(batch, plan, {}, status, nullptr), "compact"); });
  check(cudaDeviceSynchronize(), "benchmark");
  std::int32_t final_status = -1;
  check(cudaMemcpy(&final_status, status, sizeof final_status, cudaMemcpyDeviceToHost), "status");

  const double gb = 1e9;
  const double copy_bw = 2.0 * static_cast<double>(key_bytes) / (copy_ms * 1e-3) / gb;  // read + write
  const double read_bw = static_cast<double>(key_bytes) / (read_ms * 1e-3) / gb;
  const double score_io = static_cast<double>(key_bytes) + static_cast<double>(L) * geo.num_q_heads * tokens * 4.0;
  const double score_bw = score_io / (score_ms * 1e-3) / gb;
  const double moved = 2.0 * 2.0 * static_cast<double>(L) * H * budget * D * 2.0;  // K and V rows, read + write
  std::printf("%-34s %9s %12s %14s\n", "step", "ms", "GB/s", "of copy GB/s");
  std::printf("%-34s %9.3f %12.1f %13.1f%%\n", "device-to-device copy of K (r+w)", copy_ms, copy_bw, 100.0);
  std::printf("%-34s %9.3f %12.1f %13.1f%%\n", "plain read of K", read_ms, read_bw, 100.0 * read_bw / copy_bw);
  std::printf("%-34s %9.3f %12.1f %13.1f%%\n", "triattention_score (K + scores)", score_ms, score_bw,
              100.0 * score_bw / copy_bw);
  std::printf("%-34s %9.3f %12s %14s\n", "plan_round (score..select)", plan_ms, "-", "-");
  std::printf("%-34s %9.3f %12s %14s\n", "  of which after scoring (plan-score)", plan_ms - score_ms, "-", "-");
  std::printf("%-34s %9.3f %12.1f %13.1f%%\n", "compact (kept K+V rows, r+w)", compact_ms, moved / (compact_ms * 1e-3) / gb,
              100.0 * moved / (compact_ms * 1e-3) / gb / copy_bw);
  std::printf("round status after the benchmark: %d (0 = ok)\n", final_status);
  return final_status == 0 ? 0 : 1;
}
