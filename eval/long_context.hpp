/// \file eval/long_context.hpp
/// \brief triattn_eval's two long-context regimes on a chat model (the SmolLM2 quality issue):
///
/// - `long`: decode-time compression of long generations, the paper's setting. For each
///   prompt the full-cache model writes its answer (sampled at a temperature from a fixed
///   seed, end-of-turn tokens excluded so that it writes the whole length); every policy x
///   budget is teacher-forced along that trajectory in the same batch, so that KL(full ||
///   compressed), top-1 agreement and NLL are measured on the same tokens. The free-running
///   agreement comes out of the same pass exactly: a compressed run that drew the same
///   uniform at each step as the reference would write the reference's tokens up to the
///   first step where its own distribution puts another token at that uniform, and until
///   then its cache and the teacher-forced one are the same computation.
/// - `passkey`: retrieval after a compressed prefill, RULER-style and generated locally as
///   llama.cpp's `passkey` example builds it: a 5-digit key in filler text at a depth, the
///   context prefilled in chunks with a round after every chunk, then the question, then a
///   greedy answer scored exactly.
///
/// Both write CSV and markdown, deterministic (fixed seeds, results independent of the
/// thread count) and read nothing but the model, the stats and the prompt file given.
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "eval_common.hpp"
#include "eval_policies.hpp"
#include "runner/calibration.hpp"
#include "runner/compressed_session.hpp"
#include "runner/runner.hpp"
#include "runner/text_model.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/triattn.hpp"

namespace triattn_eval {

/// One compressed sequence of a batch, which rides a full-cache trunk until it branches off.
struct compressed_sequence : triattn_runner::compressed_session {
  using compressed_session::compressed_session;

  /// Takes over the trunk's cache where this row parts from it (see `trunk_observer`).
  void branch_from(const triattn_runner::session& trunk) {
    cache().copy_from(trunk);
    branched = true;
  }
  bool branched = false;  ///< decoded on its own (else it still rides the trunk)
};

/// The full-cache trunk that compressed rows ride until their first round. Until then a row
/// computes exactly what the full cache does (the same tokens through the same cache: the same
/// bits), so it is not decoded at all: its policy is fed the full cache's attention, and at its
/// first round it takes a copy of the full cache (`compressed_sequence::branch_from`). A row
/// that first compresses at budget B saves the B + slack steps before it.
class trunk_observer final : public triattn_runner::observer {
 public:
  void ride(compressed_sequence& s) { riders_.push_back(&s); }
  /// Branches `s` off `trunk` and stops feeding it.
  void branch(compressed_sequence& s, const triattn_runner::session& trunk) {
    s.branch_from(trunk);
    riders_.erase(std::find(riders_.begin(), riders_.end(), &s));
  }
  void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                    std::span<const float> probs) override {
    for (compressed_sequence* s : riders_) s->feed().on_attention(layer, q_head, position, q_post_rope, probs);
  }

 private:
  std::vector<compressed_sequence*> riders_;
};

/// The fraction of the n-grams of `tokens` that are distinct (1 for a text that never
/// repeats a run of n tokens; near 0 for a loop).
inline double distinct_ngrams(const std::vector<int>& tokens, std::size_t n) {
  if (tokens.size() < n) return 1.0;
  std::set<std::vector<int>> seen;
  for (std::size_t i = 0; i + n <= tokens.size(); ++i) seen.emplace(tokens.begin() + static_cast<std::ptrdiff_t>(i),
                                                                   tokens.begin() + static_cast<std::ptrdiff_t>(i + n));
  return static_cast<double>(seen.size()) / static_cast<double>(tokens.size() + 1 - n);
}

/// The policies, statistics and protocol of a command's `--policies` / `--stats` / `--protocol`.
struct policy_set {
  std::vector<eval_policy> policies;  ///< without `full`, which every batch has anyway
  std::optional<triattn::query_stats> stats;
  std::optional<triattn::round_protocol> protocol;  ///< unset: each policy's own defaults
  bool has_full = false;

  policy_set(const std::string& list, const std::optional<std::string>& stats_path,
             std::optional<triattn::round_protocol> protocol_ = std::nullopt)
      : protocol(protocol_) {
    bool need_stats = false;
    for (const std::string& name : split(list)) {
      if (name == triattn::full_name) {
        has_full = true;
        continue;
      }
      policies.push_back(find_eval_policy(name));
      need_stats |= policies.back().needs_stats;
    }
    if (need_stats) {
      if (!stats_path) throw usage_error{"the TriAttention rows need --stats (triattn calibrate)"};
      stats = triattn::load_stats(*stats_path);
    }
  }
  const triattn::query_stats* stats_ptr() const { return stats ? &*stats : nullptr; }
  /// Row `p`'s policy for one sequence (`seed`: see `row_seed`) on `sched`, under the protocol.
  triattn::any_policy make(std::size_t p, std::uint64_t seed, const triattn::schedule& sched) const {
    return *policies[p].make(stats_ptr(), seed, {sched, protocol, {}});
  }
};

/// A seed per (row, sequence) for the policies that draw (random): independent of threads.
inline std::uint64_t row_seed(std::size_t row, std::size_t sequence) {
  std::mt19937_64 g = triattn_runner::window_rng(0x7269616e ^ row, sequence);
  return g();
}

// ------------------------------------------------------------------------------------------
// Regime 1: `long`

struct long_options {
  fs::path model, prompts, out;
  std::optional<std::string> stats;
  std::string policies, budgets = "128,256,512";
  std::int64_t tokens = 2048, slack = 64;
  double temperature = 0.7;
  float repeat_penalty = triattn_runner::answer_sampler::default_penalty;
  int repeat_window = triattn_runner::answer_sampler::default_window;
  std::uint64_t seed = 1;
  int threads = 0;
  std::optional<triattn::round_protocol> protocol;  ///< --protocol (unset: each policy's own)
};

/// Sums over the scored positions of one (row, prompt).
struct position_sums {
  double kl = 0, top1 = 0, nll = 0;
  std::int64_t n = 0;
};

/// What one prompt gave: per row (policy x budget, then `full` per budget) and the reference.
struct long_prompt_result {
  std::vector<position_sums> rows;        // [policy * budgets + budget]
  std::vector<position_sums> full;        // [budget]: the full cache's NLL on the same positions
  std::vector<std::int64_t> prefix, peak;  // [policy * budgets + budget]
  std::int64_t full_peak = 0, prompt_tokens = 0;
  std::vector<int> answer;
  double distinct4 = 0.0;
};

