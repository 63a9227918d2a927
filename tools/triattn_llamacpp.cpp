// triattn_llamacpp: llama.cpp generating with its KV cache held at a budget by a triattn policy
// (runner/triattn_llama.hpp), and the quality of that against llama.cpp with a full cache.
//
//   triattn_llamacpp generate --model M.gguf [--policy P] [--stats S] [--budget 384] [--slack 64]
//                    [--batch 64] [--tokens 4096] [--prompt TEXT] [--temperature 0.7] [--seed 1]
//                    [--ids FILE]
//       One answer, free-running, printed as it comes; then the cells in use, the rounds and
//       the time in triattn beside llama.cpp's decode time. n_ctx = budget + slack + batch.
//       --ids FILE: the answer's token ids, one a line.
//   triattn_llamacpp quality --model M.gguf --prompts FILE [--policies a,b] [--budgets 256,512]
//                    [--stats S] [--slack 64] [--batch 64] [--tokens 600] [--count N] [--csv OUT]
//       Teacher-forced along llama.cpp's full-cache answer: for every prompt, one full-cache
//       context samples the answer and every (policy, budget) context reads the same tokens in
//       lockstep; KL(full || compressed) and top-1 agreement per step once the tokens reach
//       budget + slack (every step if they never do), from both contexts' own logits. A markdown
//       table (mean ± standard error across prompts) on stdout; --csv: one row a prompt.
//
// Policies: triattention (needs --stats, from `triattn calibrate --model M.gguf`),
// streaming_llm, snapkv (reads Qcur), random (the floor), context_shift (llama.cpp's own, as
// llama-server does it, in the same cells), full (generate only). Every policy
// decides one keep set per sequence (llama.cpp's cells hold every layer and head). The sampler
// is llama.cpp's: a repetition penalty (1.2 over the last 128 tokens, as eval/run_grid.sh),
// temperature and a seeded draw, with the end-of-generation tokens banned so that answers run
// to the requested length. Errors: one line on stderr, exit status 2.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "eval/eval_common.hpp"
#include "runner/ggml_bridge.hpp"
#include "runner/triattn_llama.hpp"
#include "triattn/triattn.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using policy_type = triattn::basic_any_policy<triattn_llama::cells_view>;
using held_sequence = triattn_llama::held_sequence<policy_type>;
using capture = triattn_llama::query_capture<policy_type>;

/// Random keep sets, one per sequence, that always hold the newest token (llama.cpp continues
/// after it): the floor every policy must beat. The draw is our own (std::shuffle is
/// implementation-defined), from a fixed seed.
class union_random : public triattn::policy_base<union_random> {
 public:
  static constexpr std::string_view name = "random";

  union_random(std::uint64_t seed, triattn::schedule sched) : rng_(seed) {
    round_.grain = triattn::granularity::whole_sequence;
    round_.sched = sched;
  }
  const triattn::round_options& round() const { return round_; }

  template <triattn::KVCacheView V>
  triattn::keep_plan plan(const V& view, std::int64_t budget, const triattn::round_context& = {}) {
    const triattn::kv_geometry& g = view.geometry();
    const std::int32_t n = view.length(0, 0);
    const auto k = static_cast<std::int32_t>(std::min<std::int64_t>(n, budget));
    std::vector<std::int32_t> slots(static_cast<std::size_t>(std::max(n - 1, 0)));
    for (std::int32_t i = 0; i + 1 < n; ++i) slots[static_cast<std::size_t>(i)] = i;
    for (std::size_t i = 0; i + 1 < static_cast<std::size_t>(k); ++i)
      std::swap(slots[i], slots[i + static_cast<std::size_t>(rng_() % (slots.size() - i))]);
    slots.resize(static_cast<std::size_t>(std::max(k - 1, 0)));
    std::sort(slots.begin(), slots.end());
    if (k > 0) slots.push_back(n - 1);
    return triattn::keep_plan::shared(g.num_layers, g.num_kv_heads, slots);
  }

 private:
  std::mt19937_64 rng_;
  triattn::round_options round_{};
};

