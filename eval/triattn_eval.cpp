// triattn_eval: quality of every KV-cache policy at every budget on a llama2.c model (issue 5).
//
//   triattn_eval --model M.bin --tokenizer T.bin --text FILE --stats S.safetensors
//                --policies full,random,window,... --budgets 32,64,128,256 --windows N
//                --divide-length D --out DIR [--quick] [--threads T] [--prompts P]
//   triattn_eval --list-policies      (the rows it knows, one name a line: for scripts and plots)
//   triattn_eval tokenize --model M --text FILE --out T.npy
//   triattn_eval logits --model M --tokens T.npy --out L.npy [--policy P --budget B --slack D --stats S]
//   triattn_eval long --model M.gguf --prompts FILE --policies LIST --out DIR [...]
//   triattn_eval prefill --model M.gguf --text FILE --policies LIST --out DIR [...]   (prefill.hpp)
//   triattn_eval passkey --model M.gguf --policies LIST --out DIR [...]
//   triattn_eval generate --model M --prompt-file F [--chat] [--policy P --budget B ...]
//
// `long` and `passkey` are the long-context regimes of a chat model (long_context.hpp): decode-
// time compression along the model's own long answers, and retrieval after a compressed prefill.
//
// M is a llama2.c checkpoint (with --tokenizer T.bin) or, in a build with llama.cpp, a GGUF
// file. `tokenize` and `logits` let other engines be compared with the runner token for token.
//
// Rows: `full`, the references `random` and `window`, every compressing policy of the registry
// (triattn::policy_registry, in its order), then variants of TriAttention.
//
// Teacher-forced over N windows of the text (triattn_runner::text_windows: blank-line paragraphs, BOS +
// tokens each, concatenated to the model's context). Every policy runs on the same schedule: a
// slack trigger of D tokens (a round when the cache holds budget + D tokens cuts it to budget),
// so the peak is budget + D tokens for every policy. No prompt protection (the windows have no
// prompt). Metrics cover the same positions for every row of one budget: every prediction made
// after the first compression that has a true next token in the window. KL(full || compressed)
// and top-1 agreement compare with the full-cache model on the same window; NLL is against the
// true next token. The full-cache logits of a window are computed once and shared by all rows.
//
// Free generation: greedy continuations (default 400 tokens) from P prompts (default 50), the
// first 32 tokens (BOS + tokens) of the first P paragraphs of the text with at least 32 tokens;
// `gen_prefix` is the mean length of the prefix equal to the full-cache continuation. Generation
// does not stop at BOS/EOS: it always runs the full length, so every row compares equal lengths.
//
// Outputs in DIR: quality.csv (deterministic: fixed seeds and formatting, results independent
// of the thread count), quality.md (the table). Progress goes to stderr. Errors: one line on
// stderr, exit code 2.

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "eval_common.hpp"
#include "eval_policies.hpp"
#include "generate.hpp"
#include "long_context.hpp"
#include "prefill.hpp"
#include "runner/compressed_session.hpp"
#include "runner/runner.hpp"
#include "runner/text_model.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/triattn.hpp"

