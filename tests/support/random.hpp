// Fresh random inputs for tests: every run draws a new seed (printed, and reproducible with
// TRIATTN_TEST_SEED=<n>), so a test never passes only for one lucky input.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace triattn_test {

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = []() -> std::uint64_t {
    if (const char* s = std::getenv("TRIATTN_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    const std::uint64_t fresh = std::random_device{}();
    std::printf("TRIATTN_TEST_SEED=%llu\n", static_cast<unsigned long long>(fresh));
    return fresh;
  }();
  return seed;
}

/// A generator seeded from the run's seed and a per-use salt.
inline std::mt19937_64 rng(std::uint64_t salt = 0) { return std::mt19937_64(test_seed() * 0x9e3779b97f4a7c15ull + salt); }

inline std::vector<float> normal_floats(std::mt19937_64& g, std::size_t n, float stddev = 1.0f) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace triattn_test