/// Every prompt with every row (row j: policy j / budgets, budget j % budgets) beside its full
/// cache, all in one batch on `decoder`'s threads. The numbers do not depend on the batch or
/// the thread count: every sequence's logits are the same bits in any batch, and each row's
/// sums are added in step order by one thread.
inline std::vector<long_prompt_result> run_long_prompts(const triattn_runner::text_model& tm,
                                                        const std::vector<std::string>& prompt_texts,
                                                        const long_options& o, const policy_set& ps,
                                                        const std::vector<std::int64_t>& budgets,
                                                        triattn_runner::batch_decoder& decoder, progress_bar& bar) {
  const triattn_runner::model& m = tm.model();
  const std::int64_t T = o.tokens;
  const std::size_t B = budgets.size(), rows = ps.policies.size() * B, N = prompt_texts.size();
  const auto V = static_cast<std::size_t>(m.config().vocab_size);
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();
  const triattn::schedule sched = triattn::schedule::with_slack(o.slack);

  struct prompt_state {
    std::vector<int> prompt;
    triattn_runner::session full;
    trunk_observer trunk;
    std::deque<compressed_sequence> seqs;  // row j
    std::vector<std::int64_t> first_round;  // [budget]: the step of the rows' first round
    std::mt19937_64 rng;
    triattn_runner::answer_sampler sampler;
    long_prompt_result r;
    int next;
    prompt_state(const triattn_runner::model& m, std::vector<int> p, std::int64_t T, std::mt19937_64 g, triattn_runner::answer_sampler s)
        : prompt(std::move(p)), full(m, static_cast<std::int64_t>(prompt.size()) + T), rng(g), sampler(std::move(s)),
          next(prompt[0]) {}
    std::int64_t length() const { return static_cast<std::int64_t>(prompt.size()); }
  };
  std::deque<prompt_state> st;
  for (std::size_t i = 0; i < N; ++i) {
    prompt_state& x = st.emplace_back(m, tm.chat(prompt_texts[i]), T, triattn_runner::window_rng(o.seed, i),
                                      triattn_runner::answer_sampler(o.temperature, o.repeat_penalty, o.repeat_window, allowed));
    const std::int64_t P = x.length();
    x.full.set_observer(&x.trunk);
    for (std::size_t j = 0; j < rows; ++j) {
      const std::size_t p = j / B, b = j % B;
      x.trunk.ride(x.seqs.emplace_back(m, std::min(P + T, sched.peak_tokens(budgets[b])), ps.make(p, row_seed(j, i), sched),
                                       budgets[b]));
    }
    // Every row of a budget first compresses on the same step (the shared slack trigger on a
    // cache that has grown one token a step): it branches off the trunk there, and the full
    // cache's NLL is summed from the next step.
    x.first_round.assign(B, P + T);
    for (std::size_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < P + T; ++t)
        if (sched.should_compress(t + 1, budgets[b], t + 1)) {
          x.first_round[b] = t;
          break;
        }
    x.r.rows.assign(rows, {});
    x.r.full.assign(B, {});
    x.r.prefix.assign(rows, -1);
    x.r.peak.assign(rows, 0);
    x.r.prompt_tokens = P;
  }
  std::int64_t steps = 0;
  for (const prompt_state& x : st) steps = std::max(steps, x.length() + T - 1);

  std::vector<triattn_runner::session*> batch;
  std::vector<std::pair<std::size_t, std::size_t>> scored;  // (prompt, row) of batch entry k, rows only
  std::vector<std::size_t> entry;                            // batch entry of prompt i's full cache
  std::vector<int> tokens;
  std::vector<std::vector<double>> logp(N, std::vector<double>(V)), prob(N, std::vector<double>(V));
  std::vector<int> top(N), drawn(N);
  std::vector<double> uniform(N);
  std::vector<std::pair<compressed_sequence*, std::int64_t>> rounds;  // with the prompt's length
  for (std::int64_t t = 0; t < steps; ++t) {
    batch.clear();
    scored.clear();
    tokens.clear();
    entry.assign(N, 0);
    std::vector<std::size_t> row_entry;  // batch entry of each scored row
    for (std::size_t i = 0; i < N; ++i) {
      prompt_state& x = st[i];
      if (t + 1 >= x.length() + T) continue;
      entry[i] = batch.size();
      batch.push_back(&x.full);
      tokens.push_back(x.next);
      for (std::size_t j = 0; j < rows; ++j) {
        TRIATTN_CHECK(x.seqs[j].compressed() == (t > x.first_round[j % B]), "triattn_eval long", "row ", j,
                      " first compressed at another step than its budget's trigger");
        if (x.seqs[j].branched) {
          row_entry.push_back(batch.size());
          scored.emplace_back(i, j);
          batch.push_back(&x.seqs[j].cache());
          tokens.push_back(x.next);
        }
      }
    }
    decoder.step(batch, tokens);
    // The reference's draw and distribution (prompt tokens are given, not drawn).
    std::vector<char> answering(N, 0);
    for (std::size_t i = 0; i < N; ++i) {
      prompt_state& x = st[i];
      if (t + 1 >= x.length() + T) continue;
      if (t + 1 < x.length()) {
        x.next = x.prompt[static_cast<std::size_t>(t + 1)];
        continue;
      }
      answering[i] = 1;
      const std::span<const float> ref = decoder.logits(static_cast<int>(entry[i]));
      uniform[i] = triattn_runner::uniform_draw(x.rng);
      drawn[i] = x.sampler.draw(ref, uniform[i]);
      x.r.answer.push_back(drawn[i]);
      const double lse = log_sum_exp(ref);
      for (std::size_t v = 0; v < V; ++v) {
        logp[i][v] = ref[v] - lse;
        prob[i][v] = std::exp(logp[i][v]);
      }
      top[i] = triattn_runner::argmax(ref);
    }
    // The rows riding a trunk are not scored yet; every branched row is.
    decoder.team().for_each(scored.size(), [&](std::size_t k) {
      const auto [i, j] = scored[k];
      if (!answering[i]) return;
      const std::span<const float> z = decoder.logits(static_cast<int>(row_entry[k]));
      const double lq = log_sum_exp(z);
      double kl = 0.0;
      for (std::size_t v = 0; v < V; ++v) kl += prob[i][v] * (logp[i][v] - (z[v] - lq));
      position_sums& sums = st[i].r.rows[j];
      sums.kl += kl;
      sums.top1 += triattn_runner::argmax(z) == top[i] ? 1.0 : 0.0;
      sums.nll += lq - z[static_cast<std::size_t>(drawn[i])];
      ++sums.n;
    });
    for (std::size_t k = 0; k < scored.size(); ++k) {  // the reference's history until now
      const auto [i, j] = scored[k];
      prompt_state& x = st[i];
      if (answering[i] && x.r.prefix[j] < 0 &&
          x.sampler.draw(decoder.logits(static_cast<int>(row_entry[k])), uniform[i]) != drawn[i])
        x.r.prefix[j] = t + 1 - x.length();
    }
    rounds.clear();
    for (std::size_t i = 0; i < N; ++i) {
      prompt_state& x = st[i];
      if (t + 1 >= x.length() + T) continue;
      if (answering[i]) {
        x.sampler.push(drawn[i]);
        x.next = drawn[i];
        for (std::size_t b = 0; b < B; ++b)
          if (t > x.first_round[b]) {
            x.r.full[b].nll -= logp[i][static_cast<std::size_t>(drawn[i])];
            ++x.r.full[b].n;
          }
      }
      for (std::size_t j = 0; j < rows; ++j) {
        compressed_sequence& c = x.seqs[j];
        if (!c.branched) {
          c.note_bytes(x.full.kv_bytes());  // a rider holds what the trunk holds
          if (t == x.first_round[j % B]) x.trunk.branch(c, x.full);
        }
        if (c.branched) rounds.emplace_back(&c, x.length());
      }
      x.r.full_peak = std::max(x.r.full_peak, x.full.kv_bytes());
    }
    decoder.team().for_each(rounds.size(), [&](std::size_t k) { rounds[k].first->maybe_compress(rounds[k].second); });
    bar.add(1);
  }
  std::vector<long_prompt_result> out;
  for (prompt_state& x : st) {
    for (std::size_t j = 0; j < rows; ++j) {
      if (x.r.prefix[j] < 0) x.r.prefix[j] = T;
      x.r.peak[j] = x.seqs[j].peak_bytes();
    }
    x.r.distinct4 = distinct_ngrams(x.r.answer, 4);
    out.push_back(std::move(x.r));
  }
  return out;
}

