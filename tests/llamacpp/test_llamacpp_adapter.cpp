// triattn inside llama.cpp (tools/triattn_llamacpp.cpp, runner/triattn_llama.hpp): the program `triattn_llamacpp` run as users run
// it, on SmolLM2-135M-Instruct; in-process, two sequences of one context held apart, the
// view's reads against the graph's own keys, and the refusals.
// - With a budget above the answer no round runs and every logit equals the full cache's
//   (KL exactly 0): the lockstep comparison itself adds nothing.
// - 600 tokens, budget 128, slack 64, batch 64 (n_ctx 256): for TriAttention (calibrated here
//   by `triattn calibrate --model`), StreamingLLM and SnapKV (which reads Qcur), rounds run,
//   the cells in use stay within budget + slack + batch, the free-running answer's tokens are
//   valid ids, and teacher-forced along the full-cache answer each policy's KL is finite and
//   below random eviction's on the same prompt.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/triattn_llama.hpp"
#include "tools/cli.hpp"
#include "triattn/registry.hpp"

namespace {

namespace cli = triattn_test::cli;
namespace fs = std::filesystem;

const fs::path gguf_path = TRIATTN_SMOLLM2_GGUF;
const fs::path test_prompts = fs::path(TRIATTN_SOURCE_DIR) / "eval" / "prompts" / "test.txt";

// One CSV row of `quality`, by column name.
using row = std::map<std::string, std::string>;

std::vector<row> read_csv(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> header;
  std::vector<row> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream s(line);
    for (std::string c; std::getline(s, c, ',');) cells.push_back(c);
    if (header.empty()) {
      header = cells;
      continue;
    }
    REQUIRE(cells.size() == header.size());
    row r;
    for (std::size_t i = 0; i < cells.size(); ++i) r[header[i]] = cells[i];
    rows.push_back(r);
  }
  return rows;
}

// TriAttention's statistics for SmolLM2, calibrated once on its own short answers.
const fs::path& smollm2_stats() {
  static const fs::path path = [] {
    static cli::scratch_dir dir("llamacpp_adapter_stats");
    const fs::path out = dir.path() / "stats.safetensors";
    const std::string cmd = cli::shell_quote(TRIATTN_TEST_TRIATTN) + " calibrate --model " +
                            cli::shell_quote(gguf_path.string()) + " --prompts " +
                            cli::shell_quote((fs::path(TRIATTN_SOURCE_DIR) / "eval" / "prompts" / "calibration.txt").string()) +
                            " --answer-tokens 128 --out " + cli::shell_quote(out.string()) + " 2>/dev/null";
    REQUIRE(triattn_test::system_status(cmd) == 0);
    return out;
  }();
  return path;
}

}  // namespace

TEST_CASE("llama.cpp with a budget above the answer: no round, every logit the full cache's", "[llamacpp]") {
  cli::scratch_dir dir("llamacpp_no_round");
  const fs::path csv = dir.path() / "q.csv";
  const cli::result r = cli::run_cli(dir, {"quality", "--model", gguf_path.string(), "--prompts", test_prompts.string(),
                                           "--count", "1", "--policies", "streaming_llm,snapkv", "--budgets", "200",
                                           "--tokens", "100", "--threads", "1", "--csv", csv.string()});
  INFO(r.command << "\n" << r.err);
  REQUIRE(r.code == 0);
  const std::vector<row> rows = read_csv(csv);
  REQUIRE(rows.size() == 2);
  for (const row& x : rows) {
    INFO(x.at("policy"));
    CHECK(x.at("rounds") == "0");
    CHECK(std::stod(x.at("kl")) == 0.0);
    CHECK(std::stod(x.at("top1")) == 1.0);
  }
}

