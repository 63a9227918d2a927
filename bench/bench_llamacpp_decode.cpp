// llama.cpp's decode throughput with its cache held at a budget by triattn (runner/triattn_llama.hpp:
// the keys read in place, eviction by llama_memory_seq_rm, no graph callback for key-only
// policies), against llama.cpp with a full cache of the same n_ctx, in one run.
//
// What is measured: per configuration a fresh context (n_ctx = prompt + tokens, flash attention
// on, the same for every configuration), a 32-token prompt in one batch (not timed), then
// `tokens` llama_decode calls of one token each, every held sequence's end_batch (its rounds
// and seq_rm calls) after each: tokens/s = tokens / seconds of those calls. The tokens are a
// fixed text's, so every configuration decodes the same ids. Configurations: full, then each
// policy at the budget (slack 64). Repetitions are interleaved (each repetition runs every
// configuration, the order rotated), so a busy machine slows them alike; the ratio to full is
// per repetition, then its mean ± standard error.
//
// Usage: triattn_bench_llamacpp_decode --stats S.safetensors [--model M.gguf] [--budget 512]
//        [--tokens 1536] [--reps 5] [--threads 2] [--policies streaming_llm,triattention,snapkv]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <llama.h>

#include "eval/eval_common.hpp"
#include "runner/ggml_bridge.hpp"
#include "runner/triattn_llama.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using policy_type = triattn::basic_any_policy<triattn_llama::cells_view>;
using held = triattn_llama::held_sequence<policy_type>;
using capture = triattn_llama::query_capture<policy_type>;

constexpr int prompt_tokens = 32;
constexpr std::int64_t slack = 64;

struct options {
  std::string model = TRIATTN_SMOLLM2_GGUF, stats;
  std::int64_t budget = 512, tokens = 1536;
  int reps = 5, threads = 2;
  std::vector<std::string> policies = {"streaming_llm", "triattention", "snapkv"};
};

options parse(int argc, char** argv) {
  const char* api = "triattn_bench_llamacpp_decode";
  options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    TRIATTN_CHECK(i + 1 < argc, api, flag, " needs a value");
    const std::string v = argv[i + 1];
    if (flag == "--model") o.model = v;
    else if (flag == "--stats") o.stats = v;
    else if (flag == "--budget") o.budget = std::stoll(v);
    else if (flag == "--tokens") o.tokens = std::stoll(v);
    else if (flag == "--reps") o.reps = std::stoi(v);
    else if (flag == "--threads") o.threads = std::stoi(v);
    else if (flag == "--policies") {
      o.policies.clear();
      std::stringstream in(v);
      for (std::string p; std::getline(in, p, ',');) o.policies.push_back(p);
    } else TRIATTN_CHECK(false, api, "unknown option ", flag);
  }
  TRIATTN_CHECK(o.budget >= 1 && o.tokens > o.budget + slack && o.reps >= 1 && o.threads >= 1, api, "budget ", o.budget,
                ", tokens ", o.tokens, " (must exceed budget + ", slack, "), reps ", o.reps, ", threads ", o.threads);
  return o;
}

// A fixed text's token ids, repeated to `n`.
std::vector<llama_token> token_stream(const llama_vocab* vocab, std::int64_t n) {
  const std::string text =
      "The history of the lighthouse begins with fires lit on hilltops to guide sailors home. "
      "Later, towers of stone carried lamps and mirrors out over the rocks of the coast, and keepers "
      "climbed their stairs every evening to trim the wicks and wind the clockwork of the lens.";
  std::vector<llama_token> ids(text.size() + 8);
  const int k = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                               static_cast<int32_t>(ids.size()), true, false);
  TRIATTN_CHECK(k > 0, "token_stream", "llama_tokenize returned ", k);
  std::vector<llama_token> out;
  while (static_cast<std::int64_t>(out.size()) < n) out.push_back(ids[out.size() % static_cast<std::size_t>(k)]);
  return out;
}

struct run_result {
  double tokens_per_second = 0.0;
  std::int64_t rounds = 0, peak_cells = 0, slot_map_bytes = 0;
  triattn_llama::reads feed = triattn_llama::reads::keys;  // what the policy observed (the callback's work)
};

