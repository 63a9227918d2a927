// Decode throughput of the runner (runner/) beside llama.cpp's
// own decode, in one run, on the same GGUF model (SmolLM2-135M-Instruct by default).
//
// What is measured: every sequence first runs the same 32-token prompt (not timed), then
// `steps` decode steps, each feeding the sequence's own argmax back in (one token per
// sequence per step). tokens/s = sequences * steps / seconds of those decode steps, argmax
// included. Configurations:
//   runner        batch 1 is session::forward, batches 4, 16 and 48 are one
//                 batch_decoder::step per step, on 1 thread (batch 16 and 48 also on 2); f32
//                 cache, and bf16 at batches 1 and 16;
//   llama.cpp     llama_decode of one token per call (1 thread, then all hardware threads),
//                 16 sequences (1 and all threads) and 48 (all threads), one token per
//                 sequence per llama_decode.
// Each configuration runs `reps` times (repetitions interleaved across configurations so
// that a busy machine slows them alike); the table gives the median and the spread.
//
// Usage: triattn_bench_runner_throughput [model.gguf ("": the configured one)] [steps=32] [reps=3]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <llama.h>

#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#include "runner/runner.hpp"

namespace {

constexpr int prompt_tokens = 32;

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// The prompt: a fixed text tokenised by llama.cpp, cut or padded (repeating it) to 32 tokens.
std::vector<int> make_prompt(const llama_vocab* vocab) {
  const std::string text =
      "The history of the lighthouse begins with fires lit on hilltops to guide sailors home. "
      "Later, towers of stone carried lamps and mirrors out over the rocks of the coast.";
  std::vector<llama_token> ids(text.size() + 8);
  const int n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                               static_cast<int32_t>(ids.size()), true, false);
  TRIATTN_CHECK(n > 0, "make_prompt", "llama_tokenize returned ", n);
  std::vector<int> prompt;
  while (prompt.size() < static_cast<std::size_t>(prompt_tokens))
    prompt.push_back(ids[prompt.size() % static_cast<std::size_t>(n)]);
  return prompt;
}

// --- the runner ---------------------------------------------------------------------------

double runner_tokens_per_s(const triattn_runner::model& m, const std::vector<int>& prompt, int batch, int steps,
                           triattn::dtype cache, int threads) {
  std::vector<triattn_runner::session> sessions;
  for (int s = 0; s < batch; ++s) sessions.emplace_back(m, prompt_tokens + steps, cache);
  std::vector<triattn_runner::session*> ptrs;
  for (auto& s : sessions) ptrs.push_back(&s);
  triattn_runner::batch_decoder decoder(m, threads);
  std::vector<int> tokens(static_cast<std::size_t>(batch));

  for (const int t : prompt) {  // prefill, not timed
    std::fill(tokens.begin(), tokens.end(), t);
    decoder.step(ptrs, tokens);
  }
  for (int s = 0; s < batch; ++s) tokens[static_cast<std::size_t>(s)] = triattn_runner::argmax(decoder.logits(s));

  const auto t0 = clock_type::now();
  for (int k = 0; k < steps; ++k) {
    if (batch == 1) {
      tokens[0] = triattn_runner::argmax(sessions[0].forward(tokens[0]));
    } else {
      decoder.step(ptrs, tokens);
      for (int s = 0; s < batch; ++s) tokens[static_cast<std::size_t>(s)] = triattn_runner::argmax(decoder.logits(s));
    }
  }
  return batch * steps / seconds_since(t0);
}

// --- llama.cpp ----------------------------------------------------------------------------

int argmax_row(const float* row, int n) { return static_cast<int>(std::max_element(row, row + n) - row); }

double llama_tokens_per_s(llama_model* model, const std::vector<int>& prompt, int batch, int steps, int threads) {
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  const int per_seq = prompt_tokens + steps;
  auto params = llama_context_default_params();
  params.n_ctx = static_cast<uint32_t>(batch * per_seq);
  params.n_batch = params.n_ubatch = static_cast<uint32_t>(batch * prompt_tokens);
  params.n_seq_max = static_cast<uint32_t>(batch);
  params.kv_unified = false;  // each sequence its own cache, as the runner's sessions
  params.n_threads = params.n_threads_batch = threads;
  params.no_perf = true;
  const std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model, params), &llama_free);
  TRIATTN_CHECK(ctx != nullptr, "llama_tokens_per_s", "llama_init_from_model failed");
  llama_batch b = llama_batch_init(batch * prompt_tokens, 0, 1);
  const auto add = [&](int token, int pos, int seq, bool logits) {
    const int i = b.n_tokens++;
    b.token[i] = token;
    b.pos[i] = pos;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = logits;
  };
  const auto decode = [&] {
    const int rc = llama_decode(ctx.get(), b);
    TRIATTN_CHECK(rc == 0, "llama_tokens_per_s", "llama_decode returned ", rc);
  };

  b.n_tokens = 0;  // prefill, not timed: every sequence's prompt in one batch
  for (int s = 0; s < batch; ++s)
    for (int p = 0; p < prompt_tokens; ++p) add(prompt[static_cast<std::size_t>(p)], p, s, p == prompt_tokens - 1);
  decode();
  std::vector<int> tokens(static_cast<std::size_t>(batch));
  for (int s = 0; s < batch; ++s)
    tokens[static_cast<std::size_t>(s)] = argmax_row(llama_get_logits_ith(ctx.get(), (s + 1) * prompt_tokens - 1), n_vocab);

  const auto t0 = clock_type::now();
  for (int k = 0; k < steps; ++k) {
    b.n_tokens = 0;
    for (int s = 0; s < batch; ++s) add(tokens[static_cast<std::size_t>(s)], prompt_tokens + k, s, true);
    decode();
    for (int s = 0; s < batch; ++s) tokens[static_cast<std::size_t>(s)] = argmax_row(llama_get_logits_ith(ctx.get(), s), n_vocab);
  }
  const double tps = batch * steps / seconds_since(t0);
  llama_batch_free(b);
  return tps;
}

