// triattn_eval's long-context regimes on SmolLM2, run as users run them (eval/long_context.hpp):
// - `long`: the CSV equals an independent computation written here, one sequence at a time
//   with the plain session API, for StreamingLLM, H2O and SnapKV at two budgets: the
//   reference answer sampled step by step, a compressed
//   sequence teacher-forced along it (KL, top-1, NLL), and a second compressed sequence that
//   really runs free (its own tokens, the same uniforms), whose matching prefix must be the
//   CSV's gen_prefix; two runs (1 and 2 threads) give byte-identical files;
// - `passkey`: the prompt holds the key at the asked depth, the full cache finds it, the
//   accuracy table agrees with the per-sample answers, and every answer (full cache, H2O and
//   SnapKV at two budgets, two samples in one batch) is that of the sequence decoded alone;
// - `retrieval`: the needle families' haystack is the model's own prose, their samples hold
//   their keys at the asked depth, and every answer after one round at the end of the prefill
//   is that of the sequence decoded alone;
// - `generate`: a needle in varied prose, found by the full cache; every registry policy's
//   answer (chunked prefill, and once after the whole prompt) is that of an independent
//   sequential computation; nothing but the answer on stdout; bad input refused in one line;
// - `triattn calibrate --prompts`: the same statistics as triattn_runner::calibrate_on_answers.
#include <catch2/catch.hpp>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "generate.hpp"
#include "long_context.hpp"
#include "runner/calibration.hpp"
#include "runner/compressed_session.hpp"
#include "runner/text_model.hpp"
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

/// A registry policy's inputs: no statistics, the rounds on `sched`.
triattn::policy_inputs on_schedule(triattn::schedule sched) {
  triattn::policy_inputs in;
  in.sched = sched;
  return in;
}

/// One compressed sequence of the oracle: its session, its policy and the policy's feed.
struct oracle_sequence {
  triattn_runner::session session;
  triattn::any_policy policy;
  triattn_runner::policy_observer feed;
  oracle_sequence(const triattn_runner::model& m, std::int64_t capacity, triattn::any_policy p)
      : session(m, capacity), policy(std::move(p)), feed(policy) {
    policy.attach(session.view());
    session.set_observer(&feed);
  }
  oracle_sequence(const oracle_sequence&) = delete;  // the session and the feed point into it
  oracle_sequence& operator=(const oracle_sequence&) = delete;
};

