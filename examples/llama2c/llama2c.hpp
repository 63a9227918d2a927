/// \file llama2c/llama2c.hpp
/// \brief The examples' Llama-family runner: the model (loaded from a llama2.c version-0
/// checkpoint such as stories260K here, or from GGUF by `gguf/gguf_model.hpp`), the llama2.c
/// tokenizer, and per-sequence sessions whose KV caches triattn compresses in place, decoded
/// one token at a time or many sequences together (`batch_decoder`).
///
/// The forward pass and the tokenizer follow llama2.c's `run.c` (github.com/karpathy/llama2.c,
/// MIT, Copyright (c) 2023 Andrej), with two differences: the cache keeps one length per
/// (layer, kv_head), and each query head attends over the slots its own kv head still holds;
/// and sequences decoded together share every read of the weights. Each product is summed in
/// run.c's order whatever the batch, so a sequence's logits are the same bits alone or in any
/// batch. The cache is NHD per layer (f32, f16 or bf16), keys stored after RoPE.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/rope.hpp"

namespace llama2c {

static_assert(std::endian::native == std::endian::little, "llama2c: checkpoints are little-endian files");

inline constexpr int bos_id = 1;  ///< "\n<s>\n": starts a text, and the model emits it to end a story
inline constexpr int eos_id = 2;  ///< "\n</s>\n"

/// The checkpoint header plus the sizes derived from it.
struct config {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;  ///< positive; the sign stored in the file is `shared_classifier`
  int seq_len = 0;     ///< the training context
  int head_dim = 0;    ///< dim / n_heads
  int kv_dim = 0;      ///< head_dim * n_kv_heads
  bool shared_classifier = true;  ///< the classifier is the token embedding
  float rms_eps = 1e-5f;          ///< RMSNorm epsilon
  /// How the model rotates queries and keys: llama2.c pairs dims (2j, 2j+1) with theta 10000;
  /// GGUF files give theta and store Q and K permuted for the same pairing.
  triattn::rope_desc rope{.style = triattn::rope_style::interleaved, .theta = 10000.0};
};

/// The tensors of a checkpoint, in file order. Matrices are row-major [out][in].
enum class tensor : std::uint8_t {
  token_embedding,  ///< [vocab, dim]
  rms_att,          ///< [layers][dim]
  wq,               ///< [layers][dim, dim]
  wk,               ///< [layers][kv_dim, dim]
  wv,               ///< [layers][kv_dim, dim]
  wo,               ///< [layers][dim, dim]
  rms_ffn,          ///< [layers][dim]
  w1,               ///< [layers][hidden, dim] (gate)
  w2,               ///< [layers][dim, hidden] (down)
  w3,               ///< [layers][hidden, dim] (up)
  rms_final,        ///< [dim]
  freq_cis_real,    ///< [seq_len, head_dim / 2] legacy cos table (unused: RoPE comes from triattn)
  freq_cis_imag,    ///< [seq_len, head_dim / 2] legacy sin table (unused)
  wcls,             ///< [vocab, dim]; the token embedding when the classifier is shared
};
inline constexpr std::size_t tensor_count = 14;

/// Reads a whole file into a string. Throws `triattn::error` naming `api` and the path.
inline std::string read_file(const std::filesystem::path& path, const char* api = "llama2c::read_file") {
  std::ifstream in(path, std::ios::binary);
  TRIATTN_CHECK(in.is_open(), api, path, ": cannot open the file");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Floats per slice (`per_slice`) and slices (`slices`: 1, or one per layer) of every tensor,
/// in file order. Counted in double: exact below 2^53, and a header implying more than that
/// cannot match any real file size. `freq_tables`: whether the legacy RoPE tables are stored.
struct tensor_layout {
  std::array<double, tensor_count> per_slice{};
  std::array<double, tensor_count> slices{};

  tensor_layout(const config& c, bool freq_tables) {
    const double d = c.dim, hidden = c.hidden_dim, kv = c.kv_dim, layers = c.n_layers, vocab = c.vocab_size;
    const double freqs = freq_tables ? static_cast<double>(c.seq_len) * (c.head_dim / 2) : 0.0;
    per_slice = {vocab * d,                               // token_embedding
                 d, d * d, kv * d, kv * d, d * d, d,      // rms_att, wq, wk, wv, wo, rms_ffn
                 hidden * d, d * hidden, hidden * d,      // w1, w2, w3
                 d, freqs, freqs,                         // rms_final, freq_cis_real, freq_cis_imag
                 c.shared_classifier ? 0.0 : vocab * d};  // wcls
    slices = {1, layers, layers, layers, layers, layers, layers, layers, layers, layers, 1, 1, 1, 1};
  }
  /// Floats of every tensor together.
  double floats() const {
    double n = 0;
    for (std::size_t i = 0; i < tensor_count; ++i) n += per_slice[i] * slices[i];
    return n;
  }
};

/// A Llama-family model held in memory as f32, every matrix row-major [out][in].
class model {
 public:
  /// Reads and validates a llama2.c checkpoint: positive dims, n_heads a multiple of
  /// n_kv_heads, dim a multiple of n_heads, an even head_dim, and the exact file size the
  /// header implies.
  static model load(const std::filesystem::path& path);

  /// A model from its config and its tensors packed in `layout(c, false)` order (no legacy
  /// RoPE tables): what a loader of another format builds. Throws when `data` has another size.
  static model from_tensors(const llama2c::config& c, std::vector<float> data) {
    model m;
    m.config_ = c;
    m.set_layout(tensor_layout(c, false));
    TRIATTN_CHECK(data.size() == m.floats_, "llama2c::model::from_tensors", data.size(), " floats, the config needs ",
                  m.floats_);
    m.data_ = std::move(data);
    m.pack_matrices();
    return m;
  }

  const llama2c::config& config() const { return config_; }

  /// The slice of tensor `t` for `layer` (0 for the tensors that are not per layer).
  std::span<const float> weights(tensor t, int layer = 0) const {
    if (t == tensor::wcls && config_.shared_classifier) t = tensor::token_embedding;
    const auto i = static_cast<std::size_t>(t);
    return {data_.data() + offset_[i] + static_cast<std::size_t>(layer) * slice_[i], slice_[i]};
  }

  /// Rows of every panel of `panels()`.
  static constexpr int panel_rows = 16;
  /// Rows (out) and columns (in) of matrix `t`: wq, wk, wv, wo, w1, w2, w3 or wcls.
  std::pair<int, int> matrix_shape(tensor t) const {
    const llama2c::config& c = config_;
    switch (t) {
      case tensor::wk:
      case tensor::wv: return {c.kv_dim, c.dim};
      case tensor::w1:
      case tensor::w3: return {c.hidden_dim, c.dim};
      case tensor::w2: return {c.dim, c.hidden_dim};
      case tensor::wcls: return {c.vocab_size, c.dim};
      default: return {c.dim, c.dim};  // wq, wo
    }
  }
  /// Matrix `t` of `layer` as the products read it: panels of `panel_rows` rows, each stored
  /// column by column ([ceil(rows / 16)][cols][16], the rows past the matrix zero), so that a
  /// product streams the weights in order and keeps 16 rows in two vector registers.
  std::span<const float> panels(tensor t, int layer = 0) const {
    const std::size_t m = matrix_index(t);
    return {panels_.data() + panel_offset_[m] + static_cast<std::size_t>(layer) * panel_slice_[m], panel_slice_[m]};
  }

 private:
  model() = default;  // only load() and from_tensors() make one

  static constexpr std::array<tensor, 8> matrices{tensor::wq, tensor::wk, tensor::wv, tensor::wo,
                                                  tensor::w1, tensor::w2, tensor::w3, tensor::wcls};
  static std::size_t matrix_index(tensor t) {
    return static_cast<std::size_t>(std::find(matrices.begin(), matrices.end(), t) - matrices.begin());
  }
  // Builds panels_ from data_ (after a load).
  void pack_matrices() {
    std::size_t at = 0;
    for (std::size_t m = 0; m < matrices.size(); ++m) {
      const auto [rows, cols] = matrix_shape(matrices[m]);
      panel_offset_[m] = at;
      panel_slice_[m] = static_cast<std::size_t>((rows + panel_rows - 1) / panel_rows) * panel_rows * static_cast<std::size_t>(cols);
      at += panel_slice_[m] * (matrices[m] == tensor::wcls ? 1 : static_cast<std::size_t>(config_.n_layers));
    }
    panels_.assign(at, 0.0f);
    for (std::size_t m = 0; m < matrices.size(); ++m) {
      const auto [rows, cols] = matrix_shape(matrices[m]);
      const int layers = matrices[m] == tensor::wcls ? 1 : config_.n_layers;
      for (int l = 0; l < layers; ++l) {
        const float* w = weights(matrices[m], l).data();
        float* out = panels_.data() + panel_offset_[m] + static_cast<std::size_t>(l) * panel_slice_[m];
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < cols; ++j)
            out[(static_cast<std::size_t>(i / panel_rows) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)) *
                    panel_rows + static_cast<std::size_t>(i % panel_rows)] =
                w[static_cast<std::size_t>(i) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(j)];
      }
    }
  }

