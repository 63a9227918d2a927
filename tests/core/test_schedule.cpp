// Trigger schedules: the firing rule against an oracle, and peak_tokens against a simulated
// decode loop.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/schedule.hpp"

namespace {

struct named_schedule {
  std::string name;
  triattn::schedule sched;
  /// Fires when the cache holds `length` tokens and `position` tokens have been processed.
  bool (*oracle)(std::int64_t length, std::int64_t budget, std::int64_t position, std::int64_t param);
  std::int64_t param;
};

// The rules as the spec words them (triattention.md §7, baselines.md §1); a round that would
// not remove anything (length <= budget) never fires.
bool every_step_oracle(std::int64_t length, std::int64_t budget, std::int64_t, std::int64_t) {
  return length > budget;
}
bool slack_oracle(std::int64_t length, std::int64_t budget, std::int64_t, std::int64_t slack) {
  return length >= budget + std::max<std::int64_t>(slack, 1);
}
bool aligned_oracle(std::int64_t length, std::int64_t budget, std::int64_t position, std::int64_t divide) {
  return length > budget && position % divide == 0;
}

std::vector<named_schedule> schedules() {
  std::vector<named_schedule> out = {{"every_step", triattn::schedule::every_step(), every_step_oracle, 0}};
  for (const std::int64_t s : {0, 1, 2, 5, 128})
    out.push_back({"with_slack(" + std::to_string(s) + ")", triattn::schedule::with_slack(s), slack_oracle, s});
  for (const std::int64_t d : {1, 2, 3, 8, 128})
    out.push_back({"aligned_to(" + std::to_string(d) + ")", triattn::schedule::aligned_to(d), aligned_oracle, d});
  out.push_back({"with_slack() default 128", triattn::schedule::with_slack(), slack_oracle, 128});
  out.push_back({"aligned_to() default 128", triattn::schedule::aligned_to(), aligned_oracle, 128});
  return out;
}

}  // namespace

TEST_CASE("should_compress follows each schedule's rule") {
  for (const auto& s : schedules()) {
    INFO(s.name);
    std::size_t fired = 0;
    for (std::int64_t budget = 1; budget <= 20; ++budget) {
      for (std::int64_t length = 0; length <= 160; ++length) {
        for (std::int64_t position = length; position <= length + 300; position += 7) {
          const bool want = s.oracle(length, budget, position, s.param);
          fired += want;
          if (s.sched.should_compress(length, budget, position) != want) {
            INFO("length " << length << " budget " << budget << " position " << position << " want " << want);
            REQUIRE(false);
          }
        }
      }
    }
    CHECK(fired > 0);  // the table is not trivially false
  }
}

TEST_CASE("peak_tokens bounds, and is reached by, a decode loop") {
  auto g = triattn_test::rng(501);
  for (const auto& s : schedules()) {
    for (int trial = 0; trial < 20; ++trial) {
      std::uniform_int_distribution<std::int64_t> budget_of(1, 300);
      const std::int64_t budget = budget_of(g);
      std::uniform_int_distribution<std::int64_t> prefill(0, budget), offset(0, 500);
      std::int64_t length = prefill(g), position = length + (trial % 2 == 0 ? 0 : offset(g));
      INFO(s.name << " budget " << budget << " start length " << length << " position " << position);
      const std::int64_t peak = s.sched.peak_tokens(budget);
      std::int64_t seen = length;
      const std::int64_t steps = 3 * (peak + 130);
      for (std::int64_t step = 0; step < steps; ++step) {
        ++length;  // append the decoded token
        ++position;
        seen = std::max(seen, length);
        REQUIRE(length <= peak);
        if (s.sched.should_compress(length, budget, position)) length = budget;
      }
      CHECK(seen == peak);  // the bound is tight: allocating less would overflow
    }
  }
}

TEST_CASE("should_compress rejects a budget below 1 and bad parameters") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(triattn::schedule::every_step().should_compress(5, 0, 0),
                    Contains("triattn::schedule::should_compress") && Contains("budget 0"));
  CHECK_THROWS_WITH(triattn::schedule::aligned_to(0).should_compress(5, 2, 0),
                    Contains("triattn::schedule::should_compress") && Contains("divide_length 0"));
  CHECK_THROWS_WITH(triattn::schedule::with_slack(-3).should_compress(5, 2, 0),
                    Contains("triattn::schedule::should_compress") && Contains("slack -3"));
}
