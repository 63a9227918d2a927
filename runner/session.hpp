/// \file runner/session.hpp
/// \brief Per-sequence sessions of the runner: a KV cache that triattn compresses in place (`view()`), the
/// forward pass, and `batch_decoder`, which decodes many sequences together.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "runner/kernels.hpp"
#include "runner/model.hpp"
#include "runner/thread_team.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"

namespace triattn_runner {

/// Receives what the attention of every (layer, q-head) saw, once per token. For policies
/// that learn from attention (H2O, calibration of TriAttention).
struct observer {
  virtual ~observer() = default;
  /// `q_post_rope` [head_dim] is the query of the token at `position`; `probs` [length] are
  /// its softmax weights over the slots its kv head holds (the new token's slot last).
  virtual void on_attention(int layer, int q_head, std::int32_t position, std::span<const float> q_post_rope,
                            std::span<const float> probs) = 0;
};

/// Activations of a batch of `n` sequences, row s for sequence s, allocated once and reused.
struct forward_buffers {
  int n = 0;
  std::vector<float> x, xb, xb2, q, k, v, hb, hb2, logits;  // [n, dim] x4, [n, kv_dim] x2, [n, hidden] x2, [n, vocab]
  std::vector<std::vector<float>> att, row;                  // per team member: [group, capacity], [head_dim]
  std::vector<std::vector<std::byte>> quantized;             // per team member: a block product's inputs
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
    quantized.resize(att.size());
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
  session(const triattn_runner::model& m, std::int64_t capacity, triattn::dtype cache_type = triattn::dtype::f32);
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
    triattn_runner::forward(*model_, {&self, 1}, {&token, 1}, buffers_, solo, true, "triattn_runner::session::forward");
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

  const triattn_runner::model& model() const { return *model_; }
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
    const char* api = "triattn_runner::session::copy_from";
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
  friend void forward(const triattn_runner::model&, std::span<session* const>, std::span<const int>, forward_buffers&,
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

  const triattn_runner::model* model_;
  triattn_runner::config cfg_;
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

inline session::session(const triattn_runner::model& m, std::int64_t capacity, triattn::dtype cache_type)
    : model_(&m), cfg_(m.config()), capacity_(capacity) {
  const char* api = "triattn_runner::session";
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
  // out = x · wᵀ for member t's share of the panels of matrix `w` of layer l (a block matrix is
  // shared by the same rows).
  const auto product = [&](int t, float* out, tensor w, int l, const float* x) {
    const auto [rows, cols] = m.matrix_shape(w);
    const int panels = (rows + model::panel_rows - 1) / model::panel_rows;
    const int p0 = panels * t / members, p1 = panels * (t + 1) / members;
    if (const block_matrix* blocks = m.blocks(w, l)) {
      detail::matmul_blocks(out, *blocks, rows, cols, x, n, p0 * model::panel_rows,
                            std::min(rows, p1 * model::panel_rows), b.quantized[static_cast<std::size_t>(t)]);
    } else {
      detail::matmul_panels(out, m.panels(w, l).data(), x, rows, cols, n, p0, p1);
    }
  };
  for (int s = 0; s < n; ++s) {
    m.embed(tokens[s], row(b.x, s, dim));
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
    if (c.qkv_bias) {
      for (int s = 0; s < n; ++s) {
        detail::add(row(b.q, s, dim), m.weights(tensor::bq, l).data(), dim);
        detail::add(row(b.k, s, kv_dim), m.weights(tensor::bk, l).data(), kv_dim);
        detail::add(row(b.v, s, kv_dim), m.weights(tensor::bv, l).data(), kv_dim);
      }
    }

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
  explicit batch_decoder(const triattn_runner::model& m, int threads = 1) : model_(&m), team_(threads) {}

  /// Runs `tokens[s]` through `*sessions[s]` for every s (distinct sessions of this model) and
  /// returns the logits [n, vocab], row s for session s (valid until the next step); with
  /// `logits` false (a prefill that reads none) the classifier is skipped and the span is
  /// empty. Throws `triattn::error`, with every session unchanged, when a token is out of range
  /// or a cache full.
  std::span<const float> step(std::span<session* const> sessions, std::span<const int> tokens, bool logits = true) {
    forward(*model_, sessions, tokens, buffers_, team_, logits, "triattn_runner::batch_decoder::step");
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
  const triattn_runner::model* model_;
  forward_buffers buffers_;
  thread_team team_;
};

}  // namespace triattn_runner