/// `policy` with one keep set per sequence on `sched`.
template <class Config>
Config per_sequence(Config c, triattn::schedule sched) {
  c.round.grain = triattn::granularity::whole_sequence;
  c.round.sched = sched;
  return c;
}

constexpr std::string_view policy_list = "triattention, streaming_llm, snapkv, random, context_shift";

policy_type make_policy(std::string_view name, const triattn::query_stats* stats, triattn::schedule sched) {
  if (name == "streaming_llm") return policy_type(triattn::streaming_llm(per_sequence(triattn::streaming_llm_config{}, sched)));
  if (name == "snapkv") return policy_type(triattn::snapkv(per_sequence(triattn::snapkv_config::decode(), sched)));
  if (name == "random") return policy_type(union_random(1, sched));
  if (name == "triattention") {
    TRIATTN_CHECK(stats != nullptr, "triattn_llamacpp", "policy triattention needs --stats (triattn calibrate --model M.gguf)");
    triattn::triattention_config c = per_sequence(triattn::triattention_config::paper(), sched);
    c.window = std::max<std::int64_t>(c.window, 1);  // llama.cpp continues after the newest token: keep it
    return policy_type(triattn::triattention(*stats, c));
  }
  TRIATTN_CHECK(false, "triattn_llamacpp", "unknown policy '", name, "' (known: ", policy_list, ")");
  return policy_type(union_random(1, sched));  // not reached
}

/// What the policy called `name` observes (the registry's entry; `random` reads nothing).
triattn_llama::reads reads_of(std::string_view name) {
  const auto* e = triattn::find_policy<triattn_llama::cells_view>(name);
  return e != nullptr ? triattn_llama::reads_of(*e, {}) : triattn_llama::reads::keys;
}

/// One llama.cpp context decoding one sequence (seq 0): with a full cache, held at a budget
/// (`held`), or shifting context when full (`context_shift`: what llama.cpp users have today,
/// llama-server's default: drop the older half of the cells after n_keep = 0, plus BOS where
/// the model adds one, and shift the rest's positions down; server-context.cpp, "slot context
/// shift"). Flash attention is on for every context (the held ones read V row-major; the
/// others decode the same way, so that the comparison measures the cache alone).
class sequence {
 public:
  sequence(llama_model* model, std::int64_t n_ctx, std::int32_t batch, int threads, std::unique_ptr<held_sequence> held,
           bool reads_queries, bool context_shift)
      : held_(std::move(held)), context_shift_(context_shift), batch_(batch) {
    llama_context_params p = llama_context_default_params();
    p.n_ctx = static_cast<std::uint32_t>(n_ctx);
    p.n_batch = p.n_ubatch = static_cast<std::uint32_t>(batch);
    p.n_seq_max = 1;
    p.n_threads = p.n_threads_batch = threads;
    p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    p.no_perf = true;
    if (held_ && reads_queries) {  // key-only policies install no callback
      capture_ = std::make_unique<capture>(model);
      capture_->route(0, held_.get());
      p.cb_eval = capture::callback;
      p.cb_eval_user_data = capture_.get();
    }
    ctx_.reset(llama_init_from_model(model, p));
    TRIATTN_CHECK(ctx_ != nullptr, "triattn_llamacpp", "llama_init_from_model failed for n_ctx ", n_ctx);
    if (held_) held_->bind(ctx_.get());
    if (capture_) capture_->bind(ctx_.get());
    keep_ = llama_vocab_get_add_bos(llama_model_get_vocab(model)) ? 1 : 0;
  }

