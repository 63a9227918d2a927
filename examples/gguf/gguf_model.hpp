/// \file gguf/gguf_model.hpp
/// \brief Loads a Llama-family GGUF checkpoint (SmolLM2, Llama 2/3, TinyLlama) into the
/// examples' runner (`llama2c::model`): shapes, RoPE and RMSNorm epsilon from the metadata,
/// every tensor dequantised to f32 once by ggml. The forward pass stays the runner's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "gguf/ggml_bridge.hpp"
#include "llama2c/llama2c.hpp"
#include "triattn/core/error.hpp"

namespace gguf_model {

/// The GGUF tensor holding runner tensor `t` of `layer`, or "" for the legacy RoPE tables
/// (GGUF has none) and for the classifier when it is tied to the embedding.
inline std::string tensor_name(llama2c::tensor t, int layer, bool shared_classifier) {
  const std::string blk = "blk." + std::to_string(layer) + ".";
  switch (t) {
    case llama2c::tensor::token_embedding: return "token_embd.weight";
    case llama2c::tensor::rms_att: return blk + "attn_norm.weight";
    case llama2c::tensor::wq: return blk + "attn_q.weight";
    case llama2c::tensor::wk: return blk + "attn_k.weight";
    case llama2c::tensor::wv: return blk + "attn_v.weight";
    case llama2c::tensor::wo: return blk + "attn_output.weight";
    case llama2c::tensor::rms_ffn: return blk + "ffn_norm.weight";
    case llama2c::tensor::w1: return blk + "ffn_gate.weight";
    case llama2c::tensor::w2: return blk + "ffn_down.weight";
    case llama2c::tensor::w3: return blk + "ffn_up.weight";
    case llama2c::tensor::rms_final: return "output_norm.weight";
    case llama2c::tensor::freq_cis_real:
    case llama2c::tensor::freq_cis_imag: return "";
    case llama2c::tensor::wcls: return shared_classifier ? "" : "output.weight";
  }
  return "";
}

/// The runner's config from the metadata of `f` (architecture `llama`).
inline llama2c::config read_config(const ggml_bridge::gguf_file& f) {
  const char* api = "gguf_model::read_config";
  const std::string arch = f.get_string("general.architecture");
  TRIATTN_CHECK(arch == "llama", api, f.path(), ": general.architecture is \"", arch,
                "\"; only the llama architecture (Llama, SmolLM2, TinyLlama) is supported");
  const auto key = [&](const char* k) { return arch + "." + k; };
  const auto as_int = [&](const std::string& k) {
    const std::int64_t v = f.get_int(k);
    TRIATTN_CHECK(v >= 1 && v <= (std::int64_t{1} << 30), api, f.path(), ": ", k, " = ", v, " is not a positive size");
    return static_cast<int>(v);
  };
  llama2c::config c;
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
  const int rotary = f.has(key("rope.dimension_count")) ? as_int(key("rope.dimension_count")) : c.head_dim;
  TRIATTN_CHECK(rotary == c.head_dim, api, f.path(), ": rope.dimension_count ", rotary, " differs from head_dim ",
                c.head_dim, " (partial rotary is not supported)");
  TRIATTN_CHECK(!f.has(key("rope.scaling.type")) || f.get_string(key("rope.scaling.type")) == "none", api, f.path(),
                ": RoPE scaling ", f.get_string(key("rope.scaling.type")), " is not supported");
  // llama.cpp rotates the llama architecture with LLAMA_ROPE_TYPE_NORM: adjacent pairs
  // (2j, 2j+1); the converter permuted Q and K so that this is right for HF checkpoints too.
  c.rope.style = triattn::rope_style::interleaved;
  c.rope.theta = f.has(key("rope.freq_base")) ? f.get_float(key("rope.freq_base")) : 10000.0;
  c.rms_eps = static_cast<float>(f.get_float(key("attention.layer_norm_rms_epsilon")));
  const ggml_bridge::tensor_desc embd = f.tensor_info("token_embd.weight");
  TRIATTN_CHECK(embd.ne.size() == 2 && embd.ne[0] == c.dim && embd.ne[1] >= 1 && embd.ne[1] <= (1 << 30), api, f.path(),
                ": token_embd.weight is not [vocab, ", c.dim, "]");
  c.vocab_size = static_cast<int>(embd.ne[1]);
  c.shared_classifier = !f.has_tensor("output.weight");
  return c;
}

/// Loads `path`. Every tensor's shape is checked against the config before it is read.
/// Throws `triattn::error` naming the file and the tensor or key.
inline llama2c::model load(const std::filesystem::path& path) {
  const char* api = "gguf_model::load";
  const ggml_bridge::gguf_file f(path);
  const llama2c::config c = read_config(f);
  const llama2c::tensor_layout layout(c, false);
  std::vector<float> data;
  data.reserve(static_cast<std::size_t>(layout.floats()));
  for (std::size_t i = 0; i < llama2c::tensor_count; ++i) {
    const auto t = static_cast<llama2c::tensor>(i);
    for (int l = 0; l < static_cast<int>(layout.slices[i]); ++l) {
      const std::string name = tensor_name(t, l, c.shared_classifier);
      if (name.empty()) continue;
      const ggml_bridge::tensor_desc info = f.tensor_info(name);
      TRIATTN_CHECK(static_cast<double>(info.elements()) == layout.per_slice[i], api, path, ": tensor ", name, " holds ",
                    info.elements(), " elements, the config needs ", static_cast<std::int64_t>(layout.per_slice[i]));
      const std::vector<float> w = f.dequantize(name);
      data.insert(data.end(), w.begin(), w.end());
    }
  }
  return llama2c::model::from_tensors(c, std::move(data));
}

}  // namespace gguf_model
