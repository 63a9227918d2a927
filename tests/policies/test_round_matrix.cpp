// The round pipeline's acceptance matrix: every policy x {per_layer, per_kv_head, union} x
// {dense NHD, dense HND, paged, a view type defined here} x {f32, f16, bf16, fp8 e4m3 with a
// scale} against the double-precision oracle (support/round_oracle.hpp over each policy's own
// oracle), on fresh random and adversarial inputs: exact ties, budget 1, budget >= length, GQA
// groups 1/2/4, both RoPE pairings, both key states, both budget modes, prompt protection.
// Also: pre-RoPE and post-RoPE caches of the same keys keep the same sets (SnapKV, R-KV,
// TriAttention, K-norm, KeyDiff, Expected Attention); a failed round leaves the cache untouched at every granularity; shared
// decisions over rows holding different positions are rejected naming the API;
// compress_batch; schedule::once_after_prompt through maybe_compress; head-adaptive budgets
// (budget_split) leave unequal per-head lengths on every view, round after round, and are
// refused where they cannot apply; segment quotas.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "support/attention_free_reference.hpp"
#include "support/baselines_reference.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/round_checks.hpp"
#include "support/round_oracle.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "support/window_oracle.hpp"
#include "support/window_reference.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/expected_attention.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/keydiff.hpp"
#include "triattn/policies/knorm.hpp"
#include "triattn/policies/rkv.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/vatp.hpp"
#include "triattn/registry.hpp"

namespace {

namespace ref = triattn_test::ref;
using triattn::granularity;
using triattn_test::cache_layout;
using triattn_test::largest_position;
using triattn_test::slot_contents;
using triattn_test::test_cache;

// --- the test's own view type: K and V rows interleaved in one allocation -----------------

/// Decodes through the run-time element functions (the view's own `key_accessor` hook).
struct own_accessor {
  triattn::dtype type = triattn::dtype::f32;
  float scale = 1.0f;
  void load(const std::byte* row, int n, float* out) const {
    for (int d = 0; d < n; ++d) out[d] = triattn::load_element(row, type, static_cast<std::size_t>(d)) * scale;
  }
  void store(std::byte* row, int n, const float* in) const {
    for (int d = 0; d < n; ++d) triattn::store_element(row, type, static_cast<std::size_t>(d), in[d] / scale);
  }
};

/// One allocation [layers, capacity, kv_heads, 2 (K then V), head_dim]; no freed_pages hook.
struct interleaved_view {
  triattn::kv_geometry geo{};
  std::byte* data = nullptr;
  std::int32_t* lengths = nullptr;    // [layers, kv_heads]
  std::int32_t* positions = nullptr;  // [layers, kv_heads, capacity]
  std::int64_t cap = 0;

  const triattn::kv_geometry& geometry() const { return geo; }
  std::int64_t capacity() const { return cap; }
  std::byte* row(int l, int h, std::int64_t s, int kv) const {
    const std::int64_t e = (((l * cap + s) * geo.num_kv_heads + h) * 2 + kv) * geo.head_dim;
    return data + e * static_cast<std::int64_t>(triattn::dtype_bytes(geo.type));
  }
  std::byte* key(int l, int h, std::int64_t s) const { return row(l, h, s, 0); }
  std::byte* value(int l, int h, std::int64_t s) const { return row(l, h, s, 1); }
  own_accessor key_accessor(int) const { return {geo.type, geo.k_scale}; }
  std::int32_t length(int l, int h) const { return lengths[l * geo.num_kv_heads + h]; }
  void set_length(int l, int h, std::int32_t n) const { lengths[l * geo.num_kv_heads + h] = n; }
  std::int32_t& position(int l, int h, std::int64_t s) const {
    return positions[(static_cast<std::int64_t>(l) * geo.num_kv_heads + h) * cap + s];
  }
  void validate(const char* api) const {
    TRIATTN_CHECK(data != nullptr && lengths != nullptr && positions != nullptr, api, "interleaved_view: null pointer");
    TRIATTN_CHECK(geo.num_layers > 0 && geo.num_kv_heads > 0 && geo.num_q_heads % geo.num_kv_heads == 0, api,
                  "interleaved_view: bad shape");
    TRIATTN_CHECK(geo.head_dim > 0 && geo.head_dim % 2 == 0, api, "interleaved_view: head_dim ", geo.head_dim);
    for (int i = 0; i < geo.num_layers * geo.num_kv_heads; ++i)
      TRIATTN_CHECK(lengths[i] >= 0 && lengths[i] <= cap, api, "interleaved_view: length ", lengths[i]);
  }
};
static_assert(triattn::KVCacheView<interleaved_view>);

/// The owning cache of an `interleaved_view`, a copy of a test cache's contents.
class own_cache {
 public:
  explicit own_cache(test_cache& src) : lengths(src.lengths), positions(src.positions), shape_(src.shape()) {
    const auto& s = shape_;
    row_bytes_ = static_cast<std::size_t>(s.head_dim) * triattn::dtype_bytes(s.type);
    data_.resize(static_cast<std::size_t>(s.num_layers * s.capacity * s.num_kv_heads * 2) * row_bytes_);
    const interleaved_view v = view();
    for (int l = 0; l < s.num_layers; ++l)
      for (int h = 0; h < s.num_kv_heads; ++h)
        for (std::int64_t t = 0; t < s.capacity; ++t) {
          std::memcpy(v.key(l, h, t), src.key_row(l, h, t), row_bytes_);
          std::memcpy(v.value(l, h, t), src.value_row(l, h, t), row_bytes_);
        }
  }
  std::vector<std::int32_t> lengths, positions;

  interleaved_view view() {
    return {geometry(), data_.data(), lengths.data(), positions.data(), shape_.capacity};
  }
  template <class F>
  decltype(auto) with_view(F&& f) {
    return f(view());
  }
  const triattn_test::cache_shape& shape() const { return shape_; }
  std::int32_t& length(int l, int h) { return lengths[static_cast<std::size_t>(l * shape_.num_kv_heads + h)]; }
  slot_contents slot(int l, int h, std::int64_t s) {
    const interleaved_view v = view();
    const std::byte *k = v.key(l, h, s), *val = v.value(l, h, s);
    return {{k, k + row_bytes_}, {val, val + row_bytes_}, v.position(l, h, s)};
  }
  struct bytes {
    std::vector<std::byte> data;
    std::vector<std::int32_t> lengths, positions;
    bool operator==(const bytes&) const = default;
  };
  bytes snapshot() const { return {data_, lengths, positions}; }

 private:
  triattn::kv_geometry geometry() const {
    return {shape_.num_layers, shape_.num_kv_heads * shape_.group, shape_.num_kv_heads, shape_.head_dim, shape_.type,
            shape_.keys, shape_.rope, shape_.k_scale, shape_.v_scale};
  }
  triattn_test::cache_shape shape_;
  std::size_t row_bytes_ = 0;
  std::vector<std::byte> data_;
};

/// Whether two caches of one shape hold the same rows (K, V, positions) in every (layer, kv_head).
bool same_contents(test_cache& a, test_cache& b) {
  if (a.lengths != b.lengths) return false;
  for (int l = 0; l < a.shape().num_layers; ++l)
    for (int h = 0; h < a.shape().num_kv_heads; ++h)
      for (std::int32_t s = 0; s < a.length(l, h); ++s)
        if (!(a.slot(l, h, s) == b.slot(l, h, s))) return false;
  return true;
}

/// A copy of `src` in another layout (same shape, rows, lengths and positions).
test_cache relayout(test_cache& src, cache_layout layout, int page_size, std::mt19937_64& g) {
  auto shape = src.shape();
  shape.layout = layout;
  shape.page_size = page_size;
  test_cache c(shape, g);
  c.lengths = src.lengths;
  c.positions = src.positions;
  const std::size_t row_bytes = static_cast<std::size_t>(shape.head_dim) * triattn::dtype_bytes(shape.type);
  for (int l = 0; l < shape.num_layers; ++l)
    for (int h = 0; h < shape.num_kv_heads; ++h)
      for (std::int64_t s = 0; s < shape.capacity; ++s) {
        std::memcpy(c.key_row(l, h, s), src.key_row(l, h, s), row_bytes);
        std::memcpy(c.value_row(l, h, s), src.value_row(l, h, s), row_bytes);
      }
  return c;
}

// --- the matrix's axes ---------------------------------------------------------------------

enum class policy_kind { streaming_llm, h2o, vatp, snapkv, rkv, triattention, knorm, keydiff, expected_attention };
constexpr const char* policy_names[] = {"streaming_llm", "h2o",   "vatp",    "snapkv",            "rkv",
                                        "triattention",  "knorm", "keydiff", "expected_attention"};
const char* policy_name(policy_kind p) { return policy_names[static_cast<int>(p)]; }

// Each policy has its own random configuration and oracle here, so the matrix lists them; the
// compiler holds the list to the registry's.
constexpr bool matrix_covers_registry() {
  std::size_t compressing = 0;
  for (const triattn::policy_entry& e : triattn::policy_registry) {
    if (!e.compresses()) continue;
    ++compressing;
    bool found = false;
    for (const std::string_view n : policy_names) found = found || n == e.name;
    if (!found) return false;
  }
  return compressing == std::size(policy_names);
}
static_assert(matrix_covers_registry(), "the round matrix needs a case for every policy of triattn::policy_registry");
enum class view_kind { dense_nhd, dense_hnd, paged, own };
const char* view_name(view_kind v) {
  constexpr const char* names[] = {"dense NHD", "dense HND", "paged", "own interleaved view"};
  return names[static_cast<int>(v)];
}
constexpr triattn::dtype matrix_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                            triattn::dtype::fp8_e4m3};