  /// Decodes `tokens` in batches of at most `batch`; the logits of the last token are ready
  /// after it. `prompt_length`: the prompt's token count (the policies may protect it).
  void feed(std::span<const llama_token> tokens, std::int64_t prompt_length) {
    for (std::size_t i = 0; i < tokens.size(); i += static_cast<std::size_t>(batch_)) {
      const auto n = static_cast<std::int32_t>(std::min<std::size_t>(static_cast<std::size_t>(batch_), tokens.size() - i));
      if (context_shift_ && cells_ + n > static_cast<std::int64_t>(llama_n_ctx(ctx_.get()))) shift();
      llama_batch b = llama_batch_get_one(const_cast<llama_token*>(tokens.data() + i), n);
      const double capture_before = held_ ? held_->stats().capture_seconds : 0.0;
      const auto t0 = clock_type::now();
      const int rc = llama_decode(ctx_.get(), b);
      const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (capture_) capture_->check();
      TRIATTN_CHECK(rc == 0, "triattn_llamacpp", "llama_decode returned ", rc, " at position ", next_, " (", n,
                    " tokens; the context has ", llama_n_ctx(ctx_.get()), " cells)");
      decode_seconds_ += wall - (held_ ? held_->stats().capture_seconds - capture_before : 0.0);
      next_ += n;
      cells_ += n;
      peak_cells_ = std::max(peak_cells_, cells_);
      if (held_) held_->end_batch(prompt_length);
    }
  }

  const float* logits() const { return llama_get_logits_ith(ctx_.get(), -1); }
  llama_context* context() const { return ctx_.get(); }
  const held_sequence* held() const { return held_.get(); }
  /// llama.cpp's decode time, less the copies of queries out of the graph (which run inside it).
  double decode_seconds() const { return decode_seconds_; }
  /// triattn's time: the copies of queries out of the graph and the rounds (with their seq_rm calls).
  double triattn_seconds() const { return held_ ? held_->stats().capture_seconds + held_->stats().round_seconds : 0.0; }
  std::int64_t next_position() const { return next_; }
  /// The rounds of a held cache, or the shifts of a context-shifting one.
  std::int64_t rounds() const { return held_ ? held_->stats().rounds : shifts_; }
  std::int64_t peak_cells() const { return held_ ? held_->stats().peak_cells : peak_cells_; }

 private:
  /// llama-server's shift: with its cells compact at positions 0..cells_-1, the
  /// (cells_ - keep_) / 2 after the first keep_ go, and the rest move down by as many (llama.cpp
  /// re-rotates their keys on the next decode).
  void shift() {
    const std::int64_t discard = (cells_ - keep_) / 2;
    TRIATTN_CHECK(discard > 0, "triattn_llamacpp", "context shift: nothing to discard from ", cells_, " cells");
    llama_memory_t mem = llama_get_memory(ctx_.get());
    const auto p0 = static_cast<llama_pos>(keep_), p1 = static_cast<llama_pos>(keep_ + discard);
    TRIATTN_CHECK(llama_memory_seq_rm(mem, 0, p0, p1), "triattn_llamacpp", "context shift: llama_memory_seq_rm refused");
    llama_memory_seq_add(mem, 0, p1, -1, -static_cast<llama_pos>(discard));
    cells_ -= discard;
    ++shifts_;
  }

  std::unique_ptr<held_sequence> held_;  // before ctx_: llama.cpp's callback points into it
  std::unique_ptr<capture> capture_;     // the callback, for a policy that reads queries
  bool context_shift_;
  ggml_bridge::detail::context_ptr ctx_;
  std::int32_t batch_;
  std::int64_t next_ = 0;
  std::int64_t cells_ = 0, peak_cells_ = 0, shifts_ = 0, keep_ = 0;
  double decode_seconds_ = 0.0;
};

/// llama.cpp's sampler: the end-of-generation tokens banned, a repetition penalty of 1.2 over
/// the last 128 tokens of the answer (without it the 135M model's long answers settle into
/// loops, which any cache predicts), then temperature and a seeded draw (greedy at 0).
struct sampler_deleter {
  void operator()(llama_sampler* s) const { llama_sampler_free(s); }
};
std::unique_ptr<llama_sampler, sampler_deleter> make_sampler(const ggml_bridge::vocab& v, float temperature,
                                                             std::uint32_t seed) {
  std::unique_ptr<llama_sampler, sampler_deleter> chain(llama_sampler_chain_init(llama_sampler_chain_default_params()));
  std::vector<llama_logit_bias> bans;
  for (int id = 0; id < v.n_vocab(); ++id)
    if (v.is_eog(id)) bans.push_back({id, -std::numeric_limits<float>::infinity()});
  llama_sampler_chain_add(chain.get(), llama_sampler_init_logit_bias(v.n_vocab(), static_cast<std::int32_t>(bans.size()),
                                                                     bans.data()));
  llama_sampler_chain_add(chain.get(), llama_sampler_init_penalties(v.n_vocab(), 128, 1.2f, 0.0f, 0.0f));
  if (temperature > 0.0f) {
    llama_sampler_chain_add(chain.get(), llama_sampler_init_temp(temperature));
    llama_sampler_chain_add(chain.get(), llama_sampler_init_dist(seed));
  } else {
    llama_sampler_chain_add(chain.get(), llama_sampler_init_greedy());
  }
  return chain;
}