inline long_options parse_long(int argc, char** argv) {
  const auto o = subcommand_options(argc, argv,
                                    {"--model", "--prompts", "--stats", "--out", "--policies", "--budgets", "--tokens",
                                     "--slack", "--temperature", "--repeat-penalty", "--repeat-window", "--seed",
                                     "--threads", "--protocol"});
  long_options l;
  l.model = required(o, "--model", "long");
  l.prompts = required(o, "--prompts", "long");
  l.out = required(o, "--out", "long");
  l.policies = required(o, "--policies", "long");
  if (o.contains("--stats")) l.stats = o.at("--stats");
  if (o.contains("--budgets")) l.budgets = o.at("--budgets");
  if (o.contains("--tokens")) l.tokens = parse_int("--tokens", o.at("--tokens"), 1);
  if (o.contains("--slack")) l.slack = parse_int("--slack", o.at("--slack"), 1);
  if (o.contains("--temperature")) l.temperature = parse_double("--temperature", o.at("--temperature"), 1e-3, 100.0);
  if (o.contains("--repeat-penalty"))
    l.repeat_penalty = static_cast<float>(parse_double("--repeat-penalty", o.at("--repeat-penalty"), 1.0, 10.0));
  if (o.contains("--repeat-window")) l.repeat_window = static_cast<int>(parse_int("--repeat-window", o.at("--repeat-window"), 0));
  if (o.contains("--seed")) l.seed = static_cast<std::uint64_t>(parse_int("--seed", o.at("--seed"), 0));
  if (o.contains("--threads")) l.threads = static_cast<int>(parse_int("--threads", o.at("--threads"), 1));
  if (o.contains("--protocol")) l.protocol = parse_protocol(o.at("--protocol"));
  return l;
}

/// `long --model M --prompts FILE --policies LIST --out DIR [--stats S] [--budgets 128,256,512]
/// [--tokens 2048] [--slack 64] [--temperature 0.7] [--repeat-penalty 1.2] [--repeat-window 128] [--seed 1]
/// [--threads T] [--protocol own|none|prompt,sinks=N,recent=N]`.
inline int run_long(int argc, char** argv) {
  const long_options o = parse_long(argc, argv);
  const char* api = "triattn_eval long";
  const policy_set ps(o.policies, o.stats, o.protocol);
  const triattn_runner::text_model tm = triattn_runner::text_model::load(o.model, "", api);
  const std::vector<std::string> prompts = triattn_runner::read_prompts(o.prompts, api);
  std::vector<std::int64_t> budgets;
  for (const std::string& b : split(o.budgets)) budgets.push_back(parse_int("--budgets", b, 1));
  if (budgets.empty() || ps.policies.empty()) throw usage_error{"long: --budgets and --policies need a compressing row"};
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::fprintf(stderr, "triattn_eval long: %zu prompts x %lld tokens, %zu rows x %zu budgets, D = %lld, %d threads\n",
               prompts.size(), static_cast<long long>(o.tokens), ps.policies.size(), budgets.size(),
               static_cast<long long>(o.slack), threads);

  // One batch: every prompt's full cache and rows, each step's work split over the threads.
  const std::size_t B = budgets.size(), N = prompts.size();
  std::int64_t longest = 0;
  for (const std::string& p : prompts) longest = std::max(longest, static_cast<std::int64_t>(tm.chat(p).size()) + o.tokens - 1);
  progress_bar bar("triattn_eval long", longest);
  triattn_runner::batch_decoder decoder(tm.model(), threads);
  const std::vector<long_prompt_result> results = run_long_prompts(tm, prompts, o, ps, budgets, decoder, bar);
  std::fputc('\n', stderr);

  // Per (row, prompt) means, then mean and standard error across prompts.
  std::ostringstream csv, per, md, answers;
  csv << "policy,budget,kl,kl_se,top1,top1_se,nll,nll_se,ppl,gen_prefix,gen_prefix_se,kv_bytes,prompts,positions,"
         "slack,tokens,temperature,protocol\n";
  per << "policy,budget,prompt,kl,top1,nll,gen_prefix,positions,kv_bytes\n";
  md << "# Decode-time compression of long generations (triattn_eval long)\n\n"
     << "Prompts: " << N << " (" << o.prompts.filename().string() << "), each answered by the full-cache model with "
     << o.tokens << " tokens sampled at temperature " << fmt("%g", o.temperature) << " with a repetition penalty of "
     << fmt("%g", o.repeat_penalty) << " over the last " << o.repeat_window << " tokens (seed " << o.seed
     << ", end-of-turn tokens excluded); every row is teacher-forced along that answer. Slack trigger D = " << o.slack
     << " for every policy (a round when the cache reaches budget + D cuts it to budget; peak budget + D). "
     << "Protection: " << (o.protocol ? "`" + protocol_name(o.protocol) + "` for every policy" : "each policy's own defaults")
     << " (`--protocol`). "
     << "KL(full || compressed) in nats, top-1 agreement with the full cache and NLL of the answer's tokens, over every "
     << "answer position after the first compression (the same positions for every row of a budget); gen_prefix: the "
     << "mean number of answer tokens a free-running compressed model writes before its first token that differs "
     << "(same seed and uniforms). ± is the standard error across prompts.\n\n"
     << "| policy | B | KL | top-1 % | NLL | gen_prefix | KV bytes |\n|---|---:|---:|---:|---:|---:|---:|\n";
  const auto emit = [&](const std::string& name, std::int64_t budget, const std::vector<double>& kl,
                        const std::vector<double>& top1, const std::vector<double>& nll,
                        const std::vector<double>& prefix, std::int64_t bytes, std::int64_t positions) {
    const mean_se k = mean_and_se(kl), t = mean_and_se(top1), n = mean_and_se(nll), g = mean_and_se(prefix);
    csv << name << ',' << budget << ',' << fmt("%.6f", k.mean) << ',' << fmt("%.6f", k.se) << ',' << fmt("%.6f", t.mean)
        << ',' << fmt("%.6f", t.se) << ',' << fmt("%.6f", n.mean) << ',' << fmt("%.6f", n.se) << ','
        << fmt("%.4f", std::exp(n.mean)) << ',' << fmt("%.2f", g.mean) << ',' << fmt("%.2f", g.se) << ',' << bytes << ','
        << N << ',' << positions << ',' << o.slack << ',' << o.tokens << ',' << fmt("%g", o.temperature) << ",\""
        << protocol_name(o.protocol) << "\"\n";
    md << "| " << name << " | " << budget << " | " << fmt("%.4f", k.mean) << " ± " << fmt("%.4f", k.se) << " | "
       << fmt("%.1f", 100 * t.mean) << " ± " << fmt("%.1f", 100 * t.se) << " | " << fmt("%.4f", n.mean) << " ± "
       << fmt("%.4f", n.se) << " | " << fmt("%.0f", g.mean) << " ± " << fmt("%.0f", g.se) << " | " << bytes << " |\n";
  };
  for (std::size_t b = 0; b < B; ++b) {
    std::vector<double> zero(N, 0.0), one(N, 1.0), nll, prefix(N, static_cast<double>(o.tokens));
    std::int64_t positions = 0, bytes = 0;
    for (const long_prompt_result& r : results) {
      nll.push_back(r.full[b].n > 0 ? r.full[b].nll / static_cast<double>(r.full[b].n) : NAN);
      positions += r.full[b].n;
      bytes = std::max(bytes, r.full_peak);
    }
    if (ps.has_full) emit(std::string(triattn::full_name), budgets[b], zero, one, nll, prefix, bytes, positions);
  }
  for (std::size_t p = 0; p < ps.policies.size(); ++p)
    for (std::size_t b = 0; b < B; ++b) {
      const std::size_t j = p * B + b;
      std::vector<double> kl, top1, nll, prefix;
      std::int64_t positions = 0, bytes = 0;
      for (std::size_t i = 0; i < N; ++i) {
        const long_prompt_result& r = results[i];
        const position_sums& s = r.rows[j];
        const double n = s.n > 0 ? static_cast<double>(s.n) : NAN;
        kl.push_back(s.kl / n);
        top1.push_back(s.top1 / n);
        nll.push_back(s.nll / n);
        prefix.push_back(static_cast<double>(r.prefix[j]));
        positions += s.n;
        bytes = std::max(bytes, r.peak[j]);
        per << ps.policies[p].name << ',' << budgets[b] << ',' << i << ',' << fmt("%.6f", kl.back()) << ','
            << fmt("%.6f", top1.back()) << ',' << fmt("%.6f", nll.back()) << ',' << r.prefix[j] << ',' << s.n << ','
            << r.peak[j] << '\n';
      }
      emit(ps.policies[p].name, budgets[b], kl, top1, nll, prefix, bytes, positions);
    }
  md << "\nThe answers (the reference trajectories): distinct 4-grams as a fraction of all 4-grams (a loop scores near "
        "0).\n\n| prompt | prompt tokens | distinct 4-grams | opening of the answer |\n|---:|---:|---:|---|\n";
  for (std::size_t i = 0; i < N; ++i) {
    const long_prompt_result& r = results[i];
    std::string head = tm.decode(std::span(r.answer).first(std::min<std::size_t>(r.answer.size(), 24)));
    for (char& c : head)
      if (c == '\n' || c == '|') c = ' ';
    md << "| " << i << " | " << r.prompt_tokens << " | " << fmt("%.3f", r.distinct4) << " | " << head << " ... |\n";
    answers << "== prompt " << i << ": " << prompts[i] << "\n" << tm.decode(r.answer) << "\n\n";
  }
  md << "\nWall time: " << fmt("%.1f", bar.seconds()) << " s on " << threads << " threads.\n";
  write_file(o.out, "long.csv", csv.str());
  write_file(o.out, "long_prompts.csv", per.str());
  write_file(o.out, "long.md", md.str());
  write_file(o.out, "answers.txt", answers.str());
  std::fprintf(stderr, "triattn_eval long: wrote %s/long.csv, long.md in %.1f s\n", o.out.string().c_str(), bar.seconds());
  return 0;
}