namespace {

namespace fs = std::filesystem;
using namespace triattn_eval;

// ------------------------------------------------------------------------------------------
// Options

struct options {
  fs::path model, tokenizer, text, stats, out;
  std::vector<std::string> policies;
  std::vector<std::int64_t> budgets;
  int windows = 200;
  std::int64_t divide_length = 16;
  int prompts = 50;
  int prompt_tokens = 32;
  int gen_tokens = 400;
  int threads = 0;
  bool quick = false;
};

std::string usage_text() {
  std::string text =
      "usage: triattn_eval --model M.bin --tokenizer T.bin --text FILE --stats S.safetensors\n"
      "                    [--policies full,random,window,...] [--budgets 32,64,128,256] [--windows 200]\n"
      "                    [--divide-length 16] [--prompts 50] [--gen-tokens 400] [--threads T]\n"
      "                    --out DIR [--quick]\n"
      "       triattn_eval --list-policies   (the policy names, one a line)\n"
      "       triattn_eval tokenize --model M [--tokenizer T] --text FILE --out T.npy\n"
      "       triattn_eval logits --model M [--tokenizer T] --tokens T.npy --out L.npy\n"
      "                    [--policy P --budget B [--slack 16] [--stats S]]\n"
      "       triattn_eval long --model M.gguf --prompts FILE --policies LIST --out DIR [--stats S]\n"
      "                    [--budgets 128,256,512] [--tokens 2048] [--slack 64] [--temperature 0.7] [--seed 1]\n"
      "       triattn_eval prefill --model M.gguf --text FILE --policies LIST --out DIR [--stats S]\n"
      "                    [--budgets 128,256] [--context 1024] [--tokens 256] [--windows 16] [--first-window 0]\n"
      "       triattn_eval passkey --model M.gguf --policies LIST --out DIR [--stats S] [--fractions 0.1,0.25,0.5]\n"
      "                    [--contexts 1024,2048,4096] [--depths 0.1,0.3,0.5,0.7,0.9] [--trials 1] [--chunk 128]\n"
      "                    [--compress-at chunks|end] [--max-cache-mib 8192]\n"
      "       triattn_eval retrieval   (passkey's options; needles in prose the model writes:)\n"
      "                    --haystack-prompts FILE [--haystack-tokens 1024] | --haystack HAYSTACK.txt\n"
      "                    [--families single,multikey,paraphrase]\n"
      "       triattn_eval generate --model M --prompt-file F [--chat] [--policy P --budget B [--slack 16] [--stats S]]\n"
      "                    [--chunk 128] [--compress-at chunks|end] [--max-tokens 32] [--threads T]   (the answer on stdout)\n"
      "long, prefill, passkey, logits and generate: [--protocol own|none|prompt,sinks=N,recent=N] protects the same slots\n"
      "                    for every policy (default own: each policy's defaults)\n"
      "M: a llama2.c checkpoint (with --tokenizer) or a GGUF file (tokenizer inside).\n"
      "--quick: 8 windows, budgets 32,64, 8 prompts (unless given explicitly).\n"
      "policies (default: all of them):\n";
  for (const eval_policy& p : all_policies()) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-32s %s\n", p.name.c_str(), p.summary.c_str());
    text += line;
  }
  return text;
}

options parse(int argc, char** argv) {
  options o;
  bool have_windows = false, have_budgets = false, have_prompts = false;
  std::string policies = "", budgets = "32,64,128,256";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage_text().c_str(), stdout);
      std::exit(0);
    }
    if (arg == "--list-policies") {
      for (const eval_policy& p : all_policies()) std::printf("%s\n", p.name.c_str());
      std::exit(0);
    }
    if (arg == "--quick") {
      o.quick = true;
      continue;
    }
    std::optional<std::string> value;
    if (const auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    if (!value) {
      if (i + 1 >= argc) throw usage_error{"option " + arg + " needs a value"};
      value = argv[++i];
    }
    const std::string& v = *value;
    if (arg == "--model") o.model = v;
    else if (arg == "--tokenizer") o.tokenizer = v;
    else if (arg == "--text") o.text = v;
    else if (arg == "--stats") o.stats = v;
    else if (arg == "--out") o.out = v;
    else if (arg == "--policies") policies = v;
    else if (arg == "--budgets") budgets = v, have_budgets = true;
    else if (arg == "--windows") o.windows = static_cast<int>(parse_int(arg, v, 1)), have_windows = true;
    else if (arg == "--divide-length") o.divide_length = parse_int(arg, v, 1);
    else if (arg == "--prompts") o.prompts = static_cast<int>(parse_int(arg, v, 0)), have_prompts = true;
    else if (arg == "--gen-tokens") o.gen_tokens = static_cast<int>(parse_int(arg, v, 1));
    else if (arg == "--threads") o.threads = static_cast<int>(parse_int(arg, v, 1));
    else throw usage_error{"unknown option " + arg};
  }
  if (o.quick) {
    if (!have_windows) o.windows = 8;
    if (!have_budgets) budgets = "32,64";
    if (!have_prompts) o.prompts = 8;
  }
  for (const auto& [name, path] : {std::pair<const char*, const fs::path*>{"--model", &o.model},
                                   {"--tokenizer", &o.tokenizer}, {"--text", &o.text}, {"--out", &o.out}})
    if (path->empty()) throw usage_error{std::string("missing ") + name};
  if (policies.empty())
    for (const eval_policy& p : all_policies()) o.policies.push_back(p.name);
  else
    o.policies = split(policies);
  for (const std::string& name : o.policies) find_eval_policy(name);  // an unknown name fails here
  for (const std::string& b : split(budgets)) o.budgets.push_back(parse_int("--budgets", b, 1));
  if (o.budgets.empty()) throw usage_error{"--budgets is empty"};
  if (o.policies.empty()) throw usage_error{"--policies is empty"};
  return o;
}

