/// \file runner/triattn_llama.hpp
/// \brief triattn inside llama.cpp: one sequence's KV cache held at a budget by any triattn
/// policy, through llama.cpp's public API only. Copy this header (it needs llama.h, ggml.h,
/// ggml-backend.h and triattn) or include it.
///
/// How it works. llama.cpp keeps its own cache, one *cell* per token for every layer and head,
/// and offers two hooks that are enough:
/// - the graph callback (`llama_context_params::cb_eval`) sees each layer's keys after RoPE
///   (`Kcur-<layer>`, f32 [head_dim, kv_heads, tokens]), values (`Vcur-<layer>`) and queries
///   (`Qcur-<layer>`, after RoPE) while a batch is computed. The adapter copies K and V into a
///   *mirror*: a triattn view (f16, NHD, post-RoPE keys) whose slots are exactly llama.cpp's
///   cells for the sequence, in the order the tokens came. Queries go to the policy's `observe`
///   when it reads them (SnapKV, R-KV).
/// - `llama_memory_seq_rm(mem, seq, p0, p1)` frees the cells of positions [p0, p1); later
///   tokens reuse them, and the kept tokens keep their positions (RoPE needs no fix-up).
///
/// After every `llama_decode`, `end_batch` runs a round when the policy's schedule says so
/// (`triattn::maybe_compress` on the mirror: scoring, selection and compaction are the
/// library's), then frees in llama.cpp the positions the round evicted, in runs of consecutive
/// positions. Mirror and cache hold the same positions after every call.
///
/// Limits. A cell holds one token for every layer and head, so the decision must be one keep
/// set for the sequence: the policy's granularity must be `whole_sequence` (the CLI's `union`).
/// llama.cpp requires a batch to continue at the largest stored position + 1, so the newest
/// token is never evicted (TriAttention: `window >= 1`; StreamingLLM, SnapKV and R-KV keep a
/// recent window). Each `seq_rm` is a pass over the cache's cells (llama.cpp's unified cache
/// finds a sequence's cells by scanning), so the adapter merges evicted positions into runs.
/// One adapter serves one sequence of one context (`n_seq_max = 1`); the mirror costs
/// 2 x layers x kv_heads x head_dim x 2 bytes per cell (23 KB for SmolLM2-135M).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ggml-backend.h>
#include <ggml.h>
#include <llama.h>

#include "triattn/triattn.hpp"

namespace triattn_llama {

/// The geometry of `model`'s cache as llama.cpp's graph computes it, from llama.h alone:
/// layers, query and KV heads, head_dim, RoPE (LLAMA_ROPE_TYPE_NORM rotates adjacent pairs:
/// `interleaved`; NEOX the two halves: `half`; theta from `<arch>.rope.freq_base`), keys
/// after RoPE, stored as f16. Throws `triattn::error` for a model it cannot describe.
inline triattn::kv_geometry geometry_of(const llama_model* model) {
  const char* api = "triattn_llama::geometry_of";
  TRIATTN_CHECK(model != nullptr, api, "model is null");
  triattn::kv_geometry g;
  g.num_layers = llama_model_n_layer(model);
  g.num_q_heads = llama_model_n_head(model);
  g.num_kv_heads = llama_model_n_head_kv(model);
  TRIATTN_CHECK(g.num_layers > 0 && g.num_q_heads > 0 && g.num_kv_heads > 0 && g.num_q_heads % g.num_kv_heads == 0, api,
                "layers ", g.num_layers, ", heads ", g.num_q_heads, ", kv heads ", g.num_kv_heads);
  g.head_dim = llama_model_n_embd(model) / g.num_q_heads;
  g.type = triattn::dtype::f16;
  g.keys = triattn::key_state::post_rope;
  const llama_rope_type rope = llama_model_rope_type(model);
  TRIATTN_CHECK(rope == LLAMA_ROPE_TYPE_NORM || rope == LLAMA_ROPE_TYPE_NEOX, api, "RoPE type ", static_cast<int>(rope),
                " is neither NORM nor NEOX");
  g.rope.style = rope == LLAMA_ROPE_TYPE_NORM ? triattn::rope_style::interleaved : triattn::rope_style::half;
  char arch[64] = {}, base[64] = {};
  TRIATTN_CHECK(llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch) > 0, api,
                "the model has no general.architecture");
  const std::string key = std::string(arch) + ".rope.freq_base";
  if (llama_model_meta_val_str(model, key.c_str(), base, sizeof base) > 0) g.rope.theta = std::stod(base);
  return g;
}

