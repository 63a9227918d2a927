// triattn_eval's long-context regimes on SmolLM2, run as users run them (eval/long_context.hpp):
// - `long`: the CSV equals an independent computation written here, one sequence at a time
//   with the plain session API: the reference answer sampled step by step, a compressed
//   sequence teacher-forced along it (KL, top-1, NLL), and a second compressed sequence that
//   really runs free (its own tokens, the same uniforms), whose matching prefix must be the
//   CSV's gen_prefix; two runs (1 and 2 threads) give byte-identical files;
// - `passkey`: the prompt holds the key at the asked depth, the full cache finds it, and the
//   accuracy table agrees with the per-sample answers;
// - `triattn calibrate --prompts`: the same statistics as llama2c::calibrate_on_answers.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "llama2c/calibration.hpp"
#include "llama2c/policies.hpp"
#include "llama2c/text_model.hpp"
#include "tools/cli.hpp"
#include "triattn/calibration/stats_file.hpp"

namespace {

namespace cli = triattn_test::cli;
namespace fs = std::filesystem;

const fs::path gguf_path = TRIATTN_SMOLLM2_GGUF;

std::vector<std::vector<std::string>> read_csv(const fs::path& p) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(triattn_test::read_text(p));
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::istringstream l(line);
    for (std::string c; std::getline(l, c, ',');) cells.push_back(c);
    rows.push_back(cells);
  }
  return rows;
}

/// The CSV row of `policy` at `budget` as column name -> value.
std::map<std::string, std::string> csv_row(const std::vector<std::vector<std::string>>& csv, const std::string& policy,
                                           const std::string& budget) {
  for (std::size_t r = 1; r < csv.size(); ++r)
    if (csv[r][0] == policy && csv[r][1] == budget) {
      std::map<std::string, std::string> out;
      for (std::size_t c = 0; c < csv[0].size(); ++c) out[csv[0][c]] = csv[r][c];
      return out;
    }
  FAIL("no row " << policy << " " << budget);
  return {};
}

void write_text(const fs::path& p, const std::string& s) {
  triattn_test::write_bytes(p, std::vector<std::byte>(reinterpret_cast<const std::byte*>(s.data()),
                                                      reinterpret_cast<const std::byte*>(s.data()) + s.size()));
}

double log_sum_exp(std::span<const float> z) {
  double m = -INFINITY;
  for (const float v : z) m = std::max(m, static_cast<double>(v));
  double s = 0.0;
  for (const float v : z) s += std::exp(v - m);
  return m + std::log(s);
}

TEST_CASE("triattn_eval long: the CSV is an independent sequential computation, and deterministic", "[eval][gguf]") {
  cli::scratch_dir dir("long_context");
  const std::string prompt = "Tell me a short story about a cat who learns to swim.";
  write_text(dir.path() / "prompts.txt", "# a comment line\n\n" + prompt + "\n");
  const std::int64_t tokens = 40, budget = 24, slack = 8;
  const auto run = [&](const char* threads, const fs::path& out) {
    const cli::result r = cli::run_cli(dir, {"long", "--model", gguf_path.string(), "--prompts",
                                             (dir.path() / "prompts.txt").string(), "--policies",
                                             "full,streaming_llm,window", "--budgets", std::to_string(budget),
                                             "--tokens", std::to_string(tokens), "--slack", std::to_string(slack),
                                             "--threads", threads, "--out", out.string()});
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
  };
  run("1", dir.path() / "a");
  run("2", dir.path() / "b");
  for (const char* f : {"long.csv", "long_prompts.csv", "answers.txt"})
    CHECK(triattn_test::read_text(dir.path() / "a" / f) == triattn_test::read_text(dir.path() / "b" / f));
  const auto csv = read_csv(dir.path() / "a" / "long.csv");
  REQUIRE(csv.size() == 4);  // header, full, streaming_llm, window

  // The oracle: sampled reference, a teacher-forced and a free-running StreamingLLM sequence.
  const llama2c::text_model tm = llama2c::text_model::load(gguf_path, "");
  const llama2c::model& m = tm.model();
  const std::vector<int> p = tm.chat(prompt);
  const auto P = static_cast<std::int64_t>(p.size());
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();
  const triattn::schedule sched = triattn::schedule::with_slack(slack);
  const auto make = [&] { return *llama2c::find_policy("streaming_llm")->create({nullptr, sched}); };
  llama2c::session full(m, P + tokens), forced(m, budget + slack), free_run(m, budget + slack);
  llama2c::any_policy forced_policy = make(), free_policy = make();
  std::mt19937_64 rng = llama2c::window_rng(1, 0);  // seed 1 (the default), prompt 0
  llama2c::answer_sampler reference(0.7, 1.2f, 128, allowed), own(0.7, 1.2f, 128, allowed);  // the defaults
  double kl = 0, top1 = 0, nll = 0, full_nll = 0;
  std::int64_t n = 0, prefix = -1;
  int ref_token = p[0], free_token = p[0];
  bool forced_compressed = false;
  for (std::int64_t t = 0; t + 1 < P + tokens; ++t) {
    const bool scored = forced_compressed;
    const auto ref = full.forward(ref_token);
    const std::vector<float> ref_logits(ref.begin(), ref.end());
    const auto z = forced.forward(ref_token);
    const std::vector<float> forced_logits(z.begin(), z.end());
    std::vector<float> free_logits;
    if (prefix < 0) {
      const auto f = free_run.forward(free_token);
      free_logits.assign(f.begin(), f.end());
    }
    int next;
    if (t + 1 < P) {
      next = p[static_cast<std::size_t>(t + 1)];
      free_token = next;
    } else {
      const double u = llama2c::uniform_draw(rng);
      next = reference.draw(ref_logits, u);
      reference.push(next);
      if (prefix < 0) {  // the free run draws with its own history: its own tokens so far
        free_token = own.draw(free_logits, u);
        own.push(free_token);
        if (free_token != next) prefix = t + 1 - P;
      }
      if (scored) {
        const double lp = log_sum_exp(ref_logits), lq = log_sum_exp(forced_logits);
        double k = 0.0;
        for (std::size_t i = 0; i < ref_logits.size(); ++i)
          k += std::exp(ref_logits[i] - lp) * ((ref_logits[i] - lp) - (forced_logits[i] - lq));
        kl += k;
        top1 += llama2c::argmax(ref_logits) == llama2c::argmax(forced_logits) ? 1 : 0;
        nll += lq - forced_logits[static_cast<std::size_t>(next)];
        full_nll += lp - ref_logits[static_cast<std::size_t>(next)];
        ++n;
      }
    }
    ref_token = next;
    forced_compressed |= triattn::maybe_compress(forced_policy, forced.view(), budget, {forced.position(), P});
    if (prefix < 0) triattn::maybe_compress(free_policy, free_run.view(), budget, {free_run.position(), P});
  }
  if (prefix < 0) prefix = tokens;
  REQUIRE(n > 0);
  const auto row = csv_row(csv, "streaming_llm", std::to_string(budget));
  CHECK(std::stod(row.at("kl")) == Approx(kl / static_cast<double>(n)).margin(2e-6));
  CHECK(std::stod(row.at("top1")) == Approx(top1 / static_cast<double>(n)).margin(2e-6));
  CHECK(std::stod(row.at("nll")) == Approx(nll / static_cast<double>(n)).margin(2e-6));
  CHECK(std::stoll(row.at("positions")) == n);
  CHECK(std::stod(row.at("gen_prefix")) == static_cast<double>(prefix));
  CHECK(std::stod(row.at("kl")) > 0.0);
  const auto f = csv_row(csv, "full", std::to_string(budget));
  CHECK(std::stod(f.at("kl")) == 0.0);
  CHECK(std::stod(f.at("nll")) == Approx(full_nll / static_cast<double>(n)).margin(2e-6));
  CHECK(std::stod(f.at("gen_prefix")) == static_cast<double>(tokens));
  // The answer file holds the sampled answer.
  CHECK(triattn_test::read_text(dir.path() / "a" / "answers.txt").find(prompt) != std::string::npos);
}

