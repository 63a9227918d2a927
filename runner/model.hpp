/// \file runner/model.hpp
/// \brief The llama2.c model: its checkpoint header (`config`), its tensors and weights, loaded from a llama2.c
/// version-0 checkpoint (stories260K here) or filled by `gguf_model.hpp` from GGUF, as f32 or, for
/// the matrices, in the file's own block format (`block_matrix`).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "triattn/core/error.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/value_weighting.hpp"

namespace triattn_runner {

static_assert(std::endian::native == std::endian::little, "triattn_runner: checkpoints are little-endian files");

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
  bool qkv_bias = false;          ///< Q, K and V add a bias (Qwen2); llama2.c and Llama have none
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
  bq,               ///< [layers][dim] Q bias (config::qkv_bias; empty otherwise)
  bk,               ///< [layers][kv_dim] K bias
  bv,               ///< [layers][kv_dim] V bias
};
inline constexpr std::size_t tensor_count = 17;

/// A matrix kept in a GGUF file's own block format (Q4_K, Q6_K, ...) and multiplied by ggml's CPU
/// kernels: each input row is quantised once to the kernel's input format, then every weight
/// row is dotted with it. `gguf_model.hpp` fills the function pointers from ggml's type traits,
/// so that the runner's other headers need no ggml. A 1.5B model stays ~1 GB instead of 6 GB of
/// f32, and its products read a quarter of the bytes.
struct block_matrix {
  void (*to_float)(const void* row, float* out, std::int64_t n) = nullptr;     ///< a weight row to f32
  void (*quantize_input)(const float* x, void* out, std::int64_t n) = nullptr;  ///< an input row to vec_dot's format
  /// ggml_vec_dot_t: *s = the dot product of n elements of rows x (weights) and y (input).
  void (*vec_dot)(int n, float* s, std::size_t bs, const void* x, std::size_t bx, const void* y, std::size_t by,
                  int nrc) = nullptr;
  std::size_t row_bytes = 0;        ///< one weight row
  std::size_t input_row_bytes = 0;  ///< one input row in vec_dot's format
  std::vector<std::byte> bytes;     ///< [rows][row_bytes]: one layer's matrix (layers may differ in format)
};


/// Floats per slice (`per_slice`) and slices (`slices`: 1, or one per layer) of every tensor,
/// in file order. Counted in double: exact below 2^53, and a header implying more than that
/// cannot match any real file size. `freq_tables`: whether the legacy RoPE tables are stored.
/// A tensor held as a `block_matrix` is left out of the f32 data (`per_slice` 0).
struct tensor_layout {
  std::array<double, tensor_count> per_slice{};
  std::array<double, tensor_count> slices{};

