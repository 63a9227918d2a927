// runner/ggml_bridge.hpp against the real SmolLM2-135M-Instruct GGUF (Q4_1): metadata,
// tensor directory and dequantisation, llama.cpp's tokenizer and chat template, llama.cpp's
// own logits, and the errors for a missing or truncated file.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#include "triattn/core/error.hpp"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

const fs::path model_path{TRIATTN_SMOLLM2_GGUF};

const ggml_bridge::gguf_file& smollm2() {
  static const ggml_bridge::gguf_file f(model_path);
  return f;
}
const ggml_bridge::vocab& smollm2_vocab() {
  static const ggml_bridge::vocab v(model_path);
  return v;
}

// Mean negative log-likelihood of tokens[1..] under logits [n][n_vocab] (row i predicts i+1).
double mean_nll(const std::vector<float>& logits, const std::vector<int>& tokens, std::size_t n_vocab) {
  double sum = 0;
  for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
    const float* row = logits.data() + i * n_vocab;
    const float top = *std::max_element(row, row + n_vocab);
    double z = 0;
    for (std::size_t v = 0; v < n_vocab; ++v) z += std::exp(static_cast<double>(row[v] - top));
    sum += std::log(z) + static_cast<double>(top) - static_cast<double>(row[tokens[i + 1]]);
  }
  return sum / static_cast<double>(tokens.size() - 1);
}

int argmax_row(const std::vector<float>& logits, std::size_t row, std::size_t n_vocab) {
  const auto first = logits.begin() + static_cast<std::ptrdiff_t>(row * n_vocab);
  return static_cast<int>(std::max_element(first, first + static_cast<std::ptrdiff_t>(n_vocab)) - first);
}

}  // namespace

