// A downstream .cu file: sizes a selection and a StreamingLLM round with the CUDA API. It only
// has to compile and link against the installed package; without a device it has nothing to run.
#include <triattn/cuda/compact.cuh>
#include <triattn/cuda/round.cuh>
#include <triattn/cuda/select.cuh>
#include <triattn/cuda/streaming_llm.cuh>
#include <triattn/cuda/triattention.cuh>

#include <cstdint>
#include <cstdio>

int main() {
  triattn::cuda::select_segments seg{nullptr, nullptr, nullptr, 4, 1024};
  std::size_t bytes = 0;
  const cudaError_t err = triattn::cuda::select_keep(nullptr, bytes, seg, {}, 64, nullptr, nullptr, nullptr);
  std::printf("consumer: select_keep of 4 x 1024 slots needs %zu workspace bytes (%s)\n", bytes, cudaGetErrorString(err));
  // A round over a batch of 2 sequences (the views' device array is never read while sizing).
  triattn::kv_geometry geo;
  geo.num_layers = 2;
  geo.num_q_heads = geo.num_kv_heads = 2;
  geo.head_dim = 64;
  const auto* views = reinterpret_cast<const triattn::dense_kv_view*>(std::uintptr_t{256});
  const triattn::cuda::view_batch<triattn::dense_kv_view> batch{views, 2, geo, 1024};
  std::size_t round_bytes = 0;
  const cudaError_t round = triattn::cuda::plan_round(nullptr, round_bytes, batch, triattn::cuda::streaming_llm_scorer{},
                                                      triattn::round_options{}, {}, {nullptr, nullptr, 64}, nullptr, nullptr);
  std::printf("consumer: plan_round of 2 x 2 x 2 x 1024 slots needs %zu workspace bytes (%s)\n", round_bytes,
              cudaGetErrorString(round));
  return err == cudaSuccess && bytes > 0 && round == cudaSuccess && round_bytes > 0 ? 0 : 1;
}