// One configuration once: `policy` empty is the full cache.
run_result run(llama_model* model, const options& o, const std::string& policy, const triattn::policy_inputs& in,
               const std::vector<llama_token>& tokens) {
  std::unique_ptr<held> h;
  std::unique_ptr<capture> c;
  triattn_llama::options ho;
  if (!policy.empty()) {
    const auto& entry = *triattn::find_policy<triattn_llama::cells_view>(policy);
    ho.budget = o.budget;
    ho.feed = triattn_llama::reads_of(entry, in);
    h = std::make_unique<held>(model, 0, triattn_llama::cells_policy(entry, in, slack), ho);
    if (ho.feed != triattn_llama::reads::keys) {
      c = std::make_unique<capture>(model);
      c->route(0, h.get());
    }
  }
  llama_context_params p = llama_context_default_params();
  p.n_ctx = static_cast<std::uint32_t>(prompt_tokens + o.tokens);
  p.n_batch = p.n_ubatch = prompt_tokens;
  p.n_seq_max = 1;
  p.n_threads = p.n_threads_batch = o.threads;
  p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  p.no_perf = true;
  if (c) {  // policies that read queries or attention: the callback, and its cost, are part of the figure
    p.cb_eval = capture::callback;
    p.cb_eval_user_data = c.get();
  }
  ggml_bridge::detail::context_ptr ctx(llama_init_from_model(model, p));
  TRIATTN_CHECK(ctx != nullptr, "run", "llama_init_from_model failed");
  if (h) h->bind(ctx.get());
  if (c) c->bind(ctx.get());
  const auto decode = [&](std::int64_t first, std::int32_t n) {
    const int rc = llama_decode(ctx.get(), llama_batch_get_one(const_cast<llama_token*>(tokens.data() + first), n));
    if (c) c->check();
    TRIATTN_CHECK(rc == 0, "run", "llama_decode failed at ", first);
    if (h) h->end_batch(prompt_tokens);
  };
  decode(0, prompt_tokens);
  const auto t0 = clock_type::now();
  for (std::int64_t i = prompt_tokens; i < prompt_tokens + o.tokens; ++i) decode(i, 1);
  const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
  run_result r;
  r.tokens_per_second = static_cast<double>(o.tokens) / s;
  r.feed = ho.feed;
  if (h) {
    r.rounds = h->stats().rounds;
    r.peak_cells = h->stats().peak_cells;
    r.slot_map_bytes = static_cast<std::int64_t>(h->slot_map_bytes());
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(o.model, false, "triattn_bench_llamacpp_decode");
    std::optional<triattn::query_stats> stats;
    if (!o.stats.empty()) stats = triattn::load_stats(o.stats);
    triattn::policy_inputs in;
    in.stats = stats ? &*stats : nullptr;
    std::vector<std::string> configs = {""};
    for (const std::string& p : o.policies) {
      TRIATTN_CHECK(triattn::find_policy<triattn_llama::cells_view>(p) != nullptr, "triattn_bench_llamacpp_decode",
                    "unknown policy ", p);
      configs.push_back(p);
    }
    const std::vector<llama_token> tokens = token_stream(llama_model_get_vocab(model.get()), prompt_tokens + o.tokens);
    std::vector<std::vector<run_result>> results(configs.size());
    for (int rep = 0; rep < o.reps; ++rep)
      for (std::size_t k = 0; k < configs.size(); ++k) {
        const std::size_t c = (k + static_cast<std::size_t>(rep)) % configs.size();  // the order rotates
        results[c].push_back(run(model.get(), o, configs[c], in, tokens));
        std::fprintf(stderr, "rep %d %s: %.1f tokens/s\n", rep, configs[c].empty() ? "full" : configs[c].c_str(),
                     results[c].back().tokens_per_second);
      }
    std::printf("llama.cpp decode, %lld tokens after a %d-token prompt, n_ctx %lld, %d threads, budget %lld + slack %lld, %d reps\n\n",
                static_cast<long long>(o.tokens), prompt_tokens, static_cast<long long>(prompt_tokens + o.tokens), o.threads,
                static_cast<long long>(o.budget), static_cast<long long>(slack), o.reps);
    std::printf("| configuration | tokens/s | / full (per rep) | rounds | peak cells | triattn host bytes (slot map) | graph callback |\n");
    std::printf("| --- | ---: | ---: | ---: | ---: | ---: | --- |\n");
    for (std::size_t c = 0; c < configs.size(); ++c) {
      std::vector<double> tps, ratio;
      for (int rep = 0; rep < o.reps; ++rep) {
        tps.push_back(results[c][static_cast<std::size_t>(rep)].tokens_per_second);
        ratio.push_back(tps.back() / results[0][static_cast<std::size_t>(rep)].tokens_per_second);
      }
      const auto [tm, ts] = triattn_eval::mean_and_se(tps);
      const auto [rm, rs] = triattn_eval::mean_and_se(ratio);
      const run_result& last = results[c].back();
      if (configs[c].empty()) {
        std::printf("| full cache | %.1f ± %.1f | 1 | 0 | %lld (every token) | 0 | none |\n", tm, ts,
                    static_cast<long long>(prompt_tokens + o.tokens));
        continue;
      }
      std::printf("| %s | %.1f ± %.1f | %.3f ± %.3f | %lld | %lld | %lld | %s |\n", configs[c].c_str(), tm, ts, rm, rs,
                  static_cast<long long>(last.rounds), static_cast<long long>(last.peak_cells),
                  static_cast<long long>(last.slot_map_bytes),
                  last.feed == triattn_llama::reads::keys      ? "none"
                  : last.feed == triattn_llama::reads::queries ? "Qcur"
                                                               : "Qcur, attention");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