TEST_CASE("triattn_eval passkey: the key at its depth, found with the full cache", "[eval][gguf]") {
  cli::scratch_dir dir("passkey");
  const cli::result r = cli::run_cli(dir, {"passkey", "--model", gguf_path.string(), "--policies", "full,streaming_llm",
                                           "--contexts", "160", "--depths", "0.5", "--fractions", "0.5", "--threads",
                                           "2", "--out", (dir.path() / "out").string()});
  INFO("stderr: " << r.err);
  REQUIRE(r.code == 0);
  const auto samples = read_csv(dir.path() / "out" / "passkey_samples.csv");
  REQUIRE(samples.size() == 3);  // header, full, streaming_llm
  CHECK(samples[1][0] == "full");
  CHECK(samples[1][6] == "1");  // SmolLM2 finds a key in the middle of 160 tokens
  CHECK(samples[1][7].find(samples[1][5]) != std::string::npos);
  const auto acc = read_csv(dir.path() / "out" / "passkey.csv");
  for (std::size_t i = 1; i < acc.size(); ++i) {
    const std::string want = acc[i][0] == "full" ? samples[1][6] : samples[2][6];
    CHECK(std::stod(acc[i][4]) == std::stod(want));
  }
}

TEST_CASE("calibrate --prompts: the statistics of the model's own answers, as in-process", "[tools][gguf]") {
  cli::scratch_dir dir("calibrate_answers");
  write_text(dir.path() / "prompts.txt", "Explain why the sky is blue.\nWrite a poem about rain.\n");
  const fs::path out = dir.path() / "stats.safetensors";
  // The `triattn` executable: tests/tools/cli.hpp runs TRIATTN_TEST_CLI, which is triattn_eval
  // here, so this one command is spelled out.
  const std::string cmd = cli::shell_quote(TRIATTN_TEST_TRIATTN) + " calibrate --model " +
                          cli::shell_quote(gguf_path.string()) + " --prompts " +
                          cli::shell_quote((dir.path() / "prompts.txt").string()) + " --answer-tokens 16 --seed 3 --out " +
                          cli::shell_quote(out.string()) + " 2>/dev/null";
  REQUIRE(triattn_test::system_status(cmd) == 0);
  const triattn::query_stats got = triattn::load_stats(out);
  const llama2c::text_model tm = llama2c::text_model::load(gguf_path, "");
  const std::vector<std::vector<int>> prompts{tm.chat("Explain why the sky is blue."), tm.chat("Write a poem about rain.")};
  const int length = static_cast<int>(std::max(prompts[0].size(), prompts[1].size())) + 16;
  const triattn::query_stats want =
      llama2c::calibrate_on_answers(tm.model(), prompts, length, 3, 0.7, tm.non_ending_tokens(), {}, 1.2f, 128);
  CHECK(got.info.at("num_traces") == "2");
  CHECK(got.q_mean_real == want.q_mean_real);
  CHECK(got.q_mean_imag == want.q_mean_imag);
  CHECK(got.q_abs_mean == want.q_abs_mean);
}

}  // namespace