// ------------------------------------------------------------------------------------------
// Text: paragraphs as triattn_runner::text_windows splits them, for the generation prompts.

std::vector<std::vector<int>> paragraph_prompts(const triattn_runner::tokenizer& tok, std::string_view text, int min_tokens,
                                                int count) {
  std::vector<std::vector<int>> out;
  constexpr std::string_view blank = " \t\r\f\v";
  std::string paragraph;
  const auto end_paragraph = [&] {
    const auto first = paragraph.find_first_not_of(blank);
    if (first == std::string::npos) return;
    const auto last = paragraph.find_last_not_of(blank);
    std::vector<int> ids{triattn_runner::bos_id};
    const auto body = tok.encode(std::string_view(paragraph).substr(first, last + 1 - first), false, false);
    ids.insert(ids.end(), body.begin(), body.end());
    paragraph.clear();
    if (ids.size() >= static_cast<std::size_t>(min_tokens)) {
      ids.resize(static_cast<std::size_t>(min_tokens));
      out.push_back(std::move(ids));
    }
  };
  while (!text.empty() && out.size() < static_cast<std::size_t>(count)) {
    const std::size_t eol = std::min(text.find('\n'), text.size());
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(std::min(eol + 1, text.size()));
    if (line.ends_with('\r')) line.remove_suffix(1);
    if (line.find_first_not_of(blank) == std::string_view::npos) {
      end_paragraph();
    } else {
      if (!paragraph.empty()) paragraph += '\n';
      paragraph += line;
    }
  }
  if (out.size() < static_cast<std::size_t>(count)) end_paragraph();
  return out;
}

// ------------------------------------------------------------------------------------------
// The evaluation

/// Sums over the scored positions of one sequence.
struct window_sums {
  double kl = 0, top1 = 0, nll = 0;
  std::int64_t n = 0;
};

/// One sequence of the evaluation: a session, its policy (none for `full`) fed with the
/// session's attention, rounds on the evaluation's schedule with no prompt protection (the
/// round context holds the next token's position, no prompt).
using runner = triattn_runner::compressed_session;

struct job {  // one compressed (policy, budget) row
  std::size_t policy;  // index into the evaluated policies
  std::size_t budget;  // index into options::budgets
};

class evaluator {
 public:
  evaluator(const options& o, const triattn_runner::model& m, const std::vector<eval_policy>& policies,
            const triattn::query_stats* stats, std::vector<std::vector<int>> windows,
            std::vector<std::vector<int>> prompts)
      : o_(o), m_(m), policies_(policies), stats_(stats), windows_(std::move(windows)), prompts_(std::move(prompts)),
        sched_(triattn::schedule::with_slack(o.divide_length)) {
    for (std::size_t p = 0; p < policies_.size(); ++p)
      for (std::size_t b = 0; b < o_.budgets.size(); ++b)
        if (policies_[p].name != "full") jobs_.push_back({p, b});
    const std::size_t W = windows_.size(), P = prompts_.size();
    sums_.assign(jobs_.size() * W, {});
    full_sums_.assign(o_.budgets.size() * W, {});
    peak_.assign(jobs_.size() * (W + P), 0);
    full_peak_.assign(W + P, 0);
    prefix_.assign(jobs_.size() * P, 0);
    total_units_ = static_cast<std::int64_t>(W) * 512 * static_cast<std::int64_t>(jobs_.size() + 1) +
                   static_cast<std::int64_t>(P) * (o_.prompt_tokens + o_.gen_tokens) *
                       static_cast<std::int64_t>(jobs_.size() + 1);
  }