// ------------------------------------------------------------------------------------------
// Regime 2: `passkey`

struct passkey_options {
  fs::path model, out;
  std::optional<std::string> stats, haystack_prompts, haystack;
  std::string policies, fractions = "0.1,0.25,0.5", contexts = "1024,2048,4096", depths = "0.1,0.3,0.5,0.7,0.9";
  std::string families = "passkey";
  int trials = 1, chunk = 128, answer_tokens = 8, threads = 0, haystack_tokens = 1024;
  std::int64_t max_cache_mib = 8192;  ///< --max-cache-mib: the cache one batch of samples may hold
  std::uint64_t seed = 1;
  prefill_rounds at = prefill_rounds::chunks;
  std::optional<triattn::round_protocol> protocol;  ///< --protocol (unset: each policy's own)
};

/// The retrieval families (`--families`): llama.cpp's passkey in its repeated filler, and three
/// with needles in prose the model wrote itself (`write_haystack`): one needle; four needles of
/// one form, the question asking for one; a needle the question words differently.
inline constexpr std::string_view retrieval_families[] = {"passkey", "single", "multikey", "paraphrase"};

/// One retrieval prompt: the context (prefilled in chunks), the question, and the key.
struct passkey_sample {
  std::string family = "passkey";
  std::int64_t context = 0;  ///< the asked context length in tokens
  double depth = 0;
  int trial = 0;
  int key = 0;
  std::vector<int> prefill, question;
};

/// Prose the model wrote itself, in sentences: the haystacks of the needle families, so that
/// no sentence repeats and the needle is not the only thing that differs.
struct haystack {
  std::vector<std::string> sentences;  ///< each starting with a space
  std::vector<std::int64_t> tokens;    ///< the tokens of each sentence alone
};

/// The sentences of `text`: cut after '.', '!' or '?' and at line ends, trimmed; without the
/// sentences that hold a digit (no number of the haystack competes with a key) or no letter.
inline std::vector<std::string> sentences_of(std::string_view text) {
  std::vector<std::string> out;
  std::string cur;
  const auto flush = [&] {
    const auto a = cur.find_first_not_of(" \t\r");
    const bool digit = cur.find_first_of("0123456789") != std::string::npos;
    const bool letter = std::any_of(cur.begin(), cur.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
    if (a != std::string::npos && !digit && letter) out.push_back(" " + cur.substr(a, cur.find_last_not_of(" \t\r") + 1 - a));
    cur.clear();
  };
  for (const char c : text) {
    if (c == '\n') {
      flush();
      continue;
    }
    cur += c;
    if (c == '.' || c == '!' || c == '?') flush();
  }
  flush();
  return out;
}

/// The haystack of the sentences of `text` (`sentences_of`); `source` names it in the error
/// when it holds fewer than 8.
inline haystack make_haystack(const triattn_runner::text_model& tm, std::string_view text, const std::string& source) {
  haystack h;
  const auto start = static_cast<std::int64_t>(tm.encode("").size());
  for (std::string& sentence : sentences_of(text)) {
    h.tokens.push_back(static_cast<std::int64_t>(tm.encode(sentence).size()) - start);
    h.sentences.push_back(std::move(sentence));
  }
  TRIATTN_CHECK(h.sentences.size() >= 8, "triattn_eval retrieval", source, " holds ", h.sentences.size(),
                " usable sentences (8 at least: sentences with a letter and no digit)");
  return h;
}

/// The haystack: the model's answers to `prompts` (its chat template), `tokens` tokens each,
/// sampled at temperature 0.7 with the long-answer repetition penalty from `seed` (prompt i
/// draws from window_rng(seed, i)), end-of-turn tokens excluded; all in one batch.
inline haystack write_haystack(const triattn_runner::text_model& tm, const std::vector<std::string>& prompts, int tokens,
                               std::uint64_t seed, triattn_runner::batch_decoder& decoder) {
  const triattn_runner::model& m = tm.model();
  const std::vector<std::uint8_t> allowed = tm.non_ending_tokens();
  struct writer {
    std::vector<int> prompt, answer;
    triattn_runner::session s;
    std::mt19937_64 rng;
    triattn_runner::answer_sampler sampler;
  };
  std::deque<writer> w;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    std::vector<int> p = tm.chat(prompts[i]);
    const auto capacity = static_cast<std::int64_t>(p.size()) + tokens;
    w.push_back({std::move(p), {}, triattn_runner::session(m, capacity), triattn_runner::window_rng(seed, i),
                 triattn_runner::answer_sampler(0.7, triattn_runner::answer_sampler::default_penalty,
                                                triattn_runner::answer_sampler::default_window, allowed)});
  }
  std::vector<triattn_runner::session*> batch;
  std::vector<int> in;
  for (std::size_t t = 0;; ++t) {
    batch.clear();
    in.clear();
    std::vector<writer*> who;
    for (writer& x : w)
      if (x.answer.size() < static_cast<std::size_t>(tokens)) {
        batch.push_back(&x.s);
        in.push_back(t < x.prompt.size() ? x.prompt[t] : x.answer.back());
        who.push_back(&x);
      }
    if (batch.empty()) break;
    decoder.step(batch, in);
    for (std::size_t k = 0; k < who.size(); ++k) {
      writer& x = *who[k];
      if (t + 1 < x.prompt.size()) continue;
      const int next = x.sampler.draw(decoder.logits(static_cast<int>(k)), triattn_runner::uniform_draw(x.rng));
      x.sampler.push(next);
      x.answer.push_back(next);
    }
  }
  std::string text;
  for (const writer& x : w) text += tm.decode(x.answer) + "\n";
  return make_haystack(tm, text, "triattn_eval: the written haystack");
}