TEST_CASE("llama.cpp generates 600 tokens through 256 cells, every policy above random", "[llamacpp]") {
  cli::scratch_dir dir("llamacpp_600");
  const std::string stats = smollm2_stats().string();
  const ggml_bridge::vocab vocab(gguf_path);
  const std::vector<std::string> common = {"--model", gguf_path.string(), "--stats", stats, "--budget", "128",
                                           "--slack", "64", "--batch", "64", "--tokens", "600", "--threads", "1"};

  for (const std::string policy : {"triattention", "streaming_llm", "snapkv"}) {
    const fs::path ids = dir.path() / (policy + ".ids");
    std::vector<std::string> args = {"generate", "--policy", policy, "--ids", ids.string()};
    args.insert(args.end(), common.begin(), common.end());
    const cli::result r = cli::run_cli(dir, args);
    INFO(r.command << "\n" << r.err << "\n" << r.out);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.out, m, std::regex(R"(at most (\d+) \(n_ctx (\d+)\))")));
    CHECK(std::stoi(m[1]) <= 128 + 64 + 64);
    CHECK(std::stoi(m[2]) <= 256);
    REQUIRE(std::regex_search(r.out, m, std::regex(R"(rounds: (\d+))")));
    CHECK(std::stoi(m[1]) >= 1);
    std::ifstream in(ids);
    std::vector<int> tokens;
    for (int t = 0; in >> t;) tokens.push_back(t);
    REQUIRE(tokens.size() == 600);
    for (const int t : tokens) {
      REQUIRE(t >= 0);
      REQUIRE(t < vocab.n_vocab());
      REQUIRE(!vocab.is_eog(t));  // the sampler bans them: an end token would be a wrong id
    }
  }

  const fs::path csv = dir.path() / "q.csv";
  std::vector<std::string> args = {"quality", "--prompts", test_prompts.string(), "--count", "1", "--policies",
                                   "triattention,streaming_llm,snapkv,random,context_shift", "--budgets", "128", "--threads", "1",
                                   "--csv", csv.string()};
  args.insert(args.end(), common.begin(), common.end());
  const cli::result r = cli::run_cli(dir, args);
  INFO(r.command << "\n" << r.err);
  REQUIRE(r.code == 0);
  std::map<std::string, row> by_policy;
  for (const row& x : read_csv(csv)) by_policy[x.at("policy")] = x;
  REQUIRE(by_policy.size() == 5);
  const double random_kl = std::stod(by_policy.at("random").at("kl"));
  const int steps = std::stoi(by_policy.at("random").at("steps"));
  for (const auto& [policy, x] : by_policy) {
    INFO(policy << ": KL " << x.at("kl") << ", random " << random_kl);
    // Counted from token 192 (budget + slack) on: the prompt and 192 - prompt answer tokens come before it.
    CHECK(std::stoi(x.at("steps")) > 400);
    CHECK(std::stoi(x.at("steps")) < 600);
    CHECK(std::stoi(x.at("steps")) == steps);  // every context counted from the same step
    CHECK(std::stoi(x.at("rounds")) >= 1);
    CHECK(std::stoi(x.at("peak_cells")) <= 256);
    CHECK(std::stoi(x.at("n_ctx")) <= 256);
    CHECK(x.at("invalid_tokens") == "0");
    const double kl = std::stod(x.at("kl"));
    CHECK(std::isfinite(kl));
    CHECK(kl > 0.0);  // evictions happened: the logits must differ from the full cache's
    if (policy != "random" && policy != "context_shift") CHECK(kl < random_kl);
  }

  // Context shift, as llama-server does it: full cells (256) before each shift, which keeps
  // n_keep (BOS where the model adds one) and the newer half of the rest. The prompt's length
  // follows from the steps counted (those from token 192 = budget + slack on).
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path.string(), true, "test");
  const int keep = llama_vocab_get_add_bos(llama_model_get_vocab(model.get())) ? 1 : 0;
  int cells = 192 - (600 - steps), shifts = 0;
  for (int t = 0; t < 600; ++t) {
    if (cells + 1 > 256) {
      cells -= (cells - keep) / 2;
      ++shifts;
    }
    ++cells;
  }
  const row& shift = by_policy.at("context_shift");
  CHECK(std::stoi(shift.at("rounds")) == shifts);
  CHECK(std::stoi(shift.at("peak_cells")) == 256);
  CHECK(shift.at("triattn_s") == "0");
}

