// `triattn_eval tokenize` and `triattn_eval logits` on SmolLM2's GGUF, run as users run them:
// the tokens against llama.cpp's tokenizer, token for token; the logits against the runner
// in-process, bit for bit, with and without a compressing policy; bad token files.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#include "runner/runner.hpp"
#include "tools/cli.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/policies/streaming_llm.hpp"

namespace {

namespace cli = triattn_test::cli;
namespace fs = std::filesystem;
namespace io = triattn::io;

const fs::path gguf_path = TRIATTN_SMOLLM2_GGUF;

std::vector<std::int64_t> ints(const io::npy_array& a) { return a.to_int64(); }

TEST_CASE("tokenize gives llama.cpp's tokens of the text, with no start token for SmolLM2", "[eval][gguf]") {
  cli::scratch_dir dir("eval_tokenize");
  // Plain prose, digits, non-ASCII, blank lines, and a chat marker that must stay plain text.
  const std::string text =
      "Once upon a time, in 1987, a fox named Zoë ran 3.5 km.\n\n  Indented line\twith a tab.\n"
      "<|im_start|>user is not special here; naïve café — ok?\n";
  const fs::path text_file = dir.path() / "text.txt", out = dir.path() / "tokens.npy";
  triattn_test::write_bytes(text_file, std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                                             reinterpret_cast<const std::byte*>(text.data()) + text.size()));
  const io::npy_array got =
      cli::run_cli_npy(dir, {"tokenize", "--model", gguf_path.string(), "--text", text_file.string(), "--out", out.string()}, out);
  CHECK(got.kind == io::element_kind::i32);
  REQUIRE(got.shape.size() == 1);
  const ggml_bridge::vocab vocab(gguf_path);
  const std::vector<int> want = vocab.tokenize(text, true, false);
  const std::vector<std::int64_t> ids = ints(got);
  REQUIRE(ids.size() == want.size());
  for (std::size_t i = 0; i < ids.size(); ++i) CHECK(ids[i] == want[i]);
  CHECK(ids.front() != vocab.bos());  // add_bos_token is false in SmolLM2's metadata
  CHECK(vocab.detokenize(want) == text);
}

TEST_CASE("logits are the runner's, teacher-forced, with and without compression", "[eval][gguf]") {
  cli::scratch_dir dir("eval_logits");
  const ggml_bridge::vocab vocab(gguf_path);
  const std::vector<int> ids = vocab.tokenize("The quick brown fox jumps over the lazy dog. It was a sunny day, and "
                                              "the children played in the park until the sun went down.",
                                              true, false);
  const auto n = static_cast<std::int64_t>(ids.size());
  REQUIRE(n >= 24);
  const std::vector<std::int32_t> ids32(ids.begin(), ids.end());
  const fs::path tokens = dir.path() / "tokens.npy", out = dir.path() / "logits.npy";
  const std::int64_t shape[] = {n};
  io::write_npy(tokens, io::element_kind::i32, shape, ids32.data());

  const triattn_runner::model m = gguf_model::load(gguf_path);
  const auto V = static_cast<std::size_t>(m.config().vocab_size);
  std::vector<float> full;
  {
    triattn_runner::session s(m, n);
    for (const int t : ids) {
      const auto l = s.forward(t);
      full.insert(full.end(), l.begin(), l.end());
    }
  }
  const io::npy_array plain =
      cli::run_cli_npy(dir, {"logits", "--model", gguf_path.string(), "--tokens", tokens.string(), "--out", out.string()}, out);
  REQUIRE(plain.kind == io::element_kind::f32);
  REQUIRE(plain.shape == std::vector<std::int64_t>{n, static_cast<std::int64_t>(V)});
  CHECK(std::memcmp(plain.data.data(), full.data(), full.size() * sizeof(float)) == 0);

  // StreamingLLM, budget 8, slack 4: identical until the first round (after 12 tokens), then
  // the runner's own compressed decode, recomputed here with the same schedule.
  const io::npy_array squeezed = cli::run_cli_npy(
      dir, {"logits", "--model", gguf_path.string(), "--tokens", tokens.string(), "--out", out.string(), "--policy",
            "streaming_llm", "--budget", "8", "--slack", "4"},
      out);
  REQUIRE(squeezed.shape == plain.shape);
  const std::vector<float> got = squeezed.to_float();
  std::vector<float> want;
  {
    triattn::streaming_llm p({.round = {.sched = triattn::schedule::with_slack(4)}});
    triattn_runner::session s(m, 12);
    for (const int t : ids) {
      const auto l = s.forward(t);
      want.insert(want.end(), l.begin(), l.end());
      triattn::maybe_compress(p, s.view(), 8, triattn::round_context{s.position(), 0});
    }
  }
  CHECK(std::memcmp(got.data(), full.data(), 12 * V * sizeof(float)) == 0);
  CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(got.data() + 12 * V, full.data() + 12 * V, (got.size() - 12 * V) * sizeof(float)) != 0);

  // A token past the vocabulary: one line naming the file and the token, nothing written.
  const std::int32_t bad[] = {5, 49152};
  const std::int64_t bad_shape[] = {2};
  io::write_npy(tokens, io::element_kind::i32, bad_shape, bad);
  const cli::result r =
      cli::run_cli(dir, {"logits", "--model", gguf_path.string(), "--tokens", tokens.string(), "--out", out.string()});
  cli::check_one_line_error(r, {"tokens.npy", "49152"});
  CHECK(!fs::exists(out));
}

}  // namespace