/// Sets the prefill of `s` to the tokens of `context` and its question to those of `question`,
/// as the two tokenize at the end of the whole prompt (checked: the question is decoded
/// after the prefill and must be the same tokens there).
inline void set_prompt(const triattn_runner::text_model& tm, passkey_sample& s, const std::string& context,
                       std::string_view question) {
  const auto start = static_cast<std::ptrdiff_t>(tm.encode("").size());
  std::vector<int> all = tm.encode(context + std::string(question));
  s.question = tm.encode(question);
  s.question.erase(s.question.begin(), s.question.begin() + start);
  TRIATTN_CHECK(all.size() > s.question.size() &&
                    std::equal(s.question.begin(), s.question.end(), all.end() - static_cast<std::ptrdiff_t>(s.question.size())),
                "triattn_eval passkey", "the question does not tokenize the same at the end of the prompt");
  s.prefill.assign(all.begin(), all.end() - static_cast<std::ptrdiff_t>(s.question.size()));
}

/// llama.cpp's `passkey` example's text (examples/passkey/passkey.cpp): the instruction, filler
/// sentences with the key sentence after `round(depth x fillers)` of them, as many fillers as
/// fit `context` tokens with the question, then the question.
inline passkey_sample make_passkey(const triattn_runner::text_model& tm, std::int64_t context, double depth, int trial,
                                   std::uint64_t seed) {
  constexpr std::string_view prefix =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you "
      "about the important information there.";
  constexpr std::string_view filler =
      " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  constexpr std::string_view question = " What is the pass key? The pass key is";
  passkey_sample s{"passkey", context, depth, trial, 0, {}, {}};
  std::mt19937_64 g = triattn_runner::window_rng(seed ^ static_cast<std::uint64_t>(context),
                                          static_cast<std::size_t>(std::llround(depth * 1000)) * 1000 + trial);
  s.key = 10000 + static_cast<int>(g() % 90000);
  const std::string key = std::to_string(s.key);
  const std::string needle = " The pass key is " + key + ". Remember it. " + key + " is the pass key.";
  const auto start = static_cast<std::int64_t>(tm.encode("").size());
  const auto tokens = [&](std::string_view text) { return static_cast<std::int64_t>(tm.encode(text).size()) - start; };
  const std::int64_t fixed = start + tokens(prefix) + tokens(needle) + tokens(question), each = tokens(filler);
  const std::int64_t fillers = std::max<std::int64_t>((context - fixed) / each, 1);
  const auto at = static_cast<std::int64_t>(std::llround(depth * static_cast<double>(fillers)));
  std::string text(prefix);
  for (std::int64_t i = 0; i < fillers; ++i) {
    if (i == at) text += needle;
    text += filler;
  }
  if (at >= fillers) text += needle;
  set_prompt(tm, s, text, question);
  return s;
}

/// The needle(s) and the question of one needle family's sample, the key first.
struct needle_case {
  std::string asked;                 ///< the needle that holds the key
  std::vector<std::string> others;   ///< the distractor needles (multikey)
  std::string question;
};

/// A needle family's needles and question for `key` (`others`: the distractors' keys).
inline needle_case needle_text(const std::string& family, int key, const std::vector<int>& others, std::mt19937_64& g) {
  static constexpr std::string_view colours[] = {"blue", "red", "green", "yellow", "white", "black", "orange", "purple"};
  // Each pair: the needle, and a question that names the same thing in other words.
  static constexpr std::pair<std::string_view, std::string_view> paraphrases[] = {
      {" Anna wrote the number @ on a small card and hid it under the flower pot by the door.",
       " Question: which number is on the card that Anna put beneath the plant pot? Answer: the number is"},
      {" The locker at the old gym opens with the combination @.",
       " Question: what combination unlocks the locker in the former sports hall? Answer: the combination is"},
      {" Captain Reyes told the crew that the ship's radio would stay on channel @ for the whole voyage.",
       " Question: on which channel was the vessel's radio kept during the trip? Answer: the channel was"},
      {" Grandpa kept his bank account number, @, written inside the band of his hat.",
       " Question: what account number did the old man keep inside his cap? Answer: the account number is"},
  };
  const auto fill = [](std::string_view t, int k) {
    std::string out(t);
    out.replace(out.find('@'), 1, std::to_string(k));
    return out;
  };
  needle_case c;
  if (family == "paraphrase") {
    const auto& [needle, question] = paraphrases[g() % std::size(paraphrases)];
    c.asked = fill(needle, key);
    c.question = question;
    return c;
  }
  std::vector<std::string_view> pick(std::begin(colours), std::end(colours));
  std::shuffle(pick.begin(), pick.end(), g);
  const auto door = [](std::string_view colour, int k) {
    return " The secret code of the " + std::string(colour) + " door is " + std::to_string(k) + ".";
  };
  c.asked = door(pick[0], key);
  for (std::size_t i = 0; i < others.size(); ++i) c.others.push_back(door(pick[1 + i], others[i]));
  c.question = " Question: what is the secret code of the " + std::string(pick[0]) + " door? Answer: the secret code of the " +
               std::string(pick[0]) + " door is";
  return c;
}

/// A sample of needle family `family` (single, multikey or paraphrase) in `hay`: an
/// instruction, haystack sentences from a random start (cyclically) up to `context` tokens
/// with the question, the asked needle after `round(depth x sentences)` of them and the
/// distractors (multikey: 3) after random others, then the question.
inline passkey_sample make_needle_sample(const triattn_runner::text_model& tm, const haystack& hay, const std::string& family,
                                         std::int64_t context, double depth, int trial, std::uint64_t seed) {
  constexpr std::string_view prefix =
      "Read the text below. A secret is hidden in it, and you will be asked about it at the end.\n\n";
  std::uint64_t salt = 0;
  for (const char c : family) salt = salt * 131 + static_cast<unsigned char>(c);
  std::mt19937_64 g = triattn_runner::window_rng(seed ^ salt ^ static_cast<std::uint64_t>(context) << 20,
                                                 static_cast<std::size_t>(std::llround(depth * 1000)) * 1000 + trial);
  passkey_sample s{family, context, depth, trial, 0, {}, {}};
  std::set<int> keys;
  while (keys.size() < (family == "multikey" ? 4u : 1u)) keys.insert(10000 + static_cast<int>(g() % 90000));
  std::vector<int> others(keys.begin(), keys.end());
  std::shuffle(others.begin(), others.end(), g);
  s.key = others.front();
  others.erase(others.begin());
  const needle_case c = needle_text(family, s.key, others, g);
  const auto start = static_cast<std::int64_t>(tm.encode("").size());
  const auto tokens = [&](std::string_view text) { return static_cast<std::int64_t>(tm.encode(text).size()) - start; };
  std::int64_t used = start + tokens(prefix) + tokens(c.asked) + tokens(c.question);
  for (const std::string& o : c.others) used += tokens(o);
  std::vector<std::size_t> picked;
  const std::size_t n = hay.sentences.size();
  for (std::size_t i = static_cast<std::size_t>(g() % n); used < context; i = (i + 1) % n) {
    picked.push_back(i);
    used += hay.tokens[i];
  }
  if (picked.size() > 1) picked.pop_back();  // stay within the context
  const auto at = static_cast<std::size_t>(std::llround(depth * static_cast<double>(picked.size())));
  std::vector<std::vector<const std::string*>> after(picked.size() + 1);  // needles after k sentences
  after[at].push_back(&c.asked);
  for (const std::string& o : c.others) after[static_cast<std::size_t>(g() % (picked.size() + 1))].push_back(&o);
  std::string text(prefix);
  for (std::size_t k = 0; k <= picked.size(); ++k) {
    for (const std::string* needle : after[k]) text += *needle;
    if (k < picked.size()) text += hay.sentences[picked[k]];
  }
  set_prompt(tm, s, text, c.question);
  return s;
}