  void set_layout(const tensor_layout& t) {
    std::size_t at = 0;
    for (std::size_t i = 0; i < tensor_count; ++i) {
      offset_[i] = at;
      slice_[i] = static_cast<std::size_t>(t.per_slice[i]);
      at += static_cast<std::size_t>(t.per_slice[i] * t.slices[i]);
    }
    floats_ = at;
  }

  llama2c::config config_;
  std::size_t floats_ = 0;  // of every tensor
  std::vector<float> data_;                       // every tensor, packed as in the file
  std::array<std::size_t, tensor_count> offset_{};  // first float of each tensor
  std::array<std::size_t, tensor_count> slice_{};   // floats per layer (or in all) of each tensor
  std::vector<float> panels_;                        // the matrices as panels(), in `matrices` order
  std::array<std::size_t, matrices.size()> panel_offset_{}, panel_slice_{};
};

inline model model::load(const std::filesystem::path& path) {
  const char* api = "llama2c::model::load";
  std::ifstream in(path, std::ios::binary);
  TRIATTN_CHECK(in.is_open(), api, path, ": cannot open the file");
  std::array<std::int32_t, 7> header{};
  constexpr auto header_bytes = static_cast<std::streamsize>(sizeof(header));
  in.read(reinterpret_cast<char*>(header.data()), header_bytes);
  TRIATTN_CHECK(in.gcount() == header_bytes, api, path, ": ", in.gcount(), " bytes, shorter than the ", header_bytes,
                "-byte header");

  static constexpr std::array<const char*, 7> names{"dim",        "hidden_dim", "n_layers", "n_heads",
                                                    "n_kv_heads", "vocab_size", "seq_len"};
  for (std::size_t i = 0; i < header.size(); ++i) {
    // vocab_size carries the classifier flag in its sign; only its magnitude must be positive.
    const bool ok = i == 5 ? header[i] != 0 && header[i] != std::numeric_limits<std::int32_t>::min() : header[i] > 0;
    TRIATTN_CHECK(ok, api, path, ": header field ", names[i], " = ", header[i], " is not a positive size");
  }
  model m;
  llama2c::config& c = m.config_;
  c.dim = header[0];
  c.hidden_dim = header[1];
  c.n_layers = header[2];
  c.n_heads = header[3];
  c.n_kv_heads = header[4];
  c.vocab_size = header[5] < 0 ? -header[5] : header[5];
  c.shared_classifier = header[5] > 0;
  c.seq_len = header[6];
  TRIATTN_CHECK(c.n_heads % c.n_kv_heads == 0, api, path, ": n_heads ", c.n_heads, " is not a multiple of n_kv_heads ",
                c.n_kv_heads);
  TRIATTN_CHECK(c.dim % c.n_heads == 0, api, path, ": dim ", c.dim, " is not a multiple of n_heads ", c.n_heads);
  c.head_dim = c.dim / c.n_heads;
  c.kv_dim = c.head_dim * c.n_kv_heads;
  TRIATTN_CHECK(c.head_dim % 2 == 0, api, path, ": head_dim ", c.head_dim, " (dim / n_heads) must be even for RoPE");

  const tensor_layout layout(c, true);
  const std::uintmax_t file_bytes = std::filesystem::file_size(path);
  const double expected_bytes = static_cast<double>(header_bytes) + 4.0 * layout.floats();
  TRIATTN_CHECK(static_cast<double>(file_bytes) == expected_bytes, api, path, ": file size ", file_bytes,
                " bytes, expected ",
                expected_bytes < 0x1p63 ? std::to_string(static_cast<std::int64_t>(expected_bytes)) : "over 2^63",
                " for the header's dims");

  m.set_layout(layout);
  const std::size_t at = m.floats_;
  m.data_.resize(at);
  in.read(reinterpret_cast<char*>(m.data_.data()), static_cast<std::streamsize>(at * sizeof(float)));
  TRIATTN_CHECK(in.gcount() == static_cast<std::streamsize>(at * sizeof(float)), api, path, ": read ", in.gcount(),
                " of ", at * sizeof(float), " weight bytes");
  // A non-finite weight poisons every activation: refused here, naming the file, instead of
  // surfacing as non-finite logits or statistics after the work.
  const auto bad = std::find_if(m.data_.begin(), m.data_.end(), [](float x) { return !std::isfinite(x); });
  TRIATTN_CHECK(bad == m.data_.end(), api, path, ": weight ", bad - m.data_.begin(), " is ",
                bad == m.data_.end() ? 0.0f : *bad, ": weights must be finite");
  m.pack_matrices();
  return m;
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
  const char* api = "llama2c::tokenizer::load";
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
  TRIATTN_CHECK(token >= 0 && token < vocab_size(), "llama2c::tokenizer::decode", "token ", token,
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

/// Receives what the attention of every (layer, q-head) saw, once per token. For policies
/// that learn from attention (H2O, calibration of TriAttention).
struct observer {
  virtual ~observer() = default;
  /// `q_post_rope` [head_dim] is the query of the token at `position`; `probs` [length] are
  /// its softmax weights over the slots its kv head holds (the new token's slot last).
  virtual void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                            std::span<const float> probs) = 0;
};

namespace detail {

// The products run on AVX2 where the CPU has it, chosen when the program starts (GCC and
// Clang function multiversioning); the sums stay in run.c's order, so both clones give the
// same bits. Not AVX-512: it brings FMA, and GCC then fuses the multiply-adds, which rounds
// differently (the batched-decoding test sees it); for the same reason the programs that use
// the runner build with -ffp-contract=off (CMake target triattn_runner), whatever -march.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#define LLAMA2C_PRODUCT_CLONES __attribute__((target_clones("avx2", "default")))
#define LLAMA2C_AVX2_KERNEL 1
#else
#define LLAMA2C_PRODUCT_CLONES
#endif

inline constexpr int panel_rows = model::panel_rows;

// Writes a tile's accumulators acc[S][16] (sequence s, panel row r) to out [n, rows], leaving
// out the rows past the matrix.
template <int S>
inline void store_tile(float* out, const float (&acc)[S][panel_rows], int rows, int i0, int s0) {
  const int valid = std::min(panel_rows, rows - i0);
  for (int s = 0; s < S; ++s) std::copy_n(acc[s], valid, out + static_cast<std::ptrdiff_t>(s0 + s) * rows + i0);
}

// out(s, i) = Σ_j w[i][j] x[s][j] for the 16 rows of one panel (from row i0) and the S
// sequences from s0: each sum in float, a multiply then an add, in j order (run.c's bits, for
// any S, any tile, any thread).
template <int S>
inline void panel_tile(float* out, const float* panel, const float* x, int rows, int cols, int i0, int s0) {
  float acc[S][panel_rows] = {};
  for (int j = 0; j < cols; ++j) {
    const float* w = panel + static_cast<std::ptrdiff_t>(j) * panel_rows;
    for (int s = 0; s < S; ++s) {
      const float a = x[static_cast<std::ptrdiff_t>(s0 + s) * cols + j];
      for (int r = 0; r < panel_rows; ++r) acc[s][r] += w[r] * a;
    }
  }
  store_tile<S>(out, acc, rows, i0, s0);
}

#if LLAMA2C_AVX2_KERNEL
// acc_lo / acc_hi (the panel's rows 0-7 / 8-15) += w * x: a multiply then an add (AVX2 has no
// fused form, and the runner builds with -ffp-contract=off).
__attribute__((target("avx2"), always_inline)) inline void panel_step(__m256& lo, __m256& hi, __m256 w_lo, __m256 w_hi,
                                                                      const float* x) {
  const __m256 a = _mm256_broadcast_ss(x);
  lo = _mm256_add_ps(lo, _mm256_mul_ps(w_lo, a));
  hi = _mm256_add_ps(hi, _mm256_mul_ps(w_hi, a));
}

// The AVX2 twin of `panel_tile` for S <= 6: the panel's 16 rows in two registers, one
// broadcast of x per sequence, each lane summing in j order. The 2S accumulators are named
// variables: GCC keeps an array of them in registers too, but also stores it to the stack on
// every j (half the speed).
template <int S>
__attribute__((target("avx2"))) inline void panel_tile_avx2(float* out, const float* panel, const float* x, int rows,
                                                            int cols, int i0, int s0) {
  static_assert(S >= 1 && S <= 6);
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, b0 = z, a1 = z, b1 = z, a2 = z, b2 = z, a3 = z, b3 = z, a4 = z, b4 = z, a5 = z, b5 = z;
  const float* xs = x + static_cast<std::ptrdiff_t>(s0) * cols;
  const auto c = static_cast<std::ptrdiff_t>(cols);
  for (int j = 0; j < cols; ++j) {
    const float* w = panel + static_cast<std::ptrdiff_t>(j) * panel_rows;
    const __m256 lo = _mm256_loadu_ps(w), hi = _mm256_loadu_ps(w + 8);
    panel_step(a0, b0, lo, hi, xs + j);
    if constexpr (S > 1) panel_step(a1, b1, lo, hi, xs + c + j);
    if constexpr (S > 2) panel_step(a2, b2, lo, hi, xs + 2 * c + j);
    if constexpr (S > 3) panel_step(a3, b3, lo, hi, xs + 3 * c + j);
    if constexpr (S > 4) panel_step(a4, b4, lo, hi, xs + 4 * c + j);
    if constexpr (S > 5) panel_step(a5, b5, lo, hi, xs + 5 * c + j);
  }
  const __m256 acc[6][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  alignas(32) float lanes[S][panel_rows];
  for (int s = 0; s < S; ++s) {
    _mm256_store_ps(lanes[s], acc[s][0]);
    _mm256_store_ps(lanes[s] + 8, acc[s][1]);
  }
  store_tile<S>(out, lanes, rows, i0, s0);
}

__attribute__((target("avx2"))) inline void matmul_panels_avx2(float* out, const float* panels, const float* x,
                                                               int rows, int cols, int n, int p0, int p1) {
  for (int p = p0; p < p1; ++p) {
    const float* panel = panels + static_cast<std::ptrdiff_t>(p) * cols * panel_rows;
    const int i0 = p * panel_rows;
    // Tiles of 6 sequences (12 accumulators + 2 weights + 1 broadcast of the 16 ymm
    // registers), the rest in tiles of at least 3 where n allows: a tile of 1 or 2 has too
    // few independent sums to hide the adds' latency. 7 = 4 + 3, 8 = 4 + 4.
    const int rest = n % 6, whole = n / 6 - (rest > 0 && rest < 3 && n >= 6 ? 1 : 0);
    int s0 = 0;
    for (int k = 0; k < whole; ++k, s0 += 6) panel_tile_avx2<6>(out, panel, x, rows, cols, i0, s0);
    for (int left = n - s0; left > 0;) {
      const int take = left > 5 ? 4 : left;  // 7, 8: 4 first
      switch (take) {
        case 5: panel_tile_avx2<5>(out, panel, x, rows, cols, i0, s0); break;
        case 4: panel_tile_avx2<4>(out, panel, x, rows, cols, i0, s0); break;
        case 3: panel_tile_avx2<3>(out, panel, x, rows, cols, i0, s0); break;
        case 2: panel_tile_avx2<2>(out, panel, x, rows, cols, i0, s0); break;
        default: panel_tile_avx2<1>(out, panel, x, rows, cols, i0, s0); break;
      }
      s0 += take;
      left -= take;
    }
  }
}
#endif

// out [n, rows] = x [n, cols] · wᵀ for the panels [p0, p1) of w (model::panels): the rows
// [16 p0, 16 p1) of every sequence. Each out(s, i) = Σ_j w[i][j] x[s][j] accumulated in float
// in j order, as run.c's matvec: the same bits for any n, any split of the panels, any vector
// width.
inline void matmul_panels(float* out, const float* panels, const float* x, int rows, int cols, int n, int p0, int p1) {
#if LLAMA2C_AVX2_KERNEL
  if (__builtin_cpu_supports("avx2")) return matmul_panels_avx2(out, panels, x, rows, cols, n, p0, p1);
#endif
  for (int p = p0; p < p1; ++p) {
    const float* panel = panels + static_cast<std::ptrdiff_t>(p) * cols * panel_rows;
    int s0 = 0;
    for (; s0 + 4 <= n; s0 += 4) panel_tile<4>(out, panel, x, rows, cols, p * panel_rows, s0);
    for (; s0 < n; ++s0) panel_tile<1>(out, panel, x, rows, cols, p * panel_rows, s0);
  }
}

// att[t] = (q · k_t) / scale for the `len` keys at `keys` + t * `stride` (an f32 cache read in
// place). Eight keys at a time, each dot product summed in d order as run.c's: eight
// independent chains hide the latency of the adds, and every key gets run.c's bits.
inline void attention_logits(const float* q, const float* keys, std::int64_t stride, int hd, std::int32_t len,
                             float scale, float* att) {
  constexpr int block = 8;
  std::int32_t t = 0;
  for (; t + block <= len; t += block) {
    float acc[block] = {};
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    for (int d = 0; d < hd; ++d)
      for (int i = 0; i < block; ++i) acc[i] += q[d] * k[static_cast<std::ptrdiff_t>(i) * stride + d];
    for (int i = 0; i < block; ++i) att[t + i] = acc[i] / scale;
  }
  for (; t < len; ++t) {
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    float dot = 0.0f;
    for (int d = 0; d < hd; ++d) dot += q[d] * k[d];
    att[t] = dot / scale;
  }
}

// out[d] = Σ_t att[t] v_t[d] for the `len` values at `values` + t * `stride`, summed in t order
// as run.c's (from 0, a multiply then an add).
inline void attention_values(const float* att, const float* values, std::int64_t stride, int hd, std::int32_t len,
                             float* out) {
  std::fill_n(out, hd, 0.0f);
  for (std::int32_t t = 0; t < len; ++t) {
    const float* v = values + static_cast<std::ptrdiff_t>(t) * stride;
    for (int d = 0; d < hd; ++d) out[d] += att[t] * v[d];
  }
}

#if LLAMA2C_AVX2_KERNEL
// r[i] (8 floats of key i) -> r[j] (dim j of the 8 keys).
__attribute__((target("avx2"), always_inline)) inline void transpose8(__m256& r0, __m256& r1, __m256& r2, __m256& r3,
                                                                      __m256& r4, __m256& r5, __m256& r6, __m256& r7) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r0 = _mm256_permute2f128_ps(u0, u4, 0x20);
  r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
  r2 = _mm256_permute2f128_ps(u2, u6, 0x20);
  r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
  r4 = _mm256_permute2f128_ps(u0, u4, 0x31);
  r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
  r6 = _mm256_permute2f128_ps(u2, u6, 0x31);
  r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// acc (8 keys) += q[j] * c_j for the 8 dims of a transposed block, in d order.
__attribute__((target("avx2"), always_inline)) inline __m256 dot_block(__m256 acc, const float* q, __m256 c0, __m256 c1,
                                                                       __m256 c2, __m256 c3, __m256 c4, __m256 c5,
                                                                       __m256 c6, __m256 c7) {
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q), c0));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 1), c1));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 2), c2));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 3), c3));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 4), c4));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 5), c5));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 6), c6));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 7), c7));
}

