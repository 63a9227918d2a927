/// \file runner/triattn_llama.hpp
/// \brief triattn inside llama.cpp: each sequence's KV cache held at a budget by any triattn
/// policy, read where llama.cpp keeps it. Copy this header (it needs llama.h with triattn's
/// patch, ggml.h, ggml-backend.h and triattn) or include it.
///
/// How it works. llama.cpp keeps its own cache: per layer one K and one V tensor, one *cell*
/// (a row) per token for every KV head. The patch in `patches/llama.cpp` adds two read
/// accessors: `llama_memory_kv_layer_get` (a layer's tensors and their layout) and
/// `llama_memory_seq_cells` (a sequence's cells in position order). Over them `cells_view` is
/// a triattn view of one sequence: slot s is the sequence's s-th cell, its K row read in
/// place (no copy, no graph callback). A round's keep set becomes `llama_memory_seq_rm` calls
/// through the view's `free_evicted` hook: llama.cpp frees the evicted cells and reuses them,
/// the kept tokens keep their cells and positions (RoPE needs no fix-up), nothing moves.
///
/// `held_sequence<Policy>` is one sequence of one context held at its budget: after every
/// `llama_decode` that carried its tokens, `end_batch` reads its cells and runs a round when
/// the policy's schedule says so. Sequences are independent (each its own policy, budget,
/// schedule and keep sets), so a context with `n_seq_max > 1` holds one per sequence.
/// Policies that read queries (SnapKV, R-KV, Expected Attention) or attention (H2O, VATP) see
/// them through the graph callback: `query_capture` is the context's `cb_eval`, hands each
/// layer's `Qcur-<l>` (after RoPE) to the sequence of each token (`llama_ubatch_tokens`, so a
/// batch of several sequences in any ubatches), and a policy that reads attention gets
/// softmax(q·k/√d) over its sequence's cells, computed from those queries and the cached keys
/// once the batch's keys are stored (flash attention never forms the probabilities). That
/// costs what a callback costs (ggml's scheduler stops at every tensor it asks for);
/// key-only policies install none (`reads_of`).
///
/// Limits. A cell holds one token for every layer and head, so the decision is one keep set
/// per sequence (union granularity; the view declares `equal_lengths` and the round refuses
/// anything else). llama.cpp requires a batch to continue at the largest stored position + 1,
/// so the newest token is never evicted (the view refuses a plan that evicts it). Keys must
/// be f16 or bf16 (V of the same type), stored as computed (quantized caches rotate their
/// keys), and V row-major (flash attention on: otherwise V is transposed). Each `seq_rm` is a
/// pass over the cache's cells, so evicted positions go in runs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <optional>
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
/// after RoPE, f16 (`cache_of` sets the cache's own type). Throws `triattn::error` for a
/// model it cannot describe.
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

/// What rounds did to a sequence so far.
struct sequence_stats {
  std::int64_t rounds = 0;
  std::int64_t evicted = 0;        ///< cells freed in llama.cpp
  std::int64_t seq_rm_calls = 0;   ///< runs of consecutive positions freed
  std::int64_t peak_cells = 0;     ///< the most cells the sequence held after a batch
  double capture_seconds = 0.0;    ///< reading queries: Qcur out of the graph, and attention rows from it
  double round_seconds = 0.0;      ///< rounds: the library's round, its seq_rm calls included
  double seq_rm_seconds = 0.0;     ///< the part of round_seconds spent in llama_memory_seq_rm
};

/// A `triattn::KVCacheView` of one sequence of a llama.cpp context: slot s is the sequence's
/// s-th cell in position order, its K and V rows read in place from llama.cpp's tensors. The
/// slot map (`cells`, `positions`, `count`) belongs to the caller (`held_sequence`), which
/// fills it from `llama_memory_seq_cells` before a round. Evicting frees cells in llama.cpp
/// (`free_evicted`); nothing is compacted.
struct cells_view {
  triattn::kv_geometry geo{};
  std::byte* const* k_layers = nullptr;  ///< [num_layers] each layer's K tensor data
  std::byte* const* v_layers = nullptr;  ///< [num_layers] each layer's V tensor data
  std::int64_t k_row_bytes = 0;          ///< bytes from one cell's K row to the next (nb[1])
  std::int64_t v_row_bytes = 0;
  std::int32_t* cells = nullptr;         ///< [capacity] the tensor row of each slot
  std::int32_t* positions = nullptr;     ///< [capacity] the position each slot holds
  std::int32_t* count = nullptr;         ///< the sequence's cells
  std::int64_t slots = 0;                ///< capacity of the slot map
  llama_memory_t memory = nullptr;
  llama_seq_id seq = 0;
  sequence_stats* stats = nullptr;       ///< eviction counters (may be null)