namespace {

using held_policy = triattn::basic_any_policy<triattn_llama::cells_view>;
using held = triattn_llama::held_sequence<held_policy>;

struct batch_deleter {
  void operator()(llama_batch* b) const { llama_batch_free(*b); delete b; }
};

/// A context of SmolLM2 with `seqs` sequences of `n_ctx` cells in all.
ggml_bridge::detail::context_ptr open_context(llama_model* model, std::uint32_t n_ctx, std::uint32_t seqs,
                                              llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                              ggml_type cache_type = GGML_TYPE_F16, ggml_backend_sched_eval_callback cb = nullptr,
                                              void* user = nullptr, bool unified = false) {
  llama_context_params p = llama_context_default_params();
  p.n_ctx = n_ctx;
  p.n_batch = p.n_ubatch = 64;
  p.n_seq_max = seqs;
  // One thread: CTest runs two tests at once on CI's two cores, and two processes whose
  // OpenMP teams spin at ggml's per-node barriers on shared cores slow each other badly (CI, stop
  // 36: this test past its 900 s beside llamacpp_server, against ~100 s here).
  p.n_threads = p.n_threads_batch = 1;
  p.flash_attn_type = fa;
  p.type_k = p.type_v = cache_type;
  p.cb_eval = cb;
  p.cb_eval_user_data = user;
  p.kv_unified = unified;
  p.no_perf = true;
  ggml_bridge::detail::context_ptr ctx(llama_init_from_model(model, p));
  REQUIRE(ctx != nullptr);
  return ctx;
}

/// Every layer's keys (`Kcur-<l>`) or queries (`Qcur-<l>`) after RoPE as the graph computes
/// them (f32), by position: the oracle of the view's in-place reads and of what the policies
/// observe. One sequence, batches in order.
struct key_capture {
  int layers = 0, row = 0;
  llama_pos next = 0;
  std::string_view prefix = "Kcur-";
  std::vector<std::vector<float>> keys;  // [layers][position * row]
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto& c = *static_cast<key_capture*>(user);
    const std::string_view name(t->name);
    const bool key = name.starts_with(c.prefix) && t->op == GGML_OP_ROPE && t->type == GGML_TYPE_F32;
    if (ask) return key;
    if (!key) return true;
    const int l = std::stoi(std::string(name.substr(c.prefix.size())));
    std::vector<float> x(static_cast<std::size_t>(ggml_nelements(t)));
    ggml_backend_tensor_get(t, x.data(), 0, ggml_nbytes(t));
    auto& out = c.keys.at(static_cast<std::size_t>(l));
    out.resize(static_cast<std::size_t>(c.next) * c.row);
    out.insert(out.end(), x.begin(), x.end());
    return true;
  }
};

}  // namespace