/// The adapter's settings: the budget (cells a round keeps) and the first position that is
/// not prompt (the prompt's protection, for policies that protect it).
struct options {
  std::int64_t budget = 512;
  std::int64_t capacity = 0;   ///< mirror slots: at least llama.cpp's n_ctx (budget + slack + n_batch)
  bool feed_queries = false;   ///< pass Qcur to the policy's observe (SnapKV, R-KV)
};

/// Time and work of an adapter so far.
struct adapter_stats {
  std::int64_t rounds = 0;
  std::int64_t evicted = 0;        ///< cells freed in llama.cpp
  std::int64_t seq_rm_calls = 0;   ///< runs of consecutive positions freed
  std::int64_t peak_cells = 0;     ///< the most cells the sequence held after a batch
  double capture_seconds = 0.0;    ///< copying K, V (and Q) out of the graph
  double round_seconds = 0.0;      ///< rounds: the library's round, then llama_memory_seq_rm
  double seq_rm_seconds = 0.0;     ///< the part of round_seconds spent in llama_memory_seq_rm
};

/// One sequence of one llama.cpp context held at `options.budget` cells by `Policy` (a
/// triattn compression policy over `triattn::dense_kv_view` whose round decides per sequence).
/// Install it as the context's graph callback, then bracket every `llama_decode` of the
/// sequence with `begin_batch` and `end_batch`:
///
///     triattn_llama::adapter<P> a(model, std::move(policy), opts);
///     params.cb_eval = triattn_llama::adapter<P>::callback;
///     params.cb_eval_user_data = &a;
///     ...
///     a.begin_batch(positions_of_the_batch);
///     llama_decode(ctx, batch);
///     a.end_batch(ctx, seq_id, prompt_length);
template <class Policy>
class adapter {
 public:
  adapter(const llama_model* model, Policy policy, options o)
      : policy_(std::move(policy)), opts_(o), geo_(geometry_of(model)) {
    const char* api = "triattn_llama::adapter";
    TRIATTN_CHECK(o.budget >= 1, api, "budget ", o.budget, " must be >= 1");
    TRIATTN_CHECK(o.capacity > o.budget, api, "capacity ", o.capacity, " must exceed the budget ", o.budget,
                  " (llama.cpp's n_ctx: budget + slack + n_batch)");
    TRIATTN_CHECK(policy_.round().grain == triattn::granularity::whole_sequence, api,
                  "the policy's granularity is ", triattn::granularity_name(policy_.round().grain),
                  "; a llama.cpp cell holds every layer and head, so it must be union (granularity::whole_sequence)");
    const auto layers = static_cast<std::size_t>(geo_.num_layers), heads = static_cast<std::size_t>(geo_.num_kv_heads);
    const std::size_t layer_elems = static_cast<std::size_t>(o.capacity) * heads * static_cast<std::size_t>(geo_.head_dim);
    k_.assign(layers * layer_elems, 0);
    v_.assign(k_.size(), 0);
    lengths_.assign(layers * heads, 0);
    positions_.assign(layers * heads * static_cast<std::size_t>(o.capacity), 0);
    for (std::size_t l = 0; l < layers; ++l) {
      k_layers_.push_back(reinterpret_cast<std::byte*>(k_.data() + l * layer_elems));
      v_layers_.push_back(reinterpret_cast<std::byte*>(v_.data() + l * layer_elems));
    }
    done_k_.assign(layers, 0);
    done_v_.assign(layers, 0);
    done_q_.assign(layers, 0);
    if constexpr (requires(Policy& p, const triattn::dense_kv_view& v) { p.attach(v); }) policy_.attach(view());
  }
  adapter(const adapter&) = delete;  // llama.cpp holds a pointer to it
  adapter& operator=(const adapter&) = delete;

  /// The mirror as a triattn view: slots are the sequence's cells, in arrival order.
  triattn::dense_kv_view view() {
    triattn::dense_kv_view v;
    v.geo = geo_;
    v.k_layers = k_layers_.data();
    v.v_layers = v_layers_.data();
    v.k_stride = v.v_stride = triattn::kv_strides::nhd(geo_.num_kv_heads, geo_.head_dim);
    v.slots = {lengths_.data(), positions_.data(), opts_.capacity};
    return v;
  }
  /// Cells the sequence holds (the mirror's length).
  std::int32_t cells() const { return lengths_.empty() ? 0 : lengths_[0]; }
  const adapter_stats& stats() const { return stats_; }
  Policy& policy() { return policy_; }