  void run(int threads) {
    bar_ = std::make_unique<progress_bar>("triattn_eval", total_units_);
    const std::size_t count = windows_.size() + prompts_.size();
    // No more members than tasks: an idle member would spin beside the working ones.
    triattn_runner::thread_team team(static_cast<int>(std::clamp<std::size_t>(count, 1, static_cast<std::size_t>(threads))));
    team.for_each_dynamic(count, [&](std::size_t t) {
      if (t < windows_.size())
        run_window(t);
      else
        run_prompt(t - windows_.size());
    });
    std::fputc('\n', stderr);
  }

  double seconds() const { return bar_->seconds(); }

  void write(const fs::path& dir, int threads) const;

 private:
  const options& o_;
  const triattn_runner::model& m_;
  const std::vector<eval_policy>& policies_;
  const triattn::query_stats* stats_;
  std::vector<std::vector<int>> windows_, prompts_;
  triattn::schedule sched_;
  std::vector<job> jobs_;
  std::vector<window_sums> sums_;       // [job, window]
  std::vector<window_sums> full_sums_;  // [budget, window]
  std::vector<std::int64_t> peak_;      // [job, task]
  std::vector<std::int64_t> full_peak_; // [task]
  std::vector<std::int32_t> prefix_;    // [job, prompt]
  std::int64_t total_units_ = 1;
  std::unique_ptr<progress_bar> bar_;

  std::size_t tasks() const { return windows_.size() + prompts_.size(); }

  void progress(std::int64_t units) { bar_->add(units); }

  /// A seed per (job, sequence), so results do not depend on the thread schedule.
  static std::uint64_t seed_of(std::size_t job_index, std::size_t sequence) {
    std::seed_seq seq{0u, static_cast<unsigned>(job_index), static_cast<unsigned>(sequence)};
    std::uint64_t out[1] = {};
    std::uint32_t words[2] = {};
    seq.generate(words, words + 2);
    out[0] = (static_cast<std::uint64_t>(words[0]) << 32) | words[1];
    return out[0];
  }

  /// The first step after which the schedule compresses a cache growing by one token a step.
  std::int64_t first_compression_step(std::int64_t budget, std::int64_t steps) const {
    for (std::int64_t t = 0; t < steps; ++t)
      if (sched_.should_compress(t + 1, budget, t + 1)) return t;
    return steps;
  }

  void run_window(std::size_t w) {
    const std::vector<int>& tokens = windows_[w];
    const auto T = static_cast<std::int64_t>(tokens.size());
    const auto V = static_cast<std::size_t>(m_.config().vocab_size);
    // The full-cache reference: log-probabilities, probabilities and argmax of every step.
    std::vector<double> logp(static_cast<std::size_t>(T) * V), prob(logp.size());
    std::vector<int> top(static_cast<std::size_t>(T));
    std::vector<double> nll_full(static_cast<std::size_t>(T), 0.0);
    {
      triattn_runner::session full(m_, T);
      for (std::int64_t t = 0; t < T; ++t) {
        const auto logits = full.forward(tokens[static_cast<std::size_t>(t)]);
        full_peak_[w] = std::max(full_peak_[w], full.kv_bytes());
        const double lse = log_sum_exp(logits);
        for (std::size_t i = 0; i < V; ++i) {
          logp[static_cast<std::size_t>(t) * V + i] = logits[i] - lse;
          prob[static_cast<std::size_t>(t) * V + i] = std::exp(logits[i] - lse);
        }
        top[static_cast<std::size_t>(t)] = triattn_runner::argmax(logits);
        if (t + 1 < T)
          nll_full[static_cast<std::size_t>(t)] = -logp[static_cast<std::size_t>(t) * V +
                                                        static_cast<std::size_t>(tokens[static_cast<std::size_t>(t + 1)])];
      }
    }
    for (std::size_t b = 0; b < o_.budgets.size(); ++b) {
      window_sums& s = full_sums_[b * windows_.size() + w];
      for (std::int64_t t = first_compression_step(o_.budgets[b], T) + 1; t + 1 < T; ++t) {
        s.nll += nll_full[static_cast<std::size_t>(t)];
        s.top1 += 1;
        ++s.n;
      }
    }
    progress(T);

    for (std::size_t j = 0; j < jobs_.size(); ++j) {
      const std::int64_t budget = o_.budgets[jobs_[j].budget];
      runner r(m_, sched_.peak_tokens(budget),
               policies_[jobs_[j].policy].make(stats_, seed_of(j, w), {sched_, {}, {}}), budget);
      window_sums& s = sums_[j * windows_.size() + w];
      for (std::int64_t t = 0; t < T; ++t) {
        const bool scored = r.compressed() && t + 1 < T;  // compressed before this step's forward
        const auto logits = r.cache().forward(tokens[static_cast<std::size_t>(t)]);
        if (scored) {
          const double lse = log_sum_exp(logits);
          const std::size_t row = static_cast<std::size_t>(t) * V;
          double kl = 0.0;
          for (std::size_t i = 0; i < V; ++i) kl += prob[row + i] * (logp[row + i] - (logits[i] - lse));
          s.kl += kl;
          s.top1 += triattn_runner::argmax(logits) == top[static_cast<std::size_t>(t)] ? 1.0 : 0.0;
          s.nll += -(logits[static_cast<std::size_t>(tokens[static_cast<std::size_t>(t + 1)])] - lse);
          ++s.n;
        }
        r.maybe_compress();  // the logits stay valid: a round does not touch them
      }
      peak_[j * tasks() + w] = r.peak_bytes();
      progress(T);
    }
  }

