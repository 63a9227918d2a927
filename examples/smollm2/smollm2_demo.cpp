// triattn_smollm2_demo: SmolLM2-135M-Instruct (GGUF, through llama.cpp's loader and
// tokenizer, our forward pass) answers one chat question with a full KV cache and, beside
// it, with each policy's compressed cache. Every sequence advances in one batch that shares
// each read of the weights. Per policy it reports the answer, the KV memory saved, how many
// tokens agree with the full-cache answer, and KL(full || compressed) along the compressed
// answer (a full-cache shadow reads the same tokens).
//
//   triattn_smollm2_demo [--model M.gguf] [--question TEXT] [--policy LIST] [--budget 128]
//                        [--slack 32] [--steps 256] [--cache f16|bf16|f32] [--stats S]

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "demo/common.hpp"
#include "runner/compressed_session.hpp"
#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#include "runner/runner.hpp"
#include "runner/text_model.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/triattn.hpp"

#ifndef TRIATTN_SMOLLM2_GGUF
#define TRIATTN_SMOLLM2_GGUF ""
#endif

namespace {

namespace fs = std::filesystem;

struct options {
  fs::path model = TRIATTN_SMOLLM2_GGUF;
  std::string question = "Explain step by step why the sky is blue.";
  std::vector<std::string> policies;  // default: every registry policy that needs no statistics
  std::int64_t budget = 128;
  std::int64_t slack = 32;
  int steps = 256;
  triattn::dtype cache = triattn::dtype::f16;
  fs::path stats;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "triattn_smollm2_demo: %s (see --help)\n", message.c_str());
  std::exit(2);
}

void print_help() {
  std::printf(
      "usage: triattn_smollm2_demo [options]\n"
      "  SmolLM2-135M-Instruct answers a chat question greedily with a full KV cache and with each\n"
      "  policy's compressed cache, all in one batch. Reports memory saved, agreement with the\n"
      "  full-cache answer and KL(full || compressed).\n\n"
      "  --model PATH      the GGUF file (default: the one the build fetched)\n"
      "  --question TEXT   the user's message\n"
      "  --policy LIST     comma-separated policies (default: all that need no statistics;\n"
      "                    triattention needs --stats from `triattn calibrate --model M.gguf`)\n"
      "  --budget N        tokens kept per (layer, KV head) after a round (default 128)\n"
      "  --slack N         a round runs when the cache reaches budget + slack (default 32)\n"
      "  --steps N         answer tokens at most (default 256)\n"
      "  --cache TYPE      f16 (default), bf16 or f32 K and V\n"
      "  --stats PATH      TriAttention statistics\n");
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    if (const std::string_view a = argv[i]; a == "--help" || a == "-h") {
      print_help();
      std::exit(0);
    }
    const auto [arg, value] = demo::next_option(argc, argv, i, usage_error);
    if (arg == "--model") {
      o.model = value;
    } else if (arg == "--question") {
      o.question = value;
    } else if (arg == "--policy") {
      o.policies.clear();
      for (std::size_t at = 0; at <= value.size();) {
        const std::size_t comma = std::min(value.find(',', at), value.size());
        const std::string name(value.substr(at, comma - at));
        const triattn::policy_entry* e = triattn::find_policy(name);
        if (e == nullptr || !e->compresses())
          usage_error("unknown policy \"" + name + "\"; known: " + triattn::policy_names(true));
        o.policies.push_back(name);
        at = comma + 1;
      }
    } else if (arg == "--budget") {
      o.budget = demo::parse_int<int>(arg, value, 1, usage_error);
    } else if (arg == "--slack") {
      o.slack = demo::parse_int<int>(arg, value, 1, usage_error);
    } else if (arg == "--steps") {
      o.steps = demo::parse_int<int>(arg, value, 1, usage_error);
    } else if (arg == "--cache") {
      if (value == "f16") o.cache = triattn::dtype::f16;
      else if (value == "bf16") o.cache = triattn::dtype::bf16;
      else if (value == "f32") o.cache = triattn::dtype::f32;
      else usage_error("--cache expects f16, bf16 or f32, got \"" + std::string(value) + "\"");
    } else if (arg == "--stats") {
      o.stats = value;
    } else {
      usage_error("unknown option " + std::string(arg));
    }
  }
  if (o.policies.empty())
    for (const triattn::policy_entry& e : triattn::policy_registry)
      if (e.compresses() && (!e.needs.stats || !o.stats.empty())) o.policies.emplace_back(e.name);
  return o;
}

/// One answer being written: its session, and for a compressed one, the policy and the
/// full-cache shadow that reads the same tokens.
struct answer {
  std::string policy;  // "full" for the reference
  triattn_runner::compressed_session seq;
  std::optional<triattn_runner::session> shadow;
  std::vector<int> tokens;  // the answer so far
  int next = -1;            // the token to feed at the next step (-1: the prompt's)
  bool done = false;
  double kl_sum = 0;
  double seconds_in_rounds = 0;

  answer(std::string name, const triattn_runner::model& m, std::int64_t capacity, triattn::dtype type,
         std::optional<triattn::any_policy> p, std::int64_t budget, std::int64_t shadow_capacity)
      : policy(std::move(name)), seq(m, capacity, std::move(p), budget, type) {
    if (seq.policy()) shadow.emplace(m, shadow_capacity, type);
  }
};