TEST_CASE("two sequences held apart in one context, their keys read where llama.cpp keeps them", "[llamacpp]") {
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path, false, "test");
  const ggml_bridge::vocab vocab(gguf_path);
  const triattn::kv_geometry g = triattn_llama::geometry_of(model.get());
  // Two token streams: the chat prompts of two test prompts, then their own tokens again.
  std::ifstream in(test_prompts);
  std::vector<std::vector<llama_token>> streams;
  for (std::string line; streams.size() < 2 && std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<int> ids = vocab.tokenize(vocab.chat_prompt(line), true, true);
    std::vector<llama_token> t;
    while (t.size() < 240) t.insert(t.end(), ids.begin(), ids.end());
    t.resize(240);
    streams.push_back(t);
  }
  REQUIRE(streams.size() == 2);

  // Sequence 0: StreamingLLM, 4 sinks, budget 64; sequence 1: K-norm, budget 100 (a recent
  // window of 16 keeps the newest token). Slack 16, batches of 8 tokens of each sequence.
  triattn::streaming_llm_config sc;
  sc.sinks = 4;
  sc.round.grain = triattn::granularity::whole_sequence;
  sc.round.sched = triattn::schedule::with_slack(16);
  triattn::key_scored_config kc;
  kc.round.grain = triattn::granularity::whole_sequence;
  kc.round.sched = triattn::schedule::with_slack(16);
  kc.round.recent = 16;
  const std::int64_t budgets[2] = {64, 100};
  std::vector<std::unique_ptr<held>> seqs;
  seqs.push_back(std::make_unique<held>(model.get(), 0, held_policy(triattn::streaming_llm(sc)), triattn_llama::options{64}));
  seqs.push_back(std::make_unique<held>(model.get(), 1, held_policy(triattn::knorm(kc)), triattn_llama::options{100}));
  auto ctx = open_context(model.get(), 512, 2);
  for (auto& s : seqs) s->bind(ctx.get());
  CHECK(seqs[0]->view().geometry().type == triattn::dtype::f16);

  // The oracle: each stream alone in a context of its own, its keys captured from the graph.
  std::vector<key_capture> oracle(2);
  for (int q = 0; q < 2; ++q) {
    key_capture& c = oracle[static_cast<std::size_t>(q)];
    c.layers = g.num_layers;
    c.row = g.num_kv_heads * g.head_dim;
    c.keys.resize(static_cast<std::size_t>(g.num_layers));
    auto solo = open_context(model.get(), 256, 1, LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_F16, key_capture::callback, &c);
    auto& t = streams[static_cast<std::size_t>(q)];
    for (std::size_t i = 0; i < t.size(); i += 8) {
      c.next = static_cast<llama_pos>(i);
      REQUIRE(llama_decode(solo.get(), llama_batch_get_one(t.data() + i, 8)) == 0);
    }
  }

  std::unique_ptr<llama_batch, batch_deleter> batch(new llama_batch(llama_batch_init(16, 0, 1)));
  for (std::size_t i = 0; i < 240; i += 8) {
    llama_batch& b = *batch;
    b.n_tokens = 0;
    for (int q = 0; q < 2; ++q)
      for (std::size_t j = i; j < i + 8; ++j) {
        const int k = b.n_tokens++;
        b.token[k] = streams[static_cast<std::size_t>(q)][j];
        b.pos[k] = static_cast<llama_pos>(j);
        b.n_seq_id[k] = 1;
        b.seq_id[k][0] = q;
        b.logits[k] = j + 1 == i + 8;
      }
    REQUIRE(llama_decode(ctx.get(), b) == 0);
    for (int q = 0; q < 2; ++q) {
      held& s = *seqs[static_cast<std::size_t>(q)];
      s.end_batch(0);
      INFO("sequence " << q << " after position " << i + 7);
      REQUIRE(s.cells() <= budgets[q] + 16 + 8);
      REQUIRE(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), q) == static_cast<llama_pos>(i + 7));
      // Every slot's key row, read in place, is the graph's key at that slot's position: in
      // layer 0 (the embedding's projection: no attention before it) to f16 rounding; in
      // deeper layers, until the sequence's first round, to what another batch layout and
      // 30 layers of f16 attention change (after it the tokens attend to an evicted cache).
      const triattn_llama::cells_view v = s.view();
      std::vector<float> row(static_cast<std::size_t>(g.head_dim));
      for (int l = 0; l < g.num_layers; l += s.stats().rounds == 0 ? 7 : g.num_layers)
        for (std::int64_t slot = 0; slot < v.length(l, 0); ++slot)
          for (int h = 0; h < g.num_kv_heads; ++h) {
            triattn::load_key(v, l, h, slot, row.data());
            const float* want = oracle[static_cast<std::size_t>(q)].keys[static_cast<std::size_t>(l)].data() +
                                static_cast<std::size_t>(v.position(l, h, slot)) * oracle[0].row +
                                static_cast<std::size_t>(h) * g.head_dim;
            const double margin = l == 0 ? 2e-3 : 0.1;
            for (int d = 0; d < g.head_dim; ++d)
              REQUIRE(row[static_cast<std::size_t>(d)] == Approx(want[d]).margin(margin).epsilon(margin / 2));
          }
    }
  }
  for (int q = 0; q < 2; ++q) CHECK(seqs[static_cast<std::size_t>(q)]->stats().rounds >= 1);
  // StreamingLLM keeps the 4 sinks and the newest tokens, nothing else.
  const triattn_llama::cells_view v0 = seqs[0]->view();
  const std::int32_t n0 = v0.length(0, 0);
  for (std::int32_t s = 0; s < n0; ++s)
    CHECK(v0.position(0, 0, s) == (s < 4 ? s : 240 - (n0 - s)));
  // K-norm holds its own budget: sequence 0's rounds never touched it.
  const triattn_llama::cells_view v1 = seqs[1]->view();
  CHECK(v1.length(0, 0) > 64 + 16 + 8);
  CHECK(seqs[1]->stats().evicted == 240 - v1.length(0, 0));
}

namespace {

/// A policy that records what it observes and never evicts (its budget is never reached).
struct observation {
  int layer, head;
  llama_pos position;
  std::vector<float> q, probs;
};
struct recorder {
  std::vector<observation> seen;
  triattn::round_options opts{};
  recorder() { opts.grain = triattn::granularity::whole_sequence; }
  const triattn::round_options& round() const { return opts; }
  void observe(int layer, int head, std::int32_t position, std::span<const float> q, std::span<const float> probs) {
    seen.push_back({layer, head, position, {q.begin(), q.end()}, {probs.begin(), probs.end()}});
  }
  triattn::keep_plan plan(const triattn_llama::cells_view&, std::int64_t, const triattn::round_context&) {
    FAIL("the recorder's budget is never reached");
    return {};
  }
};

}  // namespace

