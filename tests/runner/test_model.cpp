// The runner (runner/) against the real stories260K model: the golden greedy
// output, the tokenizer, text windows, checkpoint validation, and decoding with a cache that
// triattn compresses (StreamingLLM, and one kv head compacted by hand).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "eval/random_eviction.hpp"
#include "runner/runner.hpp"
#include "support/data.hpp"
#include "support/random.hpp"
#include "triattn/triattn.hpp"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

fs::path model_dir() { return triattn_test::data_dir() / "models" / "stories260K"; }
fs::path valid_text_path() { return triattn_test::data_dir() / "data" / "tinystories_valid_head.txt"; }

// Loaded once for all test cases.
const triattn_runner::model& stories() {
  static const triattn_runner::model m = triattn_runner::model::load(model_dir() / "stories260K.bin");
  return m;
}
const triattn_runner::tokenizer& tok512() {
  static const triattn_runner::tokenizer t = triattn_runner::tokenizer::load(model_dir() / "tok512.bin", 512);
  return t;
}

std::vector<int> golden_ids() {
  std::istringstream in(triattn_runner::read_file(model_dir() / "golden_greedy_256_ids.txt"));
  std::vector<int> ids;
  for (int id = 0; in >> id;) ids.push_back(id);
  return ids;
}

// Paragraphs of a data file, split on "\n\n" (the files use bare blank lines).
std::vector<std::string> paragraphs(const fs::path& file) {
  const std::string text = triattn_runner::read_file(file);
  std::vector<std::string> out;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = std::min(text.find("\n\n", at), text.size());
    if (end > at) out.push_back(text.substr(at, end - at));
    at = end + 2;
  }
  return out;
}

// A file under the temporary folder, removed at the end of the scope.
struct temp_file {
  fs::path path;
  explicit temp_file(const std::string& bytes) {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("triattn_llama2c_" + std::to_string(triattn_test::test_seed()) + "_" + std::to_string(counter++) + ".bin");
    std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  ~temp_file() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

// Runs `load` and returns the message of the triattn::error it must throw.
template <class Load>
std::string load_error(Load&& load) {
  try {
    load();
  } catch (const triattn::error& e) {
    return e.what();
  }
  FAIL("no triattn::error was thrown");
  return {};
}

// Records the last call of every (layer, q-head).
struct recorder final : triattn_runner::observer {
  int n_heads;
  std::vector<std::vector<float>> q, probs;  // [layers * q_heads][head_dim], [layers * q_heads][length]
  std::vector<std::int32_t> position;
  int calls = 0;
  explicit recorder(const triattn_runner::config& c)
      : n_heads(c.n_heads),
        q(static_cast<std::size_t>(c.n_layers * c.n_heads)),
        probs(q.size()),
        position(q.size(), -1) {}
  void on_attention(int layer, int q_head, std::int32_t pos, std::span<const float> q_post_rope,
                    std::span<const float> p) override {
    const auto i = static_cast<std::size_t>(layer * n_heads + q_head);
    q[i].assign(q_post_rope.begin(), q_post_rope.end());
    probs[i].assign(p.begin(), p.end());
    position[i] = pos;
    ++calls;
  }
};

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// `count` tokens of a randomly chosen validation window.
std::vector<int> random_window_tokens(std::uint64_t salt, std::size_t count) {
  const auto windows = triattn_runner::text_windows(tok512(), triattn_runner::read_file(valid_text_path()), 256, 40);
  REQUIRE(windows.size() == 40);
  auto g = triattn_test::rng(salt);
  const auto& w = windows[std::uniform_int_distribution<std::size_t>(0, windows.size() - 1)(g)];
  return {w.begin(), w.begin() + static_cast<std::ptrdiff_t>(count)};
}

}  // namespace

TEST_CASE("full-cache greedy decoding from BOS reproduces the 256 golden tokens", "[llama2c]") {
  const std::vector<int> golden = golden_ids();
  REQUIRE(golden.size() == 256);
  triattn_runner::session s(stories(), 256);
  std::vector<int> got;
  for (int token = triattn_runner::bos_id; got.size() < golden.size();) {
    token = triattn_runner::argmax(s.forward(token));
    got.push_back(token);
  }
  CHECK(got == golden);

  const triattn_runner::config& c = stories().config();
  CHECK(s.position() == 256);
  CHECK(s.kv_bytes() == 256 * 1280);  // 5 layers x 2 (K, V) x 32 floats x 4 bytes per token
  CHECK(s.full_kv_bytes(256) == s.kv_bytes());
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      REQUIRE(s.length(l, h) == 256);
      for (std::int32_t t = 0; t < 256; t += 51) CHECK(s.slot_position(l, h, t) == t);
    }
}