  static constexpr bool equal_lengths = true;  // a cell holds every layer and head

  const triattn::kv_geometry& geometry() const { return geo; }
  std::int64_t capacity() const { return slots; }
  // Rows are f16 or bf16 (`validate`): 2 bytes an element.
  std::byte* key(int l, int h, std::int64_t s) const {
    return k_layers[l] + cells[s] * k_row_bytes + static_cast<std::int64_t>(h) * geo.head_dim * 2;
  }
  std::byte* value(int l, int h, std::int64_t s) const {
    return v_layers[l] + cells[s] * v_row_bytes + static_cast<std::int64_t>(h) * geo.head_dim * 2;
  }
  std::int32_t length(int, int) const { return *count; }
  void set_length(int, int, std::int32_t n) const { *count = n; }
  std::int32_t& position(int, int, std::int64_t s) const { return positions[s]; }

  void validate(const char* api) const {
    TRIATTN_CHECK(geo.type == triattn::dtype::f16 || geo.type == triattn::dtype::bf16, api, "cache type ",
                  triattn::dtype_name(geo.type), ": llama.cpp's cells are read as f16 or bf16");
    TRIATTN_CHECK(k_layers != nullptr && v_layers != nullptr && cells != nullptr && positions != nullptr &&
                      count != nullptr && memory != nullptr,
                  api, "a cells_view pointer is null");
    TRIATTN_CHECK(*count >= 0 && *count <= slots, api, "the sequence holds ", *count, " cells, outside [0, ", slots, "]");
    for (int l = 0; l < geo.num_layers; ++l)
      TRIATTN_CHECK(k_layers[l] != nullptr && v_layers[l] != nullptr, api, "layer ", l, " has no K or V tensor");
  }