TEST_CASE("two sequences in mixed batches: each policy observes its own queries, and attention over its own cells",
          "[llamacpp]") {
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path, false, "test");
  const ggml_bridge::vocab vocab(gguf_path);
  const triattn::kv_geometry g = triattn_llama::geometry_of(model.get());
  constexpr int tokens = 48, step = 8;
  std::ifstream in(test_prompts);
  std::vector<std::vector<llama_token>> streams;
  for (std::string line; streams.size() < 2 && std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<int> ids = vocab.tokenize(vocab.chat_prompt(line), true, true);
    REQUIRE(ids.size() >= static_cast<std::size_t>(tokens));
    streams.emplace_back(ids.begin(), ids.begin() + tokens);
  }
  REQUIRE(streams.size() == 2);

  // The oracle: each stream alone, its queries captured from the graph by position.
  std::vector<key_capture> oracle(2);
  for (int q = 0; q < 2; ++q) {
    key_capture& c = oracle[static_cast<std::size_t>(q)];
    c.row = g.num_q_heads * g.head_dim;
    c.prefix = "Qcur-";
    c.keys.resize(static_cast<std::size_t>(g.num_layers));
    auto solo = open_context(model.get(), 256, 1, LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_F16, key_capture::callback, &c);
    for (int i = 0; i < tokens; i += step) {
      c.next = i;
      REQUIRE(llama_decode(solo.get(), llama_batch_get_one(streams[static_cast<std::size_t>(q)].data() + i, step)) == 0);
    }
  }

  // Sequence 0 reads attention, sequence 1 queries; batches of 8 tokens of each. A split cache
  // decodes each sequence in a ubatch of its own (llama.cpp reorders the batch by sequence), a
  // unified one both in one ubatch, interleaved as the batch is.
  const bool unified = GENERATE(false, true);
  INFO((unified ? "unified cache" : "a cache stream per sequence"));
  using recorded = triattn_llama::held_sequence<recorder>;
  std::vector<std::unique_ptr<recorded>> seqs;
  seqs.push_back(std::make_unique<recorded>(model.get(), 0, recorder{}, triattn_llama::options{4096, triattn_llama::reads::attention}));
  seqs.push_back(std::make_unique<recorded>(model.get(), 1, recorder{}, triattn_llama::options{4096, triattn_llama::reads::queries}));
  triattn_llama::query_capture<recorder> capture(model.get());
  for (int q = 0; q < 2; ++q) capture.route(q, seqs[static_cast<std::size_t>(q)].get());
  auto ctx = open_context(model.get(), 512, 2, LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_F16,
                          triattn_llama::query_capture<recorder>::callback, &capture, unified);
  capture.bind(ctx.get());
  for (auto& s : seqs) s->bind(ctx.get());
  std::unique_ptr<llama_batch, batch_deleter> batch(new llama_batch(llama_batch_init(2 * step, 0, 1)));
  for (int i = 0; i < tokens; i += step) {
    llama_batch& b = *batch;
    b.n_tokens = 0;
    for (int j = i; j < i + step; ++j)  // interleaved: token j of sequence 1, then of sequence 0
      for (int q = 1; q >= 0; --q) {
        const int k = b.n_tokens++;
        b.token[k] = streams[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)];
        b.pos[k] = j;
        b.n_seq_id[k] = 1;
        b.seq_id[k][0] = q;
        b.logits[k] = j + 1 == i + step;
      }
    REQUIRE(llama_decode(ctx.get(), b) == 0);
    capture.check();
    for (auto& s : seqs) s->end_batch(0);
  }

  for (int q = 0; q < 2; ++q) {
    INFO("sequence " << q);
    const std::vector<observation>& seen = seqs[static_cast<std::size_t>(q)]->policy().seen;
    REQUIRE(seen.size() == static_cast<std::size_t>(g.num_layers) * g.num_q_heads * tokens);
    std::vector<int> next(static_cast<std::size_t>(g.num_layers * g.num_q_heads), 0);  // per (layer, head), in order
    const triattn_llama::cells_view v = seqs[static_cast<std::size_t>(q)]->view();
    std::vector<float> key(static_cast<std::size_t>(g.head_dim));
    for (const observation& o : seen) {
      INFO("layer " << o.layer << " head " << o.head << " position " << o.position);
      REQUIRE(o.position == next[static_cast<std::size_t>(o.layer * g.num_q_heads + o.head)]++);
      // The query is the graph's for this sequence's token (layer 0: to f16 rounding of the
      // cache it attends; deeper, to what another batch layout changes).
      const float* want = oracle[static_cast<std::size_t>(q)].keys[static_cast<std::size_t>(o.layer)].data() +
                          static_cast<std::size_t>(o.position) * oracle[0].row + static_cast<std::size_t>(o.head) * g.head_dim;
      const double margin = o.layer == 0 ? 2e-3 : 0.1;
      REQUIRE(o.q.size() == static_cast<std::size_t>(g.head_dim));
      for (int d = 0; d < g.head_dim; ++d)
        REQUIRE(o.q[static_cast<std::size_t>(d)] == Approx(want[d]).margin(margin).epsilon(margin / 2));
      if (q == 1) {
        REQUIRE(o.probs.empty());
        continue;
      }
      // Attention: softmax(q·k/√d) over the cells at positions <= its own, in double, from the
      // keys as the cache holds them.
      REQUIRE(o.probs.size() == static_cast<std::size_t>(o.position) + 1);
      std::vector<double> logit(o.probs.size());
      double top = -1e300, sum = 0.0;
      for (std::size_t s = 0; s < logit.size(); ++s) {
        triattn::load_key(v, o.layer, o.head / (g.num_q_heads / g.num_kv_heads), static_cast<std::int64_t>(s), key.data());
        double dot = 0.0;
        for (int d = 0; d < g.head_dim; ++d) dot += double{o.q[static_cast<std::size_t>(d)]} * key[static_cast<std::size_t>(d)];
        logit[s] = dot / std::sqrt(static_cast<double>(g.head_dim));
        top = std::max(top, logit[s]);
      }
      for (double& x : logit) sum += x = std::exp(x - top);
      for (std::size_t s = 0; s < logit.size(); ++s) REQUIRE(o.probs[s] == Approx(logit[s] / sum).margin(1e-5));
    }
  }
}

