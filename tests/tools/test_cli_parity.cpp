// `triattn score triattention` and `triattn select triattention` against the reference
// implementation itself: reference-stats/golden/qwen3_public (see its README) holds real
// Qwen3-8B statistics of two layers, post-RoPE keys, and the scores and keep sets that the
// reference's `compute_scores_pytorch` gave in float64. The stats go through
// tools/convert_reference_stats.py with the layers, round start and budget of case.json.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli.hpp"
#include "support/data.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/json.hpp"
#include "triattn/io/npy.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
using triattn_test::cli::run_cli;
using triattn_test::cli::scratch_dir;

const io::json::value& member(const io::json::value& v, std::string_view key, io::json::value_type type) {
  const io::json::value* m = v.find(key);
  INFO("case.json: " << key);
  REQUIRE(m != nullptr);
  REQUIRE(m->type == type);
  return *m;
}

std::vector<double> as_double(const io::npy_array& a) {
  REQUIRE(a.kind == io::element_kind::f64);
  std::vector<double> v(static_cast<std::size_t>(a.size()));
  std::memcpy(v.data(), a.data.data(), a.data.size());
  return v;
}

}  // namespace

TEST_CASE("score and select triattention match the reference implementation (qwen3_public)", "[cli][parity]") {
  const fs::path golden = triattn_test::data_dir() / "reference-stats" / "golden" / "qwen3_public";
  const fs::path case_file = golden / "case.json";
  REQUIRE(fs::exists(case_file));
  const io::json::value c = io::json::parse(triattn_test::cli::read_text(case_file), case_file.string());
  const std::int64_t round_start = member(c, "round_start", io::json::value_type::integer).integer;
  const std::int64_t budget = member(c, "budget", io::json::value_type::integer).integer;
  const std::int64_t q_heads = member(c, "num_q_heads", io::json::value_type::integer).integer;
  const std::int64_t kv_heads = member(c, "num_kv_heads", io::json::value_type::integer).integer;
  const std::string stats_name = member(c, "stats_file", io::json::value_type::string).text;
  REQUIRE(member(c, "rope_style", io::json::value_type::string).text == "half");
  std::string layer_list;
  const auto& layers = member(c, "layers", io::json::value_type::array).items;
  for (const auto& l : layers) {
    REQUIRE(l.type == io::json::value_type::integer);
    if (!layer_list.empty()) layer_list += ',';
    layer_list += std::to_string(l.integer);
  }
  const auto num_layers = static_cast<std::int64_t>(layers.size());

  // Qwen3-8B: 8 kv-heads, theta 1e6, no scaling (reference-stats/README.md).
  const scratch_dir dir("cli_parity");
  const std::string stats = (dir / "qwen3_8b_layers.safetensors").string();
  triattn_test::cli::convert(
      golden.parent_path().parent_path() / stats_name,
      "--num-kv-heads " + std::to_string(kv_heads) + " --rope-theta 1000000 --layers " + layer_list, stats);
  const triattn::query_stats st = triattn::load_stats(stats);
  REQUIRE(st.num_layers == num_layers);
  REQUIRE(st.num_q_heads == q_heads);

  const std::string keys = (golden / "keys.npy").string();
  const std::string scores_file = (dir / "scores.npy").string(), keep_file = (dir / "keep.npy").string();
  const std::vector<std::string> common = {"--stats", stats,           "--keys",
                                           keys,      "--round-start", std::to_string(round_start)};
  std::vector<std::string> score = {"score", "triattention"}, select = {"select", "triattention"};
  score.insert(score.end(), common.begin(), common.end());
  select.insert(select.end(), common.begin(), common.end());
  score.insert(score.end(), {"--out", scores_file});
  select.insert(select.end(), {"--budget", std::to_string(budget), "--out", keep_file});
  for (const auto* args : {&score, &select}) {
    const auto r = run_cli(dir, *args);
    INFO("command: " << r.command << "\nstderr: " << r.err);
    REQUIRE(r.code == 0);
  }

  {  // scores: float32 [L, Hq, N], within 1e-4 of each row's largest |score|
    const io::npy_array got = io::read_npy(scores_file);
    const io::npy_array want = io::read_npy(golden / "expected_scores.npy");
    const std::int64_t n = io::read_npy(keys).shape[2];
    REQUIRE(got.kind == io::element_kind::f32);
    REQUIRE(got.shape == std::vector<std::int64_t>{num_layers, q_heads, n});
    REQUIRE(want.shape == got.shape);
    const std::vector<float> s = got.to_float();
    const std::vector<double> e = as_double(want);
    double worst = 0.0;
    for (std::int64_t row = 0; row < num_layers * q_heads; ++row) {
      double scale = 0.0, err = 0.0;
      for (std::int64_t j = 0; j < n; ++j) scale = std::max(scale, std::abs(e[static_cast<std::size_t>(row * n + j)]));
      for (std::int64_t j = 0; j < n; ++j) {
        const auto i = static_cast<std::size_t>(row * n + j);
        err = std::max(err, std::abs(s[i] - e[i]));
      }
      INFO("layer " << row / q_heads << " q-head " << row % q_heads << ": max error " << err << ", row scale "
                    << scale);
      REQUIRE(scale > 0.0);
      CHECK(err <= 1e-4 * scale);
      worst = std::max(worst, err / scale);
    }
    std::printf("parity: worst score error %.3g of the row's largest |score|\n", worst);
  }

  {  // keep sets: int64 [Hkv, B], identical to the reference
    const io::npy_array got = io::read_npy(keep_file);
    const io::npy_array want = io::read_npy(golden / "expected_keep.npy");
    REQUIRE(got.kind == io::element_kind::i64);
    REQUIRE(got.shape == std::vector<std::int64_t>{kv_heads, budget});
    REQUIRE(want.shape == got.shape);
    const std::vector<std::int64_t> k = got.to_int64(), w = want.to_int64();
    for (std::int64_t h = 0; h < kv_heads; ++h) {
      const auto row = [&](const std::vector<std::int64_t>& v) {
        return std::vector<std::int64_t>(v.begin() + h * budget, v.begin() + (h + 1) * budget);
      };
      INFO("kv-head " << h);
      CHECK(row(k) == row(w));
    }
  }
}