// `attention_logits` for up to 4 queries (q + i * hd, i < nq: a GQA group) that read the same
// keys, head_dim a multiple of 8: each block of 8 keys x 8 dims is loaded and transposed once
// for every query, and each lane sums one key's dot product in d order (run.c's bits).
// att + i * att_stride is query i's row.
__attribute__((target("avx2"))) inline void attention_logits_avx2(const float* q, int nq, const float* keys,
                                                                  std::int64_t stride, int hd, std::int32_t len,
                                                                  float scale, float* att, std::int64_t att_stride) {
  const __m256 z = _mm256_setzero_ps(), div = _mm256_set1_ps(scale);
  const std::int32_t whole = len / 8 * 8;
  for (std::int32_t t = 0; t < whole; t += 8) {
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    __m256 a0 = z, a1 = z, a2 = z, a3 = z;
    for (int d0 = 0; d0 < hd; d0 += 8) {
      __m256 r0 = _mm256_loadu_ps(k + d0), r1 = _mm256_loadu_ps(k + stride + d0),
             r2 = _mm256_loadu_ps(k + 2 * stride + d0), r3 = _mm256_loadu_ps(k + 3 * stride + d0),
             r4 = _mm256_loadu_ps(k + 4 * stride + d0), r5 = _mm256_loadu_ps(k + 5 * stride + d0),
             r6 = _mm256_loadu_ps(k + 6 * stride + d0), r7 = _mm256_loadu_ps(k + 7 * stride + d0);
      transpose8(r0, r1, r2, r3, r4, r5, r6, r7);
      a0 = dot_block(a0, q + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 1) a1 = dot_block(a1, q + hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 2) a2 = dot_block(a2, q + 2 * hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 3) a3 = dot_block(a3, q + 3 * hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
    }
    _mm256_storeu_ps(att + t, _mm256_div_ps(a0, div));
    if (nq > 1) _mm256_storeu_ps(att + att_stride + t, _mm256_div_ps(a1, div));
    if (nq > 2) _mm256_storeu_ps(att + 2 * att_stride + t, _mm256_div_ps(a2, div));
    if (nq > 3) _mm256_storeu_ps(att + 3 * att_stride + t, _mm256_div_ps(a3, div));
  }
  for (int i = 0; i < nq; ++i)
    attention_logits(q + static_cast<std::ptrdiff_t>(i) * hd, keys + static_cast<std::ptrdiff_t>(whole) * stride, stride,
                     hd, len - whole, scale, att + i * att_stride + whole);
}

// acc_k += a * v[8k..8k+8) for the V vectors of one value row.
template <int V>
__attribute__((target("avx2"), always_inline)) inline void value_step(__m256 (&acc)[8], __m256 a, const float* v) {
  if constexpr (V > 0) acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(a, _mm256_loadu_ps(v)));
  if constexpr (V > 1) acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(a, _mm256_loadu_ps(v + 8)));
  if constexpr (V > 2) acc[2] = _mm256_add_ps(acc[2], _mm256_mul_ps(a, _mm256_loadu_ps(v + 16)));
  if constexpr (V > 3) acc[3] = _mm256_add_ps(acc[3], _mm256_mul_ps(a, _mm256_loadu_ps(v + 24)));
  if constexpr (V > 4) acc[4] = _mm256_add_ps(acc[4], _mm256_mul_ps(a, _mm256_loadu_ps(v + 32)));
  if constexpr (V > 5) acc[5] = _mm256_add_ps(acc[5], _mm256_mul_ps(a, _mm256_loadu_ps(v + 40)));
  if constexpr (V > 6) acc[6] = _mm256_add_ps(acc[6], _mm256_mul_ps(a, _mm256_loadu_ps(v + 48)));
  if constexpr (V > 7) acc[7] = _mm256_add_ps(acc[7], _mm256_mul_ps(a, _mm256_loadu_ps(v + 56)));
}