  /// Frees in llama.cpp the cells `plan` evicts, in runs of consecutive positions, and keeps
  /// the slot map in step (slot i becomes the i-th kept cell). The plan's rows are equal
  /// (the round checked them). Refuses, before any cell is freed, a plan that evicts the
  /// newest token: llama.cpp continues a sequence after its largest position.
  void free_evicted(const triattn::keep_plan& plan) const {
    const char* api = "triattn_llama::cells_view::free_evicted";
    const std::span<const std::int32_t> keep = plan.row(0, 0);
    const std::int32_t n = *count;
    TRIATTN_CHECK(n == 0 || (!keep.empty() && keep.back() == n - 1), api, "the round evicts the newest token (position ",
                  n > 0 ? positions[n - 1] : -1,
                  "); llama.cpp continues a sequence after its largest position, so the policy must keep it");
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t k = 0;
    std::int32_t kept = 0;
    for (std::int32_t s = 0; s < n;) {
      if (k < keep.size() && keep[k] == s) {
        cells[kept] = cells[s];
        positions[kept] = positions[s];
        ++kept, ++k, ++s;
        continue;
      }
      std::int32_t e = s + 1;  // the run [s, e) of evicted slots with consecutive positions
      while (e < n && !(k < keep.size() && keep[k] == e) && positions[e] == positions[e - 1] + 1) ++e;
      TRIATTN_CHECK(llama_memory_seq_rm(memory, seq, positions[s], positions[e - 1] + 1), api,
                    "llama_memory_seq_rm refused positions [", positions[s], ", ", positions[e - 1] + 1, ") of sequence ",
                    seq);
      if (stats != nullptr) {
        stats->evicted += e - s;
        ++stats->seq_rm_calls;
      }
      s = e;
    }
    *count = kept;
    if (stats != nullptr)
      stats->seq_rm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};
static_assert(triattn::KVCacheView<cells_view>);

/// llama.cpp's cache tensors of a context, for `cells_view`: per layer the K and V data and
/// row strides, and the cache's element type. Throws for a cache the view cannot read.
class cache_tensors {
 public:
  cache_tensors(llama_context* ctx, triattn::kv_geometry geo) : geo_(geo) {
    const char* api = "triattn_llama::cache_tensors";
    TRIATTN_CHECK(ctx != nullptr, api, "context is null");
    memory_ = llama_get_memory(ctx);
    for (int l = 0; l < geo.num_layers; ++l) {
      llama_memory_kv_layer t{};
      TRIATTN_CHECK(llama_memory_kv_layer_get(memory_, l, &t), api, "layer ", l,
                    ": the context's memory is not a plain KV cache (SWA, hybrid and recurrent memories are not read)");
      TRIATTN_CHECK(t.k->type == t.v->type && (t.k->type == GGML_TYPE_F16 || t.k->type == GGML_TYPE_BF16), api,
                    "cache types K ", ggml_type_name(t.k->type), ", V ", ggml_type_name(t.v->type),
                    ": the view reads f16 or bf16, the same for K and V (--cache-type-k / --cache-type-v)");
      TRIATTN_CHECK(!t.k_rotated, api, "layer ", l, "'s keys are stored rotated (a quantized cache): their RoPE pairs are gone");
      TRIATTN_CHECK(!t.v_trans, api, "V is stored transposed (flash attention off): turn flash attention on (-fa on)");
      TRIATTN_CHECK(ggml_backend_buffer_is_host(t.k->buffer) && ggml_backend_buffer_is_host(t.v->buffer), api,
                    "layer ", l, "'s cache is not in host memory (a GPU cache needs the CUDA path)");
      const std::int64_t row = std::int64_t{geo.num_kv_heads} * geo.head_dim;
      TRIATTN_CHECK(t.k->ne[0] == row && t.v->ne[0] == row, api, "layer ", l, " holds rows of ", t.k->ne[0], " and ",
                    t.v->ne[0], " elements, the model ", row, " (kv_heads x head_dim)");
      geo_.type = t.k->type == GGML_TYPE_F16 ? triattn::dtype::f16 : triattn::dtype::bf16;
      k_layers_.push_back(static_cast<std::byte*>(t.k->data));
      v_layers_.push_back(static_cast<std::byte*>(t.v->data));
      k_row_bytes_ = static_cast<std::int64_t>(t.k->nb[1]);
      v_row_bytes_ = static_cast<std::int64_t>(t.v->nb[1]);
    }
  }

  /// A view of sequence `seq` over these tensors and the slot map the caller owns.
  cells_view view(llama_seq_id seq, std::span<std::int32_t> cells, std::span<std::int32_t> positions,
                  std::int32_t* count, sequence_stats* stats) const {
    return {geo_,   k_layers_.data(), v_layers_.data(), k_row_bytes_, v_row_bytes_, cells.data(), positions.data(), count,
            static_cast<std::int64_t>(cells.size()), memory_, seq, stats};
  }
  llama_memory_t memory() const { return memory_; }
  const triattn::kv_geometry& geometry() const { return geo_; }

