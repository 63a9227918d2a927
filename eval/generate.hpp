/// \file eval/generate.hpp
/// \brief `triattn_eval generate` (shared/spec/cli.md): one prompt through any policy the
/// evaluation knows, prefilled in chunks with a round after each (or one round after the whole
/// prompt), then greedy decoding on the slack trigger; the answer's text alone on stdout, so
/// that an outside program can run a retrieval case through any policy and read the answer.
///
/// The rounds see no prompt (round context prompt_length 0), as `passkey`'s do: the prompt is
/// the context being compressed, and a policy that protected it (TriAttention's paper default)
/// could not cut it below its length. `--protocol` sets sinks and a recent window for every
/// policy alike; its `prompt` part then has nothing to protect.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "eval_common.hpp"
#include "eval_policies.hpp"
#include "runner/compressed_session.hpp"
#include "runner/metrics.hpp"
#include "runner/session.hpp"
#include "runner/text_model.hpp"
#include "runner/tokenizer.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/registry.hpp"

namespace triattn_eval {

struct generate_options {
  fs::path model, prompt_file;
  std::optional<std::string> stats;
  bool chat = false;
  std::string policy{triattn::full_name};
  std::int64_t budget = 0, slack = 16, chunk = 128, max_tokens = 32;
  int threads = 0;  ///< 0: every core
  prefill_rounds at = prefill_rounds::chunks;
  std::optional<triattn::round_protocol> protocol;

