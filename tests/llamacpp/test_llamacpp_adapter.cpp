// triattn inside llama.cpp (tools/triattn_llamacpp.cpp, runner/triattn_llama.hpp): the program `triattn_llamacpp` run as users run
// it, on SmolLM2-135M-Instruct, and the adapter's refusals in-process.
// - With a budget above the answer no round runs and every logit equals the full cache's
//   (KL exactly 0): the lockstep comparison itself adds nothing.
// - 600 tokens, budget 128, slack 64, batch 64 (n_ctx 256): for TriAttention (calibrated here
//   by `triattn calibrate --model`), StreamingLLM and SnapKV (which reads Qcur), rounds run,
//   the cells in use stay within budget + slack + batch, the free-running answer's tokens are
//   valid ids, and teacher-forced along the full-cache answer each policy's KL is finite and
//   below random eviction's on the same prompt.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/triattn_llama.hpp"
#include "tools/cli.hpp"
#include "triattn/registry.hpp"

namespace {

namespace cli = triattn_test::cli;
namespace fs = std::filesystem;

const fs::path gguf_path = TRIATTN_SMOLLM2_GGUF;
const fs::path test_prompts = fs::path(TRIATTN_SOURCE_DIR) / "eval" / "prompts" / "test.txt";

// One CSV row of `quality`, by column name.
using row = std::map<std::string, std::string>;

std::vector<row> read_csv(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> header;
  std::vector<row> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream s(line);
    for (std::string c; std::getline(s, c, ',');) cells.push_back(c);
    if (header.empty()) {
      header = cells;
      continue;
    }
    REQUIRE(cells.size() == header.size());
    row r;
    for (std::size_t i = 0; i < cells.size(); ++i) r[header[i]] = cells[i];
    rows.push_back(r);
  }
  return rows;
}

// TriAttention's statistics for SmolLM2, calibrated once on its own short answers.
const fs::path& smollm2_stats() {
  static const fs::path path = [] {
    static cli::scratch_dir dir("llamacpp_adapter_stats");
    const fs::path out = dir.path() / "stats.safetensors";
    const std::string cmd = cli::shell_quote(TRIATTN_TEST_TRIATTN) + " calibrate --model " +
                            cli::shell_quote(gguf_path.string()) + " --prompts " +
                            cli::shell_quote((fs::path(TRIATTN_SOURCE_DIR) / "eval" / "prompts" / "calibration.txt").string()) +
                            " --answer-tokens 128 --out " + cli::shell_quote(out.string()) + " 2>/dev/null";
    REQUIRE(triattn_test::system_status(cmd) == 0);
    return out;
  }();
  return path;
}

}  // namespace

TEST_CASE("llama.cpp with a budget above the answer: no round, every logit the full cache's", "[llamacpp]") {
  cli::scratch_dir dir("llamacpp_no_round");
  const fs::path csv = dir.path() / "q.csv";
  const cli::result r = cli::run_cli(dir, {"quality", "--model", gguf_path.string(), "--prompts", test_prompts.string(),
                                           "--count", "1", "--policies", "streaming_llm,snapkv", "--budgets", "200",
                                           "--tokens", "100", "--csv", csv.string()});
  INFO(r.command << "\n" << r.err);
  REQUIRE(r.code == 0);
  const std::vector<row> rows = read_csv(csv);
  REQUIRE(rows.size() == 2);
  for (const row& x : rows) {
    INFO(x.at("policy"));
    CHECK(x.at("rounds") == "0");
    CHECK(std::stod(x.at("kl")) == 0.0);
    CHECK(std::stod(x.at("top1")) == 1.0);
  }
}