// `attention_values` for dims [d0, d0 + 8V) (V <= 8 vectors in registers), each lane summing
// in t order.
template <int V>
__attribute__((target("avx2"))) inline void attention_values_avx2(const float* att, const float* values,
                                                                   std::int64_t stride, std::int32_t len, float* out) {
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (std::int32_t t = 0; t < len; ++t)
    value_step<V>(acc, _mm256_broadcast_ss(att + t), values + static_cast<std::ptrdiff_t>(t) * stride);
  for (int k = 0; k < V; ++k) _mm256_storeu_ps(out + 8 * k, acc[k]);
}

__attribute__((target("avx2"))) inline void attention_values_avx2(const float* att, const float* values,
                                                                   std::int64_t stride, int hd, std::int32_t len,
                                                                   float* out) {
  for (int d0 = 0; d0 < hd; d0 += 64) {
    const float* v = values + d0;
    switch (std::min(8, (hd - d0) / 8)) {
      case 8: attention_values_avx2<8>(att, v, stride, len, out + d0); break;
      case 7: attention_values_avx2<7>(att, v, stride, len, out + d0); break;
      case 6: attention_values_avx2<6>(att, v, stride, len, out + d0); break;
      case 5: attention_values_avx2<5>(att, v, stride, len, out + d0); break;
      case 4: attention_values_avx2<4>(att, v, stride, len, out + d0); break;
      case 3: attention_values_avx2<3>(att, v, stride, len, out + d0); break;
      case 2: attention_values_avx2<2>(att, v, stride, len, out + d0); break;
      default: attention_values_avx2<1>(att, v, stride, len, out + d0); break;
    }
  }
}
#endif