struct options {
  std::string mode, model, stats, prompt, prompts, csv, ids;
  std::vector<std::string> policies;
  std::vector<std::int64_t> budgets;
  std::int64_t slack = 64, tokens = 0, count = 0;
  std::int32_t batch = 64;
  float temperature = 0.7f;
  std::uint32_t seed = 1;
  int threads = 0;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::int64_t to_int(const std::string& flag, const std::string& text, std::int64_t lo) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TRIATTN_CHECK(used == text.size() && v >= lo, "triattn_llamacpp", flag, " ", text, ": expected an integer >= ", lo);
  return v;
}

options parse(int argc, char** argv) {
  const char* api = "triattn_llamacpp";
  TRIATTN_CHECK(argc >= 2, api, "usage: triattn_llamacpp generate|quality --model M.gguf [options] (see the file comment)");
  options o;
  o.mode = argv[1];
  TRIATTN_CHECK(o.mode == "generate" || o.mode == "quality", api, "unknown mode '", o.mode, "' (generate, quality)");
  std::string policies = o.mode == "generate" ? "triattention" : "triattention,streaming_llm,snapkv,random";
  std::string budgets = o.mode == "generate" ? "384" : "256,512";
  o.tokens = o.mode == "generate" ? 4096 : 600;
  for (int i = 2; i < argc; i += 2) {
    const std::string flag = argv[i];
    TRIATTN_CHECK(i + 1 < argc, api, flag, " needs a value");
    const std::string value = argv[i + 1];
    if (flag == "--model") o.model = value;
    else if (flag == "--stats") o.stats = value;
    else if (flag == "--prompt") o.prompt = value;
    else if (flag == "--prompts") o.prompts = value;
    else if (flag == "--csv") o.csv = value;
    else if (flag == "--ids") o.ids = value;
    else if (flag == "--policy" || flag == "--policies") policies = value;
    else if (flag == "--budget" || flag == "--budgets") budgets = value;
    else if (flag == "--slack") o.slack = to_int(flag, value, 0);
    else if (flag == "--batch") o.batch = static_cast<std::int32_t>(to_int(flag, value, 1));
    else if (flag == "--tokens") o.tokens = to_int(flag, value, 1);
    else if (flag == "--count") o.count = to_int(flag, value, 1);
    else if (flag == "--seed") o.seed = static_cast<std::uint32_t>(to_int(flag, value, 0));
    else if (flag == "--threads") o.threads = static_cast<int>(to_int(flag, value, 1));
    else if (flag == "--temperature") {
      o.temperature = std::stof(value);
      TRIATTN_CHECK(o.temperature >= 0.0f && std::isfinite(o.temperature), api, "--temperature ", value, " must be >= 0");
    } else TRIATTN_CHECK(false, api, "unknown option ", flag);
  }
  TRIATTN_CHECK(!o.model.empty(), api, "--model M.gguf is required");
  o.policies = split(policies);
  for (const std::string& b : split(budgets)) o.budgets.push_back(to_int("--budgets", b, 1));
  TRIATTN_CHECK(!o.policies.empty() && !o.budgets.empty(), api, "no policy or no budget given");
  TRIATTN_CHECK(o.mode == "generate" || !o.prompts.empty(), api, "quality needs --prompts FILE (one prompt a line)");
  if (o.threads == 0) o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

/// One user turn in the model's chat template, tokenized.
std::vector<llama_token> chat_tokens(const ggml_bridge::vocab& v, const std::string& text) {
  const std::vector<int> ids = v.tokenize(v.chat_prompt(text), true, true);
  return {ids.begin(), ids.end()};
}

/// A context for `policy` at `budget`; `full`: a full cache of `length` tokens.
std::unique_ptr<sequence> open_sequence(llama_model* model, const options& o, const std::string& policy,
                                        std::int64_t budget, const triattn::query_stats* stats, std::int64_t length) {
  // Every bounded context has the same cells: the budget, the slack and one batch.
  const std::int64_t cells = budget + o.slack + o.batch;
  if (policy == "full") return std::make_unique<sequence>(model, length + o.batch, o.batch, o.threads, nullptr, false, false);
  if (policy == "context_shift")
    return std::make_unique<sequence>(model, cells, o.batch, o.threads, nullptr, false, true);
  triattn_llama::options a;
  a.budget = budget;
  a.feed = reads_of(policy);
  auto held = std::make_unique<held_sequence>(model, 0, make_policy(policy, stats, triattn::schedule::with_slack(o.slack)), a);
  return std::make_unique<sequence>(model, cells, o.batch, o.threads, std::move(held), a.feed != triattn_llama::reads::keys,
                                    false);
}

int generate(llama_model* model, const ggml_bridge::vocab& v, const options& o, const triattn::query_stats* stats) {
  const std::string prompt = o.prompt.empty() ? "Write a long story about a lighthouse keeper who finds a message in a bottle." : o.prompt;
  const std::vector<llama_token> ids = chat_tokens(v, prompt);
  auto seq = open_sequence(model, o, o.policies.front(), o.budgets.front(), stats,
                           static_cast<std::int64_t>(ids.size()) + o.tokens);
  auto smpl = make_sampler(v, o.temperature, o.seed);
  if (seq->held() != nullptr)
    std::printf("triattn_llamacpp generate: policy %s, budget %lld, slack %lld, batch %d, n_ctx %u, %lld tokens\n",
                o.policies.front().c_str(), static_cast<long long>(o.budgets.front()), static_cast<long long>(o.slack),
                o.batch, llama_n_ctx(seq->context()), static_cast<long long>(o.tokens));
  else
    std::printf("triattn_llamacpp generate: %s, batch %d, n_ctx %u, %lld tokens\n",
                o.policies.front() == "full" ? "full cache" : "llama.cpp's context shift", o.batch,
                llama_n_ctx(seq->context()), static_cast<long long>(o.tokens));
  std::printf("prompt (%zu tokens): %s\n\n", ids.size(), prompt.c_str());
  seq->feed(ids, static_cast<std::int64_t>(ids.size()));
  std::ofstream ids_out;
  if (!o.ids.empty()) ids_out.open(o.ids);
  for (std::int64_t t = 0; t < o.tokens; ++t) {
    const llama_token next = llama_sampler_sample(smpl.get(), seq->context(), -1);
    if (ids_out.is_open()) ids_out << next << '\n';
    std::fputs(v.piece(next).c_str(), stdout);
    std::fflush(stdout);
    seq->feed({&next, 1}, static_cast<std::int64_t>(ids.size()));
  }
  std::printf("\n\n");
  TRIATTN_CHECK(o.ids.empty() || ids_out.good(), "triattn_llamacpp", o.ids, ": write failed");
  const double tokens = static_cast<double>(o.tokens + static_cast<std::int64_t>(ids.size()));
  if (const held_sequence* a = seq->held()) {
    const triattn_llama::sequence_stats& s = a->stats();
    std::printf("cells in use: %d now, at most %lld (n_ctx %u); positions 0..%lld were decoded\n", a->cells(),
                static_cast<long long>(s.peak_cells), llama_n_ctx(seq->context()),
                static_cast<long long>(seq->next_position() - 1));
    std::printf("rounds: %lld, %lld cells freed by %lld llama_memory_seq_rm calls (%.1f us a call)\n",
                static_cast<long long>(s.rounds), static_cast<long long>(s.evicted),
                static_cast<long long>(s.seq_rm_calls),
                s.seq_rm_calls > 0 ? 1e6 * s.seq_rm_seconds / static_cast<double>(s.seq_rm_calls) : 0.0);
    std::printf("triattn: %.3f ms per round, %.3f ms per token copying queries out of the graph%s; %.3f ms per token in all\n",
                s.rounds > 0 ? 1e3 * s.round_seconds / static_cast<double>(s.rounds) : 0.0,
                1e3 * s.capture_seconds / tokens, reads_of(o.policies.front()) != triattn_llama::reads::keys ? "" : " (none: no callback)",
                1e3 * seq->triattn_seconds() / tokens);
  } else if (seq->rounds() > 0) {
    std::printf("context shifts: %lld, cells in use at most %lld (n_ctx %u)\n", static_cast<long long>(seq->rounds()),
                static_cast<long long>(seq->peak_cells()), llama_n_ctx(seq->context()));
  }
  std::printf("llama.cpp decode: %.3f ms per token (%.1f tokens/s)\n", 1e3 * seq->decode_seconds() / tokens,
              tokens / seq->decode_seconds());
  return 0;
}

/// KL(p || q) of two logit vectors (natural log), in double.
double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  const auto log_norm = [n](const float* x) {
    const double m = *std::max_element(x, x + n);
    double s = 0.0;
    for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i]) - m);
    return m + std::log(s);
  };
  const double lp = log_norm(p_logits), lq = log_norm(q_logits);
  double kl = 0.0;
  for (int i = 0; i < n; ++i) {
    const double a = static_cast<double>(p_logits[i]) - lp;
    kl += std::exp(a) * (a - (static_cast<double>(q_logits[i]) - lq));
  }
  return kl;
}