  /// Greedy continuation of `prompt`: o_.gen_tokens tokens.
  std::vector<int> generate(runner& r, const std::vector<int>& prompt) {
    std::span<const float> logits;
    for (const int t : prompt) logits = r.step(t);
    std::vector<int> out;
    out.reserve(static_cast<std::size_t>(o_.gen_tokens));
    for (int g = 0; g < o_.gen_tokens; ++g) {
      const int next = triattn_runner::argmax(logits);
      out.push_back(next);
      if (g + 1 < o_.gen_tokens) logits = r.step(next);
    }
    return out;
  }

  void run_prompt(std::size_t p) {
    const std::vector<int>& prompt = prompts_[p];
    const std::int64_t units = static_cast<std::int64_t>(prompt.size()) + o_.gen_tokens;
    const std::size_t task = windows_.size() + p;
    std::vector<int> reference;
    {
      runner full(m_, units, std::nullopt, 0);
      reference = generate(full, prompt);
      full_peak_[task] = full.peak_bytes();
    }
    progress(units);
    for (std::size_t j = 0; j < jobs_.size(); ++j) {
      const std::int64_t budget = o_.budgets[jobs_[j].budget];
      runner r(m_, std::max(sched_.peak_tokens(budget), std::int64_t{1}),
               policies_[jobs_[j].policy].make(stats_, seed_of(j, task), {sched_, {}, {}}), budget);
      const std::vector<int> out = generate(r, prompt);
      std::size_t k = 0;
      while (k < out.size() && out[k] == reference[k]) ++k;
      prefix_[j * prompts_.size() + p] = static_cast<std::int32_t>(k);
      peak_[j * tasks() + task] = r.peak_bytes();
      progress(units);
    }
  }

};

struct row {
  std::string policy;
  std::int64_t budget = 0;
  double nll = NAN, ppl = NAN, kl = NAN, top1 = NAN, gen_prefix = NAN;
  std::int64_t kv_bytes = 0;
  double kl_se = NAN, top1_se = NAN, nll_se = NAN;
  std::int64_t windows = 0, positions = 0, prompts = 0;
};