TEST_CASE("triattn_eval long: the CSV is an independent sequential computation, and deterministic", "[eval][gguf]") {
  cli::scratch_dir dir("long_context");
  // Two prompts of different lengths, decoded in one batch by triattn_eval.
  const std::vector<std::string> prompts{"Tell me a short story about a cat who learns to swim.",
                                         "List three colours of the sea at night, one line each, and say why."};
  write_text(dir.path() / "prompts.txt", "# a comment line\n\n" + prompts[0] + "\n" + prompts[1] + "\n");
  // Policies that read nothing, the attention (H2O) and the recent queries (SnapKV); two budgets
  // whose first rounds fall on different steps, so that rows leave the full-cache trunk apart.
  const std::vector<std::string> policies{"streaming_llm", "h2o", "snapkv"};
  const std::int64_t tokens = 40, slack = 8;
  const std::vector<std::int64_t> budgets{24, 56};
  const auto run = [&](const char* threads, const fs::path& out) {
    const cli::result r = cli::run_cli(dir, {"long", "--model", gguf_path.string(), "--prompts",
                                             (dir.path() / "prompts.txt").string(), "--policies",
                                             "full,streaming_llm,h2o,snapkv,window", "--budgets", "24,56",
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
  REQUIRE(csv.size() == 11);  // header, (full, streaming_llm, h2o, snapkv, window) x 2 budgets
  const auto per_prompt = read_csv(dir.path() / "a" / "long_prompts.csv");

  // The oracle, per policy and budget: the sampled reference, a teacher-forced and a
  // free-running compressed sequence, each decoding its own tokens from the first one through
  // its own cache (no trunk). They step together through a batch_decoder only for speed: a
  // sequence's logits are the same bits alone or in a batch (tests/runner/test_model.cpp).
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const triattn_runner::model& m = tm.model();
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();
  std::map<std::int64_t, double> full_nll_mean;  // budget -> mean over prompts of the full cache's NLL
  for (std::size_t prompt_index = 0; prompt_index < prompts.size(); ++prompt_index) {
    INFO("prompt " << prompt_index);
    const std::vector<int> p = tm.chat(prompts[prompt_index]);
    const auto P = static_cast<std::int64_t>(p.size());
    const triattn::schedule sched = triattn::schedule::with_slack(slack);
    struct config_run {
      std::string name;
      std::int64_t budget;
      oracle_sequence forced, free_run;
      triattn_runner::answer_sampler own;
      double kl = 0, top1 = 0, nll = 0, full_nll = 0;
      std::int64_t n = 0, prefix = -1;
      int free_token;
      bool forced_compressed = false;
      config_run(const triattn_runner::model& m, const std::string& policy, std::int64_t b, std::int64_t capacity,
                 const triattn::schedule& sched, std::span<const std::uint8_t> allowed, int first)
          : name(policy),
            budget(b),
            forced(m, capacity, *triattn::find_policy(policy)->create(on_schedule(sched))),
            free_run(m, capacity, *triattn::find_policy(policy)->create(on_schedule(sched))),
            own(0.7, 1.2f, 128, allowed),  // the defaults
            free_token(first) {}
    };
    std::deque<config_run> runs;
    for (const std::string& name : policies)
      for (const std::int64_t budget : budgets) runs.emplace_back(m, name, budget, budget + slack, sched, allowed, p[0]);
    triattn_runner::session full(m, P + tokens);
    triattn_runner::batch_decoder decoder(m);
    std::mt19937_64 rng = triattn_runner::window_rng(1, prompt_index);        // seed 1 (the default)
    triattn_runner::answer_sampler reference(0.7, 1.2f, 128, allowed);        // the defaults
    int ref_token = p[0];
    for (std::int64_t t = 0; t + 1 < P + tokens; ++t) {
      std::vector<triattn_runner::session*> batch{&full};
      std::vector<int> in{ref_token};
      for (config_run& c : runs) {
        batch.push_back(&c.forced.session);
        in.push_back(ref_token);
        if (c.prefix < 0) {
          batch.push_back(&c.free_run.session);
          in.push_back(c.free_token);
        }
      }
      decoder.step(batch, in);
      const auto logits = [&](std::size_t k) {
        const auto z = decoder.logits(static_cast<int>(k));
        return std::vector<float>(z.begin(), z.end());
      };
      const std::vector<float> ref_logits = logits(0);
      int next = 0;
      double u = 0;
      if (t + 1 < P) {
        next = p[static_cast<std::size_t>(t + 1)];
      } else {
        u = triattn_runner::uniform_draw(rng);
        next = reference.draw(ref_logits, u);
        reference.push(next);
      }
      std::size_t k = 1;
      for (config_run& c : runs) {
        const bool scored = c.forced_compressed;
        const std::vector<float> forced_logits = logits(k++);
        if (c.prefix >= 0) {
        } else if (t + 1 < P) {
          ++k;
          c.free_token = next;
        } else {  // the free run draws with its own history: its own tokens so far
          c.free_token = c.own.draw(logits(k++), u);
          c.own.push(c.free_token);
          if (c.free_token != next) c.prefix = t + 1 - P;
        }
        if (t + 1 >= P && scored) {
          const double lp = log_sum_exp(ref_logits), lq = log_sum_exp(forced_logits);
          double kl = 0.0;
          for (std::size_t i = 0; i < ref_logits.size(); ++i)
            kl += std::exp(ref_logits[i] - lp) * ((ref_logits[i] - lp) - (forced_logits[i] - lq));
          c.kl += kl;
          c.top1 += triattn_runner::argmax(ref_logits) == triattn_runner::argmax(forced_logits) ? 1 : 0;
          c.nll += lq - forced_logits[static_cast<std::size_t>(next)];
          c.full_nll += lp - ref_logits[static_cast<std::size_t>(next)];
          ++c.n;
        }
      }
      ref_token = next;
      for (config_run& c : runs) {
        c.forced_compressed |=
            triattn::maybe_compress(c.forced.policy, c.forced.session.view(), c.budget, {c.forced.session.position(), P});
        if (c.prefix < 0)
          triattn::maybe_compress(c.free_run.policy, c.free_run.session.view(), c.budget, {c.free_run.session.position(), P});
      }
    }
    for (const config_run& c : runs) {
      INFO(c.name << " at budget " << c.budget);
      const std::int64_t prefix = c.prefix < 0 ? tokens : c.prefix;
      REQUIRE(c.n > 0);
      const auto n = static_cast<double>(c.n);
      // long_prompts.csv: policy,budget,prompt,kl,top1,nll,gen_prefix,positions,kv_bytes
      const std::vector<std::string>* row = nullptr;
      for (std::size_t r = 1; r < per_prompt.size(); ++r)
        if (per_prompt[r][0] == c.name && per_prompt[r][1] == std::to_string(c.budget) &&
            per_prompt[r][2] == std::to_string(prompt_index))
          row = &per_prompt[r];
      REQUIRE(row != nullptr);
      CHECK(std::stod((*row)[3]) == Approx(c.kl / n).margin(2e-6));
      CHECK(std::stod((*row)[4]) == Approx(c.top1 / n).margin(2e-6));
      CHECK(std::stod((*row)[5]) == Approx(c.nll / n).margin(2e-6));
      CHECK(std::stoll((*row)[6]) == prefix);
      CHECK(std::stoll((*row)[7]) == c.n);
      CHECK(std::stod((*row)[3]) > 0.0);
      full_nll_mean[c.budget] += c.full_nll / n / static_cast<double>(prompts.size());  // the same for every policy
    }
  }
  for (const std::int64_t budget : budgets) {
    const auto f = csv_row(csv, "full", std::to_string(budget));
    CHECK(std::stod(f.at("kl")) == 0.0);
    CHECK(std::stod(f.at("nll")) == Approx(full_nll_mean[budget] / static_cast<double>(policies.size())).margin(2e-6));
    CHECK(std::stod(f.at("gen_prefix")) == static_cast<double>(tokens));
  }
  // The answer file holds the sampled answer.
  for (const std::string& prompt : prompts)
    CHECK(triattn_test::read_text(dir.path() / "a" / "answers.txt").find(prompt) != std::string::npos);
}

TEST_CASE("triattn_eval prefill: one round after the context, as an independent sequential computation",
          "[eval][gguf]") {
  cli::scratch_dir dir("prefill");
  // The test's own prose, paragraphs apart: enough for three windows of 57 tokens.
  std::string prose;
  for (int i = 0; i < 40; ++i)
    prose += "On day " + std::to_string(i) + " the miller counted " + std::to_string(7 * i + 3) +
             " sacks of grain, and the river carried the boat past the old bridge.\n\n";
  const fs::path text = dir.path() / "prose.txt";
  write_text(text, prose);
  const std::int64_t context = 48, tokens = 8, budget = 16;
  const auto run = [&](const char* threads, const fs::path& out) {
    const cli::result r = cli::run_cli(
        dir, {"prefill", "--model", gguf_path.string(), "--text", text.string(), "--policies",
              "streaming_llm,snapkv,expected_attention", "--budgets", std::to_string(budget), "--context",
              std::to_string(context), "--tokens", std::to_string(tokens), "--windows", "2", "--first-window", "1",
              "--protocol", "sinks=4,recent=8", "--threads", threads, "--out", out.string()});
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
  };
  run("1", dir.path() / "a");
  run("2", dir.path() / "b");
  for (const char* f : {"prefill.csv", "prefill_windows.csv"})
    CHECK(triattn_test::read_text(dir.path() / "a" / f) == triattn_test::read_text(dir.path() / "b" / f));
  const auto rows = read_csv(dir.path() / "a" / "prefill_windows.csv");
  REQUIRE(rows.size() == 1 + 3 * 2);  // header, 3 policies x 2 windows

  // The oracle: each window's full cache and one sequence per policy, token by token; the
  // policy's round once the context is in, then no other; KL over the continuation.
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const triattn_runner::model& m = tm.model();
  const auto windows = triattn_runner::text_windows([&](std::string_view p) { return tm.encode_paragraph(p); },
                                                    triattn_runner::read_file(text, "test"),
                                                    static_cast<int>(context + tokens + 1), 3);
  REQUIRE(windows.size() == 3);
  triattn::policy_inputs in = on_schedule(triattn::schedule::once_after_prompt());
  in.protocol = triattn::round_protocol{false, 4, 8};
  for (std::size_t r = 1; r < rows.size(); ++r) {
    const std::string& name = rows[r][0];
    const std::vector<int>& x = windows[static_cast<std::size_t>(std::stoi(rows[r][2]))];
    INFO(name << " window " << rows[r][2]);
    triattn_runner::session full(m, context + tokens);
    oracle_sequence c(m, context + tokens, *triattn::find_policy(name)->create(in));
    double kl = 0.0;
    for (std::int64_t t = 0; t < context + tokens; ++t) {
      const auto ref = full.forward(x[static_cast<std::size_t>(t)]);
      const std::vector<float> want(ref.begin(), ref.end());
      const auto got = c.session.forward(x[static_cast<std::size_t>(t)]);
      if (t >= context) {
        const double lp = log_sum_exp(want), lq = log_sum_exp(got);
        for (std::size_t v = 0; v < want.size(); ++v)
          kl += std::exp(want[v] - lp) * ((want[v] - lp) - (got[v] - lq)) / static_cast<double>(tokens);
      }
      if (t + 1 == context) triattn::compress(c.policy, c.session.view(), budget, {c.session.position(), 0});
    }
    CHECK(kl > 0.0);  // the round cut the context and changed the predictions
    CHECK(std::stod(rows[r][3]) == Approx(kl).epsilon(1e-4).margin(1e-6));  // the CSV's 6 decimals
  }
  // A budget that keeps the whole context is refused, naming it.
  const cli::result r = cli::run_cli(dir, {"prefill", "--model", gguf_path.string(), "--text", text.string(),
                                           "--policies", "streaming_llm", "--budgets", "64", "--context", "48",
                                           "--out", (dir.path() / "c").string()});
  CHECK(r.code == 2);
  CHECK(r.err.find("budget 64 must be below --context 48") != std::string::npos);
  CHECK(!fs::exists(dir.path() / "c"));
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

TEST_CASE("triattn_eval passkey: every answer is an independent sequential computation", "[eval][gguf]") {
  // Two samples of one context in one batch, H2O and SnapKV at a budget that a round cuts at
  // the first chunk and at one that only the last chunk cuts; chunks of 64.
  cli::scratch_dir dir("passkey_oracle");
  const std::int64_t context = 200;
  const int chunk = 64, answer_tokens = 6;
  const std::vector<double> fractions{0.3, 0.8};
  const std::vector<std::string> policies{"h2o", "snapkv"};
  const cli::result r = cli::run_cli(
      dir, {"passkey", "--model", gguf_path.string(), "--policies", "full,h2o,snapkv", "--contexts",
            std::to_string(context), "--depths", "0.2,0.7", "--fractions", "0.3,0.8", "--chunk", std::to_string(chunk),
            "--answer-tokens", std::to_string(answer_tokens), "--threads", "2", "--out", (dir.path() / "out").string()});
  INFO("stderr: " << r.err);
  REQUIRE(r.code == 0);
  const auto csv = read_csv(dir.path() / "out" / "passkey_samples.csv");
  REQUIRE(csv.size() == 1 + 2 * (1 + policies.size() * fractions.size()));

  // The oracle: every sequence decoding through its own cache with a round that cuts it to the
  // budget after every chunk (no trunk); stepped together only for speed.
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const triattn_runner::model& m = tm.model();
  struct oracle_row {
    std::string name;  // "full" or the policy
    double fraction = 1.0, depth = 0.0;
    std::int64_t budget = 0;
    const triattn_eval::passkey_sample* sample = nullptr;
    std::vector<int> prompt, answer;
    std::optional<oracle_sequence> seq;
    std::optional<triattn_runner::session> full;
    oracle_row(std::string n, double f, double d, std::int64_t b, const triattn_eval::passkey_sample* s,
               std::vector<int> p)
        : name(std::move(n)), fraction(f), depth(d), budget(b), sample(s), prompt(std::move(p)) {}
    triattn_runner::session& session() { return seq ? seq->session : *full; }
  };
  std::deque<triattn_eval::passkey_sample> keys;
  std::deque<oracle_row> rows;
  for (const double depth : {0.2, 0.7}) {
    const triattn_eval::passkey_sample& s = keys.emplace_back(triattn_eval::make_passkey(tm, context, depth, 0, 1));
    std::vector<int> prompt = s.prefill;
    prompt.insert(prompt.end(), s.question.begin(), s.question.end());
    const auto length = static_cast<std::int64_t>(prompt.size()) + answer_tokens;
    oracle_row& f = rows.emplace_back("full", 1.0, depth, length, &s, prompt);
    f.full.emplace(m, length);
    for (const std::string& name : policies)
      for (const double fr : fractions) {
        oracle_row& x = rows.emplace_back(name, fr, depth, std::llround(fr * static_cast<double>(context)), &s, prompt);
        x.seq.emplace(m, length, *triattn::find_policy(name)->create(on_schedule(triattn::schedule::every_step())));
      }
  }
  triattn_runner::batch_decoder decoder(m);
  for (std::size_t t = 0;; ++t) {
    std::vector<triattn_runner::session*> batch;
    std::vector<int> in;
    std::vector<oracle_row*> who;
    for (oracle_row& x : rows)
      if (t + 1 < x.prompt.size() + static_cast<std::size_t>(answer_tokens)) {
        batch.push_back(&x.session());
        in.push_back(t < x.prompt.size() ? x.prompt[t] : x.answer.back());
        who.push_back(&x);
      }
    if (batch.empty()) break;
    decoder.step(batch, in);
    for (std::size_t k = 0; k < who.size(); ++k) {
      oracle_row& x = *who[k];
      if (t + 1 >= x.prompt.size()) x.answer.push_back(triattn_runner::argmax(decoder.logits(static_cast<int>(k))));
      const std::size_t prefill = x.sample->prefill.size();
      if (x.seq && t + 1 <= prefill && ((t + 1) % chunk == 0 || t + 1 == prefill)) {
        triattn_runner::session& se = x.session();
        bool over = false;
        for (int l = 0; l < m.config().n_layers; ++l)
          for (int h = 0; h < m.config().n_kv_heads; ++h) over |= se.length(l, h) > x.budget;
        if (over) triattn::compress(x.seq->policy, se.view(), x.budget, {se.position(), 0});
      }
    }
  }
  for (const oracle_row& x : rows) {
    INFO(x.name << " at fraction " << x.fraction << ", depth " << x.depth);
    std::string text = tm.decode(x.answer);
    for (char& ch : text)
      if (ch == '\n' || ch == ',' || ch == '"') ch = ' ';
    const std::vector<std::string>* got = nullptr;
    for (std::size_t i = 1; i < csv.size(); ++i)
      if (csv[i][0] == x.name && std::stod(csv[i][1]) == x.fraction && std::stod(csv[i][3]) == x.depth) got = &csv[i];
    REQUIRE(got != nullptr);
    CHECK((*got)[7] == text);
    CHECK((*got)[6] == (text.find(std::to_string(x.sample->key)) != std::string::npos &&
                                triattn_eval::first_number(text) == std::to_string(x.sample->key)
                            ? "1"
                            : "0"));
  }
}

/// A needle in prose of several kinds (no sentence repeats), with the question after it.
std::string needle_prompt(const std::string& key) {
  return "Read the notes below, then answer the question at the end.\n\n"
         "The bakery on Elm Street opens at six. Its owner, a former sailor, bakes rye bread with caraway seeds and "
         "sells out before noon on most Saturdays. Tourists often ask for the recipe, which he keeps in a tin box.\n"
         "Yesterday's weather report said that a cold front would cross the valley overnight, bringing light snow to "
         "the hills and strong winds along the river. Farmers were told to bring their sheep down from the slopes.\n"
         "The secret code for the blue door is " + key + ". Nobody else knows it.\n"
         "In 1854 the town built a stone bridge to replace the old ferry. The bridge has seven arches, and the "
         "middle one is wide enough for a barge with a tall mast. A plaque on the east side names the masons.\n"
         "To make a simple tomato soup, soften an onion in butter, add chopped tomatoes and a little stock, simmer for "
         "twenty minutes, then blend until smooth and season with salt, pepper and a pinch of sugar.\n\n"
         "Question: what is the secret code for the blue door?";
}

TEST_CASE("triattn_eval retrieval: needles in the model's own prose, and one round after the whole prefill",
          "[eval][gguf][retrieval]") {
  cli::scratch_dir dir("retrieval");
  write_text(dir.path() / "haystack.txt", "Describe a walk by the sea.\nWrite about a village market.\n");
  const std::int64_t context = 320;
  const double fraction = 0.4;
  const int answer_tokens = 10, haystack_tokens = 160;
  const cli::result run = cli::run_cli(
      dir, {"retrieval", "--model", gguf_path.string(), "--policies", "full,snapkv,h2o", "--contexts",
            std::to_string(context), "--depths", "0.25,0.75", "--fractions", "0.4", "--compress-at", "end",
            "--answer-tokens", std::to_string(answer_tokens), "--haystack-prompts", (dir.path() / "haystack.txt").string(),
            "--haystack-tokens", std::to_string(haystack_tokens), "--threads", "2", "--out", (dir.path() / "out").string()});
  INFO("stderr: " << run.err);
  REQUIRE(run.code == 0);
  const auto csv = read_csv(dir.path() / "out" / "passkey_samples.csv");
  const std::vector<std::string> families{"single", "multikey", "paraphrase"};
  REQUIRE(csv.size() == 1 + families.size() * 2 * 3);  // header, 3 families x 2 depths x (full, snapkv, h2o)

  // The same haystack and samples in-process: the model's own sentences, none with a digit.
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const triattn_runner::model& m = tm.model();
  triattn_runner::batch_decoder decoder(m, 2);
  const triattn_eval::haystack hay =
      triattn_eval::write_haystack(tm, {"Describe a walk by the sea.", "Write about a village market."}, haystack_tokens, 1, decoder);
  CHECK(hay.sentences.size() >= 8);
  for (const std::string& sentence : hay.sentences) CHECK(sentence.find_first_of("0123456789") == std::string::npos);
  const std::string written = triattn_test::read_text(dir.path() / "out" / "haystack.txt");
  CHECK(written.find(hay.sentences.front().substr(1)) == 0);

  // Each row's answer: the full cache, and one round to the budget after the whole prefill;
  // every row its own sequence, stepped together only for speed.
  struct oracle_row {
    std::string name, family;
    double depth;
    triattn_eval::passkey_sample sample;
    std::vector<int> prompt, answer;
    std::optional<oracle_sequence> x;
    std::optional<triattn_runner::session> full;
    oracle_row(std::string n, std::string f, double d, triattn_eval::passkey_sample s, std::vector<int> p)
        : name(std::move(n)), family(std::move(f)), depth(d), sample(std::move(s)), prompt(std::move(p)) {}
    triattn_runner::session& session() { return x ? x->session : *full; }
  };
  // passkey_prompts.tsv: each sample's ids, as built here. [family + depth] -> ids
  std::map<std::string, std::vector<int>> written_prompts;
  {
    std::ifstream in(dir.path() / "out" / "passkey_prompts.tsv");
    for (std::string line; std::getline(in, line);) {
      std::vector<std::string> f;
      std::stringstream fields(line);
      for (std::string x; std::getline(fields, x, '\t');) f.push_back(x);
      REQUIRE(f.size() == 6);
      CHECK(f[1] == std::to_string(context));
      std::vector<int> ids;
      std::stringstream id_text(f[5]);
      for (int id; id_text >> id;) ids.push_back(id);
      written_prompts[f[0] + " " + f[2] + " " + f[4]] = ids;
    }
  }
  CHECK(written_prompts.size() == families.size() * 2);
  std::deque<oracle_row> rows;
  const std::int64_t budget = std::llround(fraction * static_cast<double>(context));
  for (const std::string& family : families)
    for (const double depth : {0.25, 0.75}) {
      INFO(family << " at depth " << depth);
      const triattn_eval::passkey_sample s = triattn_eval::make_needle_sample(tm, hay, family, context, depth, 0, 1);
      std::vector<int> prompt = s.prefill;
      prompt.insert(prompt.end(), s.question.begin(), s.question.end());
      const auto n = static_cast<std::int64_t>(prompt.size());
      CHECK(written_prompts[family + " " + (depth == 0.25 ? "0.25" : "0.75") + " " + std::to_string(s.key)] == prompt);
      CHECK(n <= context + 8);  // the asked context, to a sentence
      CHECK(n >= context * 4 / 5);
      const std::string text = tm.decode(s.prefill);
      const auto at = text.find(std::to_string(s.key));
      REQUIRE(at != std::string::npos);
      CHECK(std::fabs(static_cast<double>(at) / static_cast<double>(text.size()) - depth) < 0.25);
      std::size_t numbers = 0;  // runs of digits in the text: 4 keys for multikey, else 1
      for (std::size_t i = 0; i < text.size(); ++i)
        if (std::isdigit(static_cast<unsigned char>(text[i])) && (i == 0 || !std::isdigit(static_cast<unsigned char>(text[i - 1]))))
          ++numbers;
      CHECK(numbers == (family == "multikey" ? 4u : 1u));
      for (const std::string name : {"full", "snapkv", "h2o"}) {
        oracle_row& r = rows.emplace_back(name, family, depth, s, prompt);
        if (name == "full")
          r.full.emplace(m, n + answer_tokens);
        else
          r.x.emplace(m, n + answer_tokens, *triattn::find_policy(name)->create(on_schedule(triattn::schedule::every_step())));
      }
    }
  for (std::size_t t = 0;; ++t) {
    std::vector<triattn_runner::session*> batch;
    std::vector<int> in;
    std::vector<oracle_row*> who;
    for (oracle_row& r : rows)
      if (r.answer.size() < static_cast<std::size_t>(answer_tokens)) {
        batch.push_back(&r.session());
        in.push_back(t < r.prompt.size() ? r.prompt[t] : r.answer.back());
        who.push_back(&r);
      }
    if (batch.empty()) break;
    decoder.step(batch, in);
    for (std::size_t k = 0; k < who.size(); ++k) {
      oracle_row& r = *who[k];
      triattn_runner::session& se = r.session();
      if (r.x && t + 1 == r.sample.prefill.size()) triattn::compress(r.x->policy, se.view(), budget, {se.position(), 0});
      if (t + 1 >= r.prompt.size()) r.answer.push_back(triattn_runner::argmax(decoder.logits(static_cast<int>(k))));
    }
  }
  int checked = 0;
  for (const oracle_row& r : rows) {
    INFO(r.name << ", " << r.family << " at depth " << r.depth);
    std::string want = tm.decode(r.answer);
    for (char& ch : want)
      if (ch == '\n' || ch == ',' || ch == '"') ch = ' ';
    const std::vector<std::string>* got = nullptr;
    for (std::size_t i = 1; i < csv.size(); ++i)
      if (csv[i][0] == r.name && csv[i][8] == r.family && std::stod(csv[i][3]) == r.depth) got = &csv[i];
    REQUIRE(got != nullptr);
    CHECK((*got)[5] == std::to_string(r.sample.key));
    CHECK((*got)[7] == want);
    CHECK((*got)[6] == (triattn_eval::first_number(want) == std::to_string(r.sample.key) ? "1" : "0"));
    ++checked;
  }
  CHECK(checked == 18);
  const auto acc = read_csv(dir.path() / "out" / "passkey.csv");
  CHECK(acc[0][7] == "family");
  CHECK(acc[1][8] == "end");

  // The written haystack read back (--haystack), each sample in a batch of its own (a cache
  // limit under one sample's): the same answers, byte for byte.
  const fs::path written_haystack = dir.path() / "out" / "haystack.txt";
  std::vector<std::string> again{"retrieval", "--model", gguf_path.string(), "--policies", "full,snapkv,h2o", "--contexts",
                                 std::to_string(context), "--depths", "0.25,0.75", "--fractions", "0.4", "--compress-at",
                                 "end", "--answer-tokens", std::to_string(answer_tokens), "--haystack",
                                 written_haystack.string(), "--max-cache-mib", "1", "--threads", "1", "--out",
                                 (dir.path() / "again").string()};
  const cli::result rerun = cli::run_cli(dir, again);
  INFO("stderr: " << rerun.err);
  REQUIRE(rerun.code == 0);
  CHECK(rerun.err.find("6 samples in 6 batches") != std::string::npos);
  CHECK(run.err.find("6 samples in 1 batches") != std::string::npos);
  for (const char* file : {"passkey_samples.csv", "passkey.csv", "haystack.txt"}) {
    INFO(file);
    CHECK(triattn_test::read_text(dir.path() / "again" / file) == triattn_test::read_text(dir.path() / "out" / file));
  }
  const auto refused = [&](std::vector<std::string> args, const std::vector<std::string>& needles) {
    cli::check_one_line_error(cli::run_cli(dir, args), needles);
  };
  const std::vector<std::string> base{"retrieval", "--model", gguf_path.string(), "--policies", "full", "--out",
                                      (dir.path() / "refused").string()};
  const auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  refused(with({"--haystack", (dir.path() / "none.txt").string()}), {"none.txt"});
  write_text(dir.path() / "short.txt", "One sentence.\nThe 2nd has a digit.\n");
  refused(with({"--haystack", (dir.path() / "short.txt").string()}), {"short.txt", "holds 1 usable sentences"});
  refused(with({"--haystack", written_haystack.string(), "--haystack-prompts", (dir.path() / "haystack.txt").string()}),
          {"--haystack", "not both"});
  refused(with({"--haystack", written_haystack.string(), "--max-cache-mib", "0"}), {"--max-cache-mib", "'0'"});
  CHECK_FALSE(fs::exists(dir.path() / "refused"));
}

TEST_CASE("triattn_eval generate: a needle case through every policy, as an independent sequential computation",
          "[eval][gguf][generate]") {
  cli::scratch_dir dir("generate");
  const std::string key = "73914";
  const fs::path prompt_file = dir.path() / "prompt.txt", stats_file = dir.path() / "stats.safetensors";
  write_text(prompt_file, needle_prompt(key));
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const triattn_runner::model& m = tm.model();
  const std::vector<int> prompt = tm.chat(needle_prompt(key));
  const auto P = static_cast<std::int64_t>(prompt.size());
  REQUIRE(P > 200);
  const std::vector<std::vector<int>> calibration{tm.chat("Describe a walk by the sea.")};
  const triattn::query_stats stats = triattn_runner::calibrate_on_answers(
      m, calibration, static_cast<int>(calibration[0].size()) + 32, 5, 0.7, tm.non_ending_tokens());
  triattn::save_stats(stats_file, stats);
  const int chunk = 64, max_tokens = 24, slack = 8;
  const std::int64_t budget = P * 2 / 5;
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();

  const auto generate = [&](std::vector<std::string> extra) {
    std::vector<std::string> args{"generate", "--model", gguf_path.string(), "--prompt-file", prompt_file.string(),
                                  "--chat", "--chunk", std::to_string(chunk), "--max-tokens", std::to_string(max_tokens)};
    args.insert(args.end(), extra.begin(), extra.end());
    const cli::result r = cli::run_cli(dir, args);
    INFO(r.command << "\nstderr: " << r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err_lines() == 1);  // the figures, on stderr
    return r.out;
  };

  // The oracle: every (policy, prefill mode) its own sequence through the plain session API,
  // the contract's steps written out; stepped together only for speed.
  struct oracle_row {
    std::string name;
    bool at_end = false;
    oracle_sequence x;
    std::vector<int> answer;
    bool done = false;
    oracle_row(std::string n, bool e, const triattn_runner::model& m, std::int64_t capacity, triattn::any_policy p)
        : name(std::move(n)), at_end(e), x(m, capacity, std::move(p)) {}
  };
  const std::vector<std::string> end_policies{"h2o", "snapkv", "triattention"};
  std::deque<oracle_row> rows;
  for (const triattn::policy_entry& e : triattn::policy_registry) {
    if (!e.compresses()) continue;
    triattn::policy_inputs in = on_schedule(triattn::schedule::with_slack(slack));
    in.stats = &stats;
    const std::string name(e.name);
    rows.emplace_back(name, false, m, P + max_tokens, *e.create(in));
    if (std::find(end_policies.begin(), end_policies.end(), name) != end_policies.end())
      rows.emplace_back(name, true, m, P + max_tokens, *e.create(in));
  }
  REQUIRE(rows.size() == triattn::policy_name_list(true).size() + end_policies.size());
  triattn_runner::batch_decoder decoder(m, 2);
  const auto cut = [&](oracle_row& r) {
    triattn_runner::session& se = r.x.session;
    bool over = false;
    for (int l = 0; l < m.config().n_layers; ++l)
      for (int h = 0; h < m.config().n_kv_heads; ++h) over |= se.length(l, h) > budget;
    if (over) triattn::compress(r.x.policy, se.view(), budget, {se.position(), 0});
  };
  for (std::int64_t t = 0;; ++t) {
    std::vector<triattn_runner::session*> batch;
    std::vector<int> in;
    std::vector<oracle_row*> who;
    for (oracle_row& r : rows)
      if (!r.done) {
        batch.push_back(&r.x.session);
        in.push_back(t < P ? prompt[static_cast<std::size_t>(t)] : r.answer.back());
        who.push_back(&r);
      }
    if (batch.empty()) break;
    decoder.step(batch, in);
    for (std::size_t k = 0; k < who.size(); ++k) {
      oracle_row& r = *who[k];
      triattn_runner::session& se = r.x.session;
      if (t < P) {  // the prefill's rounds: after every chunk, or once after the prompt
        if (!r.at_end && ((t + 1) % chunk == 0 || t + 1 == P)) cut(r);
        if (r.at_end && t + 1 == P) cut(r);
      } else {      // decoding on the slack trigger
        triattn::maybe_compress(r.x.policy, se.view(), budget, {se.position(), 0});
      }
      if (t + 1 < P) continue;
      const int next = triattn_runner::argmax(decoder.logits(static_cast<int>(k)));
      if (allowed[static_cast<std::size_t>(next)] == 0) {
        r.done = true;
        continue;
      }
      r.answer.push_back(next);
      r.done = static_cast<int>(r.answer.size()) == max_tokens;
    }
  }

  const std::string full = generate({});
  INFO("full-cache answer: " << full);
  CHECK(full.find(key) != std::string::npos);  // a real needle case: the full cache finds it
  CHECK(generate({"--policy", "full"}) == full);
  int unlike_full = 0, unlike_chunked = 0;  // the cases tell the modes and the budget apart
  for (const oracle_row& r : rows) {
    INFO("policy " << r.name << (r.at_end ? " after the whole prefill" : " after every chunk") << ", budget " << budget
                   << " of " << P << " prompt tokens");
    std::vector<std::string> with{"--policy", r.name, "--budget", std::to_string(budget), "--slack", std::to_string(slack),
                                  "--stats", stats_file.string()};
    if (r.at_end) with.insert(with.end(), {"--compress-at", "end"});
    const std::string answer = tm.decode(r.answer);
    CHECK(generate(with) == answer);
    unlike_full += answer != full ? 1 : 0;
    if (r.at_end)
      for (const oracle_row& c : rows) unlike_chunked += !c.at_end && c.name == r.name && c.answer != r.answer ? 1 : 0;
  }
  CHECK(unlike_full >= 3);
  CHECK(unlike_chunked >= 1);
  // A budget that holds the whole sequence evicts nothing: the full cache's answer.
  CHECK(generate({"--policy", "snapkv", "--budget", std::to_string(P + max_tokens)}) == full);

  // Bad input: one line naming the input and the value, exit 2, nothing on stdout.
  const auto refused = [&](std::vector<std::string> args, const std::vector<std::string>& needles) {
    cli::check_one_line_error(cli::run_cli(dir, args), needles);
  };
  refused({"generate", "--model", gguf_path.string(), "--prompt-file", (dir.path() / "missing.txt").string()},
          {"missing.txt", "cannot open"});
  refused({"generate", "--model", gguf_path.string(), "--prompt-file", prompt_file.string(), "--policy", "lru",
           "--budget", "8"},
          {"unknown policy lru"});
  refused({"generate", "--model", gguf_path.string(), "--prompt-file", prompt_file.string(), "--policy", "h2o",
           "--budget", "0"},
          {"--budget", "'0'"});
  refused({"generate", "--model", gguf_path.string(), "--prompt-file", prompt_file.string(), "--compress-at", "never"},
          {"--compress-at", "'never'"});
  std::string long_text;
  for (int i = 0; i < 1200; ++i) long_text += "The river " + std::to_string(i) + " runs to the sea. ";
  write_text(dir.path() / "long.txt", long_text);
  refused({"generate", "--model", gguf_path.string(), "--prompt-file", (dir.path() / "long.txt").string()},
          {"long.txt", "more than the model's context of 8192"});
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
  const triattn_runner::text_model tm = triattn_runner::text_model::load(gguf_path, "");
  const std::vector<std::vector<int>> prompts{tm.chat("Explain why the sky is blue."), tm.chat("Write a poem about rain.")};
  const int length = static_cast<int>(std::max(prompts[0].size(), prompts[1].size())) + 16;
  const triattn::query_stats want =
      triattn_runner::calibrate_on_answers(tm.model(), prompts, length, 3, 0.7, tm.non_ending_tokens(), {}, 1.2f, 128);
  CHECK(got.info.at("num_traces") == "2");
  CHECK(got.q_mean_real == want.q_mean_real);
  CHECK(got.q_mean_imag == want.q_mean_imag);
  CHECK(got.q_abs_mean == want.q_abs_mean);
}

}  // namespace