struct cell_result {
  std::string policy;
  std::int64_t budget = 0;
  std::size_t prompt = 0;
  double kl = 0.0, top1 = 0.0, kl_all = 0.0, top1_all = 0.0, triattn_s = 0.0, decode_s = 0.0;
  std::int64_t rounds = 0, peak_cells = 0, capacity = 0, n_ctx = 0, steps = 0, invalid_tokens = 0;
};

int quality(llama_model* model, const ggml_bridge::vocab& v, const options& o, const triattn::query_stats* stats) {
  std::ifstream in(o.prompts);
  TRIATTN_CHECK(in.good(), "triattn_llamacpp", o.prompts, ": cannot read");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') prompts.push_back(line);
  if (o.count > 0 && static_cast<std::size_t>(o.count) < prompts.size()) prompts.resize(static_cast<std::size_t>(o.count));
  TRIATTN_CHECK(!prompts.empty(), "triattn_llamacpp", o.prompts, ": no prompt");
  const int n_vocab = v.n_vocab();
  std::vector<cell_result> results;
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<llama_token> ids = chat_tokens(v, prompts[p]);
    const auto prompt_length = static_cast<std::int64_t>(ids.size());
    auto full = open_sequence(model, o, "full", 0, stats, prompt_length + o.tokens);
    std::vector<std::unique_ptr<sequence>> held;
    std::vector<cell_result> cells;
    for (const std::string& policy : o.policies)
      for (const std::int64_t budget : o.budgets) {
        held.push_back(open_sequence(model, o, policy, budget, stats, 0));
        cells.push_back({policy, budget, p});
      }
    auto smpl = make_sampler(v, o.temperature, o.seed);
    full->feed(ids, prompt_length);
    for (auto& s : held) s->feed(ids, prompt_length);
    for (std::int64_t t = 0; t < o.tokens; ++t) {
      const float* ref = full->logits();
      const auto top = [n_vocab](const float* x) { return std::max_element(x, x + n_vocab) - x; };
      const auto ref_top = top(ref);
      for (std::size_t i = 0; i < held.size(); ++i) {
        // Until the answer reaches budget + slack tokens (where the policies' first round
        // runs) every context holds the full cache: the steps after that are counted apart,
        // from the same step for every context at one budget (context shift's first shift
        // comes one batch later, when its cells are full). A context that never gets there
        // reports every step instead: its KL measures the comparison itself, which must be 0.
        cell_result& c = cells[i];
        const double kl = kl_divergence(ref, held[i]->logits(), n_vocab);
        const double agree = top(held[i]->logits()) == ref_top ? 1.0 : 0.0;
        c.kl_all += kl;
        c.top1_all += agree;
        if (full->next_position() < c.budget + o.slack) continue;
        c.kl += kl;
        c.top1 += agree;
        ++c.steps;
      }
      const llama_token next = llama_sampler_sample(smpl.get(), full->context(), -1);
      for (std::size_t i = 0; i < held.size(); ++i) cells[i].invalid_tokens += (next < 0 || next >= n_vocab) ? 1 : 0;
      full->feed({&next, 1}, prompt_length);
      for (auto& s : held) s->feed({&next, 1}, prompt_length);
    }
    for (std::size_t i = 0; i < held.size(); ++i) {
      cell_result& c = cells[i];
      if (c.steps == 0) {
        c.kl = c.kl_all;
        c.top1 = c.top1_all;
        c.steps = o.tokens;
      }
      c.kl /= static_cast<double>(c.steps);
      c.top1 /= static_cast<double>(c.steps);
      c.rounds = held[i]->rounds();
      c.peak_cells = held[i]->peak_cells();
      c.capacity = c.budget + o.slack + o.batch;
      c.n_ctx = llama_n_ctx(held[i]->context());
      c.triattn_s = held[i]->triattn_seconds();
      c.decode_s = held[i]->decode_seconds();
      results.push_back(c);
    }
    std::fprintf(stderr, "triattn_llamacpp quality: prompt %zu of %zu done\n", p + 1, prompts.size());
  }
  if (!o.csv.empty()) {
    std::ofstream out(o.csv);
    out << "policy,budget,prompt,steps,kl,top1,rounds,peak_cells,capacity,n_ctx,invalid_tokens,triattn_s,decode_s\n";
    out.precision(9);
    for (const cell_result& c : results)
      out << c.policy << ',' << c.budget << ',' << c.prompt << ',' << c.steps << ',' << c.kl << ',' << c.top1 << ','
          << c.rounds << ',' << c.peak_cells << ',' << c.capacity << ',' << c.n_ctx << ',' << c.invalid_tokens << ','
          << c.triattn_s << ',' << c.decode_s << '\n';
    TRIATTN_CHECK(out.good(), "triattn_llamacpp", o.csv, ": write failed");
  }
  std::printf("| policy | budget | KL(full ‖ policy) | top-1 agreement | rounds (shifts) | peak cells | triattn / llama.cpp decode time |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& policy : o.policies)
    for (const std::int64_t budget : o.budgets) {
      std::vector<double> kl, top1, ratio;
      std::int64_t rounds = 0, peak = 0;
      for (const cell_result& c : results)
        if (c.policy == policy && c.budget == budget) {
          kl.push_back(c.kl);
          top1.push_back(c.top1);
          ratio.push_back(c.triattn_s / c.decode_s);
          rounds += c.rounds;
          peak = std::max(peak, c.peak_cells);
        }
      const auto [klm, kls] = triattn_eval::mean_and_se(kl);
      const auto [tm, ts] = triattn_eval::mean_and_se(top1);
      const auto [rm, rs] = triattn_eval::mean_and_se(ratio);
      std::printf("| %s | %lld | %.4f ± %.4f | %.3f ± %.3f | %.1f | %lld | %.4f ± %.4f |\n", policy.c_str(),
                  static_cast<long long>(budget), klm, kls, tm, ts, static_cast<double>(rounds) / static_cast<double>(kl.size()),
                  static_cast<long long>(peak), rm, rs);
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ggml_bridge::vocab v(o.model);
    ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(o.model, false, "triattn_llamacpp");
    std::optional<triattn::query_stats> stats;
    if (!o.stats.empty()) stats = triattn::load_stats(o.stats);
    return o.mode == "generate" ? generate(model.get(), v, o, stats ? &*stats : nullptr)
                                : quality(model.get(), v, o, stats ? &*stats : nullptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