/// Mean over all positions, and the standard error of the per-window means across windows.
void summarize(std::span<const window_sums> w, row& r) {
  double kl = 0, top1 = 0, nll = 0;
  std::int64_t n = 0, used = 0;
  for (const window_sums& s : w) {
    kl += s.kl, top1 += s.top1, nll += s.nll, n += s.n;
    used += s.n > 0 ? 1 : 0;
  }
  r.windows = used;
  r.positions = n;
  if (n == 0) return;
  r.kl = kl / static_cast<double>(n);
  r.top1 = top1 / static_cast<double>(n);
  r.nll = nll / static_cast<double>(n);
  r.ppl = std::exp(r.nll);
  const auto se = [&](auto get) -> double {
    if (used < 2) return std::numeric_limits<double>::quiet_NaN();
    double m = 0, q = 0;
    for (const window_sums& s : w)
      if (s.n > 0) m += get(s) / static_cast<double>(s.n);
    m /= static_cast<double>(used);
    for (const window_sums& s : w)
      if (s.n > 0) {
        const double d = get(s) / static_cast<double>(s.n) - m;
        q += d * d;
      }
    return std::sqrt(q / static_cast<double>(used - 1) / static_cast<double>(used));
  };
  r.kl_se = se([](const window_sums& s) { return s.kl; });
  r.top1_se = se([](const window_sums& s) { return s.top1; });
  r.nll_se = se([](const window_sums& s) { return s.nll; });
}

void evaluator::write(const fs::path& dir, int threads) const {
  const std::size_t W = windows_.size(), P = prompts_.size();
  std::vector<row> rows;
  for (std::size_t p = 0; p < policies_.size(); ++p) {
    for (std::size_t b = 0; b < o_.budgets.size(); ++b) {
      row r;
      r.policy = policies_[p].name;
      r.budget = o_.budgets[b];
      r.prompts = static_cast<std::int64_t>(P);
      if (r.policy == "full") {
        summarize({full_sums_.data() + b * W, W}, r);
        if (r.positions > 0) r.kl = 0.0, r.top1 = 1.0, r.kl_se = 0.0, r.top1_se = 0.0;
        r.kv_bytes = *std::max_element(full_peak_.begin(), full_peak_.end());
        r.gen_prefix = P > 0 ? static_cast<double>(o_.gen_tokens) : std::numeric_limits<double>::quiet_NaN();
      } else {
        const auto j = static_cast<std::size_t>(
            std::find_if(jobs_.begin(), jobs_.end(), [&](const job& x) { return x.policy == p && x.budget == b; }) -
            jobs_.begin());
        summarize({sums_.data() + j * W, W}, r);
        r.kv_bytes = *std::max_element(peak_.begin() + static_cast<std::ptrdiff_t>(j * tasks()),
                                       peak_.begin() + static_cast<std::ptrdiff_t>((j + 1) * tasks()));
        if (P > 0) {
          double sum = 0;
          for (std::size_t q = 0; q < P; ++q) sum += prefix_[j * P + q];
          r.gen_prefix = sum / static_cast<double>(P);
        }
      }
      rows.push_back(r);
    }
  }

  std::ostringstream csv;
  csv << "policy,budget,nll,ppl,kl,top1,kv_bytes,gen_prefix,kl_se,top1_se,nll_se,windows,positions,divide_length,"
         "prompts,gen_tokens\n";
  for (const row& r : rows)
    csv << r.policy << ',' << r.budget << ',' << fmt("%.6f", r.nll) << ',' << fmt("%.6f", r.ppl) << ','
        << fmt("%.8f", r.kl) << ',' << fmt("%.6f", r.top1) << ',' << r.kv_bytes << ',' << fmt("%.3f", r.gen_prefix)
        << ',' << fmt("%.8f", r.kl_se) << ',' << fmt("%.6f", r.top1_se) << ',' << fmt("%.6f", r.nll_se) << ','
        << r.windows << ',' << r.positions << ',' << o_.divide_length << ',' << r.prompts << ',' << o_.gen_tokens
        << '\n';

  std::ostringstream md;
  md << "# KV-cache policy quality (triattn_eval)\n\n"
     << "Teacher-forced over " << W << " windows of " << (W > 0 ? windows_[0].size() : 0)
     << " tokens of `" << o_.text.filename().string() << "`; slack trigger D = " << o_.divide_length
     << " (peak = budget + D tokens for every policy); no prompt protection. KL(full || compressed) in nats, "
        "top-1 agreement with the full cache and NLL of the true next token, over every prediction after the "
        "first compression (the same positions for every row of a budget). ± is the standard error of the "
        "per-window means across windows. gen_prefix: mean length of the prefix of "
     << o_.gen_tokens << "-token greedy continuations of " << P << " prompts (" << o_.prompt_tokens
     << " tokens) equal to the full cache's.\n\n"
     << "| policy | B | KL | top-1 % | NLL | ppl | KV bytes | gen_prefix | positions |\n"
     << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const row& r : rows)
    md << "| " << r.policy << " | " << r.budget << " | " << fmt("%.4f", r.kl) << " ± " << fmt("%.4f", r.kl_se)
       << " | " << fmt("%.1f", 100 * r.top1) << " | " << fmt("%.4f", r.nll) << " ± " << fmt("%.4f", r.nll_se) << " | "
       << fmt("%.3f", r.ppl) << " | " << r.kv_bytes << " | " << fmt("%.1f", r.gen_prefix) << " | " << r.positions
       << " |\n";
  md << "\nWall time: " << fmt("%.1f", seconds()) << " s on " << threads << " threads.\n";

  write_file(dir, "quality.csv", csv.str());
  write_file(dir, "quality.md", md.str());
}