TEST_CASE("decoding the golden ids reproduces the golden text", "[llama2c][tokenizer]") {
  const std::string text = triattn_runner::read_file(model_dir() / "golden_greedy_256.txt");
  CHECK(tok512().decode(golden_ids()) == text);
  CHECK(tok512().decode(triattn_runner::bos_id, 317) == "Lily");  // the leading space goes after BOS only
  CHECK(tok512().decode(259, 317) == " Lily");
  CHECK(tok512().decode(259, 'A' + 3) == "A");  // byte fallback <0x41>
}

TEST_CASE("the tokenizer encodes like run.c and round-trips text", "[llama2c][tokenizer]") {
  const triattn_runner::tokenizer& tok = tok512();
  CHECK(tok.encode("Lily", false, false) == std::vector<int>{317});  // " Lily": dummy prefix merged in
  CHECK(tok.encode("", true, true) == std::vector<int>{triattn_runner::bos_id, triattn_runner::eos_id});
  CHECK(tok.encode("", false, false).empty());
  // A code point is looked up whole (U+00E9 is piece 485); U+00FC is no piece, so its two
  // UTF-8 bytes fall back to ids byte + 3.
  CHECK(tok.encode("\xC3\xA9", false, false) == std::vector<int>{410, 485});
  CHECK(tok.encode("\xC3\xBC", false, false) == std::vector<int>{410, 0xC3 + 3, 0xBC + 3});

  std::set<std::string> pieces;
  for (int id = 0; id < tok.vocab_size(); ++id) pieces.insert(tok.piece(id));
  const triattn_runner::tokenizer reloaded = triattn_runner::tokenizer::load(model_dir() / "tok512.bin", 512);
  const auto check_text = [&](const std::string& text) {
    INFO("text: " << text);
    const std::vector<int> ids = tok.encode(text, false, false);
    CHECK(tok.decode(ids) == text);
    CHECK(reloaded.encode(text, false, false) == ids);  // deterministic, no state in the instance
    // Merging stops only when no adjacent pair forms a piece.
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) CHECK(pieces.count(tok.piece(ids[i]) + tok.piece(ids[i + 1])) == 0);
    const std::vector<int> framed = tok.encode(text, true, true);
    CHECK(framed.front() == triattn_runner::bos_id);
    CHECK(framed.back() == triattn_runner::eos_id);
  };
  check_text(triattn_runner::read_file(model_dir() / "golden_greedy_256.txt"));

  // Fresh paragraphs each run, and every paragraph with non-ASCII bytes (the data's mojibake).
  for (const char* file : {"tinystories_valid_head.txt", "tinystories_train_head.txt"}) {
    const std::vector<std::string> all = paragraphs(triattn_test::data_dir() / "data" / file);
    REQUIRE(all.size() > 1000);
    auto g = triattn_test::rng(std::hash<std::string>{}(file));
    std::uniform_int_distribution<std::size_t> pick(0, all.size() - 1);
    for (int i = 0; i < 12; ++i) check_text(all[pick(g)]);
    int non_ascii = 0;
    for (std::size_t i = 0; i < 400 && non_ascii < 8; ++i)
      if (std::any_of(all[i].begin(), all[i].end(), [](char ch) { return static_cast<unsigned char>(ch) >= 0x80; })) {
        check_text(all[i]);
        ++non_ascii;
      }
  }
}

