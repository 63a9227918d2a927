// A plain test driver for the CUDA tests: no Catch2, so that bench/gpu/run_on_device.sh can
// build and run them on a machine with nvcc and CMake only. Tests register with
// TRIATTN_CUDA_TEST; CHECK records a failure and goes on, REQUIRE stops the test case.
// main (driver.cpp) exits 77 (CTest's SKIP_RETURN_CODE) with a message when no device exists.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace triattn_cuda_test {

struct test_case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<test_case>& registry() {
  static std::vector<test_case> tests;
  return tests;
}

/// Failures of the running test case.
inline int& failures() {
  static int n = 0;
  return n;
}

struct registrar {
  registrar(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

/// Thrown by REQUIRE to leave the test case.
struct abort_case {};

/// The context lines printed with a failure (SCOPED-like: INFO pushes until the scope ends).
inline std::vector<std::string>& context() {
  static std::vector<std::string> lines;
  return lines;
}

struct scoped_info {
  explicit scoped_info(std::string line) { context().push_back(std::move(line)); }
  ~scoped_info() { context().pop_back(); }
  scoped_info(const scoped_info&) = delete;
  scoped_info& operator=(const scoped_info&) = delete;
};

inline void report(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  for (const std::string& c : context()) std::fprintf(stderr, "    with %s\n", c.c_str());
}

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

}  // namespace triattn_cuda_test

#define TRIATTN_CUDA_TEST_CAT2(a, b) a##b
#define TRIATTN_CUDA_TEST_CAT(a, b) TRIATTN_CUDA_TEST_CAT2(a, b)
#define TRIATTN_CUDA_TEST(name)                                                                              \
  static void TRIATTN_CUDA_TEST_CAT(triattn_cuda_test_body_, __LINE__)();                                      \
  static const triattn_cuda_test::registrar TRIATTN_CUDA_TEST_CAT(triattn_cuda_test_reg_, __LINE__){           \
      name, &TRIATTN_CUDA_TEST_CAT(triattn_cuda_test_body_, __LINE__)};                                        \
  static void TRIATTN_CUDA_TEST_CAT(triattn_cuda_test_body_, __LINE__)()

/// CHECK(cond, message parts...): records a failure with the parts and goes on.
#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    if (!(cond)) triattn_cuda_test::report(__FILE__, __LINE__, triattn_cuda_test::cat(#cond, " " __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
/// REQUIRE(cond, message parts...): records a failure and leaves the test case.
#define REQUIRE(cond, ...)                                                                         \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      triattn_cuda_test::report(__FILE__, __LINE__, triattn_cuda_test::cat(#cond, " " __VA_OPT__(, ) __VA_ARGS__)); \
      throw triattn_cuda_test::abort_case{};                                                       \
    }                                                                                              \
  } while (0)
/// A CUDA runtime call that must succeed.
#define CUDA_REQUIRE(call)                                                                         \
  do {                                                                                             \
    const cudaError_t triattn_err_ = (call);                                                       \
    REQUIRE(triattn_err_ == cudaSuccess, #call, " returned ", cudaGetErrorString(triattn_err_),    \
            " (", triattn::cuda::last_error_message(), ")");                                       \
  } while (0)
#define INFO_SCOPE(...) \
  const triattn_cuda_test::scoped_info TRIATTN_CUDA_TEST_CAT(triattn_info_, __LINE__)(triattn_cuda_test::cat(__VA_ARGS__))
