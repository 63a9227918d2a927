/// \file runner/gguf_model.hpp
/// \brief Loads a Llama-family GGUF checkpoint (SmolLM2, Llama 2/3, TinyLlama; Qwen2 and
/// Qwen2.5, architecture `qwen2`) into the runner (`triattn_runner::model`): shapes, RoPE, biases
/// and RMSNorm epsilon from the metadata; the tensors dequantised to f32 once by ggml, or the
/// quantised matrices of a large model kept in their blocks and multiplied by ggml's CPU kernels
/// (`matrix_storage`). The forward pass stays the runner's.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/runner.hpp"
#include "triattn/core/error.hpp"

namespace gguf_model {

/// The GGUF tensor holding runner tensor `t` of `layer`, or "" for the legacy RoPE tables
/// (GGUF has none) and for the classifier when it is tied to the embedding.
inline std::string tensor_name(triattn_runner::tensor t, int layer, bool shared_classifier) {
  const std::string blk = "blk." + std::to_string(layer) + ".";
  switch (t) {
    case triattn_runner::tensor::token_embedding: return "token_embd.weight";
    case triattn_runner::tensor::rms_att: return blk + "attn_norm.weight";
    case triattn_runner::tensor::wq: return blk + "attn_q.weight";
    case triattn_runner::tensor::wk: return blk + "attn_k.weight";
    case triattn_runner::tensor::wv: return blk + "attn_v.weight";
    case triattn_runner::tensor::wo: return blk + "attn_output.weight";
    case triattn_runner::tensor::rms_ffn: return blk + "ffn_norm.weight";
    case triattn_runner::tensor::w1: return blk + "ffn_gate.weight";
    case triattn_runner::tensor::w2: return blk + "ffn_down.weight";
    case triattn_runner::tensor::w3: return blk + "ffn_up.weight";
    case triattn_runner::tensor::rms_final: return "output_norm.weight";
    case triattn_runner::tensor::freq_cis_real:
    case triattn_runner::tensor::freq_cis_imag: return "";
    case triattn_runner::tensor::wcls: return shared_classifier ? "" : "output.weight";
    case triattn_runner::tensor::bq: return blk + "attn_q.bias";
    case triattn_runner::tensor::bk: return blk + "attn_k.bias";
    case triattn_runner::tensor::bv: return blk + "attn_v.bias";
  }
  return "";
}

/// "[a, b]" for messages.
inline std::string shape_text(const std::vector<std::int64_t>& ne) {
  std::string out = "[";
  for (std::size_t i = 0; i < ne.size(); ++i) out += (i > 0 ? ", " : "") + std::to_string(ne[i]);
  return out + "]";
}

/// The runner's config from the metadata of `f` (architecture `llama` or `qwen2`).
inline triattn_runner::config read_config(const ggml_bridge::gguf_file& f) {
  const char* api = "gguf_model::read_config";
  const std::string arch = f.get_string("general.architecture");
  TRIATTN_CHECK(arch == "llama" || arch == "qwen2", api, f.path(), ": general.architecture is \"", arch,
                "\"; only llama (Llama, SmolLM2, TinyLlama) and qwen2 (Qwen2, Qwen2.5) are supported");
  const auto key = [&](const char* k) { return arch + "." + k; };
  const auto as_int = [&](const std::string& k) {
    const std::int64_t v = f.get_int(k);
    TRIATTN_CHECK(v >= 1 && v <= (std::int64_t{1} << 30), api, f.path(), ": ", k, " = ", v, " is not a positive size");
    return static_cast<int>(v);
  };
  triattn_runner::config c;
  c.n_layers = as_int(key("block_count"));
  c.dim = as_int(key("embedding_length"));
  c.hidden_dim = as_int(key("feed_forward_length"));
  c.n_heads = as_int(key("attention.head_count"));
  c.n_kv_heads = f.has(key("attention.head_count_kv")) ? as_int(key("attention.head_count_kv")) : c.n_heads;
  c.seq_len = as_int(key("context_length"));
  TRIATTN_CHECK(c.n_heads % c.n_kv_heads == 0, api, f.path(), ": ", c.n_heads, " heads are not a multiple of ",
                c.n_kv_heads, " KV heads");
  TRIATTN_CHECK(c.dim % c.n_heads == 0, api, f.path(), ": embedding_length ", c.dim, " is not a multiple of ",
                c.n_heads, " heads");
  c.head_dim = c.dim / c.n_heads;
  c.kv_dim = c.head_dim * c.n_kv_heads;
  TRIATTN_CHECK(c.head_dim % 2 == 0, api, f.path(), ": head_dim ", c.head_dim, " must be even for RoPE");
  for (const char* k : {"attention.key_length", "attention.value_length"})
    TRIATTN_CHECK(!f.has(key(k)) || f.get_int(key(k)) == c.head_dim, api, f.path(), ": ", k, " differs from head_dim ",
                  c.head_dim, " (embedding_length / head_count)");
  // Llama 3.1+ store their RoPE scaling as per-band factors in this tensor, with no
  // rope.scaling.type key: running without them would rotate with the wrong frequencies.
  TRIATTN_CHECK(!f.has_tensor("rope_freqs.weight"), api, f.path(),
                ": per-band RoPE factors (rope_freqs.weight, Llama 3.1 scaling) are not supported");
  const int rotary = f.has(key("rope.dimension_count")) ? as_int(key("rope.dimension_count")) : c.head_dim;
  TRIATTN_CHECK(rotary == c.head_dim, api, f.path(), ": rope.dimension_count ", rotary, " differs from head_dim ",
                c.head_dim, " (partial rotary is not supported)");
  TRIATTN_CHECK(!f.has(key("rope.scaling.type")) || f.get_string(key("rope.scaling.type")) == "none", api, f.path(),
                ": RoPE scaling ", f.get_string(key("rope.scaling.type")), " is not supported");
  // llama.cpp rotates the llama architecture with LLAMA_ROPE_TYPE_NORM: adjacent pairs
  // (2j, 2j+1); the converter permuted Q and K so that this is right for HF checkpoints too.
  // qwen2 keeps Hugging Face's layout and rotates with LLAMA_ROPE_TYPE_NEOX: pairs (j, j + d/2).
  c.rope.style = arch == "qwen2" ? triattn::rope_style::half : triattn::rope_style::interleaved;
  c.qkv_bias = arch == "qwen2";
  c.rope.theta = f.has(key("rope.freq_base")) ? f.get_float(key("rope.freq_base")) : 10000.0;
  TRIATTN_CHECK(std::isfinite(c.rope.theta) && c.rope.theta > 1.0, api, f.path(), ": rope.freq_base ", c.rope.theta,
                " must be finite and > 1");
  const double eps = f.get_float(key("attention.layer_norm_rms_epsilon"));
  TRIATTN_CHECK(std::isfinite(eps) && eps > 0.0 && eps < 1.0, api, f.path(), ": layer_norm_rms_epsilon ", eps,
                " must be in (0, 1)");
  c.rms_eps = static_cast<float>(eps);
  const ggml_bridge::tensor_desc embd = f.tensor_info("token_embd.weight");
  TRIATTN_CHECK(embd.ne.size() == 2 && embd.ne[0] == c.dim && embd.ne[1] >= 1 && embd.ne[1] <= (1 << 30), api, f.path(),
                ": token_embd.weight is not [vocab, ", c.dim, "]");
  c.vocab_size = static_cast<int>(embd.ne[1]);
  c.shared_classifier = !f.has_tensor("output.weight");
  return c;
}

/// The GGUF sizes (`ne`, fastest first) runner tensor `t` must have: {in, out} for a matrix
/// [out][in], {n} for a vector.
inline std::vector<std::int64_t> expected_ne(triattn_runner::tensor t, const triattn_runner::config& c) {
  using triattn_runner::tensor;
  switch (t) {
    case tensor::token_embedding:
    case tensor::wcls: return {c.dim, c.vocab_size};
    case tensor::rms_att:
    case tensor::rms_ffn:
    case tensor::rms_final: return {c.dim};
    case tensor::wq:
    case tensor::wo: return {c.dim, c.dim};
    case tensor::wk:
    case tensor::wv: return {c.dim, c.kv_dim};
    case tensor::w1:
    case tensor::w3: return {c.dim, c.hidden_dim};
    case tensor::w2: return {c.hidden_dim, c.dim};
    case tensor::bq: return {c.dim};
    case tensor::bk:
    case tensor::bv: return {c.kv_dim};
    case tensor::freq_cis_real:
    case tensor::freq_cis_imag: return {};
  }
  return {};
}

/// How `load` keeps the quantised matrices: dequantised to f32 (the runner's own products, the
/// same bits on every build) or in the file's blocks, multiplied by ggml's CPU kernels (a
/// quarter of the memory and of the bytes each product reads; llama.cpp's own arithmetic).
enum class matrix_storage : std::uint8_t {
  automatic,  ///< blocks when the f32 weights would take over 2 GiB (a model past ~500M parameters)
  f32,
  blocks,
};

/// Per runner tensor of config `c`, its GGUF names (one per layer) in the runner's packing order.
inline std::vector<std::pair<triattn_runner::tensor, std::vector<std::string>>> gguf_names(
    const triattn_runner::config& c, const triattn_runner::tensor_layout& layout) {
  std::vector<std::pair<triattn_runner::tensor, std::vector<std::string>>> out;
  for (std::size_t i = 0; i < triattn_runner::tensor_count; ++i) {
    const auto t = static_cast<triattn_runner::tensor>(i);
    std::vector<std::string> names;
    for (int l = 0; l < static_cast<int>(layout.slices[i]); ++l) {
      std::string name = tensor_name(t, l, c.shared_classifier);
      if (!name.empty() && layout.per_slice[i] != 0) names.push_back(std::move(name));
    }
    if (!names.empty()) out.emplace_back(t, std::move(names));
  }
  return out;
}

/// The runner's config of `f`, once the file has passed `ggml_bridge::check_model_file` and
/// every tensor the runner reads has the sizes the config needs and lies inside the file.
/// Reads no tensor data. Throws `triattn::error` naming the file and the tensor or key.
inline triattn_runner::config check(const ggml_bridge::gguf_file& f) {
  const char* api = "gguf_model::check";
  ggml_bridge::check_model_file(f);
  const triattn_runner::config c = read_config(f);
  std::error_code ec;
  const std::uintmax_t file_bytes = std::filesystem::file_size(f.path(), ec);
  TRIATTN_CHECK(!ec, api, f.path(), ": cannot stat the file: ", ec.message());
  for (const auto& [t, names] : gguf_names(c, triattn_runner::tensor_layout(c, false))) {
    for (const std::string& name : names) {
      const ggml_bridge::tensor_desc info = f.tensor_info(name);
      const std::vector<std::int64_t> want = expected_ne(t, c);
      TRIATTN_CHECK(info.ne == want, api, f.path(), ": tensor ", name, " has sizes ", shape_text(info.ne),
                    ", the config needs ", shape_text(want));
      TRIATTN_CHECK(info.offset <= file_bytes && info.bytes <= file_bytes - info.offset, api, f.path(), ": tensor ",
                    name, " needs bytes [", info.offset, ", ", info.offset + info.bytes, ") of a ", file_bytes,
                    "-byte file: truncated");
    }
  }
  return c;
}

/// Loads `path`, once `check` has passed it (so every size is bounded by a tensor the file
/// holds before anything is allocated or read). With `storage` blocks (or automatic, for a
/// large model), a matrix or the token embedding whose every layer is quantised in a type with
/// ggml CPU kernels stays in its blocks; everything else is f32. Throws `triattn::error` naming
/// the file and the tensor or key.
inline triattn_runner::model load(const std::filesystem::path& path, matrix_storage storage = matrix_storage::automatic) {
  using triattn_runner::tensor;
  const ggml_bridge::gguf_file f(path);
  const triattn_runner::config c = check(f);
  const triattn_runner::tensor_layout layout(c, false);
  const bool keep_blocks = storage == matrix_storage::blocks ||
                           (storage == matrix_storage::automatic && layout.floats() * sizeof(float) > 0x1p31);
  const auto tensors = gguf_names(c, layout);
  const auto as_blocks = [&](tensor t, const std::vector<std::string>& names) {
    std::vector<triattn_runner::block_matrix> out;
    if (!keep_blocks || (t != tensor::token_embedding && expected_ne(t, c).size() != 2)) return out;
    for (const std::string& name : names) {
      const ggml_bridge::tensor_desc info = f.tensor_info(name);
      const auto kernels = ggml_bridge::quantized_kernels(info.type);
      if (!kernels) return std::vector<triattn_runner::block_matrix>{};
      triattn_runner::block_matrix& b = out.emplace_back();
      b.to_float = kernels->to_float;
      b.quantize_input = kernels->quantize_input;
      b.vec_dot = kernels->vec_dot;
      b.row_bytes = ggml_row_size(info.type, info.ne[0]);
      b.input_row_bytes = ggml_row_size(kernels->input_type, info.ne[0]);
      b.bytes = f.raw_bytes(name);
    }
    return out;
  };
  std::vector<float> data;
  std::vector<std::pair<tensor, std::vector<triattn_runner::block_matrix>>> blocks;
  for (const auto& [t, names] : tensors) {
    if (std::vector<triattn_runner::block_matrix> b = as_blocks(t, names); !b.empty()) {
      blocks.emplace_back(t, std::move(b));
      continue;
    }
    for (const std::string& name : names) {
      const std::vector<float> w = f.dequantize(name);
      data.insert(data.end(), w.begin(), w.end());
    }
  }
  return triattn_runner::model::from_tensors(c, std::move(data), std::move(blocks));
}

}  // namespace gguf_model