  bool compressing() const { return policy != triattn::full_name; }
};

inline generate_options parse_generate(int argc, char** argv) {
  const auto a = subcommand_options(argc, argv,
                                    {"--model", "--prompt-file", "--policy", "--budget", "--slack", "--stats", "--chunk",
                                     "--compress-at", "--max-tokens", "--protocol", "--threads"},
                                    {"--chat"});
  generate_options o;
  o.model = required(a, "--model", "generate");
  o.prompt_file = required(a, "--prompt-file", "generate");
  o.chat = a.contains("--chat");
  if (a.contains("--policy")) o.policy = a.at("--policy");
  if (o.compressing()) o.budget = parse_int("--budget", required(a, "--budget", "generate"), 1);
  if (a.contains("--slack")) o.slack = parse_int("--slack", a.at("--slack"), 1);
  if (a.contains("--stats")) o.stats = a.at("--stats");
  if (a.contains("--chunk")) o.chunk = parse_int("--chunk", a.at("--chunk"), 1);
  if (a.contains("--max-tokens")) o.max_tokens = parse_int("--max-tokens", a.at("--max-tokens"), 1);
  if (a.contains("--protocol")) o.protocol = parse_protocol(a.at("--protocol"));
  if (a.contains("--threads")) o.threads = static_cast<int>(parse_int("--threads", a.at("--threads"), 1));
  if (a.contains("--compress-at")) o.at = parse_prefill_rounds(a.at("--compress-at"));
  return o;
}

/// What one generation did.
struct generation {
  std::vector<int> answer;   ///< without the end-of-generation token
  bool ended = false;        ///< stopped at an end-of-generation token
  int rounds = 0;            ///< compression rounds, prefill and decoding
  std::int64_t peak_bytes = 0;  ///< the most K+V bytes the cache held
  std::int64_t full_bytes = 0;  ///< K+V bytes of the whole sequence uncompressed
};

/// The greedy answer to `prompt` [tokens] with the cache held at `o.budget` by `policy` (none:
/// the full cache), as `generate` defines it. `capacity` must hold the largest cache the
/// schedule allows (`generate_capacity`).
inline generation generate_answer(const triattn_runner::text_model& tm, std::span<const int> prompt,
                                  std::optional<triattn::any_policy> policy, const generate_options& o,
                                  std::int64_t capacity, triattn_runner::batch_decoder& decoder) {
  const bool compressing = policy.has_value();
  triattn_runner::compressed_session r(tm.model(), capacity, std::move(policy), o.budget);
  triattn_runner::session* const self[] = {&r.cache()};
  generation g;
  std::span<const float> logits;
  const auto P = static_cast<std::int64_t>(prompt.size());
  for (std::int64_t i = 0; i < P; ++i) {
    logits = decoder.step(self, {&prompt[static_cast<std::size_t>(i)], 1}, i + 1 == P);  // the prefill reads no logits
    const bool chunk_done = (i + 1) % o.chunk == 0 || i + 1 == P;
    if (compressing && o.at == prefill_rounds::chunks && chunk_done) r.compress_to_budget();
  }
  if (compressing && o.at == prefill_rounds::end) r.compress_to_budget();
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();
  for (std::int64_t t = 0; t < o.max_tokens; ++t) {
    const int next = triattn_runner::argmax(logits);
    if (allowed[static_cast<std::size_t>(next)] == 0) {
      g.ended = true;
      break;
    }
    g.answer.push_back(next);
    if (t + 1 == o.max_tokens || (!compressing && r.cache().position() == capacity)) break;
    logits = decoder.step(self, {&next, 1});
    r.maybe_compress();  // decoding: a round whenever the slack trigger fires (the logits stay valid)
  }
  r.note_bytes(r.cache().kv_bytes());
  g.rounds = r.rounds();
  g.peak_bytes = r.peak_bytes();
  g.full_bytes = r.cache().full_kv_bytes(P + static_cast<std::int64_t>(g.answer.size()));
  return g;
}

/// The cache `generate_answer` needs for a prompt of `prompt_tokens`: the whole sequence
/// without a policy (at most the model's context); with one, the budget plus a chunk or the
/// whole prompt (`--compress-at end`), or plus the slack while decoding.
inline std::int64_t generate_capacity(const generate_options& o, std::int64_t prompt_tokens, std::int64_t context) {
  const std::int64_t whole = prompt_tokens + o.max_tokens;
  if (!o.compressing()) return std::min(whole, context);
  const std::int64_t prefill = o.at == prefill_rounds::end ? prompt_tokens : o.budget + o.chunk;
  return std::min(whole, std::max(prefill, triattn::schedule::with_slack(o.slack).peak_tokens(o.budget)));
}

/// `generate --model M --prompt-file F [--chat] [--policy P --budget B [--slack 16] [--stats S]]
/// [--chunk 128] [--compress-at chunks|end] [--max-tokens 32] [--protocol ...] [--threads T]`.
inline int run_generate(int argc, char** argv) {
  const char* api = "triattn_eval generate";
  const generate_options o = parse_generate(argc, argv);
  const eval_policy policy = find_eval_policy(o.policy);  // an unknown name fails before any loading
  const std::string text = triattn_runner::read_file(o.prompt_file, api);
  std::optional<triattn::query_stats> stats;
  if (policy.needs_stats) {
    if (!o.stats) throw usage_error{"generate: policy " + o.policy + " needs --stats (triattn calibrate)"};
    stats = triattn::load_stats(*o.stats);
  }
  const triattn_runner::text_model tm = triattn_runner::text_model::load(o.model, "", api);
  const std::vector<int> prompt = o.chat ? tm.chat(text) : tm.encode(text);
  const auto P = static_cast<std::int64_t>(prompt.size());
  const std::int64_t context = tm.model().config().seq_len;
  if (!o.compressing() && P > context)
    throw usage_error{"generate: the prompt of " + o.prompt_file.string() + " holds " + std::to_string(P) +
                      " tokens, more than the model's context of " + std::to_string(context) +
                      " (give --policy and --budget to compress it)"};
  if (P == 0) throw usage_error{"generate: the prompt of " + o.prompt_file.string() + " holds no token"};

  const auto start = std::chrono::steady_clock::now();
  triattn_runner::batch_decoder decoder(
      tm.model(), o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  const generation g = generate_answer(
      tm, prompt, policy.make(stats ? &*stats : nullptr, 0, {triattn::schedule::with_slack(o.slack), o.protocol, {}}), o,
      generate_capacity(o, P, context), decoder);
  const std::string answer = tm.decode(g.answer);
  std::fwrite(answer.data(), 1, answer.size(), stdout);
  std::fflush(stdout);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  std::fprintf(stderr,
               "%s: %lld prompt tokens, %zu answer tokens (%s), policy %s, %d rounds, peak K+V %lld bytes of a full "
               "cache's %lld (%.1f %%), %.1f s\n",
               api, static_cast<long long>(P), g.answer.size(), g.ended ? "ended by the model" : "at --max-tokens",
               o.policy.c_str(), g.rounds, static_cast<long long>(g.peak_bytes), static_cast<long long>(g.full_bytes),
               100.0 * static_cast<double>(g.peak_bytes) / static_cast<double>(std::max<std::int64_t>(g.full_bytes, 1)),
               took.count());
  return 0;
}

}  // namespace triattn_eval
