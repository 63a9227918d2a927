// `triattn calibrate` on the stories260K model and TinyStories text, against E[q_f] and E|q_f|
// recomputed here in double precision from the model's own queries: the same windows
// (triattn_runner::text_windows, one window of the model's 512-token context per trace), each
// post-RoPE query un-rotated by a complex rotation written here (interleaved pairs (2f, 2f+1),
// theta 10000; not the library's RoPE or accumulator), per-window means, then the mean over
// windows. Also: the file's metadata, an exact save/load round trip, progress on stderr, and
// `triattn inspect` on the result.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "runner/runner.hpp"
#include "support/data.hpp"
#include "triattn/calibration/stats_file.hpp"

namespace {

namespace fs = std::filesystem;
using triattn_test::cli::run_cli;
using triattn_test::cli::scratch_dir;

constexpr int windows = 3;

/// Per (layer, q-head, band): Σ z_f and Σ |z_f| of the un-rotated queries of one window.
struct query_sums final : triattn_runner::observer {
  query_sums(int num_layers, int num_heads, int head_dim)
      : heads(num_heads),
        bands(head_dim / 2),
        sum(static_cast<std::size_t>(num_layers * num_heads * head_dim / 2)),
        abs_sum(sum.size()),
        tokens(static_cast<std::size_t>(num_layers)) {}

  void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q,
                    std::span<const float>) override {
    REQUIRE(q.size() == static_cast<std::size_t>(2 * bands));
    for (int f = 0; f < bands; ++f) {
      const double w = std::pow(10000.0, -2.0 * f / (2.0 * bands));
      const std::complex<double> rotated(q[static_cast<std::size_t>(2 * f)], q[static_cast<std::size_t>(2 * f + 1)]);
      const std::complex<double> z = rotated * std::polar(1.0, -static_cast<double>(position) * w);
      const std::size_t i = index(layer, q_head, f);
      sum[i] += z;
      abs_sum[i] += std::abs(z);
    }
    if (q_head == 0) ++tokens[static_cast<std::size_t>(layer)];
  }

  std::size_t index(int layer, int q_head, int f) const {
    return (static_cast<std::size_t>(layer) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(q_head)) *
               static_cast<std::size_t>(bands) +
           static_cast<std::size_t>(f);
  }
  void clear() {
    std::fill(sum.begin(), sum.end(), std::complex<double>());
    std::fill(abs_sum.begin(), abs_sum.end(), 0.0);
    std::fill(tokens.begin(), tokens.end(), 0);
  }

  int heads, bands;
  std::vector<std::complex<double>> sum;
  std::vector<double> abs_sum;
  std::vector<std::int64_t> tokens;  ///< [layers] tokens seen in this window
};

/// The stories260K model, its tokenizer and the calibration text under the data directory.
struct stories260k_files {
  fs::path data = triattn_test::data_dir();
  fs::path model = data / "models" / "stories260K" / "stories260K.bin";
  fs::path tokenizer = data / "models" / "stories260K" / "tok512.bin";
  fs::path text = data / "data" / "tinystories_train_head.txt";
};

}  // namespace