/// Calls `f(cache, view)` on a copy of `base` held by the view kind `vk`.
template <class F>
void with_subject(view_kind vk, test_cache& base, std::mt19937_64& g, F&& f) {
  std::uniform_int_distribution<int> page(1, 5), coin(0, 1);
  switch (vk) {
    case view_kind::dense_nhd: {
      test_cache c = relayout(base, cache_layout::dense_nhd, 4, g);
      f(c, c.dense_view());
      return;
    }
    case view_kind::dense_hnd: {
      test_cache c = relayout(base, cache_layout::dense_hnd, 4, g);
      f(c, c.dense_view());
      return;
    }
    case view_kind::paged: {
      test_cache c = relayout(base, coin(g) ? cache_layout::paged_nhd : cache_layout::paged_hnd, page(g), g);
      f(c, c.paged_view());
      return;
    }
    case view_kind::own: {
      own_cache c(base);
      f(c, c.view());
      return;
    }
  }
}

/// A random base cache (dense NHD; `with_subject` copies it into the view under test) whose
/// rows share their slots as `grain` requires.
test_cache make_base(std::mt19937_64& g, triattn::dtype type, int group, granularity grain, triattn::rope_style style,
                     triattn::key_state keys, std::int64_t min_capacity = 4, std::int32_t min_length = 1) {
  auto shape = triattn_test::random_shape(g, cache_layout::dense_nhd, type, 4, group,
                                          {.min_layers = 1, .max_layers = 3, .max_kv_heads = 3, .max_half_dim = 4,
                                           .min_capacity = min_capacity, .max_capacity = 20});
  shape.rope.style = style;
  shape.keys = keys;
  if (ref::is_fp8(type)) {
    std::uniform_real_distribution<float> scale(0.01f, 0.05f);
    shape.k_scale = scale(g);
    shape.v_scale = scale(g);
  }
  test_cache c(shape, g);
  std::uniform_int_distribution<std::int32_t> len(std::min<std::int32_t>(min_length, static_cast<std::int32_t>(shape.capacity)),
                                                   static_cast<std::int32_t>(shape.capacity));
  for (auto& n : c.lengths) n = len(g);
  if (grain != granularity::per_layer)
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        const int rl = 0, rh = grain == granularity::whole_sequence ? 0 : h;
        c.length(l, h) = c.length(rl, rh);
        for (std::int64_t i = 0; i < shape.capacity; ++i) c.position(l, h, i) = c.position(rl, rh, i);
      }
  return c;
}

std::vector<std::int32_t> row_positions(test_cache& c, int l, int h) {
  std::vector<std::int32_t> p;
  for (std::int32_t s = 0; s < c.length(l, h); ++s) p.push_back(c.position(l, h, s));
  return p;
}

// --- one trial: a policy, its inputs, and its per-row oracle ------------------------------

/// Attention rows for H2O / VATP: every (layer, q_head) observes `rows` rows over all its slots.
struct attention_rows {
  struct row {
    int layer, q_head;
    std::int32_t position;
    std::vector<float> probs;
  };
  std::vector<row> rows;
};

/// A value-aware round's output projection: every layer's W_o [hidden, q_heads x head_dim], in
/// double for the oracle and as the library takes it (`output_gram`). Shared by a trial's
/// copies: `round_context::projection` points into it.
struct output_projection {
  std::vector<std::vector<double>> w_o;  // [layer][hidden x q_heads x head_dim]
  std::vector<float> gram;
  triattn::value_projection view;

  static std::shared_ptr<const output_projection> random(std::mt19937_64& g, const triattn::kv_geometry& geo) {
    auto p = std::make_shared<output_projection>();
    const int hidden = std::uniform_int_distribution<int>(1, 2 * geo.head_dim)(g);
    std::normal_distribution<double> x(0.0, 1.0);
    for (int l = 0; l < geo.num_layers; ++l) {
      std::vector<float> w(static_cast<std::size_t>(hidden) * geo.num_q_heads * geo.head_dim);
      for (float& e : w) e = static_cast<float>(x(g));
      p->w_o.emplace_back(w.begin(), w.end());
      triattn::append_output_gram(w, hidden, geo.num_q_heads, geo.head_dim, p->gram);
    }
    p->view = {geo.num_layers, geo.num_q_heads, geo.head_dim, p->gram.data()};
    return p;
  }
};

/// A trial: one policy of `kind` with a random configuration and inputs over `base`.
struct trial {
  policy_kind kind;
  triattn::round_options round;
  triattn::round_context ctx;
  std::int64_t budget = 1;
  // per policy
  std::int64_t sinks = 0;
  triattn::h2o_config h2o_cfg;
  triattn::vatp_config vatp_cfg;
  triattn::snapkv_config snap_cfg;
  triattn::rkv_config rkv_cfg;
  triattn::triattention_config tri_cfg;
  triattn::expected_attention_config ea_cfg;
  bool ea_calibrated = false;  ///< Expected Attention from `stats` instead of `queries`
  std::optional<triattn::query_stats> stats;
  attention_rows attention;
  std::optional<triattn_test::window_queries> queries;
  std::shared_ptr<const output_projection> projection;  ///< a value-aware round's, or null: plain norms
  bool ties = false;

  /// Gives every policy's config the trial's round options.
  void sync_round() {
    h2o_cfg.round = vatp_cfg.round = snap_cfg.round = rkv_cfg.round = tri_cfg.round = ea_cfg.round = round;
  }
  std::string describe() const {
    std::ostringstream os;
    os << policy_name(kind) << " grain " << triattn::granularity_name(round.grain) << " reduction "
       << (round.reduction == triattn::row_reduction::max ? "max" : "mean") << " budget " << budget << " mode "
       << (round.budget == triattn::budget_mode::beyond_prompt ? "beyond_prompt" : "with_prompt") << " protect_prompt "
       << round.protect_prompt << " sinks " << round.sinks << " recent " << round.recent << " prompt "
       << ctx.prompt_length << " position " << ctx.position << " segments " << round.segments << " split "
       << triattn::budget_split_name(round.split) << " floor " << round.split_floor << " value_aware "
       << round.value_aware << (projection ? " projected" : "") << (ties ? " ties" : "");
    return os.str();
  }
};

/// Makes the slots of every row tie in pairs (equal keys, values and positions are not
/// needed: the policy's inputs of slot `to` become those of slot `from`) for policies whose
/// scores are then bit-identical: TriAttention and KeyDiff (key and position), K-norm (key),
/// H2O (probabilities), VATP (probabilities and values), Expected Attention (key, position
/// and value).
void duplicate_slots(test_cache& c, trial& t, std::mt19937_64& g) {
  const auto& s = c.shape();
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(s.capacity) - 1);
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs;
  for (int i = 0; i < 6; ++i) pairs.emplace_back(pick(g), pick(g));
  for (auto [from, to] : pairs) {
    if (t.kind == policy_kind::triattention || t.kind == policy_kind::knorm || t.kind == policy_kind::keydiff ||
        t.kind == policy_kind::expected_attention) {
      for (int l = 0; l < s.num_layers; ++l)
        for (int h = 0; h < s.num_kv_heads; ++h) {
          c.store_key(l, h, to, c.key(l, h, from));
          c.position(l, h, to) = c.position(l, h, from);
        }
    }
    if (t.kind == policy_kind::vatp || t.kind == policy_kind::expected_attention) {
      for (int l = 0; l < s.num_layers; ++l)
        for (int h = 0; h < s.num_kv_heads; ++h)
          std::memcpy(c.value_row(l, h, to), c.value_row(l, h, from), static_cast<std::size_t>(s.head_dim) * triattn::dtype_bytes(s.type));
    }
    if (t.kind == policy_kind::h2o || t.kind == policy_kind::vatp)
      for (auto& r : t.attention.rows)
        if (static_cast<std::size_t>(std::max(from, to)) < r.probs.size()) r.probs[static_cast<std::size_t>(to)] = r.probs[static_cast<std::size_t>(from)];
  }
}