TEST_CASE("text windows are BOS-started paragraphs cut at the window size", "[llama2c][tokenizer]") {
  const std::vector<std::string> paras = paragraphs(valid_text_path());
  auto g = triattn_test::rng(7);
  const int window = std::uniform_int_distribution<int>(16, 700)(g);
  const auto windows = triattn_runner::text_windows(tok512(), triattn_runner::read_file(valid_text_path()), window, 6);
  REQUIRE(windows.size() == 6);

  std::vector<std::vector<int>> expected;
  std::vector<int> current;
  for (std::size_t p = 0; expected.size() < 6; ++p) {
    current.push_back(triattn_runner::bos_id);
    const std::vector<int> ids = tok512().encode(paras.at(p), false, false);
    current.insert(current.end(), ids.begin(), ids.end());
    if (current.size() >= static_cast<std::size_t>(window)) {
      current.resize(static_cast<std::size_t>(window));
      expected.push_back(current);
      current.clear();
    }
  }
  CHECK(windows == expected);

  // A short tail is dropped; CRLF line ends and runs of blank lines split the same way.
  CHECK(triattn_runner::text_windows(tok512(), "One day.\n\nThe end.\n", 512, 10).empty());
  std::vector<int> both;
  for (const char* p : {"One day.", "The end."}) {
    both.push_back(triattn_runner::bos_id);
    const std::vector<int> ids = tok512().encode(p, false, false);
    both.insert(both.end(), ids.begin(), ids.end());
  }
  const auto crlf = triattn_runner::text_windows(tok512(), "\r\nOne day.\r\n\r\n \t\r\n\r\nThe end.",
                                          static_cast<int>(both.size()), 10);
  REQUIRE(crlf.size() == 1);
  CHECK(crlf[0] == both);
}

TEST_CASE("StreamingLLM keeps sinks + recent slots and the logits before the first round are exact",
          "[llama2c][policies]") {
  constexpr std::int64_t budget = 32, slack = 8, sinks = 4;
  constexpr std::size_t steps = 100;
  const std::vector<int> tokens = random_window_tokens(1, steps);
  const triattn_runner::config& c = stories().config();

  const auto sched = triattn::schedule::with_slack(slack);
  triattn::policy_inputs in;
  in.sched = sched;
  triattn::any_policy policy = *triattn::find_policy(triattn::streaming_llm::name)->create(in);
  CHECK(policy.name() == triattn::streaming_llm::name);
  triattn_runner::session full(stories(), steps);
  triattn_runner::session compressed(stories(), budget + slack);

  std::vector<std::int32_t> expected;  // the positions StreamingLLM keeps, the same in every head
  int rounds = 0, exact_steps = 0;
  bool diverged = false;
  for (std::size_t t = 0; t < steps; ++t) {
    const std::span<const float> full_logits = full.forward(tokens[t]);
    const std::span<const float> logits = compressed.forward(tokens[t]);
    expected.push_back(static_cast<std::int32_t>(t));
    if (rounds == 0) {
      REQUIRE(bitwise_equal(logits, full_logits));
      ++exact_steps;
    } else {
      diverged = diverged || !bitwise_equal(logits, full_logits);
    }
    const bool ran = triattn::maybe_compress(policy, compressed.view(), budget, {compressed.position(), 0});
    const bool due = static_cast<std::int64_t>(expected.size()) >= budget + slack;
    REQUIRE(ran == due);
    if (due) {
      expected.erase(expected.begin() + sinks, expected.end() - (budget - sinks));
      ++rounds;
    }
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        REQUIRE(compressed.length(l, h) <= budget + slack);
        REQUIRE(compressed.length(l, h) == static_cast<std::int32_t>(expected.size()));
        for (std::size_t s = 0; s < expected.size(); ++s)
          REQUIRE(compressed.slot_position(l, h, static_cast<std::int64_t>(s)) == expected[s]);
      }
  }
  CHECK(exact_steps == budget + slack);  // every step up to the first round, which follows token 40
  CHECK(rounds == 8);                    // after tokens 40, 48, ..., 96
  CHECK(diverged);                       // dropping tokens does change the predictions
  CHECK(compressed.position() == full.position());
  CHECK(compressed.kv_bytes() < full.kv_bytes());
}

