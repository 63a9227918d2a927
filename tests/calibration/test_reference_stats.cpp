// tools/convert_reference_stats.py on the reference implementation's real .pt files
// (TRIATTN_DATA_DIR/reference-stats), checked through load_stats against facts known
// independently of the converter: the models' shapes, the RoPE frequencies of
// triattn::inv_freq, and the band-level R_f statistics measured in reference-stats/README.md.
// Also: the Python writer and the C++ writer produce the same bytes.
//
// The converter runs under the Python that CMake found (TRIATTN_TEST_PYTHON) and needs NumPy:
// without it this test is skipped, or fails when TRIATTN_REQUIRE_DATA=1 (CI).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "support/data.hpp"
#include "support/process.hpp"
#include "triattn/calibration/stats_file.hpp"

namespace {

namespace fs = std::filesystem;

fs::path convert(const std::string& name, const std::string& flags, const std::string& suffix = "") {
  const fs::path out_dir = fs::path(TRIATTN_TEST_OUT_DIR) / "reference_stats";
  fs::create_directories(out_dir);
  const fs::path out = out_dir / (name + suffix + ".safetensors");
  fs::remove(out);
  triattn_test::convert(triattn_test::data_dir() / "reference-stats" / (name + ".pt"), flags, out);
  return out;
}

triattn::rope_desc rope_of(double theta, triattn::rope_scaling scaling = {}, double attention_scale = 1.0) {
  triattn::rope_desc r;
  r.theta = theta;
  r.scaling = scaling;
  r.attention_scale = attention_scale;
  return r;
}

triattn::kv_geometry geometry(int layers, int q_heads, int kv_heads, int head_dim, const triattn::rope_desc& rope) {
  triattn::kv_geometry g;
  g.num_layers = layers;
  g.num_q_heads = q_heads;
  g.num_kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.rope = rope;
  return g;
}

void check_inv_freq(const triattn::query_stats& s, const triattn::rope_desc& rope) {
  for (int f = 0; f < s.num_bands(); ++f) {
    const double want = triattn::inv_freq(rope, s.head_dim, f);
    // Both sides evaluate the same formula in double; only libm could differ by an ulp.
    CHECK(std::abs(s.inv_freq[static_cast<std::size_t>(f)] - want) <= 1e-15 * want);
  }
}

struct r_facts {
  double mean, median, share_above_095;
};

/// R_f = |E q_f| / E|q_f| over all layers, heads and bands.
r_facts resultant_lengths(const triattn::query_stats& s) {
  std::vector<double> r;
  for (std::size_t i = 0; i < s.q_abs_mean.size(); ++i)
    r.push_back(std::hypot(double{s.q_mean_real[i]}, double{s.q_mean_imag[i]}) / s.q_abs_mean[i]);
  double sum = 0.0;
  std::size_t above = 0;
  for (const double x : r) {
    sum += x;
    above += x > 0.95 ? 1 : 0;
  }
  std::sort(r.begin(), r.end());
  const std::size_t n = r.size();
  const double median = n % 2 ? r[n / 2] : 0.5 * (r[n / 2 - 1] + r[n / 2]);
  return {sum / static_cast<double>(n), median, static_cast<double>(above) / static_cast<double>(n)};
}

void check_model(const fs::path& file, const triattn::kv_geometry& g, const std::string& model, r_facts readme) {
  const triattn::query_stats s = triattn::load_stats(file);
  CHECK(s.num_layers == g.num_layers);
  CHECK(s.num_q_heads == g.num_q_heads);
  CHECK(s.num_kv_heads == g.num_kv_heads);
  CHECK(s.head_dim == g.head_dim);
  CHECK(s.style == triattn::rope_style::half);
  CHECK(s.attention_scale == 1.0);
  CHECK(s.info.at("model") == model);
  CHECK(s.info.at("source") == file.stem().string() + ".pt");
  check_inv_freq(s, g.rope);
  CHECK_NOTHROW(s.check_against("test", g));

  // README: mean, median (to 3 decimals) and share above 0.95 (to 0.1 %).
  const r_facts r = resultant_lengths(s);
  CHECK(std::abs(r.mean - readme.mean) < 5e-4);
  CHECK(std::abs(r.median - readme.median) < 5e-4);
  CHECK(std::abs(r.share_above_095 - readme.share_above_095) < 5e-4);

  // The converter's safetensors writer and the C++ one agree byte for byte.
  CHECK(triattn::serialize_stats(s) == triattn_test::read_bytes(file));
}

}  // namespace

TEST_CASE("Qwen3-8B reference stats convert and load", "[reference_stats]") {
  const auto rope = rope_of(1e6);
  check_model(convert("qwen3_8b", "--rope-theta 1e6 --num-kv-heads 8"), geometry(36, 32, 8, 128, rope), "Qwen/Qwen3-8B",
              {0.608, 0.628, 0.094});
}

TEST_CASE("DeepSeek-R1-Distill-Llama-8B reference stats convert and load", "[reference_stats]") {
  const auto rope = rope_of(500000.0, {triattn::rope_scaling_type::llama3, 8.0, 1.0, 4.0, 8192.0});
  const auto file = convert("ds_llama8b",
                            "--rope-theta 500000 --rope-scaling llama3 --rope-factor 8 --low-freq-factor 1 "
                            "--high-freq-factor 4 --original-max-position 8192 --num-kv-heads 8 "
                            "--model deepseek-ai/DeepSeek-R1-Distill-Llama-8B");
  check_model(file, geometry(32, 32, 8, 128, rope), "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", {0.650, 0.692, 0.134});
}

TEST_CASE("converter RoPE flags give triattn::inv_freq and the attention scale", "[reference_stats]") {
  triattn::rope_scaling yarn{triattn::rope_scaling_type::yarn};
  yarn.factor = 4.0;
  yarn.original_max_position = 32768.0;
  const auto yarn_stats =
      triattn::load_stats(convert("qwen3_8b",
                                  "--rope-theta 1e6 --rope-scaling yarn --rope-factor 4 --original-max-position 32768 "
                                  "--num-kv-heads 8",
                                  "_yarn"));
  CHECK(std::abs(yarn_stats.attention_scale - triattn::yarn_attention_scale(4.0)) <= 1e-15);
  check_inv_freq(yarn_stats, rope_of(1e6, yarn));

  // gpt-oss style: no truncation, other betas, an explicit attention scale.
  yarn.truncate = false;
  yarn.beta_fast = 16.0;
  yarn.beta_slow = 2.0;
  const auto untruncated = triattn::load_stats(convert("qwen3_8b",
                                                       "--rope-theta 150000 --rope-scaling yarn --rope-factor 4 "
                                                       "--original-max-position 32768 --no-truncate --beta-fast 16 "
                                                       "--beta-slow 2 --attention-scale 1.25 --num-kv-heads 4",
                                                       "_yarn_untruncated"));
  CHECK(untruncated.attention_scale == 1.25);
  CHECK(untruncated.num_kv_heads == 4);
  check_inv_freq(untruncated, rope_of(150000.0, yarn));

  const auto linear = triattn::load_stats(
      convert("qwen3_8b", "--rope-theta 10000 --rope-scaling linear --rope-factor 2.5 --num-kv-heads 8", "_linear"));
  check_inv_freq(linear, rope_of(10000.0, {triattn::rope_scaling_type::linear, 2.5}));
}