/// The first run of digits in `text`, or "".
inline std::string first_number(std::string_view text) {
  const auto a = text.find_first_of("0123456789");
  if (a == std::string_view::npos) return {};
  const auto b = text.find_first_not_of("0123456789", a);
  return std::string(text.substr(a, b == std::string_view::npos ? std::string_view::npos : b - a));
}

struct passkey_answer {
  std::string text;
  bool correct = false;
};

/// Cache slots a sample's full cache needs: the prompt and the answer.
inline std::int64_t sample_length(const passkey_sample& s, const passkey_options& o) {
  return static_cast<std::int64_t>(s.prefill.size() + s.question.size()) + o.answer_tokens;
}
/// The budget of a row at `fraction` of the sample's context.
inline std::int64_t row_budget(const passkey_sample& s, double fraction) {
  return std::max<std::int64_t>(1, std::llround(fraction * static_cast<double>(s.context)));
}
/// Cache slots a row needs: it leaves the trunk holding at most a chunk past its budget, or the
/// whole prefill (`--compress-at end`), then adds the question and the answer.
inline std::int64_t row_capacity(const passkey_sample& s, std::int64_t budget, const passkey_options& o) {
  const std::int64_t length = sample_length(s, o);
  const std::int64_t cut_at = o.at == prefill_rounds::end ? length : budget + o.chunk;
  return std::min(length, cut_at + static_cast<std::int64_t>(s.question.size()) + o.answer_tokens);
}

/// The samples `samples` (one context length), each with the full cache and every row (row j:
/// policy j / fractions, fraction j % fractions), all in one batch on `decoder`'s threads.
/// Returns the answers [sample][1 + rows], the full cache's first. A row rides its sample's
/// full cache (`trunk_observer`) until the first round that cuts it, so a row whose budget
/// covers the context is the full cache. `first_index` seeds the rows that draw.
inline std::vector<std::vector<passkey_answer>> run_passkey_context(const triattn_runner::text_model& tm,
                                                                    std::span<const passkey_sample> samples,
                                                                    std::size_t first_index, const passkey_options& o,
                                                                    const policy_set& ps,
                                                                    const std::vector<double>& fractions,
                                                                    triattn_runner::batch_decoder& decoder, progress_bar& bar) {
  const triattn_runner::model& m = tm.model();
  const std::size_t F = fractions.size(), rows = ps.policies.size() * F, S = samples.size();
  struct sample_state {
    triattn_runner::session full;
    trunk_observer trunk;
    std::deque<compressed_sequence> seqs;  // row j
    std::vector<std::vector<int>> answers;  // [1 + rows]
    std::size_t prompt = 0, steps = 0;      // prompt tokens; forward steps
    sample_state(const triattn_runner::model& m, std::int64_t length) : full(m, length) {}
  };
  std::deque<sample_state> st;
  for (std::size_t i = 0; i < S; ++i) {
    const passkey_sample& s = samples[i];
    const std::size_t prompt = s.prefill.size() + s.question.size();
    sample_state& x = st.emplace_back(m, sample_length(s, o));
    x.full.set_observer(&x.trunk);
    x.prompt = prompt;
    x.steps = prompt + static_cast<std::size_t>(o.answer_tokens) - 1;
    x.answers.resize(1 + rows);
    for (std::size_t j = 0; j < rows; ++j) {
      const std::int64_t budget = row_budget(s, fractions[j % F]);
      x.trunk.ride(x.seqs.emplace_back(m, row_capacity(s, budget, o),
                                       ps.make(j / F, row_seed(j, first_index + i), triattn::schedule::every_step()),
                                       budget));
    }
  }
  std::size_t steps = 0;
  for (const sample_state& x : st) steps = std::max(steps, x.steps);
  std::vector<triattn_runner::session*> batch;
  std::vector<std::pair<std::size_t, std::size_t>> who;  // batch entry -> (sample, 0 for full or 1 + row)
  std::vector<int> tokens;
  std::vector<compressed_sequence*> rounds;
  for (std::size_t t = 0; t < steps; ++t) {
    batch.clear();
    who.clear();
    tokens.clear();
    bool answering = false;
    for (std::size_t i = 0; i < S; ++i) {
      sample_state& x = st[i];
      if (t >= x.steps) continue;
      const passkey_sample& s = samples[i];
      const auto token = [&](std::size_t k) {
        return t < s.prefill.size() ? s.prefill[t] : t < x.prompt ? s.question[t - s.prefill.size()] : x.answers[k].back();
      };
      answering |= t + 1 >= x.prompt;
      batch.push_back(&x.full);
      who.emplace_back(i, 0);
      tokens.push_back(token(0));
      for (std::size_t j = 0; j < rows; ++j)
        if (x.seqs[j].branched) {
          batch.push_back(&x.seqs[j].cache());
          who.emplace_back(i, 1 + j);
          tokens.push_back(token(1 + j));
        }
    }
    decoder.step(batch, tokens, answering);  // the prefill reads no logits
    for (std::size_t k = 0; k < batch.size(); ++k) {
      const auto [i, r] = who[k];
      sample_state& x = st[i];
      if (t + 1 < x.prompt) continue;
      const int next = triattn_runner::argmax(decoder.logits(static_cast<int>(k)));
      x.answers[r].push_back(next);
      if (r == 0)  // the rows still on the trunk answer as the full cache does
        for (std::size_t j = 0; j < rows; ++j)
          if (!x.seqs[j].branched) x.answers[1 + j].push_back(next);
    }
    // A round after every chunk of the prefill (or only after its last token, --compress-at end); a
    // row leaves the trunk at the first round that cuts it.
    rounds.clear();
    for (std::size_t i = 0; i < S; ++i) {
      sample_state& x = st[i];
      const std::size_t prefill = samples[i].prefill.size();
      const bool chunk_end = (t + 1) % static_cast<std::size_t>(o.chunk) == 0 && o.at == prefill_rounds::chunks;
      if (t >= x.steps || t + 1 > prefill || (!chunk_end && t + 1 != prefill)) continue;
      std::int32_t longest = 0;
      for (int l = 0; l < m.config().n_layers; ++l)
        for (int h = 0; h < m.config().n_kv_heads; ++h) longest = std::max(longest, x.full.length(l, h));
      for (compressed_sequence& c : x.seqs) {
        if (!c.branched && longest > c.budget()) x.trunk.branch(c, x.full);
        if (c.branched) rounds.push_back(&c);
      }
    }
    decoder.team().for_each(rounds.size(), [&](std::size_t k) { rounds[k]->compress_to_budget(); });
    bar.add(static_cast<std::int64_t>(S));
  }
  std::vector<std::vector<passkey_answer>> out(S, std::vector<passkey_answer>(1 + rows));
  for (std::size_t i = 0; i < S; ++i)
    for (std::size_t r = 0; r <= rows; ++r) {
      passkey_answer& a = out[i][r];
      a.text = tm.decode(st[i].answers[r]);
      a.correct = first_number(a.text) == std::to_string(samples[i].key);
    }
  return out;
}