TEST_CASE("gguf_file reads SmolLM2's metadata", "[llamacpp]") {
  const auto& f = smollm2();
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count") == 30);
  CHECK(f.get_int("llama.attention.head_count") == 9);
  CHECK(f.get_int("llama.attention.head_count_kv") == 3);
  CHECK(f.get_int("llama.embedding_length") == 576);
  CHECK(f.get_int("llama.feed_forward_length") == 1536);
  CHECK(f.get_int("llama.context_length") == 8192);
  CHECK(f.get_int("llama.rope.dimension_count") == 64);
  CHECK(f.get_float("llama.rope.freq_base") == Approx(100000.0));
  CHECK(f.get_float("llama.attention.layer_norm_rms_epsilon") == Approx(1e-5));
  CHECK(f.get_string("tokenizer.ggml.model") == "gpt2");
  CHECK(f.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK(f.get_string_array("tokenizer.ggml.tokens").size() == 49152);
  CHECK(f.has("tokenizer.chat_template"));
  CHECK_FALSE(f.has("no.such.key"));

  CHECK_THROWS_WITH(f.get_int("no.such.key"), Contains("get_int") && Contains("no.such.key"));
  CHECK_THROWS_WITH(f.get_int("general.architecture"), Contains("not an integer"));
  CHECK_THROWS_WITH(f.get_string("llama.block_count"), Contains("llama.block_count"));
  CHECK_THROWS_WITH(f.get_float("llama.block_count"), Contains("not f32 or f64"));
}

TEST_CASE("gguf_file lists and dequantises tensors", "[llamacpp]") {
  const auto& f = smollm2();
  CHECK(f.tensor_names().size() == 272);
  CHECK_FALSE(f.has_tensor("output.weight"));  // tied to token_embd

  const auto q = f.tensor_info("blk.0.attn_q.weight");
  CHECK(q.type == GGML_TYPE_Q4_1);
  CHECK(q.ne == std::vector<std::int64_t>{576, 576});
  const auto k = f.tensor_info("blk.0.attn_k.weight");
  CHECK(k.ne == std::vector<std::int64_t>{576, 192});  // {in, out}: W[192][576]
  CHECK(f.tensor_info("blk.0.attn_norm.weight").ne == std::vector<std::int64_t>{576});
  CHECK_THROWS_WITH(f.tensor_info("blk.99.attn_q.weight"), Contains("blk.99.attn_q.weight"));

  const auto embd_info = f.tensor_info("token_embd.weight");
  CHECK(embd_info.type == GGML_TYPE_Q8_0);
  CHECK(embd_info.ne == std::vector<std::int64_t>{576, 49152});
  const std::vector<float> embd = f.dequantize("token_embd.weight");
  REQUIRE(embd.size() == std::size_t{49152} * 576);
  CHECK(std::all_of(embd.begin(), embd.end(), [](float x) { return std::isfinite(x); }));
  double sum = 0;
  double sq = 0;
  for (const float x : embd) {
    sum += x;
    sq += static_cast<double>(x) * x;
  }
  const double mean = sum / static_cast<double>(embd.size());
  const double sd = std::sqrt(sq / static_cast<double>(embd.size()) - mean * mean);
  CHECK(std::abs(mean) < 0.05);
  CHECK(sd > 0.01);
  CHECK(sd < 1.0);
  // Rows differ: two token embeddings are not the same vector.
  CHECK_FALSE(std::equal(embd.begin(), embd.begin() + 576, embd.begin() + 576 * 1000));

  // F32 is copied as is: an RMSNorm weight is positive-ish and finite.
  const std::vector<float> norm = f.dequantize("output_norm.weight");
  REQUIRE(norm.size() == 576);
  CHECK(std::all_of(norm.begin(), norm.end(), [](float x) { return std::isfinite(x); }));
  const std::vector<float> wq = f.dequantize("blk.0.attn_q.weight");
  CHECK(wq.size() == std::size_t{576} * 576);
}

TEST_CASE("a missing or truncated file is an error naming the path", "[llamacpp]") {
  const fs::path missing = fs::temp_directory_path() / "triattn-no-such-model.gguf";
  CHECK_THROWS_AS(ggml_bridge::gguf_file(missing), triattn::error);
  CHECK_THROWS_WITH(ggml_bridge::gguf_file(missing), Contains(missing.string()));
  CHECK_THROWS_WITH(ggml_bridge::vocab(missing), Contains(missing.string()));
  const std::vector<int> tokens{1, 2, 3};
  CHECK_THROWS_WITH(ggml_bridge::reference_logits(missing, tokens, 1), Contains(missing.string()));

  // The first 8 MiB: the whole metadata, but only the first tensors' data.
  const fs::path cut = fs::temp_directory_path() / "triattn-truncated-smollm2.gguf";
  {
    std::ifstream in(model_path, std::ios::binary);
    std::vector<char> head(std::size_t{8} << 20);
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream out(cut, std::ios::binary | std::ios::trunc);
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
  }
  std::string last;
  std::size_t last_end = 0;
  for (const auto& name : smollm2().tensor_names()) {
    const auto d = smollm2().tensor_info(name);
    if (d.offset + d.bytes > last_end) {
      last_end = d.offset + d.bytes;
      last = name;
    }
  }
  // gguf_init_from_file (no_alloc) reads only the metadata, so the cut shows when the data is read.
  std::optional<ggml_bridge::gguf_file> f;
  REQUIRE_NOTHROW(f.emplace(cut));
  CHECK_THROWS_WITH(f->dequantize(last), Contains(cut.string()) && Contains(last) && Contains("truncated"));
  // The runner's loader sees the cut before it allocates or reads anything.
  CHECK_THROWS_WITH(gguf_model::load(cut), Contains("gguf_model::check") && Contains("truncated"));
  f.reset();
  fs::remove(cut);
}

TEST_CASE("a file that is no GGUF, or a broken one, is refused in one line with ggml's reason", "[llamacpp]") {
  std::vector<char> bytes;
  {
    std::ifstream in(model_path, std::ios::binary);
    bytes.resize(std::size_t{1} << 16);
    in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const fs::path file = fs::temp_directory_path() / "triattn-hostile-header.gguf";
  const auto refusal = [&](std::size_t at, std::string_view patch) {
    std::vector<char> b = bytes;
    std::copy(patch.begin(), patch.end(), b.begin() + static_cast<std::ptrdiff_t>(at));
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(b.data(), static_cast<std::streamsize>(b.size()));
    try {
      ggml_bridge::gguf_file f(file);
    } catch (const triattn::error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string magic = refusal(0, "GGUX");
  CHECK_THAT(magic, Contains(file.string()) && Contains("not a GGUF file"));
  // Version 99 (little-endian u32 after the magic): ggml logs why, the one message carries it.
  const std::string version = refusal(4, std::string_view("\x63\0\0\0", 4));
  CHECK_THAT(version, Contains(file.string()) && Contains("not a valid GGUF file") && Contains("version 99"));
  CHECK(version.find('\n') == std::string::npos);
  fs::remove(file);
}

TEST_CASE("vocab tokenizes, renders pieces and applies the chat template", "[llamacpp]") {
  const auto& v = smollm2_vocab();
  CHECK(v.n_vocab() == 49152);
  CHECK(v.bos() == 1);
  CHECK(v.eos() == 2);
  CHECK(v.is_eog(v.eos()));
  CHECK_FALSE(v.is_eog(v.tokenize("Hello", false, false).at(0)));

  const std::vector<int> ids = v.tokenize("Hello world", true, false);
  REQUIRE(ids.size() == 2);  // no start token for a raw text
  CHECK(v.piece(ids[0]) + v.piece(ids[1]) == "Hello world");
  CHECK(v.detokenize(ids) == "Hello world");

  // A long text goes through the buffer-too-small path.
  std::string longer;
  for (int i = 0; i < 200; ++i) longer += "a b c ";
  CHECK(v.detokenize(v.tokenize(longer, false, false)) == longer);

  CHECK(v.piece(2) == "<|im_end|>");
  CHECK(v.tokenize("<|im_start|>", false, true) == std::vector<int>{1});
  CHECK(v.tokenize("<|im_start|>", false, false).size() > 1);
  CHECK_THROWS_WITH(v.piece(49152), Contains("49152"));

  const std::string prompt = v.chat_prompt("Hi");
  // With no system message given, the template's own comes first (llama.cpp's built-in form
  // of the template would leave it out).
  CHECK(v.default_system_message() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  CHECK(prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                           "Face<|im_end|>\n"));
  CHECK_THAT(prompt, Contains("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
  CHECK(prompt.ends_with("<|im_start|>assistant\n"));
  CHECK_THAT(v.chat_prompt("Hi", "Be brief."),
             Contains("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"));
}

TEST_CASE("reference_logits is llama.cpp's forward pass", "[llamacpp]") {
  const auto& v = smollm2_vocab();
  const auto n_vocab = static_cast<std::size_t>(v.n_vocab());
  const std::vector<int> tokens =
      v.tokenize("The quick brown fox jumps over the lazy dog. The sun was shining over the green hills.", false,
                 false);
  INFO(tokens.size() << " tokens");
  REQUIRE(tokens.size() >= 14);
  REQUIRE(tokens.size() <= 24);

  const std::vector<float> logits = ggml_bridge::reference_logits(model_path, tokens, 2);
  REQUIRE(logits.size() == tokens.size() * n_vocab);
  CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return std::isfinite(x); }));
  const double nll = mean_nll(logits, tokens, n_vocab);
  INFO("mean NLL " << nll << " nats/token");
  CHECK(nll < 6.0);
  CHECK(nll > 0.1);
  // "The quick brown fox jumps over the lazy" -> " dog".
  const int lazy_id = v.tokenize(" lazy", false, false).at(0);
  const auto lazy = static_cast<std::size_t>(std::find(tokens.begin(), tokens.end(), lazy_id) - tokens.begin());
  REQUIRE(lazy + 1 < tokens.size());
  CHECK(v.piece(argmax_row(logits, lazy, n_vocab)) == " dog");

  // Causal: the first 8 tokens alone give the same first 8 rows.
  const std::vector<int> head(tokens.begin(), tokens.begin() + 8);
  const std::vector<float> head_logits = ggml_bridge::reference_logits(model_path, head, 1);
  REQUIRE(head_logits.size() == 8 * n_vocab);
  float max_diff = 0;
  for (std::size_t i = 0; i < head_logits.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(head_logits[i] - logits[i]));
  }
  CHECK(max_diff < 0.05f);

  CHECK_THROWS_WITH(ggml_bridge::reference_logits(model_path, std::vector<int>{49152}, 1), Contains("49152"));
  CHECK_THROWS_WITH(ggml_bridge::reference_logits(model_path, std::vector<int>{}, 1), Contains("no tokens"));
}
