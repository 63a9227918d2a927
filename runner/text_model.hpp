/// \file runner/text_model.hpp
/// \brief A model with its tokenizer, from either format the runner reads: a llama2.c
/// checkpoint with its tokenizer file, or a GGUF file that holds its own tokenizer (read by
/// llama.cpp; needs a build with TRIATTN_WITH_LLAMA_CPP=ON, which defines TRIATTN_WITH_GGUF).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runner/runner.hpp"
#include "triattn/core/error.hpp"
#if TRIATTN_WITH_GGUF
#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#endif

namespace triattn_runner {

/// Whether `path` is a GGUF file: named *.gguf, or starting with the GGUF magic. The name
/// counts so that a damaged GGUF is refused as a GGUF, not as a llama2.c checkpoint.
inline bool is_gguf(const std::filesystem::path& path) {
  if (path.extension() == ".gguf") return true;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

/// The lines of the text file at `path` that hold a prompt: blank lines and lines starting
/// with '#' are skipped. Throws `triattn::error` naming `api` when none is left.
inline std::vector<std::string> read_prompts(const std::filesystem::path& path, const char* api) {
  std::vector<std::string> out;
  std::istringstream in(read_file(path, api));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos || line.front() == '#') continue;
    out.push_back(line);
  }
  TRIATTN_CHECK(!out.empty(), api, path, ": no prompts");
  return out;
}

/// A loaded model and its tokenizer. Move-only: the model is held behind a pointer so that
/// sessions made from `model()` stay valid when the text_model moves.
class text_model {
 public:
  /// Loads a GGUF file (`tokenizer` is ignored) or a llama2.c checkpoint with `tokenizer`.
  /// Throws `triattn::error` naming `api` and the file.
  static text_model load(const std::filesystem::path& model_path, const std::filesystem::path& tokenizer_path,
                         const char* api = "triattn_runner::text_model::load") {
    text_model t;
    if (is_gguf(model_path)) {
#if TRIATTN_WITH_GGUF
      // The vocabulary first: a file refused for its tokenizer is refused before its weights
      // are converted to f32 (about 1 GB for SmolLM2).
      t.vocab_.emplace(model_path);
      t.model_ = std::make_unique<triattn_runner::model>(gguf_model::load(model_path));
#else
      triattn::detail::fail(api, model_path, ": a GGUF model needs a build with llama.cpp (cmake -DTRIATTN_WITH_LLAMA_CPP=ON)");
#endif
    } else {
      TRIATTN_CHECK(!tokenizer_path.empty(), api, model_path, ": a llama2.c checkpoint needs its tokenizer (--tokenizer)");
      t.model_ = std::make_unique<triattn_runner::model>(triattn_runner::model::load(model_path));
      t.tok_.emplace(tokenizer::load(tokenizer_path, t.model_->config().vocab_size));
    }
    return t;
  }

  /// Loads only what `encode` and `decode` need: a GGUF file's vocabulary, once the file has
  /// passed the checks `load` makes (its weights stay on disk; `load` converts them to f32); a
  /// llama2.c tokenizer with its checkpoint (whose header holds the vocabulary size). `model()` and `non_ending_tokens()` need `load`.
  static text_model load_tokenizer(const std::filesystem::path& model_path, const std::filesystem::path& tokenizer_path,
                                   const char* api = "triattn_runner::text_model::load_tokenizer") {
#if TRIATTN_WITH_GGUF
    if (is_gguf(model_path)) {
      gguf_model::check(ggml_bridge::gguf_file(model_path));  // the file as `load` would take it
      text_model t;
      t.vocab_.emplace(model_path);
      return t;
    }
#endif
    return load(model_path, tokenizer_path, api);
  }

  const triattn_runner::model& model() const {
    TRIATTN_CHECK(model_ != nullptr, "triattn_runner::text_model::model", "loaded with load_tokenizer: no weights");
    return *model_;
  }
  bool gguf() const { return !tok_.has_value(); }

  /// The start token the tokenizer adds (llama2.c: BOS; GGUF: as its metadata says), then the
  /// tokens of `text`, with no chat template.
  std::vector<int> encode(std::string_view text) const {
#if TRIATTN_WITH_GGUF
    if (vocab_) return vocab_->tokenize(text, true, false);
#endif
    return tok_->encode(text, true, false);
  }
  /// A paragraph of a calibration text as `text_windows` strings them together: llama2.c's
  /// BOS + tokens; a GGUF model's start token (if it adds one) + the tokens of the paragraph
  /// followed by a blank line, so that paragraphs stay apart where no BOS marks them.
  std::vector<int> encode_paragraph(std::string_view paragraph) const {
    if (tok_) return tok_->encode(paragraph, true, false);
    return encode(std::string(paragraph) + "\n\n");
  }
  /// A one-turn chat prompt for `user_message`: a GGUF model's chat template with the system
  /// message the template writes when none is given (`ggml_bridge::vocab::chat_prompt`), the
  /// assistant's turn opened; a llama2.c model, which has no chat, gets the message as a text
  /// (`encode`).
  std::vector<int> chat(std::string_view user_message) const {
#if TRIATTN_WITH_GGUF
    if (vocab_) return vocab_->tokenize(vocab_->chat_prompt(user_message), true, true);
#endif
    return encode(user_message);
  }

  /// Per token id, 1 unless the id ends a generation (a GGUF model's end-of-turn and
  /// end-of-text ids), so that a sampler given it writes on (vLLM's `ignore_eos`). A llama2.c
  /// model ends nothing: where it ends a story (BOS) the next one starts.
  std::vector<std::uint8_t> non_ending_tokens() const {
    std::vector<std::uint8_t> ok(static_cast<std::size_t>(model().config().vocab_size), 1);
#if TRIATTN_WITH_GGUF
    if (vocab_)
      for (int id = 0; id < static_cast<int>(ok.size()); ++id) ok[static_cast<std::size_t>(id)] = vocab_->is_eog(id) ? 0 : 1;
#endif
    return ok;
  }

  /// The text of `tokens`.
  std::string decode(std::span<const int> tokens) const {
#if TRIATTN_WITH_GGUF
    if (vocab_) return vocab_->detokenize(tokens);
#endif
    return tok_->decode(tokens);
  }
  /// The llama2.c tokenizer, or nullptr for a GGUF model.
  const tokenizer* llama2c_tokenizer() const { return tok_ ? &*tok_ : nullptr; }
#if TRIATTN_WITH_GGUF
  /// llama.cpp's vocabulary of a GGUF model, or nullptr.
  const ggml_bridge::vocab* gguf_vocab() const { return vocab_ ? &*vocab_ : nullptr; }
#endif

 private:
  text_model() = default;

  std::unique_ptr<triattn_runner::model> model_;
  std::optional<tokenizer> tok_;
#if TRIATTN_WITH_GGUF
  std::optional<ggml_bridge::vocab> vocab_;
#endif
};

}  // namespace triattn_runner