std::size_t matching_prefix(const std::vector<int>& a, const std::vector<int>& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

double kib(std::int64_t bytes) { return static_cast<double>(bytes) / 1024.0; }

int run(const options& o) {
  if (o.model.empty() || !fs::is_regular_file(o.model))
    usage_error("model file not found: \"" + o.model.string() +
                "\" (scripts/fetch_llama_cpp.sh fetches SmolLM2-135M-Instruct; pass --model)");
  const auto load_start = std::chrono::steady_clock::now();
  const triattn_runner::model m = gguf_model::load(o.model);
  const ggml_bridge::vocab vocab(o.model);
  const triattn_runner::config& c = m.config();
  const std::vector<int> prompt =
      vocab.tokenize(vocab.chat_prompt(o.question), /*add_special=*/true, /*parse_special=*/true);
  std::optional<triattn::query_stats> stats;
  if (!o.stats.empty()) stats = triattn::load_stats(o.stats);
  const triattn::schedule sched = triattn::schedule::with_slack(o.slack);
  const auto prompt_len = static_cast<std::int64_t>(prompt.size());
  const std::int64_t full_capacity = prompt_len + o.steps;

  std::printf("triattn SmolLM2 demo: %s (%d layers, %d query heads over %d KV heads, head_dim %d), %s cache\n",
              o.model.filename().string().c_str(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
              triattn::dtype_name(o.cache));
  std::printf("loaded in %.1f s; the chat prompt is %lld tokens; greedy answers of up to %d tokens;\n"
              "budget %lld tokens per (layer, KV head), compressed back to it when the cache reaches %lld\n"
              "(the prompt too: rounds run from the first token); every answer is one sequence of one batch\n\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(),
              static_cast<long long>(prompt_len), o.steps, static_cast<long long>(o.budget),
              static_cast<long long>(sched.peak_tokens(o.budget)));
  std::printf("user: %s\n", o.question.c_str());

  std::deque<answer> answers;  // grows without moving its elements
  answers.emplace_back(std::string(triattn::full_name), m, full_capacity, o.cache, std::nullopt, 0, 0);
  for (const std::string& name : o.policies) {
    triattn::policy_inputs in;
    in.stats = stats ? &*stats : nullptr;
    in.sched = sched;
    answers.emplace_back(name, m, std::min(full_capacity, sched.peak_tokens(o.budget)), o.cache,
                         triattn::find_policy(name)->create(in), o.budget, full_capacity);
  }

  triattn_runner::batch_decoder decoder(m);
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t t = 0; t < full_capacity; ++t) {
    std::vector<triattn_runner::session*> batch;
    std::vector<int> tokens;
    for (answer& a : answers) {
      if (a.done) continue;
      const int token = t < prompt_len ? prompt[static_cast<std::size_t>(t)] : a.next;
      batch.push_back(&a.seq.cache());
      tokens.push_back(token);
      if (a.shadow) {
        batch.push_back(&*a.shadow);
        tokens.push_back(token);
      }
    }
    if (batch.empty()) break;
    decoder.step(batch, tokens);
    int row = 0;
    for (answer& a : answers) {
      if (a.done) continue;
      const std::span<const float> logits = decoder.logits(row++);
      if (a.shadow) {
        const std::span<const float> full = decoder.logits(row++);
        if (t >= prompt_len - 1) a.kl_sum += triattn_runner::kl_divergence(full, logits);
      }
      const auto round_start = std::chrono::steady_clock::now();
      a.seq.maybe_compress(prompt_len);
      if (a.seq.policy())
        a.seconds_in_rounds += std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count();
      if (t < prompt_len - 1) continue;
      a.next = triattn_runner::argmax(logits);
      if (vocab.is_eog(a.next) || static_cast<int>(a.tokens.size()) == o.steps) {
        a.done = true;
      } else {
        a.tokens.push_back(a.next);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const answer& full = answers.front();
  std::printf("\n== full cache (%zu tokens) ==\n", full.tokens.size());
  demo::print_wrapped(vocab.detokenize(full.tokens));
  for (std::size_t i = 1; i < answers.size(); ++i) {
    const answer& a = answers[i];
    const std::size_t same = matching_prefix(a.tokens, full.tokens);
    std::printf("\n== %s: %s ==\n", a.policy.c_str(),
                same == a.tokens.size() && same == full.tokens.size()
                    ? "the same answer as the full cache"
                    : ("the full cache's first " + std::to_string(same) + " tokens, then:").c_str());
    if (same < a.tokens.size() || same < full.tokens.size())
      demo::print_wrapped(vocab.detokenize(std::span(a.tokens).subspan(same)));
  }

  std::printf("\n%-14s %6s %6s %12s %12s %7s %7s %9s %10s\n", "policy", "tokens", "same", "peak KV", "full KV", "saved",
              "rounds", "mean KL", "ms/round");
  for (const answer& a : answers) {
    const std::int64_t full_bytes = a.shadow ? a.shadow->kv_bytes() : a.seq.cache().kv_bytes();
    const double scored = static_cast<double>(std::max<std::int64_t>(1, a.seq.cache().position() - (prompt_len - 1)));
    std::printf("%-14s %6zu %6zu %8.1f KiB %8.1f KiB %6.1f%% %7d %9.5f %10.2f\n", a.policy.c_str(), a.tokens.size(),
                matching_prefix(a.tokens, full.tokens), kib(a.seq.peak_bytes()), kib(full_bytes),
                100.0 * (1.0 - static_cast<double>(a.seq.peak_bytes()) / static_cast<double>(full_bytes)),
                a.seq.rounds(), a.seq.policy() ? a.kl_sum / scored : 0.0,
                a.seq.rounds() > 0 ? 1e3 * a.seconds_in_rounds / a.seq.rounds() : 0.0);
  }
  std::printf("\n%zu sequences (each compressed answer has a full-cache shadow) in one batch: %.1f s\n",
              answers.size() * 2 - 1, seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn_smollm2_demo: %s\n", e.what());
    return 2;
  }
}