TEST_CASE("the view refuses what llama.cpp's cells cannot hold; a refused round frees nothing", "[llamacpp]") {
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path, false, "test");
  const triattn::kv_geometry g = triattn_llama::geometry_of(model.get());
  CHECK(g.num_layers == 30);
  CHECK(g.num_kv_heads == 3);
  CHECK(g.head_dim == 64);
  CHECK(g.rope.style == triattn::rope_style::interleaved);  // GGUF's llama arch: LLAMA_ROPE_TYPE_NORM
  CHECK(g.rope.theta == 100000.0);

  triattn::streaming_llm_config c;
  c.round.grain = triattn::granularity::whole_sequence;
  const auto refused = [&](auto&& f, std::initializer_list<std::string> parts) {
    try {
      f();
      FAIL("accepted");
    } catch (const triattn::error& e) {
      for (const std::string& p : parts) CHECK_THAT(e.what(), Catch::Contains(p));
    }
  };
  // A keep set per layer would leave a cell half evicted.
  refused([&] { held h(model.get(), 0, held_policy(triattn::streaming_llm{}), {128}); },
          {"triattn_llama::held_sequence", "per_layer", "whole_sequence"});
  refused([&] { held h(model.get(), 0, held_policy(triattn::streaming_llm(c)), {0}); }, {"budget 0"});
  {
    auto ctx = open_context(model.get(), 256, 1);
    held h(model.get(), 1, held_policy(triattn::streaming_llm(c)), {128});
    refused([&] { h.bind(ctx.get()); }, {"sequence 1", "1 sequences"});
  }
  {  // V transposed, and a quantized cache
    auto ctx = open_context(model.get(), 256, 1, LLAMA_FLASH_ATTN_TYPE_DISABLED);
    held h(model.get(), 0, held_policy(triattn::streaming_llm(c)), {128});
    refused([&] { h.bind(ctx.get()); }, {"transposed", "-fa on"});
    auto q8 = open_context(model.get(), 256, 1, LLAMA_FLASH_ATTN_TYPE_ENABLED, GGML_TYPE_Q8_0);
    held hq(model.get(), 0, held_policy(triattn::streaming_llm(c)), {128});
    refused([&] { hq.bind(q8.get()); }, {"q8_0", "f16 or bf16"});
  }
  {  // a plan that evicts the newest token: refused before any cell is freed
    auto ctx = open_context(model.get(), 256, 1);
    held h(model.get(), 0, held_policy(triattn::streaming_llm(c)), {128});
    h.bind(ctx.get());
    std::vector<llama_token> t(40, 1);
    REQUIRE(llama_decode(ctx.get(), llama_batch_get_one(t.data(), 40)) == 0);
    CHECK_FALSE(h.end_batch(0));  // 40 cells: no round at budget 128
    REQUIRE(h.cells() == 40);
    std::vector<std::int32_t> keep(20);
    for (std::int32_t i = 0; i < 20; ++i) keep[static_cast<std::size_t>(i)] = i;
    const auto plan = triattn::keep_plan::shared(g.num_layers, g.num_kv_heads, keep);
    refused([&] { triattn::compact(h.view(), plan); }, {"free_evicted", "newest token", "position 39"});
    h.refresh();
    CHECK(h.cells() == 40);
    CHECK(llama_memory_seq_pos_min(llama_get_memory(ctx.get()), 0) == 0);
    CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 0) == 39);
    keep.push_back(39);  // keeps it: 19 cells freed in one run
    triattn::compact(h.view(), triattn::keep_plan::shared(g.num_layers, g.num_kv_heads, keep));
    h.refresh();
    CHECK(h.cells() == 21);
    CHECK(h.stats().seq_rm_calls == 1);
    CHECK(h.stats().evicted == 19);
  }
}

