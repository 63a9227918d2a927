// Every policy of the registry on the real model (stories260K) at budget 64, slack 16, under
// one protection for all (the first 4 and the last 16 slots: the key-only scorers have no
// sinks of their own, and without them evict the attention sinks first): teacher-forced over
// validation windows, the mean KL(full || compressed) of the next-token distributions after
// the first compression must be lower than random eviction's at the same budget. Random
// eviction is the evaluation's (eval/random_eviction.hpp), not the library's, unprotected; its
// KL is the mean of `random_draws` draws on the same windows, because one draw's KL alone
// ranged 0.050-0.094 over 16 seeds, and its low end fell below KeyDiff's. Over 26 seeds with 8
// draws the mean ranged 0.068-0.093 and the closest policy, KeyDiff, scored at most 0.79x of it
// (Expected Attention's decode-time variant, the registry's, at most 0.51x).
//
// Except K-norm, which does no better than random here (keys with small norms are not what this
// model attends to): over 26 seeds its KL was 0.79x-1.39x random's mean of 8 draws. It must
// stay within 2x random's, far from what it scores when it evicts the sinks (0.45, about 6x).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "eval/random_eviction.hpp"
#include "runner/calibration.hpp"
#include "runner/compressed_session.hpp"
#include "runner/runner.hpp"
#include "support/data.hpp"
#include "support/random.hpp"
#include "triattn/triattn.hpp"

namespace {

constexpr std::int64_t budget = 64, slack = 16;
constexpr int num_windows = 4;
constexpr int random_draws = 8;
constexpr triattn::schedule sched = triattn::schedule::with_slack(slack);  // every policy's trigger

struct fixture {
  triattn_runner::model model = triattn_runner::model::load(triattn_test::data_dir() / "models/stories260K/stories260K.bin");
  triattn_runner::tokenizer tok =
      triattn_runner::tokenizer::load(triattn_test::data_dir() / "models/stories260K/tok512.bin", model.config().vocab_size);
  std::vector<std::vector<int>> windows;
  std::vector<std::vector<std::vector<float>>> full_logits;  // [window][step][vocab]
  triattn::query_stats stats;

  fixture() {
    // Calibration text and evaluation text differ (train vs validation).
    stats = triattn_runner::calibrate(model, tok, triattn_runner::read_file(triattn_test::data_dir() / "data/tinystories_train_head.txt"),
                               8);
    const auto all = triattn_runner::text_windows(
        tok, triattn_runner::read_file(triattn_test::data_dir() / "data/tinystories_valid_head.txt"), 512, 40);
    // Fresh windows each run, from the run's seed.
    auto g = triattn_test::rng(77);
    for (int i = 0; i < num_windows; ++i) windows.push_back(all[std::uniform_int_distribution<std::size_t>(0, all.size() - 1)(g)]);
    triattn_runner::session full(model, 512);
    for (const auto& w : windows) {
      full.reset();
      auto& rows = full_logits.emplace_back();
      for (const int t : w) {
        const auto logits = full.forward(t);
        rows.emplace_back(logits.begin(), logits.end());
      }
    }
  }

  /// Mean KL over the predictions after the first compression, for `policy`.
  template <class P>
  double mean_kl(P& policy, triattn_runner::observer* feed = nullptr) {
    REQUIRE(policy.round().sched.should_compress(budget + slack, budget, budget + slack));  // the test's trigger
    triattn_runner::session s(model, sched.peak_tokens(budget));
    s.set_observer(feed);
    double kl = 0.0;
    std::int64_t n = 0;
    for (std::size_t w = 0; w < windows.size(); ++w) {
      s.reset();
      if constexpr (requires { policy.attach(s.view()); }) policy.attach(s.view());
      bool compressed = false;
      for (std::size_t t = 0; t < windows[w].size(); ++t) {
        const auto logits = s.forward(windows[w][t]);
        if (compressed) {
          kl += triattn_runner::kl_divergence(full_logits[w][t], logits);
          ++n;
        }
        compressed |= triattn::maybe_compress(policy, s.view(), budget, {s.position(), 0});
      }
    }
    REQUIRE(n > 0);
    return kl / static_cast<double>(n);
  }
};

}  // namespace

TEST_CASE("every policy beats random eviction at budget 64 on the real model") {
  fixture f;
  double random_kl = 0.0;
  for (int d = 0; d < random_draws; ++d) {
    triattn_eval::random_eviction random(triattn_test::test_seed() + static_cast<std::uint64_t>(d), sched);
    random_kl += f.mean_kl(random) / random_draws;
  }
  INFO("random eviction: mean KL " << random_kl);
  std::printf("%-16s mean KL %.5f\n", "random", random_kl);
  triattn::policy_inputs inputs;
  inputs.stats = &f.stats;
  inputs.sched = sched;
  inputs.protocol = triattn::round_protocol{false, 4, 16};  // sinks 4, recent 16, the prompt unprotected
  for (const triattn::policy_entry& e : triattn::policy_registry) {
    std::optional<triattn::any_policy> policy = e.create(inputs);
    if (!policy) continue;  // `full`
    CHECK(policy->name() == e.name);
    triattn_runner::policy_observer feed(*policy);
    const double kl = f.mean_kl(*policy, &feed);
    INFO(e.name << ": mean KL " << kl);
    std::printf("%-16.*s mean KL %.5f\n", static_cast<int>(e.name.size()), e.name.data(), kl);
    CHECK(kl > 0.0);  // it did compress and it did change the predictions
    if (e.name == triattn::knorm::name) {
      CHECK(kl < 2.0 * random_kl);
    } else {
      CHECK(kl < random_kl);
    }
  }
}
