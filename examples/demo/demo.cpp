// triattn_demo: a real model (stories260K) writes a story with a compressed KV cache, while
// a second copy with the full cache reads the same tokens. Per policy it reports the story,
// the KV memory saved, and how far compression moved the next-token distribution
// (KL(full || compressed), per generated token). It needs nothing outside the repository: the
// model is models/stories260K, and TriAttention is calibrated on text the model samples itself.
//
//   triattn_demo [--policy full,streaming_llm] [--budget 64] [--slack 16] [--steps 256]
//                [--model stories260K.bin] [--tokenizer tok512.bin]
//                [--stats FILE | --calibration-text FILE | --calibration-seed N] [--calibration-windows N]

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "demo/common.hpp"
#include "runner/calibration.hpp"
#include "runner/compressed_session.hpp"
#include "runner/runner.hpp"
#include "triattn/triattn.hpp"

// The repository's models/stories260K (examples/CMakeLists.txt sets it).
#ifndef TRIATTN_DEFAULT_MODEL_DIR
#define TRIATTN_DEFAULT_MODEL_DIR ""
#endif

namespace {

namespace fs = std::filesystem;

// The registry's names (triattn::policy_registry), in its order.
std::vector<std::string> every_policy() {
  std::vector<std::string> out;
  for (const std::string_view name : triattn::policy_name_list()) out.emplace_back(name);
  return out;
}

struct options {
  std::vector<std::string> policies = every_policy();  ///< default: the whole registry
  std::int64_t budget = 64;
  std::int64_t slack = 16;
  int steps = 256;
  fs::path model, tokenizer;
  fs::path stats;             ///< TriAttention statistics; calibrated here when empty
  fs::path calibration_text;  ///< text to calibrate on; empty: text the model samples
  int calibration_windows = 20;
  std::uint64_t calibration_seed = 1;    ///< of the sampled windows
  double calibration_temperature = 1.0;  ///< of the sampled windows

  triattn::schedule schedule() const { return triattn::schedule::with_slack(slack); }
};

// A file of the repository's models/stories260K, or an empty path when none was compiled in.
fs::path default_model_file(const fs::path& name) {
  const fs::path dir = TRIATTN_DEFAULT_MODEL_DIR;
  return dir.empty() ? fs::path() : dir / name;
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "triattn_demo: %s (see --help)\n", message.c_str());
  std::exit(2);
}

void print_help() {
  std::printf(
      "usage: triattn_demo [options]\n"
      "  A real model (stories260K) writes a story greedily from BOS with a compressed KV cache;\n"
      "  a full-cache copy reads the same tokens. Reports memory saved and KL(full || compressed).\n\n"
      "  --policy LIST     comma-separated policies, one result each (default: all of them)\n"
      "  --budget N        tokens kept per (layer, KV head) after a round (default 64)\n"
      "  --slack N         a round runs when the cache reaches budget + slack (default 16)\n"
      "  --steps N         tokens to generate; stops early when the story ends (default 256)\n"
      "  --model PATH      llama2.c checkpoint (default: this repository's models/stories260K)\n"
      "  --tokenizer PATH  its tokenizer (default: tok512.bin beside the default model)\n"
      "  --stats PATH      TriAttention statistics (`triattn calibrate`); without it the demo calibrates\n"
      "                    first, on --calibration-windows windows of the model's context (default 20)\n"
      "                    that the model samples from BOS at temperature 1 (seed --calibration-seed,\n"
      "                    default 1), or on windows of --calibration-text FILE (paragraphs split at\n"
      "                    blank lines, as `triattn calibrate` reads them)\n"
      "  --help            this text\n\n"
      "policies:\n");
  for (const triattn::policy_entry& e : triattn::policy_registry)
    std::printf("  %-16s  %.*s\n", std::string(e.name).c_str(), static_cast<int>(e.summary.size()), e.summary.data());
}

std::vector<std::string> split_policies(std::string_view list) {
  std::vector<std::string> out;
  while (true) {
    const std::size_t comma = std::min(list.find(','), list.size());
    const std::string name(list.substr(0, comma));
    if (triattn::find_policy(name) == nullptr)
      usage_error("unknown policy \"" + name + "\"; known: " + triattn::policy_names());
    out.push_back(name);
    if (comma == list.size()) return out;
    list.remove_prefix(comma + 1);
  }
}