struct configuration {
  std::string name;
  int threads;
  std::function<double()> run;
  std::vector<double> samples;
  double median() const {
    std::vector<double> v = samples;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 && argv[1][0] != '\0' ? argv[1] : TRIATTN_SMOLLM2_GGUF;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 32;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 3;
  if (steps < 1 || reps < 1) {
    std::fprintf(stderr, "usage: %s [model.gguf] [steps>=1] [reps>=1]\n", argv[0]);
    return 2;
  }
  const int hw_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  ggml_bridge::init_backend();  // llama_backend_init and a logger that keeps errors only
  auto mparams = llama_model_default_params();
  mparams.n_gpu_layers = 0;
  const std::unique_ptr<llama_model, decltype(&llama_model_free)> lmodel(
      llama_model_load_from_file(path.c_str(), mparams), &llama_model_free);
  TRIATTN_CHECK(lmodel != nullptr, "main", path, ": llama_model_load_from_file failed");
  const triattn_runner::model model = gguf_model::load(path);
  const std::vector<int> prompt = make_prompt(llama_model_get_vocab(lmodel.get()));
  const triattn_runner::config& c = model.config();
  std::printf("model %s\n  %d layers, dim %d, hidden %d, %d heads / %d kv heads, vocab %d; runner weights f32 (%.0f MB)\n",
              path.c_str(), c.n_layers, c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.vocab_size,
              static_cast<double>(llama_model_n_params(lmodel.get())) * 4 / 1e6);
  std::printf("prompt %d tokens, %d decode steps per sequence, median of %d repetitions; hardware threads %d\n\n",
              prompt_tokens, steps, reps, hw_threads);

  using triattn::dtype;
  struct runner_case { int batch; dtype cache; int threads; };
  struct llama_case { int batch, threads; };
  std::vector<configuration> configs;
  for (const runner_case rc : {runner_case{1, dtype::f32, 1}, {4, dtype::f32, 1}, {16, dtype::f32, 1}, {1, dtype::bf16, 1},
                               {16, dtype::bf16, 1}, {16, dtype::f32, hw_threads}, {48, dtype::f32, 1},
                               {48, dtype::f32, hw_threads}})
    configs.push_back({"runner batch " + std::to_string(rc.batch) + ", " + triattn::dtype_name(rc.cache) + " cache",
                       rc.threads, [&, rc] { return runner_tokens_per_s(model, prompt, rc.batch, steps, rc.cache, rc.threads); },
                       {}});
  for (const llama_case lc : {llama_case{1, 1}, {1, hw_threads}, {16, 1}, {16, hw_threads}, {48, hw_threads}})
    configs.push_back({"llama.cpp " + std::to_string(lc.batch) + (lc.batch == 1 ? " sequence" : " sequences"),
                       lc.threads, [&, lc] { return llama_tokens_per_s(lmodel.get(), prompt, lc.batch, steps, lc.threads); },
                       {}});
  const std::size_t runner_b1 = 0, llama_1t = 8;

  for (int r = 0; r < reps; ++r)
    for (auto& cfg : configs) cfg.samples.push_back(cfg.run());

  std::printf("| configuration | threads | tokens/s (median) | min - max | vs runner batch 1 | vs llama.cpp 1 seq, 1 thread |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (const auto& cfg : configs) {
    const auto [lo, hi] = std::minmax_element(cfg.samples.begin(), cfg.samples.end());
    std::printf("| %s | %d | %.1f | %.1f - %.1f | %.2fx | %.2fx |\n", cfg.name.c_str(), cfg.threads, cfg.median(), *lo,
                *hi, cfg.median() / configs[runner_b1].median(), cfg.median() / configs[llama_1t].median());
  }
  const double ratio = configs[2].median() / configs[runner_b1].median();
  std::printf("\nrunner batch 16 / batch 1 (f32 cache): %.2fx (%s 4x)\n", ratio, ratio >= 4.0 ? "meets" : "below");
  return 0;
}