// ------------------------------------------------------------------------------------------
// `tokenize` and `logits` (shared/spec/cli.md): the runner token for token, for comparisons
// with other engines.

/// `tokenize --model M [--tokenizer T] --text FILE --out T.npy`: int32 [N], the start token
/// the tokenizer adds, then the text's tokens.
int run_tokenize(int argc, char** argv) {
  const auto o = subcommand_options(argc, argv, {"--model", "--tokenizer", "--text", "--out"});
  const fs::path out = required(o, "--out", "tokenize"), text_path = required(o, "--text", "tokenize");
  const triattn_runner::text_model m =
      triattn_runner::text_model::load_tokenizer(required(o, "--model", "tokenize"),
                                                 o.contains("--tokenizer") ? o.at("--tokenizer") : "", "triattn_eval tokenize");
  const std::vector<int> ids = m.encode(triattn_runner::read_file(text_path, "triattn_eval tokenize"));
  const std::vector<std::int32_t> data(ids.begin(), ids.end());
  const std::array<std::int64_t, 1> shape{static_cast<std::int64_t>(data.size())};
  triattn::io::write_npy(out, triattn::io::element_kind::i32, shape, data.data());
  return 0;
}

/// `logits --model M [--tokenizer T] --tokens T.npy --out L.npy [--policy P --budget B
/// --slack D --stats S --protocol X]`: float32 [N, vocab], teacher-forced, with the cache compressed as in
/// the evaluation when a policy is given.
int run_logits(int argc, char** argv) {
  const auto o = subcommand_options(argc, argv,
                                    {"--model", "--tokenizer", "--tokens", "--out", "--policy", "--budget", "--slack", "--stats",
                                     "--protocol"});
  const char* api = "triattn_eval logits";
  const fs::path out = required(o, "--out", "logits"), tokens_path = required(o, "--tokens", "logits");
  const std::string policy_name = o.contains("--policy") ? o.at("--policy") : std::string(triattn::full_name);
  const eval_policy policy = find_eval_policy(policy_name);
  const eval_policy* p = &policy;
  const bool compressing = policy_name != triattn::full_name;
  const std::int64_t budget = compressing ? parse_int("--budget", required(o, "--budget", "logits"), 1) : 0;
  const std::int64_t slack = o.contains("--slack") ? parse_int("--slack", o.at("--slack"), 1) : 16;
  const std::optional<triattn::round_protocol> protocol =
      o.contains("--protocol") ? parse_protocol(o.at("--protocol")) : std::nullopt;
  std::optional<triattn::query_stats> stats;
  if (p->needs_stats) stats = triattn::load_stats(required(o, "--stats", "logits"));

  const triattn::io::npy_array t = triattn::io::read_npy(tokens_path);
  TRIATTN_CHECK(t.shape.size() == 1 && t.shape[0] >= 1, api, tokens_path, ": tokens must be a non-empty 1-D array, got ",
                t.shape.size(), " dimensions of ", t.size(), " elements");
  TRIATTN_CHECK(t.kind == triattn::io::element_kind::i32 || t.kind == triattn::io::element_kind::i64, api, tokens_path,
                ": tokens must be int32 or int64, got ", triattn::io::element_kind_name(t.kind));
  const std::vector<std::int64_t> tokens = t.to_int64();
  const triattn_runner::text_model m = triattn_runner::text_model::load(required(o, "--model", "logits"),
                                                          o.contains("--tokenizer") ? o.at("--tokenizer") : "", api);
  const std::int64_t vocab = m.model().config().vocab_size;
  for (std::size_t i = 0; i < tokens.size(); ++i)
    TRIATTN_CHECK(tokens[i] >= 0 && tokens[i] < vocab, api, tokens_path, ": token ", tokens[i], " at index ", i,
                  " is outside [0, vocab ", vocab, ")");

  const auto n = static_cast<std::int64_t>(tokens.size());
  const triattn::schedule sched = triattn::schedule::with_slack(slack);
  runner r(m.model(), compressing ? std::min(n, sched.peak_tokens(budget)) : n,
           p->make(stats ? &*stats : nullptr, 0, {sched, protocol, {}}), budget);
  std::vector<float> logits(static_cast<std::size_t>(n * vocab));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::span<const float> l = r.step(static_cast<int>(tokens[static_cast<std::size_t>(i)]));
    std::copy(l.begin(), l.end(), logits.begin() + i * vocab);
  }
  const std::array<std::int64_t, 2> shape{n, vocab};
  triattn::io::write_npy(out, triattn::io::element_kind::f32, shape, logits.data());
  return 0;
}