 private:
  triattn::kv_geometry geo_;
  llama_memory_t memory_ = nullptr;
  std::vector<std::byte*> k_layers_, v_layers_;
  std::int64_t k_row_bytes_ = 0, v_row_bytes_ = 0;
};

/// What a held sequence's policy observes besides its cache: nothing (no graph callback), each
/// layer's queries, or the attention probabilities of those queries over its cells.
enum class reads { keys, queries, attention };

/// What the registry's `entry` observes when made with `in`: a policy that takes its queries
/// from calibration statistics (`in.calibrated_queries`) reads the keys alone.
inline reads reads_of(const triattn::basic_policy_entry<cells_view>& entry, const triattn::policy_inputs& in) {
  if (entry.needs.attention) return reads::attention;
  return entry.needs.queries && !in.calibrated_queries ? reads::queries : reads::keys;
}

/// The settings of one held sequence.
struct options {
  std::int64_t budget = 512;  ///< cells a round keeps
  reads feed = reads::keys;   ///< what the policy observes: queries and attention need a `query_capture`
};

/// One sequence `seq` of a llama.cpp context held at `options.budget` cells by `Policy` (a
/// triattn policy over `cells_view` with union granularity). Bind it to the context once the
/// context exists, then call `end_batch` after every `llama_decode` that carried tokens of
/// the sequence:
///
///     triattn_llama::held_sequence<P> s(model, seq, std::move(policy), opts);
///     llama_context* ctx = llama_init_from_model(model, params);  // flash attention on
///     s.bind(ctx);
///     ...
///     llama_decode(ctx, batch);
///     s.end_batch(prompt_length);
///
/// With `options.feed` other than `reads::keys`, a `query_capture` must be the context's
/// `cb_eval` and route this sequence's queries here (`take_query`).
template <class Policy>
class held_sequence {
 public:
  held_sequence(const llama_model* model, llama_seq_id seq, Policy policy, options o)
      : policy_(std::move(policy)), opts_(o), geo_(geometry_of(model)), seq_(seq) {
    const char* api = "triattn_llama::held_sequence";
    TRIATTN_CHECK(o.budget >= 1, api, "budget ", o.budget, " must be >= 1");
    TRIATTN_CHECK(policy_.round().grain == triattn::granularity::whole_sequence, api, "the policy's granularity is ",
                  triattn::granularity_name(policy_.round().grain),
                  "; a llama.cpp cell holds every layer and head, so it must be union (granularity::whole_sequence)");
  }
  held_sequence(const held_sequence&) = delete;  // the views and llama.cpp's callback point into it
  held_sequence& operator=(const held_sequence&) = delete;

  /// Reads `ctx`'s cache tensors (throws for a cache the view cannot read) and sizes the slot
  /// map to its n_ctx. Once, before the sequence's first `end_batch`.
  void bind(llama_context* ctx) {
    const char* api = "triattn_llama::held_sequence::bind";
    TRIATTN_CHECK(ctx != nullptr && !tensors_, api, "the context is null, or the sequence is bound already");
    TRIATTN_CHECK(seq_ >= 0 && static_cast<std::uint32_t>(seq_) < llama_n_seq_max(ctx), api, "sequence ", seq_,
                  " is outside the context's ", llama_n_seq_max(ctx), " sequences");
    tensors_.emplace(ctx, geo_);
    const auto cap = static_cast<std::size_t>(llama_n_ctx(ctx));
    cells_.assign(cap, 0);
    positions_.assign(cap, 0);
    if constexpr (requires(Policy& p, const cells_view& v) { p.attach(v); }) policy_.attach(view());
  }

  /// The sequence as a triattn view, its slot map as of the last `refresh`.
  cells_view view() {
    TRIATTN_CHECK(tensors_.has_value(), "triattn_llama::held_sequence", "bind the sequence to its context first");
    return tensors_->view(seq_, cells_, positions_, &count_, &stats_);
  }
  /// Reads the sequence's cells from llama.cpp into the slot map. Throws when they exceed it.
  void refresh() {
    TRIATTN_CHECK(tensors_.has_value(), "triattn_llama::held_sequence", "bind the sequence to its context first");
    const std::int32_t n = llama_memory_seq_cells(tensors_->memory(), seq_, cells_.data(), positions_.data(),
                                                  static_cast<std::int32_t>(cells_.size()));
    TRIATTN_CHECK(n >= 0 && n <= static_cast<std::int32_t>(cells_.size()), "triattn_llama::held_sequence::refresh",
                  "sequence ", seq_, " holds ", n, " cells; the slot map has ", cells_.size());
    count_ = n;
  }
  /// Cells the sequence holds (as of the last `refresh`).
  std::int32_t cells() const { return count_; }
  const sequence_stats& stats() const { return stats_; }
  Policy& policy() { return policy_; }
  /// Host memory this sequence costs beyond its policy: the slot map, 8 bytes a cell of n_ctx.
  std::size_t slot_map_bytes() const { return (cells_.capacity() + positions_.capacity()) * sizeof(std::int32_t); }