trial random_trial(std::mt19937_64& g, test_cache& c, policy_kind kind, granularity grain, bool ties) {
  trial t;
  t.kind = kind;
  t.ties = ties;
  std::uniform_int_distribution<int> coin(0, 1), small(0, 3);
  t.round.grain = grain;
  t.round.reduction = coin(g) ? triattn::row_reduction::max : triattn::row_reduction::mean;
  t.round.budget = small(g) == 0 ? triattn::budget_mode::beyond_prompt : triattn::budget_mode::with_prompt;
  t.round.protect_prompt = small(g) == 0;
  if (small(g) == 0) {  // the round's own sinks and recent window, on top of the policy's
    std::uniform_int_distribution<std::int64_t> count(0, c.shape().capacity + 1);
    t.round.sinks = count(g) / (1 + small(g));
    t.round.recent = count(g) / (1 + small(g));
  }
  t.round.sched = triattn::schedule::every_step();
  if (small(g) == 0) t.round.segments = std::uniform_int_distribution<std::int64_t>(2, 6)(g);
  // Head-adaptive budgets; not for StreamingLLM, whose scores are all 0: its pools split
  // between exact ties only, which the oracle cannot tell from fp32 near-ties.
  if (grain != granularity::whole_sequence && kind != policy_kind::streaming_llm && coin(g)) {
    t.round.split = grain == granularity::per_layer && coin(g) ? triattn::budget_split::per_layer
                                                               : triattn::budget_split::per_sequence;
    const float floors[] = {0.0f, 0.2f, 0.5f, 1.0f};
    t.round.split_floor = floors[small(g)];
  }
  if (small(g) == 0) {  // value-aware, by a random output projection or the plain norms
    t.round.value_aware = true;
    if (coin(g)) {
      t.projection = output_projection::random(g, c.geometry());
      t.ctx.projection = &t.projection->view;
    }
  }
  if (coin(g) && c.length(0, 0) > 0) {  // the prompt ends at a random slot of (0, 0)
    std::uniform_int_distribution<std::int32_t> slot(0, c.length(0, 0) - 1);
    t.ctx.prompt_length = c.position(0, 0, slot(g));
  }
  const std::int64_t last = largest_position(c);
  if (coin(g)) t.ctx.position = last + 1 + std::uniform_int_distribution<std::int64_t>(0, 300)(g);
  const std::int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
  const std::int64_t budgets[] = {1, longest, longest + 3};
  t.budget = small(g) < 3 ? std::uniform_int_distribution<std::int64_t>(1, std::max<std::int64_t>(longest - 1, 1))(g)
                          : budgets[small(g) % 3];
  const auto G = c.shape().group;
  switch (kind) {
    case policy_kind::streaming_llm: t.sinks = small(g); break;
    case policy_kind::h2o:
    case policy_kind::vatp: {
      triattn::h2o_config& h = kind == policy_kind::h2o ? t.h2o_cfg : t.vatp_cfg;
      std::uniform_int_distribution<std::int64_t> count(0, c.shape().capacity);
      if (small(g) == 0) h.heavy = count(g);
      if (small(g) == 0) h.recent = count(g);
      h.sinks = kind == policy_kind::vatp ? small(g) + (coin(g) ? 0 : 1) : (coin(g) ? small(g) : 0);
      h.gqa = triattn_test::all_aggregations[std::uniform_int_distribution<int>(0, 2)(g)];
      h.normalize = coin(g) != 0;
      // 1-3 rows per layer over all the slots, observed by every q-head (as an engine does),
      // at positions after the cache
      std::uniform_real_distribution<float> p(0.001f, 1.0f);
      for (int l = 0; l < c.shape().num_layers; ++l) {
        const int rows = 1 + small(g) % 3;
        for (int qh = 0; qh < c.shape().num_kv_heads * G; ++qh) {
          for (int r = 0; r < rows; ++r) {
            attention_rows::row row{l, qh, static_cast<std::int32_t>(last + 1 + r), {}};
            row.probs.resize(static_cast<std::size_t>(c.length(l, qh / G)));
            for (auto& x : row.probs) x = p(g);
            t.attention.rows.push_back(std::move(row));
          }
        }
      }
      break;
    }
    case policy_kind::snapkv: {
      t.snap_cfg.window = 1 + small(g);
      t.snap_cfg.kernel = (std::uniform_int_distribution<int>(0, 2)(g)) * 2 + 1;
      t.snap_cfg.pool = coin(g) ? triattn::pooling::max : triattn::pooling::avg;
      t.snap_cfg.grouping = small(g) == 0 ? triattn::snapkv_grouping::per_q_head : triattn::snapkv_grouping::aggregate;
      t.snap_cfg.gqa = triattn_test::all_aggregations[std::uniform_int_distribution<int>(0, 2)(g)];
      t.queries = triattn_test::window_queries::random(g, c, t.snap_cfg.window);
      break;
    }
    case policy_kind::rkv: {
      t.rkv_cfg.window = 1 + small(g);
      t.rkv_cfg.kernel = (std::uniform_int_distribution<int>(0, 2)(g)) * 2 + 1;
      t.rkv_cfg.lambda = std::uniform_real_distribution<float>(0.0f, 1.0f)(g);
      t.rkv_cfg.threshold = std::uniform_real_distribution<float>(-0.5f, 0.9f)(g);
      t.queries = triattn_test::window_queries::random(g, c, t.rkv_cfg.window);
      break;
    }
    case policy_kind::triattention: {
      t.tri_cfg.normalize = coin(g) != 0;
      t.tri_cfg.gqa_reduction =
          coin(g) ? triattn::triattention_gqa_reduction::max : triattn::triattention_gqa_reduction::mean;
      t.tri_cfg.window = small(g) == 0 ? small(g) : 0;
      const std::int64_t offset_max[] = {16, 1024, 65536};
      t.tri_cfg.offset_max = offset_max[std::uniform_int_distribution<int>(0, 2)(g)];
      t.tri_cfg.aggregation = coin(g) ? triattn::offset_aggregation::mean : triattn::offset_aggregation::max;
      t.stats = ref::tri_random_stats(g, c.geometry());
      break;
    }
    case policy_kind::knorm:
    case policy_kind::keydiff: break;  // the round's options are all they take
    case policy_kind::expected_attention: {
      t.ea_cfg.window = 1 + small(g);
      const std::int64_t future[] = {1, 7, 512};
      t.ea_cfg.future = future[std::uniform_int_distribution<int>(0, 2)(g)];
      t.ea_cfg.covariance = coin(g) != 0;
      t.ea_cfg.value_norm = small(g) != 0;
      t.ea_cfg.epsilon = coin(g) ? 0.0f : 0.01f;
      t.ea_cfg.sinks = small(g);
      t.ea_calibrated = small(g) == 0;
      if (t.ea_calibrated) {
        t.stats = ref::tri_random_stats(g, c.geometry());
      } else {
        t.queries = triattn_test::window_queries::random(g, c, t.ea_cfg.window);
        for (const auto& p : t.queries->positions)  // every layer keeps a query at or after the sinks
          t.ea_cfg.sinks = std::min<std::int64_t>(t.ea_cfg.sinks, p.back());
      }
      break;
    }
  }
  if (ties) {
    duplicate_slots(c, t, g);  // may copy a position from past a row's length: re-derive a given round start
    if (t.ctx.position >= 0) t.ctx.position = largest_position(c) + 1 + small(g);
  }
  t.sync_round();
  return t;
}

/// The policy's rule for one decision (what its `rule(info)` documents).
ref::round_rule rule_of(const trial& t) {
  switch (t.kind) {
    case policy_kind::streaming_llm: {
      const std::int64_t s = std::min(t.sinks, t.budget);
      return {s, t.budget - s, t.budget};
    }
    case policy_kind::h2o:
    case policy_kind::vatp: {
      const auto sp = ref::split_for(t.kind == policy_kind::h2o ? t.h2o_cfg : t.vatp_cfg, t.budget, t.ctx.prompt_length);
      return {sp.sinks, sp.recent, sp.recent + sp.heavy};
    }
    case policy_kind::snapkv: return {0, t.snap_cfg.window, t.budget};
    case policy_kind::rkv: return {0, t.rkv_cfg.window, t.budget};
    case policy_kind::triattention: return {0, t.tri_cfg.window, t.budget};
    case policy_kind::knorm:
    case policy_kind::keydiff: return {0, 0, t.budget};
    case policy_kind::expected_attention: return {t.ea_cfg.sinks, 0, t.budget};
  }
  return {};
}

/// The per-row oracle of the trial's policy over the base cache.
class row_oracle {
 public:
  row_oracle(test_cache& c, const trial& t) : c_(c), t_(t) {
    const int G = c.shape().group;
    if (t.kind == policy_kind::h2o || t.kind == policy_kind::vatp) {
      hist_.emplace(c.shape().num_layers, c.shape().num_kv_heads * G);
      for (const auto& r : t.attention.rows) {
        auto pos = row_positions(c, r.layer, r.q_head / G);
        hist_->observe(r.layer, r.q_head, pos, r.probs, 1.0);
      }
    }
    if (t.kind == policy_kind::triattention) {
      ref::tri_score_options so = ref::tri_options_for(c);
      so.offset_max = t.tri_cfg.offset_max;
      so.use_max = t.tri_cfg.aggregation == triattn::offset_aggregation::max;
      const std::int64_t r = t.ctx.position >= 0 ? t.ctx.position : largest_position(c) + 1;
      raw_ = ref::tri_cache_scores(c, *t.stats, r, so);
    }
  }

  /// Set when a row's score is discontinuous near its inputs (SnapKV per_q_head ranks of
  /// near-tied votes, R-KV similarities at the threshold): fp32 may differ by a whole step.
  mutable bool unstable = false;

  std::vector<double> operator()(int l, int h, const std::vector<bool>& candidate) const {
    const int G = c_.shape().group;
    const std::int32_t n = c_.length(l, h);
    switch (t_.kind) {
      case policy_kind::streaming_llm: return std::vector<double>(static_cast<std::size_t>(n), 0.0);
      case policy_kind::h2o:
      case policy_kind::vatp: {
        const auto& cfg = t_.kind == policy_kind::h2o ? t_.h2o_cfg : t_.vatp_cfg;
        auto s = ref::h2o_scores(*hist_, l, h, G, row_positions(c_, l, h), cfg.gqa, cfg.normalize);
        if (t_.kind == policy_kind::vatp) {
          const auto norms = ref::value_l1_norms(c_, l, h);
          for (std::size_t j = 0; j < s.size(); ++j) s[j] *= norms[j];
        }
        return s;
      }
      case policy_kind::snapkv: {
        const auto& cfg = t_.snap_cfg;
        const auto in = window_row(l, h, cfg.window);
        const auto votes = ref::snapkv_votes(in, cfg.window, cfg.kernel, cfg.pool == triattn::pooling::max);
        const auto rule = cfg.grouping == triattn::snapkv_grouping::per_q_head ? ref::group_rule::per_q_head
                          : cfg.gqa == triattn::gqa_aggregation::mean          ? ref::group_rule::mean
                          : cfg.gqa == triattn::gqa_aggregation::max           ? ref::group_rule::max
                                                                               : ref::group_rule::sum;
        if (in.k.size() <= static_cast<std::size_t>(cfg.window)) return std::vector<double>(in.k.size(), ref::inf);
        if (rule == ref::group_rule::per_q_head) {  // ranks: a near-tie of two votes swaps them by a whole rank
          double top = 0.0;
          for (const auto& v : votes)
            for (const double x : v) top = std::max(top, std::fabs(x));
          if (ref::order_margin(votes) < 1e-4 * top) unstable = true;
        }
        return ref::snapkv_scores(votes, in.k.size(), rule);
      }
      case policy_kind::rkv: {
        const auto& cfg = t_.rkv_cfg;
        double threshold_margin = ref::inf;
        auto z = ref::rkv_scores(window_row(l, h, cfg.window), cfg.window, cfg.kernel, cfg.lambda, cfg.threshold,
                                 threshold_margin);
        if (threshold_margin < 1e-5) unstable = true;  // a near-duplicate decision may flip in fp32
        return z;
      }
      case policy_kind::triattention: {
        ref::tri_select_options o;
        o.group_max = t_.tri_cfg.gqa_reduction == triattn::triattention_gqa_reduction::max;
        o.normalize = t_.tri_cfg.normalize;
        return ref::tri_group_score(raw_, l, h, G, candidate, o);
      }
      case policy_kind::expected_attention: return expected_attention_row(l, h, candidate);
      case policy_kind::knorm: return flag_formula_ties(ref::knorm_scores(c_, l, h), l, h);
      case policy_kind::keydiff: return flag_formula_ties(ref::keydiff_scores(c_, l, h), l, h);
    }
    return {};
  }

