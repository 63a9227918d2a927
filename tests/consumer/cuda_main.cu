// A downstream .cu file: sizes a TriAttention round and a selection with the CUDA API. It only
// has to compile and link against the installed package; without a device it has nothing to run.
#include <triattn/cuda/compact.cuh>
#include <triattn/cuda/select.cuh>
#include <triattn/cuda/streaming_llm.cuh>
#include <triattn/cuda/triattention.cuh>

#include <cstdio>

int main() {
  triattn::cuda::select_segments seg{nullptr, nullptr, nullptr, 4, 1024};
  std::size_t bytes = 0;
  const cudaError_t err = triattn::cuda::select_keep(nullptr, bytes, seg, {}, 64, nullptr, nullptr, nullptr);
  std::printf("consumer: select_keep of 4 x 1024 slots needs %zu workspace bytes (%s)\n", bytes, cudaGetErrorString(err));
  return err == cudaSuccess && bytes > 0 ? 0 : 1;
}
