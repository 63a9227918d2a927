// A TriAttention round on the GPU for a batch of two sequences: the engine owns a dense bf16
// cache per sequence in device memory; one call (`plan_round` with TriAttention's device
// scorer) plans every (sequence, layer, kv_head), one call compacts them in place. README's CUDA example is the region between the markers.
// Exits 77 (nothing to run) without a CUDA device.
#include <triattn/cuda/compact.cuh>
#include <triattn/cuda/round.cuh>
#include <triattn/cuda/triattention.cuh>

#include <cstdio>
#include <random>
#include <vector>

#define CHECK_CUDA(call)                                                                                     \
  do {                                                                                                       \
    if (const cudaError_t e = (call); e != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s: %s %s\n", #call, cudaGetErrorString(e), triattn::cuda::last_error_message().c_str()); \
      return 1;                                                                                              \
    }                                                                                                        \
  } while (0)

template <class T>
T* upload(const std::vector<T>& host) {
  T* p = nullptr;
  if (cudaMalloc(&p, host.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cuda_round: no CUDA device, nothing to run\n");
    return 77;
  }
  constexpr int batch_size = 2, layers = 4, q_heads = 8, kv_heads = 2, head_dim = 64, capacity = 1024;
  constexpr std::int32_t budget = 256;
  triattn::kv_geometry geo{layers, q_heads, kv_heads, head_dim, triattn::dtype::bf16, triattn::key_state::post_rope, {}};

  // The engine's caches: per sequence, per layer, K and V [capacity, kv_heads, head_dim] (NHD).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<triattn::dense_kv_view> views;
  for (int b = 0; b < batch_size; ++b) {
    std::vector<std::byte*> k_layers, v_layers;
    for (int l = 0; l < layers; ++l) {
      std::vector<std::uint16_t> k(capacity * kv_heads * head_dim), v(k.size());
      for (auto& x : k) x = triattn::float_to_bf16_bits(normal(rng));
      for (auto& x : v) x = triattn::float_to_bf16_bits(normal(rng));
      k_layers.push_back(reinterpret_cast<std::byte*>(upload(k)));
      v_layers.push_back(reinterpret_cast<std::byte*>(upload(v)));
    }
    std::vector<std::int32_t> lengths(layers * kv_heads, capacity), positions(layers * kv_heads * capacity);
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % capacity);
    const auto st = triattn::kv_strides::nhd(kv_heads, head_dim);
    views.push_back({geo, upload(k_layers), upload(v_layers), st, st, {upload(lengths), upload(positions), capacity}});
  }
  // Calibrated statistics (random here; `triattn calibrate` writes real ones).
  triattn::query_stats stats;
  stats.num_layers = layers;
  stats.num_q_heads = q_heads;
  stats.num_kv_heads = kv_heads;
  stats.head_dim = head_dim;
  for (int f = 0; f < head_dim / 2; ++f) stats.inv_freq.push_back(triattn::inv_freq(geo.rope, head_dim, f));
  for (std::size_t i = 0; i < stats.row(layers, 0); ++i) {
    stats.q_mean_real.push_back(normal(rng));
    stats.q_mean_imag.push_back(normal(rng));
    stats.q_abs_mean.push_back(4.0f);
  }
  float* stats_buffer = nullptr;
  CHECK_CUDA(cudaMalloc(&stats_buffer, triattn::cuda::stats_floats(stats) * sizeof(float)));
  triattn::cuda::triattention_device_stats device_stats;
  CHECK_CUDA(triattn::cuda::upload_stats(stats, stats_buffer, nullptr, device_stats));
  const std::vector<std::int64_t> next_positions(batch_size, capacity);  // each sequence's next token
  const std::vector<std::int32_t> budgets(batch_size, budget);            // each sequence's budget

// example-begin cuda_round
  // The batch: a device array of views (their pointers are device pointers) and the model.
  const triattn::cuda::view_batch<triattn::dense_kv_view> batch{upload(views), batch_size, geo, capacity};
  // Per sequence: its budget and the position of its next token (the round start).
  const triattn::cuda::round_inputs inputs{upload(budgets), upload(next_positions)};  // [batch] each
  const auto rows = static_cast<std::size_t>(batch_size) * layers * kv_heads;
  std::int32_t *keep, *kept, *status;  // [batch, layers, kv_heads, budget], [batch, layers, kv_heads], [1]
  CHECK_CUDA(cudaMalloc(&keep, rows * budget * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&kept, rows * sizeof(std::int32_t)));
  CHECK_CUDA(cudaMalloc(&status, sizeof(std::int32_t)));
  CHECK_CUDA(cudaMemset(status, 0, sizeof(std::int32_t)));
  const triattn::cuda::device_keep_plan plan{keep, kept, budget};  // stride: the largest budget

  // The policy is a device scorer; the round (granularity, protection, selection) is shared.
  const triattn::triattention_config config = triattn::triattention_config::paper();
  const triattn::cuda::triattention_scorer scorer{device_stats, config};
  cudaStream_t stream = nullptr;
  std::size_t workspace_bytes = 0;  // a first call with no workspace sizes it
  CHECK_CUDA(triattn::cuda::plan_round(nullptr, workspace_bytes, batch, scorer, config.round, inputs, plan, status,
                                       stream));
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  // Score every key of the batch, decide, and compact K, V, positions and lengths in place.
  CHECK_CUDA(triattn::cuda::plan_round(workspace, workspace_bytes, batch, scorer, config.round, inputs, plan, status,
                                       stream));
  CHECK_CUDA(triattn::cuda::compact(batch, plan, {}, status, stream));
// example-end cuda_round
  CHECK_CUDA(cudaStreamSynchronize(stream));

  std::int32_t round = -1;
  std::vector<std::int32_t> lengths(layers * kv_heads);
  CHECK_CUDA(cudaMemcpy(&round, status, sizeof round, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lengths.data(), views[0].slots.lengths, lengths.size() * sizeof(std::int32_t),
                        cudaMemcpyDeviceToHost));
  bool ok = round == 0;
  for (const std::int32_t n : lengths) ok = ok && n == budget;
  std::printf("cuda_round: status %d; sequence 0 holds %d of %d tokens per (layer, kv_head): %s\n", round, lengths[0],
              capacity, ok ? "yes" : "NO");
  return ok ? 0 : 1;  // the process exit frees the device memory
}