 private:
  test_cache& c_;
  const trial& t_;
  std::optional<ref::attention_history> hist_;
  ref::tri_scores raw_;

  /// `x`, the key-only scores of row (l, h), setting `unstable` when two different keys tie
  /// exactly in the formula: fp8 keys that hold the same elements permuted (K-norm), collinear
  /// keys, or two directions and their bisector, the anchor (KeyDiff). fp32 sums them in
  /// another order and rounds them apart; equal keys tie exactly on both sides.
  std::vector<double> flag_formula_ties(std::vector<double> x, int l, int h) const {
    for (std::size_t a = 0; a < x.size(); ++a)
      for (std::size_t b = a + 1; b < x.size(); ++b)
        if (std::fabs(x[a] - x[b]) <= 1e-12 && c_.key(l, h, static_cast<std::int64_t>(a)) != c_.key(l, h, static_cast<std::int64_t>(b)))
          unstable = true;
    return x;
  }

  /// Expected Attention of row (l, h): the sinks score +inf and take no part in the softmax.
  std::vector<double> expected_attention_row(int l, int h, const std::vector<bool>& candidate) const {
    const auto& cfg = t_.ea_cfg;
    const int G = c_.shape().group, D = c_.shape().head_dim;
    std::vector<ref::query_moments> moments;
    for (int gi = 0; gi < G; ++gi) {
      if (t_.ea_calibrated) {  // the stats' means, no covariance
        ref::query_moments m{std::vector<double>(static_cast<std::size_t>(D), 0.0),
                             std::vector<double>(static_cast<std::size_t>(D) * D, 0.0)};
        const std::size_t row = t_.stats->row(l, h * G + gi);
        for (int f = 0; f < D / 2; ++f) {
          const auto [re, im] = ref::band_dims(c_.shape().rope.style, D, f);
          m.mean[re] = t_.stats->q_mean_real[row + f];
          m.mean[im] = t_.stats->q_mean_imag[row + f];
        }
        moments.push_back(m);
      } else {
        const ref::window_row in = t_.queries->row(c_, l, h, cfg.window);
        moments.push_back(ref::moments_of(c_.shape().rope, in.q[gi], in.q_pos, cfg.sinks, cfg.covariance));
        if (moments.back().cov.empty()) moments.back().cov.assign(static_cast<std::size_t>(D) * D, 0.0);
      }
    }
    std::vector<bool> competes = candidate;
    for (std::size_t s = 0; s < competes.size(); ++s) competes[s] = competes[s] && static_cast<std::int64_t>(s) >= cfg.sinks;
    const double T = static_cast<double>(t_.ctx.position >= 0 ? t_.ctx.position : largest_position(c_) + 1);
    auto x = ref::expected_attention_scores(c_, l, h, moments, T, cfg.future, competes, cfg.value_norm, cfg.epsilon);
    for (std::size_t s = 0; s < x.size(); ++s)
      if (static_cast<std::int64_t>(s) < cfg.sinks) x[s] = ref::inf;
    return x;
  }

  /// The window oracle's inputs, keys post-RoPE (a pre-RoPE cache's keys rotated to their
  /// positions, in double).
  ref::window_row window_row(int l, int h, int window) const {
    ref::window_row in = t_.queries->row(c_, l, h, window);
    if (c_.shape().keys == triattn::key_state::pre_rope)
      for (std::size_t s = 0; s < in.k.size(); ++s) in.k[s] = ref::rotate(c_.shape().rope, in.k[s], in.k_pos[s]);
    return in;
  }
};

/// Relative tolerance of a decision's margin: fp32 scoring error (z-scores, softmax sums,
/// means over rows) is well below it.
constexpr double rel_tol = 2e-4;

/// The pools of a budget split: a layer's decisions (per_layer granularity) or all of them.
int pool_count(const triattn::round_options& o, int layers) {
  return o.split == triattn::budget_split::per_layer ? layers : 1;
}
int pool_of(const triattn::round_options& o, int kv_heads, int decision) {
  return o.split == triattn::budget_split::per_layer ? decision / kv_heads : 0;
}

/// Whether the policy's scores are logits to a value-aware round (what core/value_weighting.hpp
/// says of each).
bool logit_scores(policy_kind k) {
  return k == policy_kind::triattention || k == policy_kind::knorm || k == policy_kind::keydiff || k == policy_kind::rkv;
}

/// The oracle's decisions of a trial; `unstable` is set when they are not to be trusted.
std::vector<ref::round_decision> oracle_decisions(test_cache& c, const trial& t, bool* unstable = nullptr) {
  const row_oracle policy_rows(c, t);
  const auto rows = [&](int l, int h, const std::vector<bool>& candidate) {
    std::vector<double> x = policy_rows(l, h, candidate);
    if (!t.round.value_aware) return x;
    const std::vector<double> w =
        ref::value_weights(c, l, h, t.projection ? t.projection->w_o[static_cast<std::size_t>(l)] : std::vector<double>{});
    for (std::size_t s = 0; s < x.size(); ++s)
      if (candidate[s]) x[s] = ref::value_weighted(x[s], w[s], logit_scores(t.kind));
    return x;
  };
  const ref::round_spec spec{t.round.grain,
                             t.round.reduction == triattn::row_reduction::max,
                             t.round.budget == triattn::budget_mode::beyond_prompt,
                             t.round.protect_prompt,
                             t.ctx.prompt_length,
                             t.round.sinks,
                             t.round.recent,
                             t.round.segments,
                             static_cast<int>(t.round.split),
                             static_cast<double>(t.round.split_floor)};
  const int L = c.shape().num_layers, H = c.shape().num_kv_heads;
  std::vector<ref::round_decision> out;
  const int count = ref::decision_count(t.round.grain, L, H);
  for (int d = 0; d < count; ++d) {
    const auto members = ref::decision_rows(t.round.grain, L, H, d);
    const auto positions = row_positions(c, members[0].first, members[0].second);
    if (spec.split == 0) {
      out.push_back(ref::decide(members, positions, rule_of(t), spec, rows));
    } else {  // every decision with candidates is scored: the pool compares them all
      out.push_back(ref::prepare(members, positions, rule_of(t), spec, rows,
                                 [](std::int64_t n, std::int64_t prot, std::int64_t k) { return k > 0 && n > prot; }));
    }
  }
  if (spec.split != 0)
    for (int p = 0; p < pool_count(t.round, L); ++p) {
      std::vector<ref::round_decision*> pool;
      for (int d = 0; d < count; ++d)
        if (pool_of(t.round, H, d) == p) pool.push_back(&out[static_cast<std::size_t>(d)]);
      ref::split_pool(pool, spec.split_floor, rel_tol);
    }
  if (unstable != nullptr) *unstable = policy_rows.unstable;
  return out;
}

/// Builds the trial's policy, feeds it over `view` and calls `f(policy)`.
template <class V, class F>
void with_policy(const trial& t, const V& view, F&& f) {
  switch (t.kind) {
    case policy_kind::streaming_llm: {
      triattn::streaming_llm_config cfg{t.sinks, false};
      cfg.round = t.round;
      triattn::streaming_llm p(cfg);
      f(p);
      return;
    }
    case policy_kind::h2o:
    case policy_kind::vatp: {
      const auto feed = [&](auto& p) {
        p.attach(view);
        for (const auto& r : t.attention.rows) p.observe(r.layer, r.q_head, r.position, {}, r.probs);
        f(p);
      };
      if (t.kind == policy_kind::h2o) {
        triattn::h2o p(t.h2o_cfg);
        feed(p);
      } else {
        triattn::vatp p(t.vatp_cfg);
        feed(p);
      }
      return;
    }
    case policy_kind::snapkv: {
      triattn::snapkv p(t.snap_cfg);
      t.queries->feed(p, view);
      f(p);
      return;
    }
    case policy_kind::rkv: {
      triattn::rkv p(t.rkv_cfg);
      t.queries->feed(p, view);
      f(p);
      return;
    }
    case policy_kind::triattention: {
      triattn::triattention p(*t.stats, t.tri_cfg);
      f(p);
      return;
    }
    case policy_kind::knorm: {
      triattn::knorm p(triattn::key_scored_config{t.round});
      f(p);
      return;
    }
    case policy_kind::keydiff: {
      triattn::keydiff p(triattn::key_scored_config{t.round});
      f(p);
      return;
    }
    case policy_kind::expected_attention: {
      if (t.ea_calibrated) {
        triattn::expected_attention p(*t.stats, t.ea_cfg);
        f(p);
      } else {
        triattn::expected_attention p(t.ea_cfg);
        t.queries->feed(p, view);
        f(p);
      }
      return;
    }
  }
}