TEST_CASE("llama.cpp generates 600 tokens through 256 cells, every policy above random", "[llamacpp]") {
  cli::scratch_dir dir("llamacpp_600");
  const std::string stats = smollm2_stats().string();
  const ggml_bridge::vocab vocab(gguf_path);
  const std::vector<std::string> common = {"--model", gguf_path.string(), "--stats", stats, "--budget", "128",
                                           "--slack", "64", "--batch", "64", "--tokens", "600"};

  for (const std::string policy : {"triattention", "streaming_llm", "snapkv"}) {
    const fs::path ids = dir.path() / (policy + ".ids");
    std::vector<std::string> args = {"generate", "--policy", policy, "--ids", ids.string()};
    args.insert(args.end(), common.begin(), common.end());
    const cli::result r = cli::run_cli(dir, args);
    INFO(r.command << "\n" << r.err << "\n" << r.out);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.out, m, std::regex(R"(at most (\d+) \(n_ctx (\d+)\))")));
    CHECK(std::stoi(m[1]) <= 128 + 64 + 64);
    CHECK(std::stoi(m[2]) <= 256);
    REQUIRE(std::regex_search(r.out, m, std::regex(R"(rounds: (\d+))")));
    CHECK(std::stoi(m[1]) >= 1);
    std::ifstream in(ids);
    std::vector<int> tokens;
    for (int t = 0; in >> t;) tokens.push_back(t);
    REQUIRE(tokens.size() == 600);
    for (const int t : tokens) {
      REQUIRE(t >= 0);
      REQUIRE(t < vocab.n_vocab());
      REQUIRE(!vocab.is_eog(t));  // the sampler bans them: an end token would be a wrong id
    }
  }

  const fs::path csv = dir.path() / "q.csv";
  std::vector<std::string> args = {"quality", "--prompts", test_prompts.string(), "--count", "1", "--policies",
                                   "triattention,streaming_llm,snapkv,random", "--budgets", "128", "--csv", csv.string()};
  args.insert(args.end(), common.begin(), common.end());
  const cli::result r = cli::run_cli(dir, args);
  INFO(r.command << "\n" << r.err);
  REQUIRE(r.code == 0);
  std::map<std::string, row> by_policy;
  for (const row& x : read_csv(csv)) by_policy[x.at("policy")] = x;
  REQUIRE(by_policy.size() == 4);
  const double random_kl = std::stod(by_policy.at("random").at("kl"));
  for (const auto& [policy, x] : by_policy) {
    INFO(policy << ": KL " << x.at("kl") << ", random " << random_kl);
    // Counted from the first round: the prompt and 192 - prompt tokens come before it.
    CHECK(std::stoi(x.at("steps")) > 400);
    CHECK(std::stoi(x.at("steps")) < 600);
    CHECK(std::stoi(x.at("rounds")) >= 1);
    CHECK(std::stoi(x.at("peak_cells")) <= 256);
    CHECK(std::stoi(x.at("n_ctx")) <= 256);
    CHECK(x.at("invalid_tokens") == "0");
    const double kl = std::stod(x.at("kl"));
    CHECK(std::isfinite(kl));
    CHECK(kl > 0.0);  // evictions happened: the logits must differ from the full cache's
    if (policy != "random") CHECK(kl < random_kl);
  }
}

TEST_CASE("the adapter refuses what llama.cpp's cells cannot hold", "[llamacpp]") {
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path, false, "test");
  const triattn::kv_geometry g = triattn_llama::geometry_of(model.get());
  CHECK(g.num_layers == 30);
  CHECK(g.num_kv_heads == 3);
  CHECK(g.head_dim == 64);
  CHECK(g.rope.style == triattn::rope_style::interleaved);  // GGUF's llama arch: LLAMA_ROPE_TYPE_NORM
  CHECK(g.rope.theta == 100000.0);

  triattn_llama::options o;
  o.budget = 128;
  o.capacity = 256;
  // A keep set per layer would leave a cell half evicted.
  using adapter = triattn_llama::adapter<triattn::any_policy>;
  try {
    adapter a(model.get(), triattn::any_policy(triattn::streaming_llm{}), o);
    FAIL("a per-layer policy was accepted");
  } catch (const triattn::error& e) {
    CHECK_THAT(e.what(), Catch::Contains("triattn_llama::adapter") && Catch::Contains("per_layer") &&
                             Catch::Contains("whole_sequence"));
  }
  triattn::streaming_llm_config c;
  c.round.grain = triattn::granularity::whole_sequence;
  o.capacity = 128;
  try {
    adapter a(model.get(), triattn::any_policy(triattn::streaming_llm(c)), o);
    FAIL("a mirror no larger than the budget was accepted");
  } catch (const triattn::error& e) {
    CHECK_THAT(e.what(), Catch::Contains("capacity 128"));
  }
}
