// TriAttention calibration on text the model samples itself (triattn_runner::calibrate_on_samples),
// on the repository's own stories260K (models/stories260K): no data folder needed. A seed
// gives bit-identical statistics; the windows are distinct stories; the statistics are finite
// and are exactly those of calibrating on the sampled windows.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "runner/calibration.hpp"
#include "runner/runner.hpp"
#include "triattn/triattn.hpp"

namespace {

namespace fs = std::filesystem;

const fs::path model_dir = TRIATTN_TEST_MODEL_DIR;

const triattn_runner::model& stories() {
  static const triattn_runner::model m = triattn_runner::model::load(model_dir / "stories260K.bin");
  return m;
}
const triattn_runner::tokenizer& tok512() {
  static const triattn_runner::tokenizer t = triattn_runner::tokenizer::load(model_dir / "tok512.bin", 512);
  return t;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

bool bitwise_equal(const triattn::query_stats& a, const triattn::query_stats& b) {
  return a.num_layers == b.num_layers && a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.style == b.style && a.attention_scale == b.attention_scale &&
         bitwise_equal(a.inv_freq, b.inv_freq) && bitwise_equal(a.q_mean_real, b.q_mean_real) &&
         bitwise_equal(a.q_mean_imag, b.q_mean_imag) && bitwise_equal(a.q_abs_mean, b.q_abs_mean) && a.info == b.info;
}

constexpr int windows = 3;
constexpr std::uint64_t seed = 1;

}  // namespace

TEST_CASE("calibrate_on_samples: the same seed gives bitwise-equal, finite statistics", "[llama2c][calibration]") {
  const triattn_runner::model& m = stories();
  std::vector<std::size_t> progress;
  const triattn::query_stats a =
      triattn_runner::calibrate_on_samples(m, windows, seed, 1.0, [&](std::size_t done, std::size_t total) {
        CHECK(total == static_cast<std::size_t>(windows));
        progress.push_back(done);
      });
  const triattn::query_stats b = triattn_runner::calibrate_on_samples(m, windows, seed);
  CHECK(progress == std::vector<std::size_t>{1, 2, 3});
  CHECK(bitwise_equal(a, b));

  REQUIRE_NOTHROW(a.validate("test"));  // shapes, and every value finite
  const triattn_runner::config& c = m.config();
  CHECK(a.num_layers == c.n_layers);
  CHECK(a.num_q_heads == c.n_heads);
  CHECK(a.num_kv_heads == c.n_kv_heads);
  CHECK(a.head_dim == c.head_dim);
  for (std::size_t i = 0; i < a.q_abs_mean.size(); ++i) {
    REQUIRE(std::isfinite(a.q_mean_real[i]));
    REQUIRE(std::isfinite(a.q_mean_imag[i]));
    REQUIRE(a.q_abs_mean[i] > 0.0f);
    // |E[q_f]| <= E[|q_f|] (with room for rounding)
    REQUIRE(std::hypot(a.q_mean_real[i], a.q_mean_imag[i]) <= a.q_abs_mean[i] * (1.0f + 1e-5f));
  }

  // Another seed samples other text, so other statistics.
  CHECK_FALSE(bitwise_equal(a, triattn_runner::calibrate_on_samples(m, windows, seed + 1)));
}

TEST_CASE("calibrate_on_samples calibrates on windows the model samples, which are distinct stories",
          "[llama2c][calibration]") {
  const triattn_runner::model& m = stories();
  const int context = m.config().seq_len;
  // Each window as calibrate_on_samples draws it, one token at a time: BOS, then samples of
  // the logits that followed the token before, from the window's own generator.
  triattn_runner::session s(m, context);
  std::vector<std::vector<int>> sampled;
  for (int w = 0; w < windows; ++w) {
    std::mt19937_64 rng = triattn_runner::window_rng(seed, static_cast<std::size_t>(w));
    s.reset();
    std::vector<int> fed{triattn_runner::bos_id};
    for (;;) {
      const std::span<const float> logits = s.forward(fed.back());
      if (fed.size() == static_cast<std::size_t>(context)) break;
      fed.push_back(triattn_runner::sample_token(logits, 1.0, rng));
    }
    CHECK(s.position() == context);
    sampled.push_back(std::move(fed));
  }

  std::set<std::string> texts;
  for (const std::vector<int>& window : sampled) {
    REQUIRE(window.size() == static_cast<std::size_t>(context));
    CHECK(window.front() == triattn_runner::bos_id);
    for (const int t : window) REQUIRE((t >= 0 && t < m.config().vocab_size));
    // Mostly learned pieces, not byte fallbacks or <unk>: the model writes text.
    std::size_t pieces = 0;
    for (const int t : window) pieces += t >= 259 || t == triattn_runner::bos_id ? 1 : 0;
    CHECK(pieces > window.size() * 9 / 10);
    const std::string text = tok512().decode(window);
    CHECK(text.size() > window.size());  // more than a byte a token: words
    UNSCOPED_INFO("window " << texts.size() << ": " << text.substr(0, 200));
    texts.insert(text);
  }
  CHECK(texts.size() == static_cast<std::size_t>(windows));

  // The same windows through the shared (batched) calibration loop give the same statistics,
  // bit for bit, and so does every batch size.
  const triattn::query_stats from_windows = triattn_runner::calibrate(m, sampled);
  CHECK(bitwise_equal(from_windows, triattn_runner::calibrate_on_samples(m, windows, seed)));
  for (const int batch : {1, 2}) {
    INFO("batch " << batch);
    const triattn::query_stats b = triattn_runner::detail::calibrate_windows(
        m, sampled.size(), context,
        [&](std::size_t w, int t, std::span<const float>) { return sampled[w][static_cast<std::size_t>(t)]; }, {},
        batch);
    CHECK(bitwise_equal(from_windows, b));
  }
}

TEST_CASE("sample_token: inverse CDF of softmax(logits / temperature), seeded", "[llama2c][calibration]") {
  const std::vector<float> logits = {0.0f, std::log(3.0f), -INFINITY, 0.0f};  // weights 1 : 3 : 0 : 1
  std::mt19937_64 rng(42), again(42);
  std::vector<int> counts(logits.size(), 0), first, second;
  constexpr int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    const int t = triattn_runner::sample_token(logits, 1.0, rng);
    REQUIRE((t >= 0 && t < 4));
    ++counts[static_cast<std::size_t>(t)];
    if (i < 100) {
      first.push_back(t);
      second.push_back(triattn_runner::sample_token(logits, 1.0, again));
    }
  }
  CHECK(first == second);
  CHECK(counts[2] == 0);  // zero weight: never drawn
  CHECK(std::abs(counts[1] / double{draws} - 0.6) < 0.02);
  CHECK(std::abs(counts[0] / double{draws} - 0.2) < 0.02);
  CHECK(std::abs(counts[3] / double{draws} - 0.2) < 0.02);

  // A low temperature is (nearly) greedy; a bad one is refused.
  for (int i = 0; i < 100; ++i) CHECK(triattn_runner::sample_token(logits, 0.01, rng) == 1);
  CHECK_THROWS_AS(triattn_runner::sample_token(logits, 0.0, rng), triattn::error);
  CHECK_THROWS_AS(triattn_runner::sample_token(logits, NAN, rng), triattn::error);
  CHECK_THROWS_AS(triattn_runner::sample_token({}, 1.0, rng), triattn::error);
}