TEST_CASE("each kv head attends over its own slots after a per-head compaction", "[llama2c][policies]") {
  const triattn_runner::config& c = stories().config();
  constexpr int prefix = 20;
  const std::vector<int> tokens = random_window_tokens(2, prefix + 1);
  auto g = triattn_test::rng(3);
  const int layer = std::uniform_int_distribution<int>(0, c.n_layers - 1)(g);
  const int head = std::uniform_int_distribution<int>(0, c.n_kv_heads - 1)(g);
  // A random, ascending, non-empty proper subset of the prefix's slots.
  std::vector<std::int32_t> all(prefix), keep;
  for (int i = 0; i < prefix; ++i) all[static_cast<std::size_t>(i)] = i;
  const auto kept = std::uniform_int_distribution<std::size_t>(1, prefix - 1)(g);
  std::sample(all.begin(), all.end(), std::back_inserter(keep), static_cast<std::ptrdiff_t>(kept), g);
  INFO("layer " << layer << " kv_head " << head << ", " << keep.size() << " slots kept");

  triattn_runner::session reference(stories(), 64), compacted(stories(), 64);
  for (int t = 0; t < prefix; ++t) {
    reference.forward(tokens[static_cast<std::size_t>(t)]);
    compacted.forward(tokens[static_cast<std::size_t>(t)]);
  }
  triattn::keep_plan plan(c.n_layers, c.n_kv_heads);
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) plan.push_row(l == layer && h == head ? keep : all);
  triattn::compact(compacted.view(), plan);
  REQUIRE(compacted.length(layer, head) == static_cast<std::int32_t>(keep.size()));
  for (std::size_t i = 0; i < keep.size(); ++i)
    CHECK(compacted.slot_position(layer, head, static_cast<std::int64_t>(i)) == keep[i]);

  recorder want(c), got(c);
  reference.set_observer(&want);
  compacted.set_observer(&got);
  reference.forward(tokens[prefix]);
  const std::span<const float> logits = compacted.forward(tokens[prefix]);
  CHECK(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
  REQUIRE(got.calls == c.n_layers * c.n_heads);
  CHECK(compacted.length(layer, head) == static_cast<std::int32_t>(keep.size()) + 1);

  const int group = c.n_heads / c.n_kv_heads;
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < c.n_heads; ++h) {
      const auto i = static_cast<std::size_t>(l * c.n_heads + h);
      const bool affected = l == layer && h / group == head;
      INFO("layer " << l << " q_head " << h);
      CHECK(got.position[i] == prefix);
      CHECK(got.probs[i].size() == (affected ? keep.size() + 1 : std::size_t{prefix} + 1));
      double sum = 0.0;
      for (const float p : got.probs[i]) sum += p;
      CHECK(sum == Approx(1.0).epsilon(1e-5));
      if (l > layer) continue;  // later layers see a changed hidden state
      CHECK(bitwise_equal(got.q[i], want.q[i]));
      if (!affected) {
        CHECK(bitwise_equal(got.probs[i], want.probs[i]));
        continue;
      }
      // Softmax over a subset of the slots = the full softmax restricted and renormalised.
      double mass = want.probs[i][prefix];
      for (const std::int32_t s : keep) mass += want.probs[i][static_cast<std::size_t>(s)];
      for (std::size_t j = 0; j < keep.size(); ++j)
        CHECK(got.probs[i][j] == Approx(want.probs[i][static_cast<std::size_t>(keep[j])] / mass).epsilon(1e-4));
      CHECK(got.probs[i].back() == Approx(want.probs[i][prefix] / mass).epsilon(1e-4));
    }
  }
}

TEST_CASE("a full cache throws, stays unchanged, and runs again after compression or reset", "[llama2c]") {
  triattn_runner::session s(stories(), 3);
  std::vector<float> first;
  for (int token : {triattn_runner::bos_id, 317, 259}) {
    const std::span<const float> logits = s.forward(token);
    if (first.empty()) first.assign(logits.begin(), logits.end());
  }
  CHECK_THAT(load_error([&] { s.forward(400); }), Contains("triattn_runner::session::forward") && Contains("cache full"));
  CHECK(s.position() == 3);
  CHECK(s.length(0, 0) == 3);
  CHECK_THAT(load_error([&] { triattn_runner::session(stories(), 4).forward(512); }), Contains("token 512"));

  triattn::streaming_llm({.sinks = 1}).compress(s.view(), 2);
  CHECK(s.length(2, 1) == 2);
  CHECK(s.slot_position(2, 1, 1) == 2);
  s.forward(400);
  CHECK(s.position() == 4);

  s.reset();
  CHECK(s.kv_bytes() == 0);
  CHECK(bitwise_equal(s.forward(triattn_runner::bos_id), first));
  CHECK(s.position() == 1);
}