// The logits of the `nq` queries at q (q + i * hd) that read the same f32 keys: row i at
// att + i * att_stride. The AVX2 kernel where the CPU has it and head_dim is a multiple of 8.
inline void group_logits(const float* q, int nq, const float* keys, std::int64_t stride, int hd, std::int32_t len,
                         float scale, float* att, std::int64_t att_stride) {
#if LLAMA2C_AVX2_KERNEL
  if (hd % 8 == 0 && __builtin_cpu_supports("avx2")) {
    for (int i = 0; i < nq; i += 4)
      attention_logits_avx2(q + static_cast<std::ptrdiff_t>(i) * hd, std::min(4, nq - i), keys, stride, hd, len, scale,
                            att + i * att_stride, att_stride);
    return;
  }
#endif
  for (int i = 0; i < nq; ++i)
    attention_logits(q + static_cast<std::ptrdiff_t>(i) * hd, keys, stride, hd, len, scale, att + i * att_stride);
}

// `attention_values` with the AVX2 kernel where the CPU has it and head_dim is a multiple of 8.
inline void values_sum(const float* att, const float* values, std::int64_t stride, int hd, std::int32_t len,
                       float* out) {
#if LLAMA2C_AVX2_KERNEL
  if (hd % 8 == 0 && __builtin_cpu_supports("avx2")) return attention_values_avx2(att, values, stride, hd, len, out);
#endif
  attention_values(att, values, stride, hd, len, out);
}

// RoPE at one position, its cos and sin per band computed once and applied to every head of
// every layer: triattn::rope_rotate's phases and roundings (the same bits) without its
// trigonometry per head.
struct position_rotation {
  std::vector<double> c, s;  // [bands]: cos(phase) x scale, sin(phase) x scale
  triattn::rope_style style = triattn::rope_style::half;
  int dim = 0;

  void set(const triattn::rope_desc& r, int head_dim, std::int32_t pos) {
    dim = triattn::rotary_dims(r, head_dim);
    style = r.style;
    c.resize(static_cast<std::size_t>(dim / 2));
    s.resize(c.size());
    for (int f = 0; f < dim / 2; ++f) {
      const double phase = static_cast<double>(pos) * triattn::inv_freq(r, dim, f);
      c[static_cast<std::size_t>(f)] = std::cos(phase) * r.attention_scale;
      s[static_cast<std::size_t>(f)] = std::sin(phase) * r.attention_scale;
    }
  }
  void apply(float* x) const {
    for (int f = 0; f < dim / 2; ++f) {
      int re, im;
      triattn::rope_band_dims(style, dim, f, re, im);
      triattn::rotate_band_cs(x, re, im, c[static_cast<std::size_t>(f)], s[static_cast<std::size_t>(f)]);
    }
  }
};

inline void rmsnorm(float* out, const float* x, const float* gain, int n, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = gain[i] * (ss * x[i]);
}

inline void softmax(float* x, std::int64_t n) {
  const float max = *std::max_element(x, x + n);
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  for (std::int64_t i = 0; i < n; ++i) x[i] /= sum;
}

}  // namespace detail