  /// After a successful `llama_decode` that carried this sequence's tokens: reads its cells
  /// and, when the policy's schedule says so, runs a round that frees the evicted cells in
  /// llama.cpp. `prompt_length`: positions below it are the prompt, protected by the policies
  /// that protect it while it is shorter than the budget; a longer prompt cannot stay whole in
  /// the budget, so it is compressed as it arrives, as eval's chunked prefill does (the round
  /// is told of no prompt), and the newest token stays. Returns whether a round ran.
  bool end_batch(std::int64_t prompt_length) {
    const char* api = "triattn_llama::held_sequence::end_batch";
    if (opts_.feed != reads::keys) {
      for (std::size_t l = 0; l < taken_.size(); ++l)
        TRIATTN_CHECK(taken_[l] == taken_[0] && taken_[0] > 0, api, "sequence ", seq_, ": layer ", l, " captured ",
                      taken_[l], " queries of the batch, layer 0 ", taken_[0],
                      " (is a query_capture the context's cb_eval, routing this sequence?)");
      std::fill(taken_.begin(), taken_.end(), 0);
    }
    refresh();
    stats_.peak_cells = std::max<std::int64_t>(stats_.peak_cells, count_);
    if (opts_.feed == reads::attention) observe_attention();
    if (count_ == 0) return false;
    const auto t0 = std::chrono::steady_clock::now();
    const triattn::round_context rc{static_cast<std::int64_t>(positions_[static_cast<std::size_t>(count_ - 1)]) + 1,
                                    prompt_length < opts_.budget ? prompt_length : 0};
    if (!triattn::maybe_compress(policy_, view(), opts_.budget, rc)) return false;
    // llama.cpp's count and the slot map agree (one more pass over the sequence's cells).
    const std::int32_t held = llama_memory_seq_cells(tensors_->memory(), seq_, nullptr, nullptr, 0);
    TRIATTN_CHECK(held == count_, api, "llama.cpp holds ", held, " cells of sequence ", seq_, " after the round, the view ",
                  count_);
    ++stats_.rounds;
    stats_.round_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return true;
  }