int run(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == "tokenize") return run_tokenize(argc, argv);
  if (argc > 1 && std::string_view(argv[1]) == "logits") return run_logits(argc, argv);
  if (argc > 1 && std::string_view(argv[1]) == "long") return run_long(argc, argv);
  if (argc > 1 && std::string_view(argv[1]) == "prefill") return run_prefill(argc, argv);
  if (argc > 1 && (std::string_view(argv[1]) == "passkey" || std::string_view(argv[1]) == "retrieval"))
    return run_passkey(argc, argv);
  if (argc > 1 && std::string_view(argv[1]) == "generate") return run_generate(argc, argv);
  const options o = parse(argc, argv);
  const triattn_runner::model m = triattn_runner::model::load(o.model);
  const triattn_runner::tokenizer tok = triattn_runner::tokenizer::load(o.tokenizer, m.config().vocab_size);
  const std::string text = triattn_runner::read_file(o.text, "triattn_eval");

  std::vector<eval_policy> policies;
  bool need_stats = false;
  for (const std::string& name : o.policies) {
    policies.push_back(find_eval_policy(name));
    need_stats |= policies.back().needs_stats;
  }
  std::optional<triattn::query_stats> stats;
  if (need_stats) {
    if (o.stats.empty()) throw usage_error{"the TriAttention policies need --stats (triattn calibrate)"};
    stats = triattn::load_stats(o.stats);
  }

  auto windows = triattn_runner::text_windows(tok, text, m.config().seq_len, o.windows);
  if (windows.empty()) throw usage_error{"the text holds no full window of " + std::to_string(m.config().seq_len) + " tokens"};
  auto prompts = paragraph_prompts(tok, text, o.prompt_tokens, o.prompts);
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::fprintf(stderr, "triattn_eval: %zu windows (%d asked), %zu prompts, %zu policies x %zu budgets, D = %lld, %d threads\n",
               windows.size(), o.windows, prompts.size(), policies.size(), o.budgets.size(),
               static_cast<long long>(o.divide_length), threads);

  evaluator ev(o, m, policies, stats ? &*stats : nullptr, std::move(windows), std::move(prompts));
  ev.run(threads);
  ev.write(o.out, threads);
  std::fprintf(stderr, "triattn_eval: wrote %s/quality.csv and quality.md in %.1f s\n", o.out.string().c_str(),
               ev.seconds());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "triattn_eval: %s\n", e.message.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn_eval: %s\n", e.what());
  }
  return 2;
}