TEST_CASE("batched decoding gives every session the bits it gets alone", "[llama2c][batch]") {
  // Sequences of different lengths and caches of different sizes, advanced together; each
  // is compared with the same tokens run alone, logit for logit, bit for bit.
  auto rng = triattn_test::rng();
  const int batch = std::uniform_int_distribution<int>(2, 19)(rng);
  const int threads = std::uniform_int_distribution<int>(1, 3)(rng);  // the products split by panels of rows
  INFO("batch " << batch << ", threads " << threads);
  std::uniform_int_distribution<int> token(3, 511);
  std::vector<triattn_runner::session> together, alone;
  std::vector<std::vector<int>> streams;
  for (int b = 0; b < batch; ++b) {
    const int start = std::uniform_int_distribution<int>(0, 12)(rng);
    std::vector<int> tokens(static_cast<std::size_t>(start + 24));
    for (int& t : tokens) t = token(rng);
    together.emplace_back(stories(), start + 40);
    alone.emplace_back(stories(), start + 40);
    for (int t = 0; t < start; ++t) together.back().forward(tokens[static_cast<std::size_t>(t)]);  // a head start
    streams.push_back(std::move(tokens));
  }
  triattn_runner::batch_decoder decoder(stories(), threads);
  std::vector<triattn_runner::session*> ptrs;
  for (auto& s : together) ptrs.push_back(&s);
  for (int step = 0; step < 24; ++step) {
    std::vector<int> now;
    for (int b = 0; b < batch; ++b) now.push_back(streams[b][static_cast<std::size_t>(together[b].position())]);
    decoder.step(ptrs, now);
    for (int b = 0; b < batch; ++b) {
      triattn_runner::session& a = alone[static_cast<std::size_t>(b)];
      std::span<const float> want;
      while (a.position() < together[b].position()) want = a.forward(streams[b][static_cast<std::size_t>(a.position())]);
      CHECK(bitwise_equal(decoder.logits(b), want));
    }
  }
  // Bad input anywhere in the batch changes no session.
  const std::int64_t before = together[0].position();
  std::vector<int> bad(static_cast<std::size_t>(batch), 5);
  bad.back() = 512;
  CHECK_THAT(load_error([&] { decoder.step(ptrs, bad); }), Contains("triattn_runner::batch_decoder::step") &&
                                                              Contains("token 512"));
  std::vector<triattn_runner::session*> twice{ptrs[0], ptrs[0]};
  CHECK_THAT(load_error([&] { decoder.step(twice, std::vector<int>{5, 5}); }), Contains("session 1 is also session 0"));
  CHECK(together[0].position() == before);
  CHECK(together[0].length(0, 0) == before);
}

TEST_CASE("a session copied from another goes on with the same bits", "[llama2c][batch]") {
  auto rng = triattn_test::rng();
  std::uniform_int_distribution<int> token(3, 511);
  const int head = std::uniform_int_distribution<int>(4, 30)(rng);
  INFO("head " << head);
  triattn_runner::session a(stories(), 64), b(stories(), head + 10);
  for (int t = 0; t < head; ++t) a.forward(token(rng));
  // a compressed source: rows of different lengths
  triattn_eval::random_eviction evict(rng());
  triattn::compress(evict, a.view(), head / 2);
  b.forward(7);  // whatever b held is replaced
  b.copy_from(a);
  CHECK(b.position() == a.position());
  for (int l = 0; l < stories().config().n_layers; ++l)
    for (int h = 0; h < stories().config().n_kv_heads; ++h) {
      REQUIRE(b.length(l, h) == a.length(l, h));
      for (std::int32_t s = 0; s < a.length(l, h); ++s) CHECK(b.slot_position(l, h, s) == a.slot_position(l, h, s));
    }
  for (int t = 0; t < 8; ++t) {
    const int x = token(rng);
    const auto za = a.forward(x);
    const std::vector<float> want(za.begin(), za.end());
    CHECK(bitwise_equal(b.forward(x), want));
  }
  // too small, or another cache type: refused, the session unchanged
  std::int32_t longest = 0;
  for (int l = 0; l < stories().config().n_layers; ++l)
    for (int h = 0; h < stories().config().n_kv_heads; ++h) longest = std::max(longest, a.length(l, h));
  triattn_runner::session small(stories(), longest - 1);
  small.forward(5);
  CHECK_THAT(load_error([&] { small.copy_from(a); }), Contains("triattn_runner::session::copy_from") && Contains("room for"));
  CHECK(small.position() == 1);
  CHECK(small.length(0, 0) == 1);
  triattn_runner::session narrow(stories(), 64, triattn::dtype::f16);
  CHECK_THAT(load_error([&] { narrow.copy_from(a); }), Contains("cache type"));
}

