// `triattn calibrate --model M.gguf` on SmolLM2, run as users run it: the stats file has the
// model's shape and RoPE, and equals, bit for bit, the calibration computed in-process on the
// same windows (text_windows of GGUF paragraphs, the runner's queries).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "runner/calibration.hpp"
#include "runner/text_model.hpp"
#include "tools/cli.hpp"
#include "triattn/calibration/stats_file.hpp"

namespace {

namespace cli = triattn_test::cli;
namespace fs = std::filesystem;

const fs::path gguf_path = TRIATTN_SMOLLM2_GGUF;

TEST_CASE("calibrate --model M.gguf: SmolLM2's statistics, the same as in-process", "[tools][gguf]") {
  cli::scratch_dir dir("calibrate_gguf");
  std::string text;
  for (int p = 0; p < 12; ++p)
    text += "Paragraph " + std::to_string(p) + ": the little fox ran to the river, looked at the water, and " +
            "thought about the moon for a while before going home.\n\n";
  const fs::path text_file = dir.path() / "text.txt", out = dir.path() / "stats.safetensors";
  triattn_test::write_bytes(text_file, std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                                             reinterpret_cast<const std::byte*>(text.data()) + text.size()));
  const cli::result r = cli::run_cli(dir, {"calibrate", "--model", gguf_path.string(), "--text", text_file.string(),
                                           "--windows", "3", "--window-tokens", "64", "--out", out.string()});
  INFO("stderr: " << r.err);
  REQUIRE(r.code == 0);
  const triattn::query_stats got = triattn::load_stats(out);
  CHECK(got.num_layers == 30);
  CHECK(got.num_q_heads == 9);
  CHECK(got.num_kv_heads == 3);
  CHECK(got.head_dim == 64);
  CHECK(got.style == triattn::rope_style::interleaved);
  REQUIRE(got.inv_freq.size() == 32);
  CHECK(got.inv_freq[1] == Approx(std::pow(100000.0, -2.0 / 64)).epsilon(1e-12));  // theta from the metadata
  CHECK(got.info.at("num_traces") == "3");
  CHECK(got.info.at("num_tokens") == "192");

  const triattn_runner::text_model m = triattn_runner::text_model::load(gguf_path, "");
  const auto windows =
      triattn_runner::text_windows([&](std::string_view p) { return m.encode_paragraph(p); }, text, 64, 3);
  REQUIRE(windows.size() == 3);
  const triattn::query_stats want = triattn_runner::calibrate(m.model(), windows);
  CHECK(got.q_mean_real == want.q_mean_real);
  CHECK(got.q_mean_imag == want.q_mean_imag);
  CHECK(got.q_abs_mean == want.q_abs_mean);

  // A window longer than the model's context is refused, naming the option.
  const cli::result too_long = cli::run_cli(dir, {"calibrate", "--model", gguf_path.string(), "--text",
                                                  text_file.string(), "--window-tokens", "9000", "--out", out.string()});
  CHECK(too_long.code == 2);
  CHECK(too_long.err.find("--window-tokens 9000") != std::string::npos);
}

}  // namespace