struct tally {
  int decisions = 0, decisive = 0, scored_decisive = 0, trials = 0, unstable = 0;
};

/// Runs `t` on the view kind `vk` (a copy of `base`): the plan against the oracle, then
/// compress, which must leave exactly the plan's slots (K, V, positions) in every row.
void run_trial(test_cache& base, const trial& t, view_kind vk, std::mt19937_64& g, tally& tl) {
  bool unstable = false;
  const auto want = oracle_decisions(base, t, &unstable);
  tl.unstable += unstable ? 1 : 0;
  const int L = base.shape().num_layers, H = base.shape().num_kv_heads;
  with_subject(vk, base, g, [&](auto& cache, const auto& view) {
    with_policy(t, view, [&](auto& policy) {
      if constexpr (requires { policy.score(view, std::span<float>{}); }) {  // the per-row scores (H2O, VATP, SnapKV, R-KV)
        const row_oracle rows(base, t);
        std::vector<float> out(static_cast<std::size_t>(L * H * base.shape().capacity));
        if constexpr (std::is_same_v<std::decay_t<decltype(policy)>, triattn::expected_attention>) {
          policy.score(view, t.ctx.position, out);  // its expectation runs from the round start
        } else {
          policy.score(view, out);
        }
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < H; ++h) {
            const auto want_row = rows(l, h, std::vector<bool>(static_cast<std::size_t>(base.length(l, h)), true));
            if (rows.unstable) break;
            double scale = 0.0;
            for (const double x : want_row)
              if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
            for (std::int32_t s = 0; s < base.length(l, h); ++s) {
              const float got = out[static_cast<std::size_t>((l * H + h) * base.shape().capacity + s)];
              INFO("score of layer " << l << " kv_head " << h << " slot " << s << " got " << got << " want " << want_row[s]);
              if (std::isinf(want_row[s])) {
                REQUIRE(got == want_row[s]);
              } else {
                REQUIRE(std::fabs(got - want_row[s]) <= 1e-4 * scale + 1e-6);
              }
            }
          }
      }
      const triattn::keep_plan plan = policy.plan(view, t.budget, t.ctx);
      REQUIRE(plan.rows() == static_cast<std::size_t>(L * H));
      for (const auto& d : want) {
        ++tl.decisions;
        if (unstable) break;  // counted as not decisive
        const bool sure = ref::decisive(d, rel_tol) && d.count_sure;
        tl.decisive += sure ? 1 : 0;
        tl.scored_decisive += sure && !d.score.empty() ? 1 : 0;
        for (const auto& [l, h] : d.rows) {
          const std::vector<std::int32_t> got(plan.row(l, h).begin(), plan.row(l, h).end());
          INFO("layer " << l << " kv_head " << h << " margin " << d.margin << " scale " << d.scale << " got "
                        << Catch::Detail::stringify(got) << " want " << Catch::Detail::stringify(d.keep));
          if (sure) {
            REQUIRE(got == d.keep);
          } else {
            REQUIRE(ref::valid_top_set(d, got, rel_tol));
          }
          // beyond_prompt: every prompt slot survives, on top of the budget
          if (t.round.budget == triattn::budget_mode::beyond_prompt && !t.ties)  // ties may reorder positions
            for (std::int32_t s = 0; s < base.length(l, h); ++s)
              if (base.position(l, h, s) < t.ctx.prompt_length) REQUIRE(std::binary_search(got.begin(), got.end(), s));
        }
      }
      // a budget split keeps the oracle's count per pool, whoever wins a close cut
      if (t.round.split != triattn::budget_split::equal && !unstable)
        for (int p = 0; p < pool_count(t.round, L); ++p) {
          std::size_t got = 0, wanted = 0;
          for (std::size_t d = 0; d < want.size(); ++d)
            if (pool_of(t.round, H, static_cast<int>(d)) == p) {
              wanted += want[d].keep.size() * want[d].rows.size();
              for (const auto& [l, h] : want[d].rows) got += plan.row(l, h).size();
            }
          REQUIRE(got == wanted);
        }
      // compress moves exactly the plan's slots
      std::vector<std::vector<slot_contents>> kept;
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          kept.emplace_back();
          for (const auto s : plan.row(l, h)) kept.back().push_back(cache.slot(l, h, s));
        }
      triattn::compress(policy, view, t.budget, t.ctx);
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          const auto& k = kept[static_cast<std::size_t>(l * H + h)];
          REQUIRE(cache.length(l, h) == static_cast<std::int32_t>(k.size()));
          for (std::size_t i = 0; i < k.size(); ++i) REQUIRE(cache.slot(l, h, static_cast<std::int64_t>(i)) == k[i]);
        }
    });
  });
  ++tl.trials;
}

}  // namespace

TEST_CASE("every policy x granularity x view x dtype matches the round oracle") {
  const auto kind = GENERATE(policy_kind::streaming_llm, policy_kind::h2o, policy_kind::vatp, policy_kind::snapkv,
                             policy_kind::rkv, policy_kind::triattention, policy_kind::knorm, policy_kind::keydiff,
                             policy_kind::expected_attention);
  const auto grain = GENERATE(granularity::per_layer, granularity::per_kv_head, granularity::whole_sequence);
  const auto vk = GENERATE(view_kind::dense_nhd, view_kind::dense_hnd, view_kind::paged, view_kind::own);
  const auto type = GENERATE(from_range(std::begin(matrix_dtypes), std::end(matrix_dtypes)));
  auto g = triattn_test::rng(3000 + static_cast<std::uint64_t>(kind) * 100 + static_cast<std::uint64_t>(grain) * 10 +
                             static_cast<std::uint64_t>(vk));
  INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << policy_name(kind) << " "
                            << triattn::granularity_name(grain) << " " << view_name(vk) << " " << triattn::dtype_name(type));
  tally tl;
  for (int i = 0; i < 6; ++i) {
    const int group = 1 << (i % 3);
    const auto style = i % 2 ? triattn::rope_style::interleaved : triattn::rope_style::half;
    const auto keys = (i / 2) % 2 ? triattn::key_state::pre_rope : triattn::key_state::post_rope;
    test_cache base = make_base(g, type, group, grain, style, keys);
    const trial t = random_trial(g, base, kind, grain, i == 5);
    INFO(base.shape().describe() << " " << t.describe());
    run_trial(base, t, vk, g, tl);
  }
  CHECK(tl.trials == 6);
  // most decisions are decisive (near-ties are rare on continuous random inputs; a union
  // combination has only one decision per trial, so the floor is loose here and tight in the
  // next test case, which sums 16 scored trials). An unstable trial counts one decision, not
  // decisive (fp8 keys of head_dim 2 tie in K-norm's and KeyDiff's formulas often).
  INFO("decisions " << tl.decisions << " decisive " << tl.decisive << " scored and decisive " << tl.scored_decisive
                    << " unstable trials " << tl.unstable);
  CHECK(tl.decisive * 2 >= tl.decisions - tl.unstable);
}

TEST_CASE("the round oracle sees scored decisions on every policy and granularity") {
  // The matrix above draws budgets at random; here every trial must score: long rows, a
  // budget well below them, no prompt. Counts the decisive scored decisions and requires a floor.
  const auto kind = GENERATE(policy_kind::h2o, policy_kind::vatp, policy_kind::snapkv, policy_kind::rkv,
                             policy_kind::triattention, policy_kind::knorm, policy_kind::keydiff,
                             policy_kind::expected_attention);
  const auto grain = GENERATE(granularity::per_layer, granularity::per_kv_head, granularity::whole_sequence);
  auto g = triattn_test::rng(3900 + static_cast<std::uint64_t>(kind) * 10 + static_cast<std::uint64_t>(grain));
  INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << policy_name(kind) << " "
                            << triattn::granularity_name(grain));
  tally tl;
  for (int i = 0; i < 16; ++i) {
    const auto type = matrix_dtypes[i % 4];
    const auto vk = static_cast<view_kind>(i / 4);
    test_cache base = make_base(g, type, 1 << (i % 3), grain, i % 2 ? triattn::rope_style::interleaved : triattn::rope_style::half,
                                i % 3 == 0 ? triattn::key_state::pre_rope : triattn::key_state::post_rope, 12, 12);
    trial t = random_trial(g, base, kind, grain, i % 4 == 3);
    t.ctx.prompt_length = 0;
    t.budget = 6;
    t.round.sinks = std::min<std::int64_t>(t.round.sinks, 1);  // the round's protection leaves slots to score
    t.round.recent = std::min<std::int64_t>(t.round.recent, 1);
    t.sync_round();
    if (kind == policy_kind::h2o || kind == policy_kind::vatp) {  // a split that leaves slots to score
      auto& h = kind == policy_kind::h2o ? t.h2o_cfg : t.vatp_cfg;
      h.heavy.reset();
      h.recent = 2;
      h.sinks = std::min<std::int64_t>(h.sinks, 1);
    }
    INFO(base.shape().describe() << " " << t.describe());
    run_trial(base, t, vk, g, tl);
  }
  INFO("decisions " << tl.decisions << " decisive and scored " << tl.scored_decisive);
  // Over 40 seeds every policy and granularity scored 0.84 or more of its decisions decisively
  // but SnapKV per_layer (0.69 at worst, 0.94 on average; CI drew 0.67): a trial whose
  // per_q_head votes near-tie counts none of its decisions, and per_layer has many per trial.
  CHECK(tl.scored_decisive * 2 >= tl.decisions);
}