TEST_CASE("f16 and bf16 caches decode close to the f32 cache and compress alike", "[llama2c][batch]") {
  const std::vector<int> golden = golden_ids();
  for (const triattn::dtype type : {triattn::dtype::f16, triattn::dtype::bf16}) {
    INFO(triattn::dtype_name(type));
    triattn_runner::session exact(stories(), 128), narrow(stories(), 128, type);
    CHECK(narrow.view().geometry().type == type);
    CHECK(narrow.kv_bytes() == 0);
    double kl = 0;
    int agree = 0;
    for (int t = 0; t < 128; ++t) {
      const int token = t == 0 ? triattn_runner::bos_id : golden[static_cast<std::size_t>(t - 1)];
      const std::span<const float> want = exact.forward(token);
      const std::span<const float> got = narrow.forward(token);
      kl += triattn_runner::kl_divergence(want, got);
      agree += triattn_runner::argmax(want) == triattn_runner::argmax(got);
    }
    // 2-byte elements: half the bytes of f32; the distributions barely move.
    CHECK(narrow.kv_bytes() * 2 == exact.kv_bytes());
    CHECK(kl / 128 < (type == triattn::dtype::f16 ? 1e-5 : 1e-3));
    CHECK(agree >= 126);
    CHECK_THAT(load_error([&] { triattn_runner::session(stories(), 4, triattn::dtype::fp8_e4m3); }),
               Contains("triattn_runner::session") && Contains("fp8_e4m3"));
  }
}