  tensor_layout(const config& c, bool freq_tables) {
    const double d = c.dim, hidden = c.hidden_dim, kv = c.kv_dim, layers = c.n_layers, vocab = c.vocab_size;
    const double freqs = freq_tables ? static_cast<double>(c.seq_len) * (c.head_dim / 2) : 0.0;
    const double bias = c.qkv_bias ? 1.0 : 0.0;
    per_slice = {vocab * d,                              // token_embedding
                 d, d * d, kv * d, kv * d, d * d, d,     // rms_att, wq, wk, wv, wo, rms_ffn
                 hidden * d, d * hidden, hidden * d,     // w1, w2, w3
                 d, freqs, freqs,                        // rms_final, freq_cis_real, freq_cis_imag
                 c.shared_classifier ? 0.0 : vocab * d,  // wcls
                 bias * d, bias * kv, bias * kv};        // bq, bk, bv
    slices = {1, layers, layers, layers, layers, layers, layers, layers, layers, layers, 1, 1, 1, 1, layers, layers, layers};
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
  /// RoPE tables): what a loader of another format builds. The matrices (and the token
  /// embedding) in `blocks` are kept in their block format, one `block_matrix` per layer, and
  /// left out of `data`. Throws when `data` or a block matrix has another size.
  static model from_tensors(const triattn_runner::config& c, std::vector<float> data,
                            std::vector<std::pair<tensor, std::vector<block_matrix>>> blocks = {}) {
    const char* api = "triattn_runner::model::from_tensors";
    model m;
    m.config_ = c;
    tensor_layout layout(c, false);
    for (auto& [t, slices] : blocks) {
      const auto i = static_cast<std::size_t>(t);
      TRIATTN_CHECK(t == tensor::token_embedding || matrix_index(t) < matrices.size(), api, "tensor ", i,
                    " is not a matrix");
      TRIATTN_CHECK(slices.size() == static_cast<std::size_t>(layout.slices[i]), api, "tensor ", i, ": ",
                    slices.size(), " block matrices for ", layout.slices[i], " layers");
      const auto rows = static_cast<std::size_t>(m.matrix_shape(t).first);
      for (const block_matrix& b : slices)
        TRIATTN_CHECK(b.to_float != nullptr && b.quantize_input != nullptr && b.vec_dot != nullptr &&
                          b.row_bytes > 0 && b.bytes.size() == rows * b.row_bytes,
                      api, "tensor ", i, ": a block matrix of ", b.bytes.size(), " bytes or its kernels do not fit ",
                      rows, " rows");
      layout.per_slice[i] = 0;
      m.blocks_[i] = std::move(slices);
    }
    m.set_layout(layout);
    TRIATTN_CHECK(data.size() == m.floats_, api, data.size(), " floats, the config needs ", m.floats_);
    m.data_ = std::move(data);
    m.pack_matrices();
    return m;
  }

  const triattn_runner::config& config() const { return config_; }

  /// The slice of tensor `t` for `layer` (0 for the tensors that are not per layer); empty for
  /// a tensor kept as a block matrix.
  std::span<const float> weights(tensor t, int layer = 0) const {
    const auto i = static_cast<std::size_t>(resolve(t));
    return {data_.data() + offset_[i] + static_cast<std::size_t>(layer) * slice_[i], slice_[i]};
  }
  /// Matrix `t` (or the token embedding) of `layer` when it is kept in its block format, else
  /// nullptr.
  const block_matrix* blocks(tensor t, int layer = 0) const {
    const std::vector<block_matrix>& b = blocks_[static_cast<std::size_t>(resolve(t))];
    return b.empty() ? nullptr : &b[static_cast<std::size_t>(layer)];
  }
  /// Row `row` of matrix `t` (or the token embedding) of `layer` as f32 into `out` [its columns].
  void matrix_row(tensor t, int layer, int row, float* out) const {
    const int cols = matrix_shape(t).second;
    if (const block_matrix* b = blocks(t, layer)) {
      b->to_float(b->bytes.data() + static_cast<std::size_t>(row) * b->row_bytes, out, cols);
    } else {
      std::copy_n(weights(t, layer).data() + static_cast<std::ptrdiff_t>(row) * cols, cols, out);
    }
  }
  /// Row `token` of the token embedding as f32 into `out` [dim].
  void embed(int token, float* out) const { matrix_row(tensor::token_embedding, 0, token, out); }

  /// The output projections as a value-aware round reads them (triattn/core/value_weighting.hpp):
  /// W_o,hᵀ W_o,h per (layer, q-head), computed on first use (about a second for a 576-wide
  /// model of 30 layers) and kept with the model's weights. Thread-safe.
  const triattn::value_projection& output_projection() const {
    std::call_once(projection_->once, [&] {
      const triattn_runner::config& c = config_;
      std::vector<float> w_o(static_cast<std::size_t>(c.dim) * c.dim);
      for (int l = 0; l < c.n_layers; ++l) {
        for (int i = 0; i < c.dim; ++i) matrix_row(tensor::wo, l, i, w_o.data() + static_cast<std::ptrdiff_t>(i) * c.dim);
        triattn::append_output_gram(w_o, c.dim, c.n_heads, c.head_dim, projection_->gram);
      }
      projection_->view = {c.n_layers, c.n_heads, c.head_dim, projection_->gram.data()};
    });
    return projection_->view;
  }

  /// Rows of every panel of `panels()`.
  static constexpr int panel_rows = 16;
  /// Rows (out) and columns (in) of matrix `t`: wq, wk, wv, wo, w1, w2, w3, wcls or the token
  /// embedding.
  std::pair<int, int> matrix_shape(tensor t) const {
    const triattn_runner::config& c = config_;
    switch (t) {
      case tensor::wk:
      case tensor::wv: return {c.kv_dim, c.dim};
      case tensor::w1:
      case tensor::w3: return {c.hidden_dim, c.dim};
      case tensor::w2: return {c.dim, c.hidden_dim};
      case tensor::token_embedding:
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
  // The tensor that holds `t`: the token embedding for a shared classifier.
  tensor resolve(tensor t) const {
    return t == tensor::wcls && config_.shared_classifier ? tensor::token_embedding : t;
  }
  // Builds panels_ from data_ (after a load), for the matrices held as f32.
  void pack_matrices() {
    std::size_t at = 0;
    for (std::size_t m = 0; m < matrices.size(); ++m) {
      const auto [rows, cols] = matrix_shape(matrices[m]);
      panel_offset_[m] = at;
      if (blocks(matrices[m]) != nullptr) {
        panel_slice_[m] = 0;
        continue;
      }
      panel_slice_[m] = static_cast<std::size_t>((rows + panel_rows - 1) / panel_rows) * panel_rows * static_cast<std::size_t>(cols);
      at += panel_slice_[m] * (matrices[m] == tensor::wcls ? 1 : static_cast<std::size_t>(config_.n_layers));
    }
    panels_.assign(at, 0.0f);
    for (std::size_t m = 0; m < matrices.size(); ++m) {
      if (panel_slice_[m] == 0) continue;
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

  triattn_runner::config config_;
  std::size_t floats_ = 0;  // of every tensor
  std::vector<float> data_;                       // every tensor, packed as in the file
  std::array<std::size_t, tensor_count> offset_{};  // first float of each tensor
  std::array<std::size_t, tensor_count> slice_{};   // floats per layer (or in all) of each tensor
  std::vector<float> panels_;                        // the f32 matrices as panels(), in `matrices` order
  struct lazy_projection {
    std::once_flag once;
    std::vector<float> gram;
    triattn::value_projection view;
  };
  std::shared_ptr<lazy_projection> projection_ = std::make_shared<lazy_projection>();  // output_projection()
  std::array<std::vector<block_matrix>, tensor_count> blocks_;  // [layers] of the tensors kept in a block format
  std::array<std::size_t, matrices.size()> panel_offset_{}, panel_slice_{};
};

inline model model::load(const std::filesystem::path& path) {
  const char* api = "triattn_runner::model::load";
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
  triattn_runner::config& c = m.config_;
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

}  // namespace triattn_runner