TEST_CASE("budget 1 and budget >= length on every policy and granularity") {
  const auto kind = GENERATE(policy_kind::streaming_llm, policy_kind::h2o, policy_kind::vatp, policy_kind::snapkv,
                             policy_kind::rkv, policy_kind::triattention, policy_kind::knorm, policy_kind::keydiff,
                             policy_kind::expected_attention);
  const auto grain = GENERATE(granularity::per_layer, granularity::per_kv_head, granularity::whole_sequence);
  auto g = triattn_test::rng(3950 + static_cast<std::uint64_t>(kind) * 10 + static_cast<std::uint64_t>(grain));
  for (int i = 0; i < 8; ++i) {
    test_cache base = make_base(g, matrix_dtypes[i % 4], 1 << (i % 3), grain, triattn::rope_style::half,
                                triattn::key_state::post_rope);
    trial t = random_trial(g, base, kind, grain, false);
    t.round.budget = triattn::budget_mode::with_prompt;
    t.round.protect_prompt = false;
    t.sync_round();
    const std::int64_t longest = *std::max_element(base.lengths.begin(), base.lengths.end());
    const bool one = i % 2 == 0;
    t.budget = one ? 1 : longest + i;
    INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << base.shape().describe() << " " << t.describe());
    const auto want = oracle_decisions(base, t);
    for (const auto& d : want) {
      const auto n = static_cast<std::size_t>(base.length(d.rows[0].first, d.rows[0].second));
      if (one && t.round.split == triattn::budget_split::equal) {
        REQUIRE(d.keep.size() <= std::min<std::size_t>(n, 1));
      } else if (one) {  // a pool of budget 1 per decision: its count is the pool's
        REQUIRE(d.keep.size() <= std::min<std::size_t>(n, want.size()));
      } else if (t.kind != policy_kind::h2o && t.kind != policy_kind::vatp) {
        REQUIRE(d.keep.size() == n);  // nothing to evict
      }
    }
    if (!one && kind != policy_kind::h2o && kind != policy_kind::vatp) {  // a no-op, byte for byte
      with_subject(static_cast<view_kind>(i / 2 % 4), base, g, [&](auto& cache, const auto& view) {
        with_policy(t, view, [&](auto& policy) {
          const auto before = cache.snapshot();
          triattn::compress(policy, view, t.budget, t.ctx);
          CHECK(cache.snapshot() == before);
        });
      });
    }
    tally tl;
    run_trial(base, t, static_cast<view_kind>(i / 2 % 4), g, tl);
  }
}

TEST_CASE("SnapKV, R-KV, TriAttention, K-norm, KeyDiff and Expected Attention keep the same sets from pre-RoPE and post-RoPE caches") {
  auto g = triattn_test::rng(3960);
  int compared = 0;
  for (int i = 0; i < 108; ++i) {
    const auto kind = std::array{policy_kind::snapkv, policy_kind::rkv,     policy_kind::triattention,
                                 policy_kind::knorm,  policy_kind::keydiff, policy_kind::expected_attention}[i % 6];
    const auto grain = static_cast<granularity>(i / 3 % 3);
    const auto style = i / 9 % 2 ? triattn::rope_style::interleaved : triattn::rope_style::half;
    test_cache pre = make_base(g, triattn::dtype::f32, 1 << (i / 18 % 3), grain, style, triattn::key_state::pre_rope, 10, 8);
    // the same keys, stored rotated to their positions
    auto shape = pre.shape();
    shape.keys = triattn::key_state::post_rope;
    test_cache post_cache(shape, g);
    post_cache.lengths = pre.lengths;
    post_cache.positions = pre.positions;
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h)
        for (std::int64_t s = 0; s < shape.capacity; ++s) {
          post_cache.store_key(l, h, s, ref::rotate(shape.rope, pre.key(l, h, s), pre.position(l, h, s)));
          std::memcpy(post_cache.value_row(l, h, s), pre.value_row(l, h, s), static_cast<std::size_t>(shape.head_dim) * 4);
        }
    trial t = random_trial(g, pre, kind, grain, false);
    t.budget = 5;
    INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << pre.shape().describe() << " " << t.describe());
    bool unstable_pre = false, unstable_post = false;
    const auto want_pre = oracle_decisions(pre, t, &unstable_pre);
    const auto want_post = oracle_decisions(post_cache, t, &unstable_post);
    std::vector<std::int32_t> plan_pre, plan_post;
    with_policy(t, pre.dense_view(), [&](auto& p) { plan_pre = p.plan(pre.dense_view(), t.budget, t.ctx).indices; });
    with_policy(t, post_cache.dense_view(), [&](auto& p) { plan_post = p.plan(post_cache.dense_view(), t.budget, t.ctx).indices; });
    bool all_decisive = !unstable_pre && !unstable_post;
    for (std::size_t d = 0; d < want_pre.size(); ++d) {
      all_decisive = all_decisive && ref::decisive(want_pre[d], rel_tol) && ref::decisive(want_post[d], rel_tol);
      REQUIRE((!all_decisive || want_pre[d].keep == want_post[d].keep));  // the oracles agree (up to rounding)
    }
    if (!all_decisive) continue;
    ++compared;
    CHECK(plan_pre == plan_post);
    tally tl;
    run_trial(pre, t, view_kind::paged, g, tl);
    run_trial(post_cache, t, view_kind::own, g, tl);
  }
  CHECK(compared >= 50);
}

TEST_CASE("a failed round leaves the cache untouched at every granularity and view") {
  auto g = triattn_test::rng(3970);
  for (const auto kind : {policy_kind::snapkv, policy_kind::rkv, policy_kind::triattention, policy_kind::vatp}) {
    for (const auto grain : {granularity::per_layer, granularity::per_kv_head, granularity::whole_sequence}) {
      for (const auto vk : {view_kind::dense_nhd, view_kind::dense_hnd, view_kind::paged, view_kind::own}) {
        test_cache base = make_base(g, triattn::dtype::bf16, 2, grain, triattn::rope_style::half,
                                    triattn::key_state::post_rope, 8, 8);
        for (auto& n : base.lengths) n = 8;  // every row holds 8 slots: budget 3 scores every decision
        trial t = random_trial(g, base, kind, grain, false);
        t.budget = 3;
        t.ctx.prompt_length = 0;
        t.round.protect_prompt = false;
        t.round.sinks = t.round.recent = 0;
        t.round.budget = triattn::budget_mode::with_prompt;
        t.snap_cfg.window = t.rkv_cfg.window = 1;
        t.tri_cfg.window = 0;
        t.vatp_cfg.sinks = 0;
        t.vatp_cfg.heavy.reset();
        t.vatp_cfg.recent = 1;
        t.sync_round();
        const int l = base.shape().num_layers - 1, h = base.shape().num_kv_heads - 1;
        std::vector<double> bad(static_cast<std::size_t>(base.shape().head_dim), 0.5);
        bad[0] = std::numeric_limits<double>::quiet_NaN();
        if (kind == policy_kind::vatp) {
          base.store_value(l, h, 2, bad);
        } else {
          base.store_key(l, h, 2, bad);
        }
        INFO(policy_name(kind) << " " << triattn::granularity_name(grain) << " " << view_name(vk));
        with_subject(vk, base, g, [&](auto& cache, const auto& view) {
          with_policy(t, view, [&](auto& policy) {
            const auto before = cache.snapshot();
            triattn_test::throws_with([&] { triattn::compress(policy, view, t.budget, t.ctx); },
                                      {"triattn::compress", "layer " + std::to_string(l) + " kv_head " + std::to_string(h) + " slot 2", "finite"});
            CHECK(cache.snapshot() == before);
          });
        });
      }
    }
  }
}

TEST_CASE("shared granularities reject rows holding different positions, naming the API") {
  auto g = triattn_test::rng(3980);
  for (const auto kind : {policy_kind::streaming_llm, policy_kind::h2o, policy_kind::vatp, policy_kind::snapkv,
                          policy_kind::rkv, policy_kind::triattention, policy_kind::knorm, policy_kind::keydiff,
                          policy_kind::expected_attention}) {
    for (const auto grain : {granularity::per_kv_head, granularity::whole_sequence}) {
      for (const auto vk : {view_kind::dense_nhd, view_kind::paged, view_kind::own}) {
        test_cache base = make_base(g, triattn::dtype::f16, 2, grain, triattn::rope_style::half,
                                    triattn::key_state::post_rope, 6, 6);
        if (base.shape().num_layers * base.shape().num_kv_heads == 1 ||
            (grain == granularity::per_kv_head && base.shape().num_layers == 1))
          continue;  // nothing shared
        trial t = random_trial(g, base, kind, grain, false);
        t.budget = 2;
        t.ctx.position = -1;  // derived: the moved position below is above any given one
        const int l = base.shape().num_layers - 1, h = base.shape().num_kv_heads - 1;
        base.position(l, h, base.length(l, h) - 1) += 1000;  // the newest slot of the last row differs
        INFO(policy_name(kind) << " " << triattn::granularity_name(grain) << " " << view_name(vk));
        with_subject(vk, base, g, [&](auto& cache, const auto& view) {
          with_policy(t, view, [&](auto& policy) {
            const auto before = cache.snapshot();
            const std::string name(triattn::granularity_name(grain));
            triattn_test::throws_with([&] { triattn::compress(policy, view, t.budget, t.ctx); },
                                      {"triattn::compress", "layer " + std::to_string(l) + " kv_head " + std::to_string(h),
                                       name + " granularity"});
            triattn_test::throws_with([&] { (void)policy.plan(view, t.budget, t.ctx); },
                                      {"triattn::" + std::string(policy_name(kind)) + "::plan", name + " granularity"});
            CHECK(cache.snapshot() == before);
          });
        });
      }
    }
  }
}