TEST_CASE("model and tokenizer loading reject truncated and malformed files", "[llama2c]") {
  const std::string model_bytes = triattn_runner::read_file(model_dir() / "stories260K.bin");
  REQUIRE(model_bytes.size() == 1056540);
  auto g = triattn_test::rng(4);
  std::vector<std::size_t> cuts{0, 27, 28, model_bytes.size() - 1};
  for (int i = 0; i < 4; ++i) cuts.push_back(std::uniform_int_distribution<std::size_t>(1, model_bytes.size() - 1)(g));
  for (const std::size_t cut : cuts) {
    INFO("first " << cut << " bytes");
    const temp_file f(model_bytes.substr(0, cut));
    const std::string msg = load_error([&] { triattn_runner::model::load(f.path); });
    CHECK_THAT(msg, Contains("triattn_runner::model::load") && Contains(f.path.filename().string()));
  }
  const temp_file longer(model_bytes + "x");
  CHECK_THAT(load_error([&] { triattn_runner::model::load(longer.path); }), Contains("file size 1056541"));

  // Header fields: [dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len].
  const auto with_field = [&](int field, std::int32_t value) {
    std::string bytes = model_bytes;
    std::memcpy(bytes.data() + 4 * field, &value, 4);
    return bytes;
  };
  const temp_file zero_layers(with_field(2, 0)), odd_group(with_field(4, 3)), odd_head(with_field(3, 64)),
      split_dim(with_field(3, 5));
  // Issue 15 (the fuzz driver): a NaN weight made calibrate fail after its progress line, on
  // non-finite statistics; the model is refused at load, naming the file.
  std::string nan_bytes = model_bytes;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan_bytes.data() + 28 + 4 * 1000, &nan, 4);
  const temp_file nan_weight(nan_bytes);
  CHECK_THAT(load_error([&] { triattn_runner::model::load(nan_weight.path); }),
             Contains("weight 1000 is nan") && Contains("weights must be finite"));
  CHECK_THAT(load_error([&] { triattn_runner::model::load(zero_layers.path); }), Contains("n_layers = 0"));
  CHECK_THAT(load_error([&] { triattn_runner::model::load(odd_group.path); }), Contains("n_kv_heads 3"));
  CHECK_THAT(load_error([&] { triattn_runner::model::load(odd_head.path); }), Contains("head_dim 1"));
  CHECK_THAT(load_error([&] { triattn_runner::model::load(split_dim.path); }), Contains("n_heads 5"));

  const std::string tok_bytes = triattn_runner::read_file(model_dir() / "tok512.bin");
  const temp_file short_tok(tok_bytes.substr(0, std::uniform_int_distribution<std::size_t>(0, tok_bytes.size() - 1)(g)));
  CHECK_THAT(load_error([&] { triattn_runner::tokenizer::load(short_tok.path, 512); }),
             Contains("triattn_runner::tokenizer::load") && Contains("truncated"));
  CHECK_THAT(load_error([&] { triattn_runner::tokenizer::load(model_dir() / "tok512.bin", 511); }), Contains("bytes follow"));

  // Issue 15: a vocabulary below 259 sent byte fallback and the dummy prefix past the piece
  // table; a piece length was trusted before its bytes were known to exist (a 14-byte file
  // took 2.1 GB); a vocabulary the file cannot hold was allocated first.
  CHECK_THAT(load_error([&] { triattn_runner::tokenizer::load(model_dir() / "tok512.bin", 258); }),
             Contains("vocab_size 258") && Contains(">= 259"));
  std::string huge_piece(4, '\0');  // max_token_length
  const float score = 0.0f;
  const std::int32_t length = 0x7fff0000;
  huge_piece.append(reinterpret_cast<const char*>(&score), 4);
  huge_piece.append(reinterpret_cast<const char*>(&length), 4);
  huge_piece.append(std::string(259 * 8, 'x'));
  const temp_file huge(huge_piece);
  CHECK_THAT(load_error([&] { triattn_runner::tokenizer::load(huge.path, 259); }),
             Contains("token 0 declares 2147418112 bytes") && Contains("truncated"));
  const temp_file tiny(std::string(14, '\0'));
  CHECK_THAT(load_error([&] { triattn_runner::tokenizer::load(tiny.path, 1 << 30); }),
             Contains("truncated") && Contains("1073741824 pieces"));
}

TEST_CASE("the model's output projection weighs a value by the norm of W_o,h v, averaged over the kv head's q-heads",
          "[llama2c][policies]") {
  const triattn_runner::model& m = stories();
  const triattn_runner::config& c = m.config();
  const triattn::value_projection& p = m.output_projection();
  REQUIRE(p.num_layers == c.n_layers);
  REQUIRE(p.num_q_heads == c.n_heads);
  REQUIRE(p.head_dim == c.head_dim);
  CHECK(&m.output_projection() == &p);  // built once
  auto g = triattn_test::rng(5);
  std::normal_distribution<float> x(0.0f, 1.0f);
  const int G = c.n_heads / c.n_kv_heads, D = c.head_dim;
  std::vector<float> row(static_cast<std::size_t>(c.dim)), v(static_cast<std::size_t>(D));
  for (int trial = 0; trial < 8; ++trial) {
    const int layer = std::uniform_int_distribution<int>(0, c.n_layers - 1)(g);
    const int kv_head = std::uniform_int_distribution<int>(0, c.n_kv_heads - 1)(g);
    for (float& e : v) e = x(g);
    // From the definition: y_h = W_o[:, h D : (h + 1) D] v over the rows of W_o, in double.
    double want = 0.0;
    for (int h = kv_head * G; h < (kv_head + 1) * G; ++h) {
      double sq = 0.0;
      for (int i = 0; i < c.dim; ++i) {
        m.matrix_row(triattn_runner::tensor::wo, layer, i, row.data());
        double y = 0.0;
        for (int a = 0; a < D; ++a) y += static_cast<double>(row[static_cast<std::size_t>(h * D + a)]) * v[static_cast<std::size_t>(a)];
        sq += y * y;
      }
      want += std::sqrt(sq) / G;
    }
    const float got = triattn::value_weight(v.data(), &p, layer, kv_head, G, D);
    INFO("layer " << layer << " kv_head " << kv_head << " got " << got << " want " << want);
    CHECK(std::fabs(got - want) <= 1e-4 * want);
  }
}