/// `passkey --model M --policies LIST --out DIR [--stats S] [--fractions 0.1,0.25,0.5]
/// [--contexts 1024,2048,4096] [--depths 0.1,...] [--trials 1] [--chunk 128] [--answer-tokens 8]
/// [--seed 1] [--threads T] [--protocol P] [--compress-at chunks|end] [--families passkey,...]
/// [--haystack-prompts FILE [--haystack-tokens 1024] | --haystack FILE] [--max-cache-mib 8192]`;
/// `retrieval` is the same command with the needle families by default.
inline int run_passkey(int argc, char** argv) {
  const bool retrieval = std::string_view(argv[1]) == "retrieval";
  const auto a = subcommand_options(argc, argv,
                                    {"--model", "--stats", "--out", "--policies", "--fractions", "--contexts", "--depths",
                                     "--trials", "--chunk", "--answer-tokens", "--seed", "--threads", "--protocol",
                                     "--compress-at", "--families", "--haystack-prompts", "--haystack-tokens", "--haystack",
                                     "--max-cache-mib"});
  const char* api = retrieval ? "triattn_eval retrieval" : "triattn_eval passkey";
  passkey_options o;
  if (retrieval) o.families = "single,multikey,paraphrase";
  o.model = required(a, "--model", api);
  o.out = required(a, "--out", api);
  o.policies = required(a, "--policies", api);
  if (a.contains("--stats")) o.stats = a.at("--stats");
  if (a.contains("--fractions")) o.fractions = a.at("--fractions");
  if (a.contains("--contexts")) o.contexts = a.at("--contexts");
  if (a.contains("--depths")) o.depths = a.at("--depths");
  if (a.contains("--families")) o.families = a.at("--families");
  if (a.contains("--haystack-prompts")) o.haystack_prompts = a.at("--haystack-prompts");
  if (a.contains("--haystack")) o.haystack = a.at("--haystack");
  if (a.contains("--max-cache-mib")) o.max_cache_mib = parse_int("--max-cache-mib", a.at("--max-cache-mib"), 1);
  if (a.contains("--haystack-tokens"))
    o.haystack_tokens = static_cast<int>(parse_int("--haystack-tokens", a.at("--haystack-tokens"), 16));
  if (a.contains("--trials")) o.trials = static_cast<int>(parse_int("--trials", a.at("--trials"), 1));
  if (a.contains("--chunk")) o.chunk = static_cast<int>(parse_int("--chunk", a.at("--chunk"), 1));
  if (a.contains("--answer-tokens")) o.answer_tokens = static_cast<int>(parse_int("--answer-tokens", a.at("--answer-tokens"), 1));
  if (a.contains("--seed")) o.seed = static_cast<std::uint64_t>(parse_int("--seed", a.at("--seed"), 0));
  if (a.contains("--threads")) o.threads = static_cast<int>(parse_int("--threads", a.at("--threads"), 1));
  if (a.contains("--protocol")) o.protocol = parse_protocol(a.at("--protocol"));
  if (a.contains("--compress-at")) o.at = parse_prefill_rounds(a.at("--compress-at"));
  std::vector<double> fractions, depths;
  std::vector<std::int64_t> contexts;
  for (const std::string& f : split(o.fractions)) fractions.push_back(parse_double("--fractions", f, 1e-6, 1.0));
  for (const std::string& d : split(o.depths)) depths.push_back(parse_double("--depths", d, 0.0, 1.0));
  for (const std::string& c : split(o.contexts)) contexts.push_back(parse_int("--contexts", c, 64));
  const std::vector<std::string> families = split(o.families);
  if (fractions.empty() || depths.empty() || contexts.empty() || families.empty())
    throw usage_error{std::string(api) + ": empty list"};
  bool needs_haystack = false;
  for (const std::string& f : families) {
    if (std::find(std::begin(retrieval_families), std::end(retrieval_families), f) == std::end(retrieval_families))
      throw usage_error{"option --families: unknown family '" + f + "' (known: passkey, single, multikey, paraphrase)"};
    needs_haystack |= f != "passkey";
  }
  if (o.haystack && o.haystack_prompts)
    throw usage_error{std::string(api) + ": give --haystack (a written haystack) or --haystack-prompts, not both"};
  if (needs_haystack && !o.haystack && !o.haystack_prompts)
    throw usage_error{std::string(api) + ": the needle families need --haystack-prompts (prompts the model writes the "
                      "haystack from) or --haystack (the haystack.txt of an earlier run)"};

  const policy_set ps(o.policies, o.stats, o.protocol);
  const triattn_runner::text_model tm = triattn_runner::text_model::load(o.model, "", api);
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  triattn_runner::batch_decoder decoder(tm.model(), threads);
  haystack hay;
  if (needs_haystack) {
    if (o.haystack) {
      // An earlier run's haystack.txt: its sentences, one a line, are that run's haystack again.
      hay = make_haystack(tm, triattn_runner::read_file(*o.haystack, api), "--haystack '" + *o.haystack + "'");
    } else {
      std::fprintf(stderr, "%s: writing the haystack (%d tokens per prompt)\n", api, o.haystack_tokens);
      hay = write_haystack(tm, triattn_runner::read_prompts(*o.haystack_prompts, api), o.haystack_tokens, o.seed, decoder);
    }
    std::string text;
    for (const std::string& sentence : hay.sentences) text += sentence.substr(1) + "\n";
    write_file(o.out, "haystack.txt", text);
  }
  std::vector<passkey_sample> all;
  for (const std::int64_t c : contexts)
    for (const std::string& f : families)
      for (const double d : depths)
        for (int t = 0; t < o.trials; ++t)
          all.push_back(f == "passkey" ? make_passkey(tm, c, d, t, o.seed) : make_needle_sample(tm, hay, f, c, d, t, o.seed));
  // The samples as token ids, for other engines' clients (eval/server_passkey.py sends them to
  // llama-server): one a line, tab-separated family, context, depth, trial, key, then the
  // prompt's ids (the prefill's, then the question's) separated by spaces.
  std::ostringstream prompts;
  for (const passkey_sample& s : all) {
    prompts << s.family << '\t' << s.context << '\t' << fmt("%g", s.depth) << '\t' << s.trial << '\t' << s.key << '\t';
    for (std::size_t i = 0; i < s.prefill.size() + s.question.size(); ++i)
      prompts << (i > 0 ? " " : "") << (i < s.prefill.size() ? s.prefill[i] : s.question[i - s.prefill.size()]);
    prompts << '\n';
  }
  write_file(o.out, "passkey_prompts.tsv", prompts.str());
  const std::size_t F = fractions.size(), S = all.size();
  const std::size_t per_context = families.size() * depths.size() * static_cast<std::size_t>(o.trials);
  // One batch a group of samples of one context (each sample with its full cache and every row),
  // the groups in turn, each step's work split over the threads. A batch holds all its caches at
  // once (a row of `--compress-at end` holds the whole prefill before its round: 30 samples of
  // 2K tokens with 14 rows each would be 43 GB on SmolLM2), so a group holds at most
  // `--max-cache-mib` of cache (one sample at least). A sequence computes the same bits in any
  // batch, so the grouping changes no answer.
  const std::int64_t group_bytes = o.max_cache_mib << 20;
  const triattn_runner::config& cfg = tm.model().config();
  const std::int64_t slot_bytes = std::int64_t{2} * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * std::int64_t{sizeof(float)};
  std::vector<std::pair<std::size_t, std::size_t>> groups;  // [first, end) of `all`
  std::int64_t total = 0;                                    // the progress bar's sample steps
  for (std::size_t first = 0, end = 0; first < S; first = end) {
    std::int64_t bytes = 0, longest = 0;
    for (end = first; end < S && end / per_context == first / per_context; ++end) {
      const std::int64_t length = sample_length(all[end], o);
      std::int64_t slots = length;
      for (const double f : fractions)
        slots += row_capacity(all[end], row_budget(all[end], f), o) * static_cast<std::int64_t>(ps.policies.size());
      if (end > first && bytes + slots * slot_bytes > group_bytes) break;
      bytes += slots * slot_bytes;
      longest = std::max(longest, length - 1);  // the sample's forward steps
    }
    groups.emplace_back(first, end);
    total += longest * static_cast<std::int64_t>(end - first);
  }
  std::fprintf(stderr, "%s: %zu samples in %zu batches, %zu rows x %zu fractions, rounds after %s, %d threads\n", api, S,
               groups.size(), ps.policies.size(), F,
               o.at == prefill_rounds::end ? "the whole prefill" : ("chunks of " + std::to_string(o.chunk)).c_str(), threads);
  progress_bar bar(api, total);
  std::vector<std::vector<passkey_answer>> results;  // [sample][1 + row]
  for (const auto& [first, end] : groups) {
    auto part = run_passkey_context(tm, std::span(all).subspan(first, end - first), first, o, ps, fractions, decoder, bar);
    for (auto& r : part) results.push_back(std::move(r));
  }
  std::fputc('\n', stderr);

  // Accuracy per (family, row, fraction, context) and over the contexts; SE of a proportion.
  std::ostringstream csv, samples, md;
  const std::string setting = std::string(",") + prefill_rounds_name(o.at) + ",\"" + protocol_name(o.protocol) + "\"\n";
  csv << "policy,fraction,context,budget,accuracy,accuracy_se,samples,family,compress_at,protocol\n";
  samples << "policy,fraction,context,depth,trial,key,correct,answer,family\n";
  md << "# Retrieval after a compressed prefill (" << api << ")\n\n"
     << "Families: `passkey` is llama.cpp's `passkey` text (a 5-digit key at a depth of repeated filler); `single`, "
     << "`multikey` and `paraphrase` hide 5-digit keys in prose the model wrote itself (`haystack.txt`): one needle; "
     << "four needles of one form, the question asking for one; a needle the question words differently. The context "
     << "is prefilled "
     << (o.at == prefill_rounds::end ? std::string("whole, then one round cuts the cache to the budget")
                                     : "in chunks of " + std::to_string(o.chunk) +
                                           " tokens with a round after every chunk that cuts the cache to the budget")
     << " (a fraction of the context), then the question, then " << o.answer_tokens
     << " greedy tokens; correct when the first number of the answer is the key. Protection: "
     << (o.protocol ? "`" + protocol_name(o.protocol) + "` for every policy" : "each policy's own defaults")
     << ". Depths " << o.depths << ", " << o.trials << " sample(s) per depth. ± is the standard "
     << "error of the proportion (sqrt(p (1 - p) / n)).\n";
  const auto cell = [](double hits, double n) {
    const double p = n > 0 ? hits / n : NAN;
    return std::pair{p, n > 0 ? std::sqrt(p * (1 - p) / n) : NAN};
  };
  std::vector<std::string> names;
  if (ps.has_full) names.emplace_back(triattn::full_name);
  for (const eval_policy& p : ps.policies) names.push_back(p.name);
  for (const std::string& family : families) {
    md << "\n## " << family << "\n\n| policy | fraction |";
    for (const std::int64_t c : contexts) md << " " << c << " |";
    md << " all |\n|---|---:|";
    for (std::size_t c = 0; c <= contexts.size(); ++c) md << "---:|";
    md << "\n";
    for (std::size_t r = 0; r < names.size(); ++r) {
      const bool is_full = ps.has_full && r == 0;
      const std::size_t p = ps.has_full ? r - 1 : r;
      for (std::size_t f = 0; f < (is_full ? 1 : F); ++f) {
        const std::size_t column = is_full ? 0 : 1 + p * F + f;
        md << "| " << names[r] << " | " << (is_full ? std::string("1") : fmt("%g", fractions[f])) << " |";
        double all_hits = 0, all_n = 0;
        for (const std::int64_t c : contexts) {
          double hits = 0, n = 0;
          for (std::size_t i = 0; i < S; ++i) {
            const passkey_sample& s = all[i];
            if (s.context != c || s.family != family) continue;
            const passkey_answer& ans = results[i][column];
            hits += ans.correct ? 1 : 0;
            ++n;
            std::string text = ans.text;
            for (char& ch : text)
              if (ch == '\n' || ch == ',' || ch == '"') ch = ' ';
            samples << names[r] << ',' << (is_full ? 1.0 : fractions[f]) << ',' << c << ',' << fmt("%g", s.depth) << ','
                    << s.trial << ',' << s.key << ',' << (ans.correct ? 1 : 0) << ',' << text << ',' << family << '\n';
          }
          const auto [acc, se] = cell(hits, n);
          const std::int64_t budget = is_full ? c : std::max<std::int64_t>(1, std::llround(fractions[f] * static_cast<double>(c)));
          csv << names[r] << ',' << (is_full ? 1.0 : fractions[f]) << ',' << c << ',' << budget << ',' << fmt("%.4f", acc)
              << ',' << fmt("%.4f", se) << ',' << n << ',' << family << setting;
          md << " " << fmt("%.2f", acc) << " ± " << fmt("%.2f", se) << " |";
          all_hits += hits;
          all_n += n;
        }
        const auto [acc, se] = cell(all_hits, all_n);
        csv << names[r] << ',' << (is_full ? 1.0 : fractions[f]) << ",all,0," << fmt("%.4f", acc) << ',' << fmt("%.4f", se)
            << ',' << all_n << ',' << family << setting;
        md << " " << fmt("%.2f", acc) << " ± " << fmt("%.2f", se) << " |\n";
      }
    }
  }
  md << "\nWall time: " << fmt("%.1f", bar.seconds()) << " s on " << threads << " threads.\n";
  write_file(o.out, "passkey.csv", csv.str());
  write_file(o.out, "passkey_samples.csv", samples.str());
  write_file(o.out, "passkey.md", md.str());
  std::fprintf(stderr, "%s: wrote %s/passkey.csv, passkey.md in %.1f s\n", api, o.out.string().c_str(), bar.seconds());
  return 0;
}

}  // namespace triattn_eval