TEST_CASE("a policy that protects the prompt holds a prompt longer than its budget: the prompt is compressed as it arrives",
          "[llamacpp]") {
  const ggml_bridge::detail::model_ptr model = ggml_bridge::detail::load_model(gguf_path, false, "test");
  // K-norm with TriAttention's default protection (the prompt) and what cells_policy adds (the
  // newest token); budget 64, slack 16, batches of 32 tokens.
  triattn::key_scored_config c;
  c.round.grain = triattn::granularity::whole_sequence;
  c.round.sched = triattn::schedule::with_slack(16);
  c.round.protect_prompt = true;
  c.round.recent = 1;
  std::vector<llama_token> t(240);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<llama_token>(100 + (i * 37) % 900);
  const auto run = [&](std::int64_t prompt_length) {
    auto ctx = open_context(model.get(), 256, 1);
    auto h = std::make_unique<held>(model.get(), 0, held_policy(triattn::knorm(c)), triattn_llama::options{64});
    h->bind(ctx.get());
    for (std::size_t i = 0; i < t.size(); i += 32) {
      const auto n = static_cast<std::int32_t>(std::min<std::size_t>(32, t.size() - i));
      REQUIRE(llama_decode(ctx.get(), llama_batch_get_one(t.data() + i, n)) == 0);
      h->end_batch(prompt_length);
      INFO("prompt " << prompt_length << ", after position " << i + n - 1);
      REQUIRE(h->cells() <= 64 + 16 + 32);
      REQUIRE(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 0) == static_cast<llama_pos>(i + n - 1));
    }
    CHECK(h->stats().rounds >= 1);
    std::vector<std::int32_t> kept;
    const triattn_llama::cells_view v = h->view();
    for (std::int32_t s = 0; s < v.length(0, 0); ++s) kept.push_back(v.position(0, 0, s));
    return kept;
  };
  // A 240-token prompt cannot stay whole in 64 cells: it competes like any token (without the
  // rule, the protected prompt alone fills the budget and the round evicts the newest token).
  const std::vector<std::int32_t> long_prompt = run(240);
  CHECK(long_prompt.back() == 239);
  CHECK(long_prompt.size() < 64 + 16 + 32);
  // A 40-token prompt fits: every round keeps it whole.
  const std::vector<std::int32_t> short_prompt = run(40);
  REQUIRE(short_prompt.size() > 40);
  for (std::int32_t p = 0; p < 40; ++p) CHECK(short_prompt[static_cast<std::size_t>(p)] == p);
  CHECK(short_prompt.back() == 239);
}