/// A fixed team of threads for one batch's forward: `run(f)` calls f(member) on every member
/// and returns when all are done. The calling thread is member 0; the others wait between
/// calls by spinning (yielding the CPU every few iterations) for a few milliseconds, then on a
/// futex: a forward makes hundreds of calls, and a futex wake-up costs tens of microseconds
/// on a virtual machine (measured: 15-20 % of a batched step); the yields keep a team from
/// starving other programs when the cores are oversubscribed. No thread is started for a
/// team of one.
class thread_team {
 public:
  explicit thread_team(int threads = 1) {
    TRIATTN_CHECK(threads >= 1 && threads <= 1024, "llama2c::thread_team", "threads ", threads, " must be in [1, 1024]");
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  thread_team(const thread_team&) = delete;
  thread_team& operator=(const thread_team&) = delete;
  ~thread_team() {
    stop_ = true;
    generation_.fetch_add(1);
    generation_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// f(member) for every member in [0, size()); rethrows the first exception one threw.
  void run(const std::function<void(int)>& f) {
    if (workers_.empty()) return f(0);
    job_ = &f;
    error_ = nullptr;
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1);
    generation_.notify_all();
    call(0);
    for (int spin = 0; pending_.load() != 0; ++spin) {
      if (spin < spin_limit) {
        pause(spin);
        continue;
      }
      const int left = pending_.load();
      if (left != 0) pending_.wait(left);
    }
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  /// f(i) for every i in [0, count), item i on member i % size().
  void for_each(std::size_t count, const std::function<void(std::size_t)>& f) {
    const auto members = static_cast<std::size_t>(size());
    run([&](int t) {
      for (std::size_t i = static_cast<std::size_t>(t); i < count; i += members) f(i);
    });
  }

 private:
  static constexpr int spin_limit = 1 << 18;
  static void pause(int spin) {
    if (spin % 64 == 63) std::this_thread::yield();
  }

  void call(int t) {
    try {
      (*job_)(t);
    } catch (...) {
      const std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
  void work(int t) {
    unsigned seen = 0;
    for (;;) {
      for (int spin = 0; generation_.load() == seen; ++spin) {
        if (spin >= spin_limit) generation_.wait(seen);
        pause(spin);
      }
      seen = generation_.load();
      if (stop_) return;
      call(t);
      if (pending_.fetch_sub(1) == 1) pending_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

/// Activations of a batch of `n` sequences, row s for sequence s, allocated once and reused.
struct forward_buffers {
  int n = 0;
  std::vector<float> x, xb, xb2, q, k, v, hb, hb2, logits;  // [n, dim] x4, [n, kv_dim] x2, [n, hidden] x2, [n, vocab]
  std::vector<std::vector<float>> att, row;                  // per team member: [group, capacity], [head_dim]
  std::vector<detail::position_rotation> rope;               // [n]: each sequence's RoPE at its position

  void reserve(const config& c, int batch, std::int64_t capacity, int members) {
    const auto b = static_cast<std::size_t>(batch);
    if (batch != n) {
      n = batch;
      for (auto* buf : {&x, &xb, &xb2, &q}) buf->resize(b * static_cast<std::size_t>(c.dim));
      k.resize(b * static_cast<std::size_t>(c.kv_dim));
      v.resize(k.size());
      hb.resize(b * static_cast<std::size_t>(c.hidden_dim));
      hb2.resize(hb.size());
      logits.resize(b * static_cast<std::size_t>(c.vocab_size));
      rope.resize(b);
    }
    att.resize(static_cast<std::size_t>(members));
    row.resize(att.size());
    const auto group_slots = static_cast<std::size_t>(c.n_heads / c.n_kv_heads) * static_cast<std::size_t>(capacity);
    for (std::size_t t = 0; t < att.size(); ++t) {
      if (att[t].size() < group_slots) att[t].resize(group_slots);
      row[t].resize(static_cast<std::size_t>(c.head_dim));
    }
  }
};

class session;
/// Runs `tokens[s]` through `sessions[s]` for every s, all of model `m`, sharing each read of
/// the weights; logits land in `b.logits` [n, vocab] when `logits` (else they are not
/// computed). The work is split over `team`'s threads: each product by panels of output rows,
/// the attention by sequences, so every value is computed by one thread exactly as alone.
/// Throws `triattn::error` naming `api`, with every session unchanged, for a token out of
/// range, a full cache, or another model.
inline void forward(const model& m, std::span<session* const> sessions, std::span<const int> tokens,
                    forward_buffers& b, thread_team& team, bool logits, const char* api);

/// One sequence: its KV cache and the forward pass. The model must outlive the session.
///
/// The cache holds `capacity` slots per (layer, kv_head). `forward` appends the token's K and
/// V to every (layer, kv_head) and attends over the slots each kv head holds, so a compressed
/// cache (through `view()`, with any triattn policy) is used as it is, per head.
class session {
 public:
  /// `cache_type`: how K and V are stored (f32, f16 or bf16); attention reads them back as f32.
  session(const llama2c::model& m, std::int64_t capacity, triattn::dtype cache_type = triattn::dtype::f32);
  session(const session&) = delete;  // view() hands out pointers into this object
  session& operator=(const session&) = delete;
  session(session&&) noexcept = default;  // the cache's heap buffers, and so the view's pointers, move along
  session& operator=(session&&) noexcept = default;

  /// Runs `token` at position `position()`, appends its post-RoPE K and V, and returns the
  /// logits [vocab] (valid until the next call). Throws `triattn::error`, with the session
  /// unchanged, when a (layer, kv_head) is full or the token is out of range.
  std::span<const float> forward(int token) {
    session* self = this;
    thread_team solo(1);
    llama2c::forward(*model_, {&self, 1}, {&token, 1}, buffers_, solo, true, "llama2c::session::forward");
    return buffers_.logits;
  }

  /// The cache as a triattn view (NHD, post-RoPE keys, the model's RoPE).
  triattn::dense_kv_view view() {
    triattn::dense_kv_view v;
    v.geo = geometry_;
    v.k_layers = k_bases_.data();
    v.v_layers = v_bases_.data();
    v.k_stride = v.v_stride = triattn::kv_strides::nhd(cfg_.n_kv_heads, cfg_.head_dim);
    v.slots = {lengths_.data(), positions_.data(), capacity_};
    return v;
  }

  const llama2c::model& model() const { return *model_; }
  /// Slots held by (layer, kv_head).
  std::int32_t length(int layer, int kv_head) const { return lengths_[slot_row(layer, kv_head)]; }
  /// The token position held by slot `s` of (layer, kv_head).
  std::int32_t slot_position(int layer, int kv_head, std::int64_t s) const {
    return positions_[slot_row(layer, kv_head) * static_cast<std::size_t>(capacity_) + static_cast<std::size_t>(s)];
  }
  std::int64_t capacity() const { return capacity_; }
  /// Tokens processed so far: the position of the next token.
  std::int64_t position() const { return position_; }
  /// K and V bytes the cache holds now.
  std::int64_t kv_bytes() const {
    std::int64_t slots = 0;
    for (const std::int32_t n : lengths_) slots += n;
    return slots * row_bytes();
  }
  /// K and V bytes of an uncompressed cache of `tokens` tokens.
  std::int64_t full_kv_bytes(std::int64_t tokens) const {
    return tokens * cfg_.n_layers * cfg_.n_kv_heads * row_bytes();
  }

  /// Calls `o` (nullptr: nobody) for every (layer, q-head) of every forward.
  void set_observer(observer* o) { observer_ = o; }
  /// Empties the cache; the next token is at position 0.
  void reset() {
    std::fill(lengths_.begin(), lengths_.end(), 0);
    position_ = 0;
  }

  /// Makes this session a copy of `other` (same model and cache type; its slots must fit this
  /// capacity): every slot's K, V and position, the lengths and the next position. The
  /// observer stays. A sequence can thus branch off another where they part.
  void copy_from(const session& other) {
    const char* api = "llama2c::session::copy_from";
    TRIATTN_CHECK(other.model_ == model_ && other.geometry_.type == geometry_.type, api,
                  "the sessions differ in model or cache type");
    const std::int32_t longest = *std::max_element(other.lengths_.begin(), other.lengths_.end());
    TRIATTN_CHECK(longest <= capacity_, api, "the other session holds ", longest, " slots, this one has room for ",
                  capacity_);
    // [layers, capacity, kv_heads, head_dim]: a layer's first `longest` slots are one run
    const std::size_t slot_bytes = static_cast<std::size_t>(cfg_.n_kv_heads) * static_cast<std::size_t>(cfg_.head_dim) *
                                   triattn::dtype_bytes(geometry_.type);
    for (int l = 0; l < cfg_.n_layers; ++l) {
      std::memcpy(k_bases_[static_cast<std::size_t>(l)], other.k_bases_[static_cast<std::size_t>(l)], static_cast<std::size_t>(longest) * slot_bytes);
      std::memcpy(v_bases_[static_cast<std::size_t>(l)], other.v_bases_[static_cast<std::size_t>(l)], static_cast<std::size_t>(longest) * slot_bytes);
      for (int g = 0; g < cfg_.n_kv_heads; ++g)
        std::copy_n(other.positions_.begin() + static_cast<std::ptrdiff_t>(other.slot_row(l, g) * static_cast<std::size_t>(other.capacity_)),
                    other.length(l, g), positions_.begin() + static_cast<std::ptrdiff_t>(slot_row(l, g) * static_cast<std::size_t>(capacity_)));
    }
    lengths_ = other.lengths_;
    position_ = other.position_;
  }

 private:
  friend void forward(const llama2c::model&, std::span<session* const>, std::span<const int>, forward_buffers&,
                      thread_team&, bool, const char*);

  std::size_t slot_row(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(cfg_.n_kv_heads) +
           static_cast<std::size_t>(kv_head);
  }
  // K and V of one slot of one head.
  std::int64_t row_bytes() const {
    return std::int64_t{cfg_.head_dim} * 2 * static_cast<std::int64_t>(triattn::dtype_bytes(geometry_.type));
  }
  // Checks that one more token fits (see forward()).
  void check_room(const char* api) const {
    TRIATTN_CHECK(position_ < std::numeric_limits<std::int32_t>::max(), api, "position ", position_,
                  " does not fit the cache's int32 positions");
    for (int l = 0; l < cfg_.n_layers; ++l)
      for (int g = 0; g < cfg_.n_kv_heads; ++g)
        TRIATTN_CHECK(length(l, g) < capacity_, api, "cache full: layer ", l, " kv_head ", g, " holds all ", capacity_,
                      " slots; compress it or make the session larger");
  }

  const llama2c::model* model_;
  llama2c::config cfg_;
  triattn::kv_geometry geometry_;
  std::int64_t capacity_;
  std::int64_t position_ = 0;
  std::vector<std::byte> k_cache_, v_cache_;  // [layers, capacity, kv_heads, head_dim] elements of geometry_.type
  std::vector<std::int32_t> lengths_;         // [layers, kv_heads]
  std::vector<std::int32_t> positions_;       // [layers, kv_heads, capacity]
  std::vector<std::byte*> k_bases_, v_bases_;  // [layers] what the view's k_layers / v_layers point at
  forward_buffers buffers_;                    // for forward(): a batch of one
  observer* observer_ = nullptr;
};

inline session::session(const llama2c::model& m, std::int64_t capacity, triattn::dtype cache_type)
    : model_(&m), cfg_(m.config()), capacity_(capacity) {
  const char* api = "llama2c::session";
  TRIATTN_CHECK(capacity >= 1 && capacity <= std::numeric_limits<std::int32_t>::max(), api, "capacity ", capacity,
                " must be in [1, 2^31)");
  TRIATTN_CHECK(cache_type == triattn::dtype::f32 || cache_type == triattn::dtype::f16 ||
                    cache_type == triattn::dtype::bf16,
                api, "cache type ", triattn::dtype_name(cache_type), " is not f32, f16 or bf16");
  geometry_.num_layers = cfg_.n_layers;
  geometry_.num_q_heads = cfg_.n_heads;
  geometry_.num_kv_heads = cfg_.n_kv_heads;
  geometry_.head_dim = cfg_.head_dim;
  geometry_.type = cache_type;
  geometry_.keys = triattn::key_state::post_rope;
  geometry_.rope = cfg_.rope;

  const auto layers = static_cast<std::size_t>(cfg_.n_layers);
  const auto heads = static_cast<std::size_t>(cfg_.n_kv_heads);
  const auto cap = static_cast<std::size_t>(capacity);
  const std::size_t layer_bytes = cap * heads * static_cast<std::size_t>(cfg_.head_dim) * triattn::dtype_bytes(cache_type);
  k_cache_.resize(layers * layer_bytes);
  v_cache_.resize(k_cache_.size());
  lengths_.assign(layers * heads, 0);
  positions_.assign(layers * heads * cap, 0);
  for (std::size_t l = 0; l < layers; ++l) {
    k_bases_.push_back(k_cache_.data() + l * layer_bytes);
    v_bases_.push_back(v_cache_.data() + l * layer_bytes);
  }
}

inline void forward(const model& m, std::span<session* const> sessions, std::span<const int> tokens,
                    forward_buffers& b, thread_team& team, bool logits, const char* api) {
  const config& c = m.config();
  TRIATTN_CHECK(sessions.size() == tokens.size() && !sessions.empty(), api, sessions.size(), " sessions and ",
                tokens.size(), " tokens");
  TRIATTN_CHECK(sessions.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()), api, sessions.size(),
                " sessions");
  std::int64_t capacity = 0;
  for (std::size_t i = 0; i < sessions.size(); ++i) {
    TRIATTN_CHECK(sessions[i] != nullptr && sessions[i]->model_ == &m, api, "session ", i,
                  " is null or of another model");
    TRIATTN_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size, api, "token ", tokens[i], " is outside [0, vocab_size ",
                  c.vocab_size, ")");
    for (std::size_t j = 0; j < i; ++j)
      TRIATTN_CHECK(sessions[j] != sessions[i], api, "session ", i, " is also session ", j);
    sessions[i]->check_room(api);
    capacity = std::max(capacity, sessions[i]->capacity_);
  }
  const int n = static_cast<int>(sessions.size()), members = team.size();
  b.reserve(c, n, capacity, members);

  const int dim = c.dim, kv_dim = c.kv_dim, hidden = c.hidden_dim, hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  const auto row = [](std::vector<float>& buf, int s, int width) { return buf.data() + std::ptrdiff_t{s} * width; };
  // run.c divides by sqrtf(head_size); dividing (not multiplying by the reciprocal) keeps its bits.
  const float scale = std::sqrt(static_cast<float>(hd));
  // out = x · wᵀ for member t's share of the panels of matrix `w` of layer l.
  const auto product = [&](int t, float* out, tensor w, int l, const float* x) {
    const auto [rows, cols] = m.matrix_shape(w);
    const int panels = (rows + model::panel_rows - 1) / model::panel_rows;
    detail::matmul_panels(out, m.panels(w, l).data(), x, rows, cols, n, panels * t / members, panels * (t + 1) / members);
  };
  for (int s = 0; s < n; ++s) {
    std::copy_n(m.weights(tensor::token_embedding).data() + static_cast<std::ptrdiff_t>(tokens[s]) * dim, dim,
                row(b.x, s, dim));
    b.rope[static_cast<std::size_t>(s)].set(c.rope, hd, static_cast<std::int32_t>(sessions[static_cast<std::size_t>(s)]->position_));
  }

  for (int l = 0; l < c.n_layers; ++l) {
    for (int s = 0; s < n; ++s)
      detail::rmsnorm(row(b.xb, s, dim), row(b.x, s, dim), m.weights(tensor::rms_att, l).data(), dim, c.rms_eps);
    team.run([&](int t) {
      product(t, b.q.data(), tensor::wq, l, b.xb.data());
      product(t, b.k.data(), tensor::wk, l, b.xb.data());
      product(t, b.v.data(), tensor::wv, l, b.xb.data());
    });

    // Attention, a sequence per member at a time (its observer is called from that member only).
    team.for_each(static_cast<std::size_t>(n), [&](std::size_t si) {
      const auto s = static_cast<int>(si);
      const int t = static_cast<int>(si % static_cast<std::size_t>(members));
      session& se = *sessions[si];
      const triattn::dense_kv_view view = se.view();
      const auto pos = static_cast<std::int32_t>(se.position_);
      float* q_all = row(b.q, s, dim);
      const detail::position_rotation& rope = b.rope[si];
      for (int h = 0; h < c.n_heads; ++h) rope.apply(q_all + h * hd);
      for (int g = 0; g < c.n_kv_heads; ++g) {
        float* k = row(b.k, s, kv_dim) + g * hd;
        rope.apply(k);
        const std::int32_t slot = se.lengths_[se.slot_row(l, g)]++;
        triattn::store_key(view, l, g, slot, k);
        triattn::store_value(view, l, g, slot, row(b.v, s, kv_dim) + g * hd);
        view.position(l, g, slot) = pos;
      }

      // The q-heads of kv head g read its slots. An f32 cache is read in place, the group's
      // logits together; others are decoded a row at a time.
      const bool f32 = view.geometry().type == triattn::dtype::f32;
      float* key = b.row[static_cast<std::size_t>(t)].data();
      float* att_all = b.att[static_cast<std::size_t>(t)].data();  // [group, capacity]
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const std::int32_t len = se.length(l, g);
        const float* q_group = q_all + g * group * hd;
        if (f32) {
          detail::group_logits(q_group, group, reinterpret_cast<const float*>(view.key(l, g, 0)), view.k_stride.token, hd,
                               len, scale, att_all, capacity);
        } else {
          for (int i = 0; i < group; ++i)
            for (std::int32_t j = 0; j < len; ++j) {
              triattn::load_key(view, l, g, j, key);
              float dot = 0.0f;
              for (int d = 0; d < hd; ++d) dot += q_group[i * hd + d] * key[d];
              att_all[i * capacity + j] = dot / scale;
            }
        }
        for (int i = 0; i < group; ++i) {
          const int h = g * group + i;
          float* att = att_all + i * capacity;
          detail::softmax(att, len);
          if (se.observer_ != nullptr)
            se.observer_->on_attention(l, h, pos, {q_all + h * hd, static_cast<std::size_t>(hd)},
                                       {att, static_cast<std::size_t>(len)});
          float* out = row(b.xb, s, dim) + h * hd;
          if (f32) {
            detail::values_sum(att, reinterpret_cast<const float*>(view.value(l, g, 0)), view.v_stride.token, hd, len, out);
          } else {
            std::fill_n(out, hd, 0.0f);
            for (std::int32_t j = 0; j < len; ++j) {
              triattn::load_value(view, l, g, j, key);
              for (int d = 0; d < hd; ++d) out[d] += att[j] * key[d];
            }
          }
        }
      }
    });
    team.run([&](int t) { product(t, b.xb2.data(), tensor::wo, l, b.xb.data()); });
    for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] += b.xb2[i];

    // Feed-forward: w2 (silu(w1 x) * (w3 x)); each member gates the hidden rows it computed.
    for (int s = 0; s < n; ++s)
      detail::rmsnorm(row(b.xb, s, dim), row(b.x, s, dim), m.weights(tensor::rms_ffn, l).data(), dim, c.rms_eps);
    team.run([&](int t) {
      product(t, b.hb.data(), tensor::w1, l, b.xb.data());
      product(t, b.hb2.data(), tensor::w3, l, b.xb.data());
      const int panels = (hidden + model::panel_rows - 1) / model::panel_rows;
      const int i0 = panels * t / members * model::panel_rows;
      const int i1 = std::min(hidden, panels * (t + 1) / members * model::panel_rows);
      for (int s = 0; s < n; ++s) {
        float* h1 = row(b.hb, s, hidden);
        const float* h3 = row(b.hb2, s, hidden);
        for (int i = i0; i < i1; ++i) h1[i] = h1[i] * (1.0f / (1.0f + std::exp(-h1[i]))) * h3[i];
      }
    });
    team.run([&](int t) { product(t, b.xb.data(), tensor::w2, l, b.hb.data()); });
    for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] += b.xb[i];
  }
  if (logits) {
    for (int s = 0; s < n; ++s)
      detail::rmsnorm(row(b.x, s, dim), row(b.x, s, dim), m.weights(tensor::rms_final).data(), dim, c.rms_eps);
    team.run([&](int t) { product(t, b.logits.data(), tensor::wcls, 0, b.x.data()); });
  }
  for (session* se : sessions) ++se->position_;
}

/// Decodes several sessions of one model together: each `step` advances every session by one
/// token and reads the weights once for all of them (matrix-matrix products), split over
/// `threads` threads. A session's logits are the same bits as its own `forward` would give,
/// in any batch and at any thread count.
class batch_decoder {
 public:
  explicit batch_decoder(const llama2c::model& m, int threads = 1) : model_(&m), team_(threads) {}

  /// Runs `tokens[s]` through `*sessions[s]` for every s (distinct sessions of this model) and
  /// returns the logits [n, vocab], row s for session s (valid until the next step); with
  /// `logits` false (a prefill that reads none) the classifier is skipped and the span is
  /// empty. Throws `triattn::error`, with every session unchanged, when a token is out of range
  /// or a cache full.
  std::span<const float> step(std::span<session* const> sessions, std::span<const int> tokens, bool logits = true) {
    forward(*model_, sessions, tokens, buffers_, team_, logits, "llama2c::batch_decoder::step");
    if (!logits) return {};
    return std::span<const float>(buffers_.logits).first(sessions.size() * static_cast<std::size_t>(model_->config().vocab_size));
  }
  /// Row s of the last step's logits [vocab].
  std::span<const float> logits(int s) const {
    const auto v = static_cast<std::size_t>(model_->config().vocab_size);
    return std::span<const float>(buffers_.logits).subspan(static_cast<std::size_t>(s) * v, v);
  }
  /// The decoder's threads, for the caller's own per-sequence work between steps.
  thread_team& team() { return team_; }

 private:
  const llama2c::model* model_;
  forward_buffers buffers_;
  thread_team team_;
};

/// Index of the largest logit; the first one on ties, as run.c's argmax.
inline int argmax(std::span<const float> logits) {
  return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// KL(p || q) in nats between the softmax distributions of two logit vectors, in double.
inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  TRIATTN_CHECK(p_logits.size() == q_logits.size() && !p_logits.empty(), "llama2c::kl_divergence", "logit vectors of ",
                p_logits.size(), " and ", q_logits.size(), " entries");
  // log-sum-exp of each vector, then Σ p_i (log p_i - log q_i) with no buffer.
  const auto lse = [](std::span<const float> z) {
    const double max = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (const float v : z) sum += std::exp(v - max);
    return max + std::log(sum);
  };
  const double lp = lse(p_logits), lq = lse(q_logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < p_logits.size(); ++i) {
    const double log_p = p_logits[i] - lp;
    kl += std::exp(log_p) * (log_p - (q_logits[i] - lq));
  }
  return kl;
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
  const char* api = "llama2c::text_windows";
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

}  // namespace llama2c
