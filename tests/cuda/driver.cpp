// main of every CUDA test: skips (exit 77, CTest's SKIP_RETURN_CODE) without a device, else
// runs each registered case and exits 1 if any check failed. Host C++: no nvcc needed here.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cuda/driver.hpp"

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s, %d devices); %zu test cases not run\n",
                cudaGetErrorString(err), devices, triattn_cuda_test::registry().size());
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  int failed_cases = 0, run = 0;
  for (const auto& t : triattn_cuda_test::registry()) {
    if (argc > 1 && std::strstr(t.name, argv[1]) == nullptr) continue;
    triattn_cuda_test::failures() = 0;
    try {
      t.body();
    } catch (const triattn_cuda_test::abort_case&) {
    } catch (const std::exception& e) {
      triattn_cuda_test::report(__FILE__, __LINE__, std::string("exception: ") + e.what());
    }
    ++run;
    const bool ok = triattn_cuda_test::failures() == 0;
    failed_cases += ok ? 0 : 1;
    std::printf("%s %s\n", ok ? "passed" : "FAILED", t.name);
  }
  std::printf("%d of %d test cases passed\n", run - failed_cases, run);
  return failed_cases == 0 && run > 0 ? 0 : 1;
}