options parse(int argc, char** argv) {
  options o;
  o.model = default_model_file("stories260K.bin");
  o.tokenizer = default_model_file("tok512.bin");
  for (int i = 1; i < argc; ++i) {
    if (const std::string_view a = argv[i]; a == "--help" || a == "-h") {
      print_help();
      std::exit(0);
    }
    const auto [arg, value] = demo::next_option(argc, argv, i, usage_error);
    if (arg == "--policy") {
      o.policies = split_policies(value);
    } else if (arg == "--budget") {
      o.budget = demo::parse_int<std::int64_t>(arg, value, 1, usage_error);
    } else if (arg == "--slack") {
      o.slack = demo::parse_int<std::int64_t>(arg, value, 0, usage_error);
    } else if (arg == "--steps") {
      o.steps = demo::parse_int<int>(arg, value, 1, usage_error);
    } else if (arg == "--model") {
      o.model = value;
    } else if (arg == "--tokenizer") {
      o.tokenizer = value;
    } else if (arg == "--stats") {
      o.stats = value;
    } else if (arg == "--calibration-text") {
      o.calibration_text = value;
    } else if (arg == "--calibration-windows") {
      o.calibration_windows = demo::parse_int<int>(arg, value, 1, usage_error);
    } else if (arg == "--calibration-seed") {
      o.calibration_seed = demo::parse_int<std::uint64_t>(arg, value, 0, usage_error);
    } else {
      usage_error("unknown option " + std::string(arg));
    }
  }
  return o;
}

// A file the demo needs is not there: name it, and where the default model comes from.
[[noreturn]] void missing_file(const char* what, const fs::path& file) {
  if (file.empty()) {
    std::fprintf(stderr, "triattn_demo: no %s file given, and the build compiled in no default\n", what);
  } else {
    std::fprintf(stderr, "triattn_demo: %s file not found: \"%s\"\n", what, file.string().c_str());
  }
  std::fprintf(stderr,
               "  The default model is the repository's models/stories260K/{stories260K.bin,tok512.bin}\n"
               "  (upstream: https://huggingface.co/karpathy/tinyllamas, folder stories260K); pass --model\n"
               "  and --tokenizer for another copy.\n");
  std::exit(2);
}

struct run_result {
  std::string policy;
  std::string text;
  int tokens = 0;  // generated, the final BOS excluded
  std::int64_t peak_bytes = 0;
  std::int64_t full_bytes = 0;
  int rounds = 0;
  double mean_kl = 0.0;
  double seconds = 0.0;
};

// Greedy decoding from BOS with `name`'s cache; the full-cache session reads the same tokens.
run_result run(const triattn_runner::model& m, const triattn_runner::tokenizer& tok, const std::string& name, const options& o,
               const triattn::policy_inputs& inputs) {
  std::optional<triattn::any_policy> policy = triattn::find_policy(name)->create(inputs);  // on o.schedule()
  const triattn::schedule sched = o.schedule();
  const auto start = std::chrono::steady_clock::now();
  triattn_runner::session full(m, o.steps);
  const std::int64_t capacity = policy ? std::min<std::int64_t>(sched.peak_tokens(o.budget), o.steps) : o.steps;
  triattn_runner::compressed_session compressed(m, capacity, std::move(policy), o.budget);

  run_result r;
  r.policy = name;
  std::vector<int> generated;
  double kl_sum = 0.0;
  int token = triattn_runner::bos_id;
  for (int step = 0; step < o.steps; ++step) {
    // No prompt: the story starts from BOS, and every generated token may be evicted.
    const std::span<const float> logits = compressed.step(token);
    kl_sum += triattn_runner::kl_divergence(full.forward(token), logits);
    token = triattn_runner::argmax(logits);
    if (token == triattn_runner::bos_id) break;  // the model ends a story with BOS
    generated.push_back(token);
  }
  r.peak_bytes = compressed.peak_bytes();
  r.rounds = compressed.rounds();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokens = static_cast<int>(generated.size());
  r.text = tok.decode(generated);
  r.full_bytes = full.kv_bytes();
  r.mean_kl = kl_sum / static_cast<double>(full.position());
  return r;
}

