/// \file eval/prefill.hpp
/// \brief `triattn_eval prefill`: compression of a long context, once, after its prefill
/// (kvpress' setting): every window of held-out text is `--context` tokens of context, then
/// `--tokens` teacher-forced tokens. Each row (policy x budget) prefills the context with the
/// full cache, observing it as the engine would, cuts it to the budget in one round (round
/// context: the next position, no prompt), and is teacher-forced along the continuation with
/// no further round. KL(full || compressed) and top-1 agreement are measured on the
/// continuation's `--tokens` predictions, all made after the round; the full cache's
/// distributions are the same window's. One window at a time, its rows in one batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "eval_common.hpp"
#include "eval_policies.hpp"
#include "long_context.hpp"
#include "runner/compressed_session.hpp"
#include "runner/metrics.hpp"
#include "runner/session.hpp"
#include "runner/text_model.hpp"
#include "runner/tokenizer.hpp"
#include "triattn/registry.hpp"

namespace triattn_eval {

struct prefill_options {
  fs::path model, text, out;
  std::optional<std::string> stats;
  std::string policies, budgets = "128,256";
  std::int64_t context = 1024, tokens = 256;
  int windows = 16, first_window = 0, threads = 0;
  std::optional<triattn::round_protocol> protocol;
};

inline prefill_options parse_prefill(int argc, char** argv) {
  const auto a = subcommand_options(argc, argv,
                                    {"--model", "--text", "--stats", "--out", "--policies", "--budgets", "--context",
                                     "--tokens", "--windows", "--first-window", "--threads", "--protocol"});
  prefill_options o;
  o.model = required(a, "--model", "prefill");
  o.text = required(a, "--text", "prefill");
  o.out = required(a, "--out", "prefill");
  o.policies = required(a, "--policies", "prefill");
  if (a.contains("--stats")) o.stats = a.at("--stats");
  if (a.contains("--budgets")) o.budgets = a.at("--budgets");
  if (a.contains("--context")) o.context = parse_int("--context", a.at("--context"), 2);
  if (a.contains("--tokens")) o.tokens = parse_int("--tokens", a.at("--tokens"), 1);
  if (a.contains("--windows")) o.windows = static_cast<int>(parse_int("--windows", a.at("--windows"), 1));
  if (a.contains("--first-window")) o.first_window = static_cast<int>(parse_int("--first-window", a.at("--first-window"), 0));
  if (a.contains("--threads")) o.threads = static_cast<int>(parse_int("--threads", a.at("--threads"), 1));
  if (a.contains("--protocol")) o.protocol = parse_protocol(a.at("--protocol"));
  return o;
}

/// `prefill --model M --text FILE --policies LIST --out DIR [--stats S] [--budgets 128,256]
/// [--context 1024] [--tokens 256] [--windows 16] [--first-window 0] [--threads T]
/// [--protocol own|none|prompt,sinks=N,recent=N]`: windows `--first-window` onwards of the
/// text (`text_windows`: blank-line paragraphs strung together), `--windows` of them.
inline int run_prefill(int argc, char** argv) {
  const prefill_options o = parse_prefill(argc, argv);
  const char* api = "triattn_eval prefill";
  const policy_set ps(o.policies, o.stats, o.protocol);
  std::vector<std::int64_t> budgets;
  for (const std::string& b : split(o.budgets)) budgets.push_back(parse_int("--budgets", b, 1));
  if (budgets.empty() || ps.policies.empty()) throw usage_error{"prefill: --budgets and --policies need a compressing row"};
  for (const std::int64_t b : budgets)
    if (b >= o.context)
      throw usage_error{"prefill: budget " + std::to_string(b) + " must be below --context " + std::to_string(o.context)};
  const triattn_runner::text_model tm = triattn_runner::text_model::load(o.model, "", api);
  const triattn_runner::model& m = tm.model();
  const std::string text = triattn_runner::read_file(o.text, api);
  const auto length = static_cast<int>(o.context + o.tokens + 1);
  std::vector<std::vector<int>> windows = triattn_runner::text_windows(
      [&](std::string_view p) { return tm.encode_paragraph(p); }, text, length, o.first_window + o.windows);
  if (static_cast<int>(windows.size()) <= o.first_window)
    throw usage_error{"prefill: " + o.text.string() + " holds " + std::to_string(windows.size()) + " windows of " +
                      std::to_string(length) + " tokens, --first-window is " + std::to_string(o.first_window)};
  windows.erase(windows.begin(), windows.begin() + o.first_window);
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const std::size_t B = budgets.size(), R = ps.policies.size() * B, W = windows.size();
  const auto V = static_cast<std::size_t>(m.config().vocab_size);
  const auto C = o.context, T = o.tokens;
  std::fprintf(stderr, "triattn_eval prefill: %zu windows of %lld + %lld tokens, %zu rows x %zu budgets, %d threads\n", W,
               static_cast<long long>(C), static_cast<long long>(T), ps.policies.size(), B, threads);

  triattn_runner::batch_decoder decoder(m, threads);
  progress_bar bar("triattn_eval prefill", static_cast<std::int64_t>(W) * (C + T));
  std::vector<double> kl(R * W, 0.0), top1(R * W, 0.0);  // [row, window]: means over the T predictions
  std::vector<float> logp(static_cast<std::size_t>(T) * V), prob(logp.size());
  std::vector<int> top(static_cast<std::size_t>(T));
  for (std::size_t w = 0; w < W; ++w) {
    const std::vector<int>& x = windows[w];
    triattn_runner::session full(m, C + T);
    std::deque<triattn_runner::compressed_session> rows;
    for (std::size_t j = 0; j < R; ++j)
      rows.emplace_back(m, C + T, ps.make(j / B, row_seed(j, w), triattn::schedule::once_after_prompt()), budgets[j % B]);
    std::vector<triattn_runner::session*> batch{&full};
    for (auto& r : rows) batch.push_back(&r.cache());
    std::vector<int> tokens(batch.size());
    for (std::int64_t t = 0; t < C + T; ++t) {
      std::fill(tokens.begin(), tokens.end(), x[static_cast<std::size_t>(t)]);
      const bool scored = t >= C;  // the prediction of token t + 1, after the round
      decoder.step(batch, tokens, scored);
      if (scored) {
        const std::size_t i = static_cast<std::size_t>(t - C);
        const std::span<const float> ref = decoder.logits(0);
        const double lse = log_sum_exp(ref);
        for (std::size_t v = 0; v < V; ++v) {
          logp[i * V + v] = static_cast<float>(ref[v] - lse);
          prob[i * V + v] = std::exp(logp[i * V + v]);
        }
        top[i] = triattn_runner::argmax(ref);
        decoder.team().for_each(R, [&](std::size_t j) {
          const std::span<const float> z = decoder.logits(static_cast<int>(j + 1));
          const double lq = log_sum_exp(z);
          double d = 0.0;
          for (std::size_t v = 0; v < V; ++v) d += prob[i * V + v] * (logp[i * V + v] - (z[v] - lq));
          kl[j * W + w] += d / static_cast<double>(T);
          top1[j * W + w] += (triattn_runner::argmax(z) == top[i] ? 1.0 : 0.0) / static_cast<double>(T);
        });
      }
      if (t + 1 == C)  // the context is in: one round per row, then none
        decoder.team().for_each(R, [&](std::size_t j) {
          TRIATTN_CHECK(rows[j].compress_to_budget(), api, "row ", j, " did not compress its context");
        });
      bar.add(1);
    }
  }
  std::fputc('\n', stderr);

  std::ostringstream csv, per, md;
  csv << "policy,budget,kl,kl_se,top1,top1_se,windows,context,tokens,protocol\n";
  per << "policy,budget,window,kl,top1\n";
  md << "# One round after a " << C << "-token prefill (triattn_eval prefill)\n\n"
     << W << " windows of `" << o.text.filename().string() << "` (from window " << o.first_window << "): " << C
     << " tokens of context, prefilled with the full cache (every policy observes it), cut to the budget in one round, "
     << "then " << T << " tokens teacher-forced with no further round. KL(full || compressed) in nats and top-1 "
     << "agreement over the " << T << " predictions after the round. Protection: "
     << (o.protocol ? "`" + protocol_name(o.protocol) + "` for every policy" : "each policy's own defaults")
     << ". ± is the standard error across windows; Δ is the paired difference in KL against the budget's best row, "
     << "with its standard error.\n\n| policy | B | KL | Δ KL vs best | top-1 % |\n|---|---:|---:|---:|---:|\n";
  for (std::size_t b = 0; b < B; ++b) {
    std::size_t best = b;  // the budget's row of lowest mean KL (ties: the first listed)
    double best_kl = INFINITY;
    for (std::size_t p = 0; p < ps.policies.size(); ++p)
      if (const double row_kl = mean_and_se(std::span(kl).subspan((p * B + b) * W, W)).mean; row_kl < best_kl) {
        best = p * B + b;
        best_kl = row_kl;
      }
    for (std::size_t p = 0; p < ps.policies.size(); ++p) {
      const std::size_t j = p * B + b;
      const auto k = std::span(kl).subspan(j * W, W), t1 = std::span(top1).subspan(j * W, W);
      std::vector<double> diff(W);
      for (std::size_t w = 0; w < W; ++w) diff[w] = kl[j * W + w] - kl[best * W + w];
      const mean_se km = mean_and_se(k), tm1 = mean_and_se(t1), dm = mean_and_se(diff);
      const std::string& name = ps.policies[p].name;
      csv << name << ',' << budgets[b] << ',' << fmt("%.6f", km.mean) << ',' << fmt("%.6f", km.se) << ','
          << fmt("%.6f", tm1.mean) << ',' << fmt("%.6f", tm1.se) << ',' << W << ',' << C << ',' << T << ",\""
          << protocol_name(o.protocol) << "\"\n";
      for (std::size_t w = 0; w < W; ++w)
        per << name << ',' << budgets[b] << ',' << o.first_window + static_cast<int>(w) << ',' << fmt("%.6f", k[w]) << ','
            << fmt("%.6f", t1[w]) << '\n';
      md << "| " << name << " | " << budgets[b] << " | " << fmt("%.4f", km.mean) << " ± " << fmt("%.4f", km.se) << " | "
         << (j == best ? std::string("best") : fmt("%+.4f", dm.mean) + " ± " + fmt("%.4f", dm.se)) << " | "
         << fmt("%.1f", 100 * tm1.mean) << " ± " << fmt("%.1f", 100 * tm1.se) << " |\n";
    }
  }
  md << "\nWall time: " << fmt("%.1f", bar.seconds()) << " s on " << threads << " threads.\n";
  write_file(o.out, "prefill.csv", csv.str());
  write_file(o.out, "prefill_windows.csv", per.str());
  write_file(o.out, "prefill.md", md.str());
  std::fprintf(stderr, "triattn_eval prefill: wrote %s/prefill.csv, prefill.md in %.1f s\n", o.out.string().c_str(),
               bar.seconds());
  return 0;
}

}  // namespace triattn_eval