TEST_CASE("triattn calibrate matches E[q_f] and E|q_f| recomputed in double", "[cli][calibrate]") {
  const stories260k_files files;
  const fs::path &model_path = files.model, &tok_path = files.tokenizer, &text_path = files.text;
  REQUIRE(fs::exists(text_path));

  const scratch_dir dir("cli_calibrate");
  const std::string out = (dir / "stories260K.stats.safetensors").string();
  const auto r = run_cli(dir, {"calibrate", "--model", model_path.string(), "--tokenizer", tok_path.string(), "--text",
                               text_path.string(), "--out", out, "--windows", std::to_string(windows)});
  INFO("command: " << r.command << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  // Progress goes to stderr (ending at "3/3"); stdout carries no progress.
  CHECK(r.err.find(std::to_string(windows) + "/" + std::to_string(windows)) != std::string::npos);
  CHECK(r.out.find('/') == std::string::npos);
  CHECK(r.out.find('#') == std::string::npos);
  const triattn::query_stats s = triattn::load_stats(out);

  // --- the same computation, here -----------------------------------------------------------
  const triattn_runner::model model = triattn_runner::model::load(model_path);
  const triattn_runner::config& cfg = model.config();
  const triattn_runner::tokenizer tok = triattn_runner::tokenizer::load(tok_path, cfg.vocab_size);
  const std::string text = triattn_test::cli::read_text(text_path);
  const auto ws = triattn_runner::text_windows(tok, text, cfg.seq_len, windows);
  REQUIRE(cfg.seq_len == 512);
  REQUIRE(ws.size() == static_cast<std::size_t>(windows));

  // Metadata: the model's geometry, interleaved RoPE with theta 10000, a = 1.
  const int bands = cfg.head_dim / 2;
  CHECK(s.num_layers == cfg.n_layers);
  CHECK(s.num_q_heads == cfg.n_heads);
  CHECK(s.num_kv_heads == cfg.n_kv_heads);
  CHECK(s.num_kv_heads == 4);
  CHECK(s.head_dim == cfg.head_dim);
  CHECK(s.style == triattn::rope_style::interleaved);
  CHECK(s.attention_scale == 1.0);
  REQUIRE(s.inv_freq.size() == static_cast<std::size_t>(bands));
  for (int f = 0; f < bands; ++f) {
    const double want = std::pow(10000.0, -2.0 * f / cfg.head_dim);
    INFO("inv_freq[" << f << "]");
    CHECK(std::abs(s.inv_freq[static_cast<std::size_t>(f)] - want) <= 1e-15 * want);
  }
  CHECK(s.info.at("num_traces") == std::to_string(windows));
  CHECK(s.info.at("num_tokens") == std::to_string(windows * cfg.seq_len));

  triattn_runner::session session(model, cfg.seq_len);
  query_sums sums(cfg.n_layers, cfg.n_heads, cfg.head_dim);
  session.set_observer(&sums);
  const std::size_t n = sums.sum.size();
  std::vector<std::complex<double>> mean(n);
  std::vector<double> abs_mean(n);
  for (const auto& w : ws) {
    REQUIRE(w.size() == static_cast<std::size_t>(cfg.seq_len));
    session.reset();
    sums.clear();
    for (const int token : w) session.forward(token);
    for (const auto t : sums.tokens) REQUIRE(t == cfg.seq_len);
    for (std::size_t i = 0; i < n; ++i) {  // the window's mean, weighted 1/windows
      mean[i] += sums.sum[i] / static_cast<double>(cfg.seq_len) / static_cast<double>(windows);
      abs_mean[i] += sums.abs_sum[i] / static_cast<double>(cfg.seq_len) / static_cast<double>(windows);
    }
  }
  REQUIRE(s.q_mean_real.size() == n);
  double worst = 0.0;
  for (int l = 0; l < cfg.n_layers; ++l)
    for (int h = 0; h < cfg.n_heads; ++h)
      for (int f = 0; f < bands; ++f) {
        const std::size_t i = sums.index(l, h, f);
        INFO("layer " << l << " q-head " << h << " band " << f << ": file (" << s.q_mean_real[i] << ", "
                      << s.q_mean_imag[i] << ", " << s.q_abs_mean[i] << "), here (" << mean[i].real() << ", "
                      << mean[i].imag() << ", " << abs_mean[i] << ")");
        // Relative to the band's scale E|q_f| (a component of E[q_f] may be near zero).
        const double scale = abs_mean[i];
        REQUIRE(scale > 0.0);
        const double e =
            std::max({std::abs(s.q_mean_real[i] - mean[i].real()), std::abs(s.q_mean_imag[i] - mean[i].imag()),
                      std::abs(s.q_abs_mean[i] - abs_mean[i])}) /
            scale;
        CHECK(e <= 1e-5);
        worst = std::max(worst, e);
      }
  std::printf("calibrate: worst relative difference %.3g\n", worst);

  // --- the file round-trips exactly ---------------------------------------------------------
  const std::string again = (dir / "again.safetensors").string();
  triattn::save_stats(again, s);
  CHECK(triattn_test::cli::read_bytes(again) == triattn_test::cli::read_bytes(out));
  const triattn::query_stats t = triattn::load_stats(again);
  CHECK(t.q_mean_real == s.q_mean_real);
  CHECK(t.q_mean_imag == s.q_mean_imag);
  CHECK(t.q_abs_mean == s.q_abs_mean);
  CHECK(t.inv_freq == s.inv_freq);
  CHECK(t.info == s.info);
  CHECK((t.num_layers == s.num_layers && t.num_q_heads == s.num_q_heads && t.num_kv_heads == s.num_kv_heads &&
         t.head_dim == s.head_dim && t.style == s.style && t.attention_scale == s.attention_scale));

  // --- inspect: the shape with the layer count, and mean R_f per layer ----------------------
  const auto in = run_cli(dir, {"inspect", out});
  INFO("inspect stdout:\n" << in.out << "\nstderr: " << in.err);
  REQUIRE(in.code == 0);
  std::ostringstream shape;
  shape << "[" << cfg.n_layers << ", " << cfg.n_heads << ", " << bands << "]";
  CHECK(in.out.find(shape.str()) != std::string::npos);
  CHECK(in.out.find("mean R_f") != std::string::npos);
  for (int l = 0; l < cfg.n_layers; ++l) {
    double sum = 0.0;
    for (int h = 0; h < cfg.n_heads; ++h)
      for (int f = 0; f < bands; ++f) {
        const std::size_t i = sums.index(l, h, f);
        sum += std::abs(mean[i]) / abs_mean[i];
      }
    const double want = sum / (cfg.n_heads * bands);
    char label[32];
    std::snprintf(label, sizeof label, "layer %3d ", l);
    const std::size_t at = in.out.find(label);
    INFO("line \"" << label << "\", expected mean R_f " << want);
    REQUIRE(at != std::string::npos);
    const double printed = std::strtod(in.out.c_str() + at + std::strlen(label), nullptr);
    CHECK(std::abs(printed - want) <= 0.5e-4 + 1e-6);  // printed with 4 decimals
  }
}

TEST_CASE("calibrate's integer options are refused past their range, never narrowed", "[cli][calibrate]") {
  // Issue 15, item 16: `--windows 4294967297` was narrowed to 1 window and ran. Every value
  // past an option's range exits 2 with one line naming the option, and writes nothing.
  const stories260k_files files;
  const fs::path &model_path = files.model, &tok_path = files.tokenizer, &text_path = files.text;
  REQUIRE(fs::exists(text_path));
  const scratch_dir dir("cli_calibrate_bounds");
  const std::string out = (dir / "stats.safetensors").string();
  const auto command = [&](const std::string& option, const std::string& value) {
    return std::vector<std::string>{"calibrate", "--model", model_path.string(), "--tokenizer", tok_path.string(),
                                    "--text", text_path.string(), "--out", out, "--windows", "1", option, value};
  };
  for (const auto& [option, value] : std::vector<std::pair<std::string, std::string>>{
           {"--windows", "4294967297"},
           {"--windows", "2147483648"},
           {"--windows", "0"},
           {"--window-tokens", "4294967328"},
           {"--window-tokens", "0"},
           {"--window-tokens", "99999999999999999999"}}) {
    INFO(option << " " << value);
    const auto r = run_cli(dir, command(option, value));
    triattn_test::cli::check_one_line_error(r, {option});
    CHECK(!fs::exists(out));
  }
  // In range, the same command runs (so the refusals above come from the values).
  const auto r = run_cli(dir, command("--window-tokens", "32"));
  INFO("command: " << r.command << "\nstderr: " << r.err);
  CHECK(r.code == 0);
  CHECK(fs::exists(out));
}