TEST_CASE("compress_batch: per-sequence budgets and lengths; one failing sequence changes no cache") {
  auto g = triattn_test::rng(3990);
  for (int trial_i = 0; trial_i < 12; ++trial_i) {
    const int seqs = 2 + trial_i % 3;
    std::vector<test_cache> caches, copies;
    std::vector<std::int64_t> budgets;
    std::vector<triattn::round_context> contexts;
    auto shape = triattn_test::random_shape(g, cache_layout::dense_nhd, matrix_dtypes[trial_i % 4], 4, 2,
                                            {.min_capacity = 6, .max_capacity = 24});
    if (ref::is_fp8(shape.type)) shape.k_scale = shape.v_scale = 0.03f;
    for (int i = 0; i < seqs; ++i) {
      caches.emplace_back(shape, g);  // different lengths and positions per sequence
      copies.push_back(relayout(caches.back(), cache_layout::dense_nhd, 4, g));
      budgets.push_back(std::uniform_int_distribution<std::int64_t>(1, shape.capacity)(g));
      contexts.push_back({-1, std::uniform_int_distribution<std::int64_t>(0, 20)(g)});
    }
    std::vector<triattn::dense_kv_view> views;
    for (auto& c : caches) views.push_back(c.dense_view());
    INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << shape.describe() << " sequences " << seqs);
    const auto stats = ref::tri_random_stats(g, caches[0].geometry());
    triattn::triattention_config cfg;
    cfg.round.grain = triattn::granularity::per_layer;  // rows of a sequence hold different slots
    cfg.round.protect_prompt = false;  // so that budget 2 scores the row holding the NaN key
    triattn::triattention policy(stats, cfg);

    // one failing sequence (budget 0 or a NaN key in the last one): nothing changes anywhere
    auto bad_budgets = budgets;
    const bool nan_key = trial_i % 2 == 1;
    std::vector<double> key;
    if (nan_key) {
      for (auto& n : caches.back().lengths) n = std::max<std::int32_t>(n, 4);
      for (auto& n : copies.back().lengths) n = std::max<std::int32_t>(n, 4);
      bad_budgets.back() = 2;
      key = caches.back().key(0, 0, 1);
      auto k = key;
      k[0] = std::numeric_limits<double>::quiet_NaN();
      caches.back().store_key(0, 0, 1, k);
    } else {
      bad_budgets[static_cast<std::size_t>(seqs / 2)] = 0;
    }
    std::vector<triattn_test::cache_bytes> before;
    for (auto& c : caches) before.push_back(c.snapshot());
    triattn_test::throws_with(
        [&] {
          triattn::compress_batch(policy, std::span<const triattn::dense_kv_view>(views), std::span<const std::int64_t>(bad_budgets),
                                  std::span<const triattn::round_context>(contexts));
        },
        {"triattn::compress_batch", nan_key ? "finite" : "budget 0"});
    for (int i = 0; i < seqs; ++i) REQUIRE(caches[static_cast<std::size_t>(i)].snapshot() == before[static_cast<std::size_t>(i)]);
    if (nan_key) caches.back().store_key(0, 0, 1, key);

    // every sequence as compressed alone, with its own budget and context
    for (int i = 0; i < seqs; ++i)
      policy.compress(copies[static_cast<std::size_t>(i)].dense_view(), budgets[static_cast<std::size_t>(i)],
                      contexts[static_cast<std::size_t>(i)]);
    const auto results = triattn::compress_batch(policy, std::span<const triattn::dense_kv_view>(views),
                                                 std::span<const std::int64_t>(budgets),
                                                 std::span<const triattn::round_context>(contexts));
    REQUIRE(results.size() == static_cast<std::size_t>(seqs));
    for (int i = 0; i < seqs; ++i) {
      INFO("sequence " << i << " budget " << budgets[static_cast<std::size_t>(i)]);
      CHECK(caches[static_cast<std::size_t>(i)].snapshot() == copies[static_cast<std::size_t>(i)].snapshot());
      for (const auto n : caches[static_cast<std::size_t>(i)].lengths) CHECK(n <= budgets[static_cast<std::size_t>(i)]);
    }

    // per-sequence policies (H2O's state is per sequence): policy_of(i)
    std::vector<triattn::h2o> h2os(static_cast<std::size_t>(seqs));
    std::vector<triattn::h2o> alone(static_cast<std::size_t>(seqs));
    for (int i = 0; i < seqs; ++i) {
      auto& c = caches[static_cast<std::size_t>(i)];
      h2os[static_cast<std::size_t>(i)].attach(views[static_cast<std::size_t>(i)]);
      alone[static_cast<std::size_t>(i)].attach(copies[static_cast<std::size_t>(i)].dense_view());
      for (int l = 0; l < shape.num_layers; ++l)
        for (int qh = 0; qh < shape.num_kv_heads * shape.group; ++qh) {
          if (c.length(l, qh / shape.group) == 0) continue;  // an empty row has nothing to observe
          const auto probs = triattn_test::normal_floats(g, static_cast<std::size_t>(c.length(l, qh / shape.group)));
          std::vector<float> p(probs.size());
          for (std::size_t j = 0; j < p.size(); ++j) p[j] = std::fabs(probs[j]);
          h2os[static_cast<std::size_t>(i)].observe(l, qh, 1000, {}, p);
          alone[static_cast<std::size_t>(i)].observe(l, qh, 1000, {}, p);
        }
    }
    std::vector<std::int64_t> smaller(budgets);
    for (auto& b : smaller) b = std::max<std::int64_t>(1, b / 2);
    for (int i = 0; i < seqs; ++i)
      alone[static_cast<std::size_t>(i)].compress(copies[static_cast<std::size_t>(i)].dense_view(), smaller[static_cast<std::size_t>(i)]);
    triattn::compress_batch([&](std::size_t i) -> triattn::h2o& { return h2os[i]; },
                            std::span<const triattn::dense_kv_view>(views), std::span<const std::int64_t>(smaller));
    for (int i = 0; i < seqs; ++i)
      CHECK(caches[static_cast<std::size_t>(i)].snapshot() == copies[static_cast<std::size_t>(i)].snapshot());
  }
}

TEST_CASE("schedule::once_after_prompt through maybe_compress fires once, at position == prompt_length") {
  auto g = triattn_test::rng(3995);
  int fired = 0;
  for (int i = 0; i < 16; ++i) {
    auto shape = triattn_test::random_shape(g, triattn_test::all_layouts[i % 4], matrix_dtypes[i % 4], 3, 1 << (i % 3),
                                            {.min_capacity = 30, .max_capacity = 40});
    if (ref::is_fp8(shape.type)) shape.k_scale = shape.v_scale = 0.03f;
    test_cache c(shape, g);
    const std::int32_t prompt = std::uniform_int_distribution<std::int32_t>(8, 20)(g);
    for (auto& n : c.lengths) n = prompt;
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h)
        for (std::int64_t s = 0; s < shape.capacity; ++s) c.position(l, h, s) = static_cast<std::int32_t>(s);
    triattn::snapkv_config cfg = triattn::snapkv_config::paper();
    REQUIRE(cfg.round.sched.kind == triattn::trigger::once_after_prompt);
    cfg.window = 3;
    triattn::snapkv policy(cfg), twin(cfg);
    triattn_test::window_queries wq;
    wq.head_dim = shape.head_dim;
    for (int l = 0; l < shape.num_layers; ++l) {  // the prompt's last queries
      wq.positions.push_back({prompt - 3, prompt - 2, prompt - 1});
      wq.q.emplace_back();
      for (int qh = 0; qh < shape.num_kv_heads * shape.group; ++qh)
        wq.q.back().push_back(triattn_test::normal_floats(g, static_cast<std::size_t>(3 * shape.head_dim)));
    }
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(1, prompt + 2)(g);
    test_cache copy = relayout(c, shape.layout, shape.page_size, g);
    INFO("TRIATTN_TEST_SEED=" << triattn_test::test_seed() << " " << shape.describe() << " prompt " << prompt
                              << " budget " << budget);
    c.with_view([&](const auto& v) { wq.feed(policy, v); });
    copy.with_view([&](const auto& v) { wq.feed(twin, v); });
    const triattn::round_context at_prompt{prompt, prompt};
    const bool ran = c.with_view([&](const auto& v) { return triattn::maybe_compress(policy, v, budget, at_prompt); });
    CHECK(ran == (static_cast<std::int64_t>(prompt) > budget));
    fired += ran ? 1 : 0;
    if (ran) copy.with_view([&](const auto& v) { twin.compress(v, budget, at_prompt); });
    CHECK(same_contents(c, copy));  // the round is compress's
    // decode: the cache grows past the budget, and the schedule never fires again
    for (std::int32_t pos = prompt; pos < prompt + 6; ++pos) {
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          std::int32_t& n = c.length(l, h);
          c.position(l, h, n) = pos;
          ++n;
        }
      const auto before = c.snapshot();
      const bool again = c.with_view(
          [&](const auto& v) { return triattn::maybe_compress(policy, v, budget, {pos + 1, prompt}); });
      CHECK_FALSE(again);
      CHECK(c.snapshot() == before);
    }
  }
  CHECK(fired > 0);
}