double kib(std::int64_t bytes) { return static_cast<double>(bytes) / 1024.0; }
double saved_percent(const run_result& r) {
  return 100.0 * (1.0 - static_cast<double>(r.peak_bytes) / static_cast<double>(r.full_bytes));
}

// TriAttention's statistics: from --stats, or calibrated now, on --calibration-text or on
// windows the model samples itself (not the greedy story it then writes).
triattn::query_stats load_or_calibrate(const triattn_runner::model& m, const triattn_runner::tokenizer& tok, const options& o) {
  if (!o.stats.empty()) {
    std::printf("TriAttention statistics from %s\n", o.stats.string().c_str());
    return triattn::load_stats(o.stats);
  }
  if (!o.calibration_text.empty()) {
    if (!fs::is_regular_file(o.calibration_text)) missing_file("calibration text", o.calibration_text);
    std::printf("calibrating TriAttention on %d windows of %s\n", o.calibration_windows,
                o.calibration_text.filename().string().c_str());
    return triattn_runner::calibrate(m, tok, triattn_runner::read_file(o.calibration_text), o.calibration_windows);
  }
  std::printf("calibrating TriAttention on %d windows of %d tokens that the model samples from BOS\n"
              "(temperature %g, seed %llu; --calibration-text FILE calibrates on text instead)\n",
              o.calibration_windows, m.config().seq_len, o.calibration_temperature,
              static_cast<unsigned long long>(o.calibration_seed));
  return triattn_runner::calibrate_on_samples(m, o.calibration_windows, o.calibration_seed, o.calibration_temperature);
}

void print_table(const std::vector<run_result>& results) {
  std::printf("\n%-18s %6s %12s %12s %7s %7s %10s %9s\n", "policy", "tokens", "peak KV", "full KV", "saved", "rounds",
              "mean KL", "wall");
  for (const run_result& r : results)
    std::printf("%-18s %6d %8.1f KiB %8.1f KiB %6.1f%% %7d %10.5f %6.1f ms\n", r.policy.c_str(), r.tokens,
                kib(r.peak_bytes), kib(r.full_bytes), saved_percent(r), r.rounds, r.mean_kl, 1e3 * r.seconds);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  if (!fs::is_regular_file(o.model)) missing_file("model", o.model);
  if (!fs::is_regular_file(o.tokenizer)) missing_file("tokenizer", o.tokenizer);
  try {
    const triattn_runner::model m = triattn_runner::model::load(o.model);
    const triattn_runner::tokenizer tok = triattn_runner::tokenizer::load(o.tokenizer, m.config().vocab_size);
    const triattn_runner::config& c = m.config();
    std::printf("triattn demo: %s (%d layers, %d query heads over %d KV heads, head_dim %d)\n",
                o.model.stem().string().c_str(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim);
    std::printf("greedy decoding from BOS, up to %d tokens; budget %lld tokens per (layer, KV head),\n"
                "compressed back to it when the cache reaches %lld; a full-cache copy reads the same tokens\n",
                o.steps, static_cast<long long>(o.budget),
                static_cast<long long>(o.schedule().peak_tokens(o.budget)));

    std::optional<triattn::query_stats> stats;
    if (std::any_of(o.policies.begin(), o.policies.end(),
                    [](const std::string& n) { return triattn::find_policy(n)->needs.stats; }))
      stats = load_or_calibrate(m, tok, o);
    // Every policy on the demo's trigger (a round when the cache reaches budget + slack).
    triattn::policy_inputs inputs;
    inputs.stats = stats ? &*stats : nullptr;
    inputs.sched = o.schedule();

    std::vector<run_result> results;
    for (const std::string& name : o.policies) {
      const run_result& r = results.emplace_back(run(m, tok, name, o, inputs));
      std::printf("\n== %s: %s ==\n", name.c_str(), std::string(triattn::find_policy(name)->summary).c_str());
      demo::print_wrapped(r.text);
      std::printf("  %d tokens | peak KV %.1f KiB vs %.1f KiB full (%.1f%% saved) | %d rounds | mean KL %.5f | %.1f ms\n",
                  r.tokens, kib(r.peak_bytes), kib(r.full_bytes), saved_percent(r), r.rounds, r.mean_kl,
                  1e3 * r.seconds);
    }
    print_table(results);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