  /// From `query_capture`, during `llama_decode`: layer `layer`'s query (after RoPE) of this
  /// sequence's token at `position`, [q_heads, head_dim]. A policy that reads queries observes
  /// it now; one that reads attention at `end_batch`, when the batch's keys are in the cache.
  void take_query(int layer, llama_pos position, std::span<const float> q) {
    const char* api = "triattn_llama::held_sequence::take_query";
    const triattn::kv_geometry& g = geo_;
    const auto row = static_cast<std::size_t>(g.head_dim);
    TRIATTN_CHECK(opts_.feed != reads::keys && layer >= 0 && layer < g.num_layers &&
                      q.size() == static_cast<std::size_t>(g.num_q_heads) * row,
                  api, "sequence ", seq_, " (reads ", opts_.feed == reads::keys ? "keys only" : "queries", "): layer ",
                  layer, ", ", q.size(), " query elements, expected ", g.num_q_heads, " x ", g.head_dim);
    if (taken_.empty()) taken_.assign(static_cast<std::size_t>(g.num_layers), 0);
    ++taken_[static_cast<std::size_t>(layer)];
    if (opts_.feed == reads::attention) {
      pending_.push_back({layer, position});
      pending_q_.insert(pending_q_.end(), q.begin(), q.end());
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int h = 0; h < g.num_q_heads; ++h) observe(layer, h, position, q.subspan(h * row, row), {});
    charge_capture(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  /// Adds `seconds` to the time spent reading queries (`sequence_stats::capture_seconds`).
  void charge_capture(double seconds) { stats_.capture_seconds += seconds; }

 private:
  // The queries of the batch, for a policy that reads attention: each one's row over the
  // cells at positions up to its own (causal; the cells are in position order), softmax of
  // q·k/√head_dim as the model's attention computes it, from the f16/bf16 keys in the cache.
  void observe_attention() {
    const auto t0 = std::chrono::steady_clock::now();
    const triattn::kv_geometry& g = geo_;
    const auto dim = static_cast<std::size_t>(g.head_dim);
    const int group = g.num_q_heads / g.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    const cells_view v = view();
    keys_.resize(static_cast<std::size_t>(count_) * dim);
    probs_.resize(static_cast<std::size_t>(count_));
    for (int l = 0; l < g.num_layers; ++l) {
      for (int kv = 0; kv < g.num_kv_heads; ++kv) {
        bool loaded = false;
        for (std::size_t i = 0; i < pending_.size(); ++i) {
          if (pending_[i].layer != l) continue;
          if (!loaded) {  // [count_, head_dim] this head's keys, once for every query of the layer
            for (std::int32_t s = 0; s < count_; ++s) triattn::load_key(v, l, kv, s, keys_.data() + s * dim);
            loaded = true;
          }
          const auto n = static_cast<std::size_t>(
              std::upper_bound(positions_.begin(), positions_.begin() + count_, pending_[i].position) - positions_.begin());
          for (int h = kv * group; h < (kv + 1) * group; ++h) {
            const float* q = pending_q_.data() + (i * static_cast<std::size_t>(g.num_q_heads) + h) * dim;
            float top = -std::numeric_limits<float>::infinity();
            for (std::size_t s = 0; s < n; ++s) {
              float dot = 0.0f;
              for (std::size_t d = 0; d < dim; ++d) dot += q[d] * keys_[s * dim + d];
              probs_[s] = dot * scale;
              top = std::max(top, probs_[s]);
            }
            float sum = 0.0f;
            for (std::size_t s = 0; s < n; ++s) sum += probs_[s] = std::exp(probs_[s] - top);
            for (std::size_t s = 0; s < n; ++s) probs_[s] /= sum;
            observe(l, h, pending_[i].position, {q, dim}, {probs_.data(), n});
          }
        }
      }
    }
    pending_.clear();
    pending_q_.clear();
    charge_capture(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  void observe(int layer, int q_head, llama_pos position, std::span<const float> q, std::span<const float> probs) {
    if constexpr (requires { policy_.observe(0, 0, 0, std::span<const float>(), std::span<const float>()); })
      policy_.observe(layer, q_head, position, q, probs);
  }

  struct pending_query {
    int layer;
    llama_pos position;
  };

  Policy policy_;
  options opts_;
  triattn::kv_geometry geo_;
  llama_seq_id seq_;
  std::optional<cache_tensors> tensors_;
  std::vector<std::int32_t> cells_, positions_;  // [n_ctx] the slot map
  std::int32_t count_ = 0;
  std::vector<std::int32_t> taken_;              // [layers] queries of the batch taken
  std::vector<pending_query> pending_;           // the batch's queries, for attention
  std::vector<float> pending_q_;                 // [pending, q_heads, head_dim]
  std::vector<float> keys_, probs_;              // [cells, head_dim], [cells] scratch
  sequence_stats stats_;
};

/// The graph callback of a context whose held sequences read queries or attention: set
/// `params.cb_eval = query_capture::callback` and `params.cb_eval_user_data = &capture` before
/// creating the context, `bind` it to the context, and `route` each such sequence to its
/// `held_sequence`. It asks ggml for each layer's `Qcur` after RoPE, [head_dim, q_heads,
/// tokens] f32, and hands token i's column to the sequence llama.cpp decodes it for
/// (`llama_ubatch_tokens`: llama_decode may reorder a batch of several sequences). Asks for
/// nothing until bound, so a warm-up decode before the sequences exist costs no stop.
template <class Policy>
class query_capture {
 public:
  explicit query_capture(const llama_model* model) : geo_(geometry_of(model)) {}
  query_capture(const query_capture&) = delete;  // llama.cpp's callback points into it
  query_capture& operator=(const query_capture&) = delete;

  void bind(llama_context* ctx) { ctx_ = ctx; }
  /// Sequence `seq`'s queries go to `s` from now on (null: nowhere).
  void route(llama_seq_id seq, held_sequence<Policy>* s) {
    TRIATTN_CHECK(seq >= 0, "triattn_llama::query_capture::route", "sequence ", seq, " must be >= 0");
    if (static_cast<std::size_t>(seq) >= to_.size()) to_.resize(static_cast<std::size_t>(seq) + 1, nullptr);
    to_[static_cast<std::size_t>(seq)] = s;
  }
  /// Throws what went wrong inside the graph, if anything did (an exception must not cross
  /// ggml's scheduler: the callback records it and stops the graph, so llama_decode fails).
  void check() const { TRIATTN_CHECK(error_.empty(), "triattn_llama::query_capture", error_); }

  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto& c = *static_cast<query_capture*>(user);
    const int layer = c.ctx_ != nullptr && c.error_.empty() ? c.query_layer(t) : -1;
    if (ask) return layer >= 0;
    if (layer < 0) return true;
    try {
      c.take(t, layer);
      return true;
    } catch (const std::exception& e) {
      c.error_ = e.what();
      return false;
    }
  }

 private:
  // The layer of `t` when it is `Qcur-<l>` after RoPE, [head_dim, q_heads, tokens] f32; else -1.
  int query_layer(const ggml_tensor* t) const {
    const triattn::kv_geometry& g = geo_;
    const std::string_view name(t->name);
    if (!name.starts_with("Qcur-") || t->op != GGML_OP_ROPE || t->type != GGML_TYPE_F32 || t->ne[0] != g.head_dim ||
        t->ne[1] != g.num_q_heads)
      return -1;
    int layer = 0;
    for (const char ch : name.substr(5)) {
      if (ch < '0' || ch > '9' || layer > g.num_layers) return -1;
      layer = layer * 10 + (ch - '0');
    }
    return name.size() > 5 && layer < g.num_layers ? layer : -1;
  }

  void take(const ggml_tensor* t, int layer) {
    const char* api = "triattn_llama::query_capture";
    const auto t0 = std::chrono::steady_clock::now();
    const std::int32_t n = llama_ubatch_tokens(ctx_, nullptr, nullptr, 0);
    TRIATTN_CHECK(n == t->ne[2] && ggml_is_contiguous(t), api, t->name, " holds ", t->ne[2],
                  " tokens, the ubatch being computed ", n);
    seqs_.resize(static_cast<std::size_t>(n));
    positions_.resize(static_cast<std::size_t>(n));
    llama_ubatch_tokens(ctx_, seqs_.data(), positions_.data(), n);
    staging_.resize(static_cast<std::size_t>(ggml_nelements(t)));
    ggml_backend_tensor_get(t, staging_.data(), 0, ggml_nbytes(t));
    const auto row = static_cast<std::size_t>(geo_.num_q_heads) * static_cast<std::size_t>(geo_.head_dim);
    held_sequence<Policy>* last = nullptr;
    for (std::int32_t i = 0; i < n; ++i) {
      const auto s = static_cast<std::size_t>(seqs_[static_cast<std::size_t>(i)]);
      held_sequence<Policy>* h = s < to_.size() ? to_[s] : nullptr;
      if (h == nullptr) continue;
      h->take_query(layer, positions_[static_cast<std::size_t>(i)], {staging_.data() + static_cast<std::size_t>(i) * row, row});
      last = h;
    }
    // The copy out of the graph, charged to a sequence the tensor carried (all of it, with one).
    if (last != nullptr) last->charge_capture(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  triattn::kv_geometry geo_;
  llama_context* ctx_ = nullptr;
  std::vector<held_sequence<Policy>*> to_;  // [sequences] where each sequence's queries go
  std::vector<llama_seq_id> seqs_;          // [ubatch] each token's sequence
  std::vector<llama_pos> positions_;        // [ubatch] and position
  std::vector<float> staging_;              // [ubatch, q_heads, head_dim] Qcur
  std::string error_;
};

/// The registry's policy `entry` made for llama.cpp's cells: one keep set per sequence (a
/// cell holds every layer and head), rounds when a sequence holds `slack` cells past its
/// budget, and the newest token always kept (llama.cpp continues after it).
inline triattn::basic_any_policy<cells_view> cells_policy(const triattn::basic_policy_entry<cells_view>& entry,
                                                          const triattn::policy_inputs& in, std::int64_t slack) {
  triattn::basic_any_policy<cells_view> p = *entry.create(in);
  triattn::round_options r = p.round();
  r.grain = triattn::granularity::whole_sequence;
  r.sched = triattn::schedule::with_slack(slack);
  r.recent = std::max<std::int64_t>(r.recent, 1);
  p.set_round(r);
  return p;
}

}  // namespace triattn_llama
