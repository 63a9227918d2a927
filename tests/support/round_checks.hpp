// Catch2 checks of a compression round on a test cache, shared by the policy tests: the cache
// holds exactly the expected slots afterwards, or a rejected call left it byte for byte.
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "support/views.hpp"
#include "triattn/core/error.hpp"

namespace triattn_test {

/// Compresses with `run` and checks that every (layer, kv_head) now holds exactly the slots
/// `keep` [l * kv_heads + h] (K, V and positions, in order), and the freed pages.
template <class Run>
void check_round(test_cache& c, const std::vector<std::vector<std::int32_t>>& keep, Run&& run) {
  const int L = c.shape().num_layers, H = c.shape().num_kv_heads;
  std::vector<std::vector<slot_contents>> kept;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      kept.emplace_back();
      for (const auto s : keep[static_cast<std::size_t>(l * H + h)]) kept.back().push_back(c.slot(l, h, s));
    }
  const auto lengths_before = c.lengths;
  const auto freed = run();
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const auto r = static_cast<std::size_t>(l * H + h);
      INFO("layer " << l << " kv_head " << h);
      REQUIRE(c.length(l, h) == static_cast<std::int32_t>(kept[r].size()));
      for (std::size_t i = 0; i < kept[r].size(); ++i) {
        INFO("slot " << i << " (was " << keep[r][i] << ")");
        REQUIRE(c.slot(l, h, static_cast<std::int64_t>(i)) == kept[r][i]);
      }
    }
  CHECK(freed == expected_freed_pages(c, lengths_before));
}

/// Runs `f` and expects a `triattn::error` whose message holds every part.
template <class F>
void throws_with(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL("no triattn::error thrown");
  } catch (const triattn::error& err) {
    for (const auto& p : parts) CHECK_THAT(err.what(), Catch::Contains(p));
  }
}

/// Expects `f` to throw a triattn::error containing every part, the cache byte for byte as it was.
template <class F>
void check_rejected(test_cache& c, F&& f, const std::vector<std::string>& parts) {
  const auto before = c.snapshot();
  throws_with(f, parts);
  CHECK(c.snapshot() == before);
}

}  // namespace triattn_test