TEST_CASE("head-adaptive budgets leave unequal per-head lengths on every view, round after round") {
  // Round 1 on an equal-length cache (dense NHD), round 2 on its unequal result through every
  // view kind against the oracle (run_trial: plan, then compress moves exactly the plan).
  // StreamingLLM is left out: its rule protects all it keeps, so there is nothing to pool.
  auto g = triattn_test::rng(3990);
  int trials = 0, unequal_after_first = 0, unequal_after_second = 0;
  for (const auto kind : {policy_kind::h2o, policy_kind::vatp, policy_kind::snapkv, policy_kind::rkv,
                          policy_kind::triattention, policy_kind::knorm, policy_kind::keydiff,
                          policy_kind::expected_attention}) {
    for (const auto vk : {view_kind::dense_nhd, view_kind::dense_hnd, view_kind::paged, view_kind::own}) {
      const auto grain = vk == view_kind::own ? granularity::per_kv_head : granularity::per_layer;
      const auto make = [&] {
        return make_base(g, matrix_dtypes[trials % 4], 2, grain, triattn::rope_style::half,
                         triattn::key_state::post_rope, 16, 16);
      };
      std::optional<test_cache> made;
      do made.emplace(make());
      while (made->shape().num_kv_heads < 2);  // two heads or more: something to split
      test_cache& base = *made;
      const auto L = base.shape().num_layers, H = base.shape().num_kv_heads;
      for (auto& n : base.lengths) n = 16;
      const auto unequal = [&] {
        for (int l = 0; l < L; ++l)
          for (int h = 1; h < H; ++h)
            if (base.length(l, h) != base.length(l, 0)) return true;
        for (int l = 1; l < L; ++l)
          if (base.length(l, 0) != base.length(0, 0)) return true;
        return false;
      };
      const auto adaptive_trial = [&](std::int64_t budget) {
        trial t = random_trial(g, base, kind, grain, false);
        t.round.split = grain == granularity::per_layer && trials % 2 == 0 ? triattn::budget_split::per_layer
                                                                           : triattn::budget_split::per_sequence;
        t.round.split_floor = 0.2f;
        t.round.budget = triattn::budget_mode::with_prompt;
        t.round.protect_prompt = false;
        t.round.sinks = std::min<std::int64_t>(t.round.sinks, 1);
        t.round.recent = std::min<std::int64_t>(t.round.recent, 1);
        t.ctx.prompt_length = 0;
        t.budget = budget;
        t.sync_round();
        return t;
      };
      INFO(policy_name(kind) << " " << view_name(vk) << " " << base.shape().describe());
      {
        const trial t = adaptive_trial(8);
        INFO("round 1: " << t.describe());
        const auto view = base.dense_view();
        with_policy(t, view, [&](auto& policy) { triattn::compress(policy, view, t.budget, t.ctx); });
      }
      unequal_after_first += unequal() ? 1 : 0;
      const trial t = adaptive_trial(5);
      INFO("round 2: " << t.describe());
      tally tl;
      run_trial(base, t, vk, g, tl);  // the oracle and compaction over the unequal lengths
      with_subject(vk, base, g, [&](auto& cache, const auto& view) {
        with_policy(t, view, [&](auto& policy) { triattn::compress(policy, view, t.budget, t.ctx); });
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < H; ++h) base.length(l, h) = cache.length(l, h);
      });
      unequal_after_second += unequal() ? 1 : 0;
      ++trials;
    }
  }
  INFO("trials " << trials << " unequal after round 1: " << unequal_after_first << ", after round 2: "
                 << unequal_after_second);
  // iid random scores split a pool near evenly, and exactly evenly now and then: most rounds,
  // not all, leave unequal lengths (the oracle checks every one)
  CHECK(unequal_after_first * 3 >= trials);
  CHECK(unequal_after_second * 3 >= trials);
}

TEST_CASE("a budget split pools its budget: the schedule reads a pool's mean length") {
  auto g = triattn_test::rng(3991);
  test_cache base = make_base(g, triattn::dtype::f32, 1, granularity::per_layer, triattn::rope_style::half,
                              triattn::key_state::post_rope, 16, 16);
  for (auto& n : base.lengths) n = 16;
  const auto view = base.dense_view();
  triattn::key_scored_config cfg;
  cfg.round.split = triattn::budget_split::per_sequence;
  cfg.round.sched = triattn::schedule::every_step();
  triattn::knorm p(cfg);
  const std::int64_t budget = 8;
  triattn::round_context ctx;
  ctx.position = largest_position(base) + 1;
  REQUIRE(triattn::maybe_compress(p, view, budget, ctx));
  std::int64_t held = 0;
  for (const auto n : base.lengths) held += n;
  const auto rows = static_cast<std::int64_t>(base.lengths.size());
  CHECK(held == budget * rows);  // the pool: budget x decisions, whatever each row holds
  CHECK(triattn::scheduled_length(view, cfg.round) == budget);
  CHECK_FALSE(triattn::maybe_compress(p, view, budget, ctx));  // the pool is at its budget
  const auto row = std::find_if(base.lengths.begin(), base.lengths.end(), [&](std::int32_t n) { return n < base.shape().capacity; });
  REQUIRE(row != base.lengths.end());
  ++*row;  // one token more anywhere in the pool: its mean rounds up past the budget
  CHECK(triattn::scheduled_length(view, cfg.round) == budget + 1);
  cfg.round.split = triattn::budget_split::equal;  // without a split: the longest row
  CHECK(triattn::scheduled_length(view, cfg.round) == *std::max_element(base.lengths.begin(), base.lengths.end()));
}

namespace {
/// A cell-based cache: every (layer, kv_head) holds the same slots.
struct cell_view : interleaved_view {
  static constexpr bool equal_lengths = true;
};
static_assert(triattn::KVCacheView<cell_view>);
}  // namespace

/// A cache of 12 slots per row (f32, one q-head per kv head) for the refusal tests.
struct refusal_cache {
  test_cache base;
  own_cache cache;

  explicit refusal_cache(std::uint64_t seed) : base(full_base(seed)), cache(base) {}
  static test_cache full_base(std::uint64_t seed) {
    auto g = triattn_test::rng(seed);
    test_cache b = make_base(g, triattn::dtype::f32, 1, granularity::whole_sequence, triattn::rope_style::half,
                             triattn::key_state::post_rope, 12, 12);
    for (auto& n : b.lengths) n = 12;
    return b;
  }
  /// A K-norm round under `o` over `view` with `ctx` must fail with `parts` and leave the cache as it was.
  template <class V>
  void refused(const triattn::round_options& o, const V& view, const triattn::round_context& ctx,
               std::initializer_list<std::string> parts) {
    triattn::knorm p(triattn::key_scored_config{o});
    const auto before = cache.snapshot();
    triattn_test::throws_with([&] { triattn::compress(p, view, 4, ctx); }, parts);
    CHECK(cache.snapshot() == before);
  }
};

TEST_CASE("budget splits and segments are refused where they cannot apply, naming the API; the cache is untouched") {
  refusal_cache rc(3992);
  own_cache& cache = rc.cache;
  const auto try_round = [&](const triattn::round_options& o, const auto& view, std::initializer_list<std::string> parts) {
    rc.refused(o, view, {}, parts);
  };
  triattn::round_options o;
  o.split = triattn::budget_split::per_sequence;
  o.grain = granularity::whole_sequence;
  try_round(o, cache.view(), {"triattn::compress", "budget split per_sequence", "union granularity"});
  o.grain = granularity::per_kv_head;
  o.split = triattn::budget_split::per_layer;
  try_round(o, cache.view(), {"triattn::compress", "per_layer granularity", "per_kv_head"});
  o.grain = granularity::per_layer;
  o.split_floor = 1.5f;
  try_round(o, cache.view(), {"triattn::compress", "split floor 1.5", "[0, 1]"});
  o.split_floor = 0.2f;
  cell_view cells{cache.view()};
  // A split needs several decisions; a cell view allows one (union): refused either way.
  try_round(o, cells, {"triattn::compress", "granularity per_layer", "equal_lengths", "union"});
  o.split = triattn::budget_split::equal;
  try_round(o, cells, {"triattn::compress", "granularity per_layer", "equal_lengths", "union"});
  o.grain = granularity::whole_sequence;
  o.segments = 0;
  try_round(o, cache.view(), {"triattn::compress", "segments 0", "[1, 65536]"});
  o.segments = 1;
  {  // one keep set on the cell view is fine
    triattn::knorm p(triattn::key_scored_config{o});
    triattn::compress(p, cells, 4);
    CHECK(cache.view().length(0, 0) == 4);
  }
}

TEST_CASE("value-aware rounds refuse a projection of another shape and a non-finite value, naming the API; the cache is untouched") {
  refusal_cache rc(3993);
  own_cache& cache = rc.cache;
  auto g = triattn_test::rng(3994);
  const triattn::kv_geometry geo = cache.view().geometry();
  triattn::round_options o;
  o.value_aware = true;
  const auto try_round = [&](const triattn::round_context& ctx, std::initializer_list<std::string> parts) {
    rc.refused(o, cache.view(), ctx, parts);
  };
  const auto projection = output_projection::random(g, geo);
  triattn::value_projection wrong = projection->view;
  wrong.head_dim = geo.head_dim + 2;
  triattn::round_context ctx;
  ctx.projection = &wrong;
  try_round(ctx, {"triattn::compress", "value projection", "head_dim " + std::to_string(geo.head_dim + 2)});
  wrong = projection->view;
  wrong.gram = nullptr;
  try_round(ctx, {"triattn::compress", "gram is null"});
  // a NaN value in a slot that competes: its weight is not finite
  std::vector<float> bad(static_cast<std::size_t>(geo.head_dim), 1.0f);
  bad[1] = std::nanf("");
  triattn::store_value(cache.view(), 0, 0, 5, bad.data());
  ctx.projection = &projection->view;
  try_round(ctx, {"triattn::compress", "value of layer 0 kv_head 0 slot 5", "must be finite"});
  try_round({}, {"triattn::compress", "value of layer 0 kv_head 0 slot 5", "must be finite"});
  {  // off, the same round reads no value and the projection is not checked
    o.value_aware = false;
    ctx.projection = &wrong;
    triattn::knorm p(triattn::key_scored_config{o});
    triattn::compress(p, cache.view(), 4, ctx);
    CHECK(cache.view().length(0, 0) == 4);
  }
}
