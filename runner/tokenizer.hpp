/// \file runner/tokenizer.hpp
/// \brief The llama2.c tokenizer (SentencePiece pieces with scores, byte fallback) and the token windows
/// of a text that calibration reads (spec/cli.md's "Calibration windows").
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "triattn/core/error.hpp"

namespace triattn_runner {

inline constexpr int bos_id = 1;  ///< "\n<s>\n": starts a text, and the model emits it to end a story
inline constexpr int eos_id = 2;  ///< "\n</s>\n"

/// Reads a whole file into a string. Throws `triattn::error` naming `api` and the path.
inline std::string read_file(const std::filesystem::path& path, const char* api = "triattn_runner::read_file") {
  std::ifstream in(path, std::ios::binary);
  TRIATTN_CHECK(in.is_open(), api, path, ": cannot open the file");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The llama2.c tokenizer (tok512.bin and the like): SentencePiece pieces with scores,
/// byte fallback for ids 3..258, greedy highest-score merges.
class tokenizer {
 public:
  /// Reads `path`, which holds `vocab_size` pieces (the file does not store the count).
  /// Throws `triattn::error` for a truncated file, a negative piece length, or trailing bytes.
  static tokenizer load(const std::filesystem::path& path, int vocab_size);

  /// Token ids of `text` as run.c encodes them: [BOS], the " " dummy prefix when the text is
  /// not empty, each UTF-8 code point as a piece or else as byte-fallback ids, then repeated
  /// merges of the adjacent pair whose concatenation is the highest-scoring piece, [EOS].
  std::vector<int> encode(std::string_view text, bool bos, bool eos) const;

  /// The text of `token` when it follows `prev`: no leading space right after BOS, and a
  /// byte-fallback piece `<0xHH>` is the raw byte HH.
  std::string decode(int prev, int token) const;
  /// The text of a token sequence that follows `prev` (by default: a text started at BOS).
  std::string decode(std::span<const int> tokens, int prev = bos_id) const {
    std::string out;
    for (const int t : tokens) {
      out += decode(prev, t);
      prev = t;
    }
    return out;
  }

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::string& piece(int id) const { return pieces_.at(static_cast<std::size_t>(id)); }
  float score(int id) const { return scores_.at(static_cast<std::size_t>(id)); }

 private:
  tokenizer() = default;  // only load() makes one

  int lookup(const std::string& s) const {
    const auto it = ids_.find(s);
    return it == ids_.end() ? -1 : it->second;
  }

  std::vector<std::string> pieces_;  // [vocab]
  std::vector<float> scores_;        // [vocab]
  std::unordered_map<std::string, int> ids_;
  int space_id_ = ' ' + 3;  // the dummy prefix " "; byte fallback if the vocab has no such piece
};

inline tokenizer tokenizer::load(const std::filesystem::path& path, int vocab_size) {
  const char* api = "triattn_runner::tokenizer::load";
  // Byte fallback encodes byte b as id b + 3, and the dummy prefix falls back to ' ' + 3: a
  // smaller vocabulary would send the encoder past its piece table.
  TRIATTN_CHECK(vocab_size >= 259, api, path, ": vocab_size ", vocab_size,
                " must be >= 259 (<unk>, BOS, EOS and the 256 byte-fallback pieces)");
  const std::string bytes = read_file(path, api);
  // Every piece takes at least 8 bytes (score, length): a vocabulary the file cannot hold is
  // refused before anything is sized by it.
  TRIATTN_CHECK(bytes.size() >= 4 && (bytes.size() - 4) / 8 >= static_cast<std::size_t>(vocab_size), api, path,
                ": truncated: ", bytes.size(), " bytes cannot hold ", vocab_size, " pieces");
  std::size_t at = 0;
  // Copies the next `n` bytes into `out`; `id` is the token being read (-1: the header).
  const auto take = [&](void* out, std::size_t n, int id) {
    TRIATTN_CHECK(bytes.size() - at >= n, api, path, ": truncated: the file ends at byte ", bytes.size(), " inside ",
                  id < 0 ? std::string("the header") : "token " + std::to_string(id), " of ", vocab_size);
    std::memcpy(out, bytes.data() + at, n);
    at += n;
  };
  std::int32_t max_token_length = 0;  // unused: pieces carry their own lengths
  take(&max_token_length, sizeof(max_token_length), -1);

  tokenizer t;
  t.pieces_.resize(static_cast<std::size_t>(vocab_size));
  t.scores_.resize(static_cast<std::size_t>(vocab_size));
  for (int id = 0; id < vocab_size; ++id) {
    std::int32_t len = 0;
    take(&t.scores_[static_cast<std::size_t>(id)], sizeof(float), id);
    take(&len, sizeof(len), id);
    TRIATTN_CHECK(len >= 0, api, path, ": token ", id, " has a negative length ", len);
    // The bytes must exist before the piece is sized by its declared length.
    TRIATTN_CHECK(static_cast<std::size_t>(len) <= bytes.size() - at, api, path, ": truncated: token ", id,
                  " declares ", len, " bytes, the file holds ", bytes.size() - at, " more");
    std::string& p = t.pieces_[static_cast<std::size_t>(id)];
    p.resize(static_cast<std::size_t>(len));
    take(p.data(), p.size(), id);
    t.ids_.emplace(p, id);
  }
  TRIATTN_CHECK(at == bytes.size(), api, path, ": ", bytes.size() - at, " bytes follow the ", vocab_size,
                " pieces; does vocab_size match the model?");
  if (const int space = t.lookup(" "); space >= 0) t.space_id_ = space;
  return t;
}

inline std::vector<int> tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  std::vector<int> ids;
  ids.reserve(text.size() + 3);
  if (bos) ids.push_back(bos_id);
  if (!text.empty()) ids.push_back(space_id_);

  // One code point (at most 4 bytes) at a time; a stray continuation byte extends the
  // current buffer, exactly as run.c does.
  std::string buf;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto is_continuation = [&](std::size_t j) { return (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80; };
    if (!is_continuation(i)) buf.clear();
    buf.push_back(text[i]);
    if (i + 1 < text.size() && is_continuation(i + 1) && buf.size() < 4) continue;
    if (const int id = lookup(buf); id >= 0) {
      ids.push_back(id);
    } else {
      for (const char b : buf) ids.push_back(static_cast<unsigned char>(b) + 3);
    }
    buf.clear();
  }

  std::string pair;
  for (;;) {
    float best_score = -1e10f;
    int best_id = -1;
    std::size_t best_at = 0;
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
      pair = pieces_[static_cast<std::size_t>(ids[i])];
      pair += pieces_[static_cast<std::size_t>(ids[i + 1])];
      const int id = lookup(pair);
      if (id >= 0 && scores_[static_cast<std::size_t>(id)] > best_score) {
        best_score = scores_[static_cast<std::size_t>(id)];
        best_id = id;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
  }
  if (eos) ids.push_back(eos_id);
  return ids;
}

inline std::string tokenizer::decode(int prev, int token) const {
  TRIATTN_CHECK(token >= 0 && token < vocab_size(), "triattn_runner::tokenizer::decode", "token ", token,
                " is outside [0, vocab_size ", vocab_size(), ")");
  std::string_view p = pieces_[static_cast<std::size_t>(token)];
  if (prev == bos_id && p.starts_with(' ')) p.remove_prefix(1);
  if (p.size() == 6 && p.starts_with("<0x") && p.ends_with('>')) {
    unsigned byte = 0;
    const auto [end, ec] = std::from_chars(p.data() + 3, p.data() + 5, byte, 16);
    if (ec == std::errc() && end == p.data() + 5) return std::string(1, static_cast<char>(byte));
  }
  return std::string(p);
}

/// Token windows of a text (the "Calibration windows" of spec/cli.md): the text splits into
/// paragraphs at blank lines; each paragraph is encoded by `encode_paragraph` (its start
/// token, then its tokens); paragraphs are concatenated until the window holds
/// `window_tokens` tokens, and the last one is cut there, so every window starts with a new
/// paragraph. Returns at most `max_windows` windows of exactly `window_tokens` tokens; a short
/// tail is dropped.
template <class Encode>
  requires std::is_invocable_r_v<std::vector<int>, const Encode&, std::string_view>
std::vector<std::vector<int>> text_windows(const Encode& encode_paragraph, std::string_view text, int window_tokens,
                                           int max_windows) {
  const char* api = "triattn_runner::text_windows";
  TRIATTN_CHECK(window_tokens >= 1, api, "window_tokens ", window_tokens, " must be >= 1");
  TRIATTN_CHECK(max_windows >= 1, api, "max_windows ", max_windows, " must be >= 1");
  const auto window_size = static_cast<std::size_t>(window_tokens);
  constexpr std::string_view blank = " \t\r\f\v";
  std::vector<std::vector<int>> windows;
  std::vector<int> window;
  std::string paragraph;
  const auto end_paragraph = [&] {
    const auto first = paragraph.find_first_not_of(blank);
    if (first == std::string::npos) return;
    const auto last = paragraph.find_last_not_of(blank);
    const std::vector<int> ids = encode_paragraph(std::string_view(paragraph).substr(first, last + 1 - first));
    window.insert(window.end(), ids.begin(), ids.end());
    paragraph.clear();
    if (window.size() >= window_size) {
      window.resize(window_size);
      windows.push_back(std::move(window));
      window.clear();
    }
  };
  while (!text.empty() && windows.size() < static_cast<std::size_t>(max_windows)) {
    const std::size_t eol = std::min(text.find('\n'), text.size());
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(std::min(eol + 1, text.size()));
    if (line.ends_with('\r')) line.remove_suffix(1);  // CRLF text
    if (line.find_first_not_of(blank) == std::string_view::npos) {
      end_paragraph();
    } else {
      if (!paragraph.empty()) paragraph += '\n';
      paragraph += line;
    }
  }
  if (windows.size() < static_cast<std::size_t>(max_windows)) end_paragraph();
  return windows;
}

/// The llama2.c windows: each paragraph is BOS + its tokens (with the dummy prefix).
inline std::vector<std::vector<int>> text_windows(const tokenizer& tok, std::string_view text, int window_tokens,
                                                  int max_windows) {
  return text_windows([&tok](std::string_view p) { return tok.encode(p, true, false); }, text, window_tokens,
                      max_windows);
}

}  // namespace triattn_runner