  /// The context's graph callback (`cb_eval`, with `cb_eval_user_data` = this adapter): asks
  /// for each layer's Kcur and Vcur (and Qcur when the policy reads queries) and copies them
  /// out. Always lets the computation go on.
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto& a = *static_cast<adapter*>(user);
    const capture c = a.classify(t);
    if (ask) return c.kind != tensor_kind::none;
    if (c.kind != tensor_kind::none) a.take(t, c);
    return true;
  }

  /// Before `llama_decode`: the positions of the batch's tokens of this sequence, in batch
  /// order (llama.cpp itself refuses positions that do not continue the sequence). Throws
  /// when they do not fit the mirror.
  void begin_batch(std::span<const llama_pos> positions) {
    const char* api = "triattn_llama::adapter::begin_batch";
    TRIATTN_CHECK(!positions.empty(), api, "an empty batch");
    TRIATTN_CHECK(cells() + static_cast<std::int64_t>(positions.size()) <= opts_.capacity, api, "the sequence holds ",
                  cells(), " cells; ", positions.size(), " more do not fit the mirror's ", opts_.capacity,
                  " (n_ctx must be at most the mirror's capacity)");
    batch_.assign(positions.begin(), positions.end());
    std::fill(done_k_.begin(), done_k_.end(), 0);
    std::fill(done_v_.begin(), done_v_.end(), 0);
    std::fill(done_q_.begin(), done_q_.end(), 0);
  }

  /// After a successful `llama_decode`: checks that every layer's K and V of the batch were
  /// captured, then runs a round when the policy's schedule says so and frees the evicted
  /// positions of `seq` in `ctx`'s memory. `prompt_length`: positions below it are the
  /// prompt. Returns whether a round ran.
  bool end_batch(llama_context* ctx, llama_seq_id seq, std::int64_t prompt_length) {
    const char* api = "triattn_llama::adapter::end_batch";
    const auto n = static_cast<std::int32_t>(batch_.size());
    for (int l = 0; l < geo_.num_layers; ++l)
      TRIATTN_CHECK(done_k_[static_cast<std::size_t>(l)] == n && done_v_[static_cast<std::size_t>(l)] == n, api,
                    "layer ", l, " captured ", done_k_[static_cast<std::size_t>(l)], " keys and ",
                    done_v_[static_cast<std::size_t>(l)], " values of a batch of ", n,
                    " tokens (is this adapter the context's cb_eval, and the only sequence?)");
    for (std::size_t r = 0; r < lengths_.size(); ++r) lengths_[r] += n;
    batch_.clear();
    stats_.peak_cells = std::max<std::int64_t>(stats_.peak_cells, cells());

    const auto t0 = std::chrono::steady_clock::now();
    const triattn::dense_kv_view v = view();
    before_.assign(positions_.begin(), positions_.begin() + cells());  // row (0, 0): every row holds the same
    const triattn::round_context rc{static_cast<std::int64_t>(before_.back()) + 1, prompt_length};
    if (!triattn::maybe_compress(policy_, v, opts_.budget, rc)) return false;
    // The evicted positions, in runs of consecutive positions: one seq_rm per run.
    const std::span<const std::int32_t> kept(positions_.data(), static_cast<std::size_t>(cells()));
    TRIATTN_CHECK(!kept.empty() && kept.back() == before_.back(), api,
                  "the round evicted the newest token (position ", before_.back(),
                  "); llama.cpp continues a sequence after its largest position, so the policy must keep it");
    llama_memory_t mem = llama_get_memory(ctx);
    const auto rm0 = std::chrono::steady_clock::now();
    std::size_t k = 0;
    for (std::size_t i = 0; i < before_.size();) {
      if (k < kept.size() && kept[k] == before_[i]) {
        ++k;
        ++i;
        continue;
      }
      std::size_t j = i + 1;
      while (j < before_.size() && before_[j] == before_[j - 1] + 1 && !(k < kept.size() && kept[k] == before_[j])) ++j;
      TRIATTN_CHECK(llama_memory_seq_rm(mem, seq, before_[i], before_[j - 1] + 1), api,
                    "llama_memory_seq_rm refused positions [", before_[i], ", ", before_[j - 1] + 1, ")");
      stats_.evicted += static_cast<std::int64_t>(j - i);
      ++stats_.seq_rm_calls;
      i = j;
    }
    stats_.seq_rm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - rm0).count();
    // llama.cpp's cache and the mirror hold the same positions (its cells are scanned for
    // the bounds only: cheap beside the round).
    TRIATTN_CHECK(llama_memory_seq_pos_min(mem, seq) == kept.front() && llama_memory_seq_pos_max(mem, seq) == kept.back(),
                  api, "llama.cpp holds positions [", llama_memory_seq_pos_min(mem, seq), ", ",
                  llama_memory_seq_pos_max(mem, seq), "] of sequence ", seq, " after the round, the mirror [",
                  kept.front(), ", ", kept.back(), "]");
    ++stats_.rounds;
    stats_.round_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return true;
  }

 private:
  enum class tensor_kind { none, key, value, query };
  struct capture {
    tensor_kind kind = tensor_kind::none;
    int layer = -1;
  };

  // Which of the adapter's tensors `t` is: `Kcur-<l>` / `Qcur-<l>` after RoPE (the rope op),
  // `Vcur-<l>` as [head_dim, kv_heads, tokens] (the graph also names its matmul output
  // [kv_heads * head_dim, tokens] so; a one-token batch has two dimensions).
  capture classify(const ggml_tensor* t) const {
    const std::string_view name(t->name);
    const auto dash = name.find('-');
    if (dash == std::string_view::npos || dash != 4) return {};
    const std::string_view stem = name.substr(0, dash);
    int layer = 0;
    for (const char ch : name.substr(dash + 1)) {
      if (ch < '0' || ch > '9' || layer > geo_.num_layers) return {};
      layer = layer * 10 + (ch - '0');
    }
    if (layer >= geo_.num_layers || t->type != GGML_TYPE_F32) return {};
    if (stem == "Kcur" && t->op == GGML_OP_ROPE && t->ne[0] == geo_.head_dim && t->ne[1] == geo_.num_kv_heads)
      return {tensor_kind::key, layer};
    if (stem == "Vcur" && t->ne[0] == geo_.head_dim && t->ne[1] == geo_.num_kv_heads)
      return {tensor_kind::value, layer};
    if (opts_.feed_queries && stem == "Qcur" && t->op == GGML_OP_ROPE && t->ne[0] == geo_.head_dim &&
        t->ne[1] == geo_.num_q_heads)
      return {tensor_kind::query, layer};
    return {};
  }

  // Copies the tokens of `t` ([head_dim, heads, tokens], f32) into the mirror (K, V) or the
  // policy (Q). A batch may come in several ubatches: each layer keeps its own count.
  void take(const ggml_tensor* t, capture c) {
    const char* api = "triattn_llama::adapter::callback";
    const auto t0 = std::chrono::steady_clock::now();
    const auto tokens = static_cast<std::int32_t>(t->ne[2]);
    const auto heads = static_cast<int>(t->ne[1]);
    const auto l = static_cast<std::size_t>(c.layer);
    std::int32_t& done = c.kind == tensor_kind::key ? done_k_[l] : c.kind == tensor_kind::value ? done_v_[l] : done_q_[l];
    const std::int32_t first = done;
    TRIATTN_CHECK(ggml_is_contiguous(t) && first + tokens <= static_cast<std::int32_t>(batch_.size()), api,
                  t->name, ": ", tokens, " tokens past the ", batch_.size(), " of the batch begun (call begin_batch)");
    staging_.resize(static_cast<std::size_t>(ggml_nelements(t)));
    ggml_backend_tensor_get(t, staging_.data(), 0, ggml_nbytes(t));
    const triattn::dense_kv_view v = view();
    const std::int32_t base = lengths_[l * static_cast<std::size_t>(geo_.num_kv_heads)];
    for (std::int32_t i = 0; i < tokens; ++i) {
      const std::int32_t position = batch_[static_cast<std::size_t>(first + i)];
      for (int h = 0; h < heads; ++h) {
        const float* x = staging_.data() + (static_cast<std::size_t>(i) * heads + h) * static_cast<std::size_t>(geo_.head_dim);
        const std::int32_t slot = base + first + i;
        switch (c.kind) {
          case tensor_kind::key:
            triattn::store_key(v, c.layer, h, slot, x);
            v.position(c.layer, h, slot) = position;
            break;
          case tensor_kind::value: triattn::store_value(v, c.layer, h, slot, x); break;
          case tensor_kind::query:
            if constexpr (requires { policy_.observe(0, 0, 0, std::span<const float>(), std::span<const float>()); })
              policy_.observe(c.layer, h, position, {x, static_cast<std::size_t>(geo_.head_dim)}, {});
            break;
          case tensor_kind::none: break;
        }
      }
    }
    done += tokens;
    stats_.capture_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  Policy policy_;
  options opts_;
  triattn::kv_geometry geo_;
  std::vector<std::uint16_t> k_, v_;        // [layers, capacity, kv_heads, head_dim] f16
  std::vector<std::byte*> k_layers_, v_layers_;
  std::vector<std::int32_t> lengths_;       // [layers, kv_heads]: all equal (one keep set)
  std::vector<std::int32_t> positions_;     // [layers, kv_heads, capacity]
  std::vector<std::int32_t> done_k_, done_v_, done_q_;  // [layers]: tokens of the batch captured
  std::vector<llama_pos> batch_;            // the positions of the batch being decoded
  std::vector<std::int32_t> before_;        // a round's positions before it ran
  std::vector<float> staging_;
  adapter_stats stats_;
};

}  // namespace triattn_llama
