// triattn: the command-line tool. The contract is shared/spec/cli.md (commands, .npy shapes
// and dtypes, errors); docs/cli.md documents it for users.
//
//   triattn score <policy>  --keys K.npy ... --out SCORES.npy
//   triattn select <policy> --keys K.npy ... --budget B [--granularity G] --out KEEP.npy
//   triattn inspect S.safetensors
//   triattn calibrate --model M.bin --tokenizer T.bin --text FILE --out S.safetensors [--windows N]
//   triattn calibrate --model M.gguf --text FILE --out S.safetensors [--windows N] [--window-tokens W]
//   triattn calibrate --model M --prompts FILE --out S.safetensors [--answer-tokens N] [--temperature T] [--seed S]
//
// Every error prints one line naming the file and the problem and exits with code 2; nothing
// is written then (outputs are written last, through a temporary file and a rename).
//
// The policies are the registry's (triattn::policy_registry): their names, the usage text and
// the unknown-policy error come from it. Every `select` runs the library's round pipeline
// (`policy.plan(view, budget, ctx)` with `config.round.grain` from --granularity).

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runner/calibration.hpp"
#include "runner/runner.hpp"
#include "runner/text_model.hpp"
#include "triattn/triattn.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;

/// A usage problem (bad option, missing input): printed as `triattn: <message>`, exit 2.
struct usage_error {
  std::string message;
};

// ------------------------------------------------------------------------------------------
// Options: `--name value` or `--name=value`; switches take no value. Unknown names are errors
// (a typo must not be silently ignored), but every command accepts every known input and
// ignores those it does not use, so one set of files can drive all policies.

const std::set<std::string, std::less<>> value_options = {
    "--stats", "--keys", "--values", "--queries", "--attn", "--positions", "--round-start", "--budget", "--out",
    "--window", "--protect-first", "--offset-max", "--aggregation", "--granularity", "--gqa", "--model",
    "--tokenizer", "--text", "--windows", "--window-tokens", "--sinks", "--prompts", "--answer-tokens",
    "--temperature", "--seed", "--repeat-window"};
const std::set<std::string, std::less<>> switch_options = {"--pre-rope", "--disable-trig", "--disable-norm",
                                                           "--no-normalize", "--help"};

class options {
 public:
  options(int argc, char** argv, int first) {
    for (int i = first; i < argc; ++i) {
      std::string arg = argv[i];
      if (!arg.starts_with("--")) {
        positional_.push_back(arg);
        continue;
      }
      std::optional<std::string> value;
      if (const auto eq = arg.find('='); eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg.resize(eq);
      }
      if (switch_options.contains(arg)) {
        if (value) throw usage_error{"option " + arg + " takes no value"};
        switches_.insert(arg);
      } else if (value_options.contains(arg)) {
        if (!value) {
          if (i + 1 >= argc) throw usage_error{"option " + arg + " needs a value"};
          value = argv[++i];
        }
        values_[arg] = *value;
      } else {
        throw usage_error{"unknown option " + arg};
      }
    }
  }

  bool has(std::string_view name) const { return values_.contains(name) || switches_.contains(name); }
  const std::vector<std::string>& positional() const { return positional_; }

  std::string required(std::string_view name) const {
    const auto it = values_.find(name);
    if (it == values_.end()) throw usage_error{"missing " + std::string(name)};
    return it->second;
  }
  std::optional<std::string> optional_value(std::string_view name) const {
    const auto it = values_.find(name);
    return it == values_.end() ? std::nullopt : std::optional(it->second);
  }
  /// An integer option in [min, max]; an out-of-range value is refused naming the option
  /// (never narrowed: `--windows 4294967297` is not 1).
  std::int64_t integer(std::string_view name, std::int64_t min, std::optional<std::int64_t> fallback = {},
                       std::int64_t max = std::numeric_limits<std::int64_t>::max()) const {
    const auto text = optional_value(name);
    if (!text) {
      if (fallback) return *fallback;
      throw usage_error{"missing " + std::string(name)};
    }
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), v);
    if (ec != std::errc() || end != text->data() + text->size())
      throw usage_error{std::string(name) + " \"" + *text + "\" is not an integer"};
    if (v < min) throw usage_error{std::string(name) + " " + *text + " must be >= " + std::to_string(min)};
    if (v > max) throw usage_error{std::string(name) + " " + *text + " must be <= " + std::to_string(max)};
    return v;
  }
  /// One of `choices` (the first is the default).
  std::string choice(std::string_view name, std::initializer_list<std::string_view> choices) const {
    const auto text = optional_value(name);
    if (!text) return std::string(*choices.begin());
    for (std::string_view c : choices)
      if (c == *text) return *text;
    std::string known;
    for (std::string_view c : choices) known += (known.empty() ? "" : ", ") + std::string(c);
    throw usage_error{std::string(name) + " \"" + *text + "\" is not one of " + known};
  }

 private:
  std::map<std::string, std::string, std::less<>> values_;
  std::set<std::string, std::less<>> switches_;
  std::vector<std::string> positional_;
};

/// The float values of an input array, refused naming `path` unless it holds floats (an int
/// array is not read as floats) that are all finite: the library would refuse them later, in a
/// message about a layer and a slot that does not name the file.
std::vector<float> finite_floats(const io::npy_array& a, const std::string& path, const char* what) {
  if (a.kind != io::element_kind::f16 && a.kind != io::element_kind::f32 && a.kind != io::element_kind::f64)
    throw triattn::error(path + ": " + what + " has dtype " + io::element_kind_name(a.kind) +
                         ", expected float16, float32 or float64");
  std::vector<float> v = a.to_float();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw triattn::error(path + ": " + what + " holds " + std::to_string(v[i]) + " at element " + std::to_string(i) +
                           ": values must be finite");
  return v;
}

/// A --out that a rename would replace (a device, a FIFO, a folder, a link) is refused before
/// any work: nothing is printed first (calibrate's progress) and nothing is computed for it.
void check_out(const options& o) {
  if (const auto out = o.optional_value("--out")) io::detail::check_output_path(*out, "triattn");
}

// ------------------------------------------------------------------------------------------
// Inputs as triattn views.

/// Keys (and optionally values) from .npy [num_layers, num_kv_heads, num_tokens, head_dim]
/// (f16 stays f16; f32 and f64 become f32) as a dense HND view. Owns the memory.
class npy_cache {
 public:
  npy_cache(const fs::path& keys_path, const std::optional<fs::path>& positions_path) {
    keys_ = load_cache_array(keys_path);
    const auto& s = keys_.shape;
    // Every axis is checked before anything is sized by it: with head_dim 0 the file holds no
    // element, so its other axes bound nothing (a position table of layers x kv_heads x tokens).
    const auto axis = [&](std::size_t i, const char* name, std::int64_t hi) {
      if (s[i] < 1 || s[i] > hi)
        throw triattn::error(keys_path.string() + ": " + name + " " + std::to_string(s[i]) + " must be in [1, " +
                             std::to_string(hi) + "]");
      return s[i];
    };
    layers_ = static_cast<int>(axis(0, "num_layers", 65535));
    kv_heads_ = static_cast<int>(axis(1, "num_kv_heads", 65535));
    head_dim_ = static_cast<int>(axis(3, "head_dim", 65536));
    tokens_ = s[2];
    if (head_dim_ % 2 != 0)
      throw triattn::error(keys_path.string() + ": head_dim " + std::to_string(head_dim_) + " must be even");
    if (tokens_ < 1 || tokens_ > INT32_MAX)
      throw triattn::error(keys_path.string() + ": num_tokens " + std::to_string(tokens_) + " must be in [1, 2^31)");
    lengths_.assign(static_cast<std::size_t>(layers_) * static_cast<std::size_t>(kv_heads_),
                    static_cast<std::int32_t>(tokens_));
    positions_.resize(lengths_.size() * static_cast<std::size_t>(tokens_));
    if (positions_path) {
      const io::npy_array p = io::read_npy(*positions_path);
      const std::int64_t expected[] = {layers_, kv_heads_, tokens_};
      io::check_shape(p, expected, positions_path->string(), "positions");
      if (p.kind == io::element_kind::f16 || p.kind == io::element_kind::f32 || p.kind == io::element_kind::f64)
        throw triattn::error(positions_path->string() + ": positions have dtype " + io::element_kind_name(p.kind) +
                             ", expected integers");
      const std::vector<std::int64_t> v = p.to_int64();
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (v[i] < 0 || v[i] > INT32_MAX)
          throw triattn::error(positions_path->string() + ": position " + std::to_string(v[i]) + " is out of range");
        positions_[i] = static_cast<std::int32_t>(v[i]);
      }
    } else {
      // Without positions, slot t holds position t (all a post-RoPE scorer needs).
      for (std::size_t i = 0; i < positions_.size(); ++i)
        positions_[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(tokens_));
    }
    for (int l = 0; l < layers_; ++l) bases_.push_back(keys_.data.data() + layer_bytes() * static_cast<std::size_t>(l));
  }

  /// Adds values [num_layers, num_kv_heads, num_tokens, head_dim], same dtype as the keys.
  void add_values(const fs::path& path) {
    values_ = load_cache_array(path);
    if (values_->shape != keys_.shape)
      throw triattn::error(path.string() + ": values have shape " + io::detail::shape_string(values_->shape) + ", keys have " +
                           io::detail::shape_string(keys_.shape));
    // Mixed dtypes meet at float32, which holds float16 exactly: neither input loses precision
    // (casting float32 values to float16 keys would change a value norm).
    if (values_->kind != keys_.kind) {
      if (keys_.kind == io::element_kind::f16) {
        keys_ = as_kind(std::move(keys_), io::element_kind::f32);
        bases_.clear();
        for (int l = 0; l < layers_; ++l)
          bases_.push_back(keys_.data.data() + layer_bytes() * static_cast<std::size_t>(l));
      }
      if (values_->kind == io::element_kind::f16) values_ = as_kind(std::move(*values_), io::element_kind::f32);
    }
    value_bases_.clear();
    for (int l = 0; l < layers_; ++l)
      value_bases_.push_back(values_->data.data() + layer_bytes() * static_cast<std::size_t>(l));
  }

  int layers() const { return layers_; }
  int kv_heads() const { return kv_heads_; }
  std::int64_t tokens() const { return tokens_; }
  int head_dim() const { return head_dim_; }

  /// The view, with `q_heads` query heads and `rope`. V points at the keys when no values
  /// were given (policies that read V are only run with values).
  triattn::dense_kv_view view(int q_heads, triattn::key_state keys, const triattn::rope_desc& rope) {
    triattn::dense_kv_view v;
    v.geo = {layers_, q_heads, kv_heads_, head_dim_, dtype(), keys, rope};
    v.k_layers = bases_.data();
    v.v_layers = values_ ? value_bases_.data() : bases_.data();
    v.k_stride = v.v_stride = triattn::kv_strides::hnd(tokens_, head_dim_);
    v.slots = {lengths_.data(), positions_.data(), tokens_};
    return v;
  }

 private:
  static io::npy_array as_kind(io::npy_array a, io::element_kind kind) {
    const std::vector<float> f = a.to_float();
    a.kind = kind;
    a.data.resize(f.size() * io::element_bytes(kind));
    for (std::size_t i = 0; i < f.size(); ++i)
      triattn::store_element(a.data.data(), kind == io::element_kind::f16 ? triattn::dtype::f16 : triattn::dtype::f32,
                             i, f[i]);
    return a;
  }
  static io::npy_array load_cache_array(const fs::path& path) {
    io::npy_array a = io::read_npy(path);
    const std::int64_t expected[] = {-1, -1, -1, -1};
    io::check_shape(a, expected, path.string(), "[num_layers, num_kv_heads, num_tokens, head_dim]");
    if (a.kind != io::element_kind::f16 && a.kind != io::element_kind::f32 && a.kind != io::element_kind::f64)
      throw triattn::error(path.string() + ": dtype " + io::element_kind_name(a.kind) +
                           " is not supported (expected float16, float32 or float64)");
    (void)finite_floats(a, path.string(), "the array");  // NaN or inf named with the file
    if (a.kind == io::element_kind::f64) a = as_kind(std::move(a), io::element_kind::f32);
    return a;
  }
  triattn::dtype dtype() const { return keys_.kind == io::element_kind::f16 ? triattn::dtype::f16 : triattn::dtype::f32; }
  std::size_t layer_bytes() const {
    return static_cast<std::size_t>(kv_heads_) * static_cast<std::size_t>(tokens_) * static_cast<std::size_t>(head_dim_) *
           io::element_bytes(keys_.kind);
  }

  io::npy_array keys_;
  std::optional<io::npy_array> values_;
  int layers_ = 0, kv_heads_ = 0, head_dim_ = 0;
  std::int64_t tokens_ = 0;
  std::vector<std::int32_t> lengths_;    // [layers, kv_heads]
  std::vector<std::int32_t> positions_;  // [layers, kv_heads, tokens]
  std::vector<std::byte*> bases_, value_bases_;
};

void write_int64(const fs::path& out, std::span<const std::int64_t> shape, const std::vector<std::int64_t>& data) {
  io::write_npy(out, io::element_kind::i64, shape, data.data());
}

/// `--granularity per_layer|per_kv_head|union`, or `fallback` (the policy's default) when absent.
triattn::granularity granularity_option(const options& o, triattn::granularity fallback) {
  const auto text = o.optional_value("--granularity");
  if (!text) return fallback;
  if (const auto g = triattn::parse_granularity(*text)) return *g;
  throw usage_error{"--granularity \"" + *text + "\" is not one of per_layer, per_kv_head, union"};
}

/// `select`'s output (cli.md, Granularity): one ascending row of min(budget, N) slots per keep
/// set of the round, int64 [L, Hkv, k] (per_layer), [Hkv, k] (per_kv_head) or [k] (union).
void write_keep(const fs::path& out, const triattn::keep_plan& plan, const triattn::kv_geometry& g,
                triattn::granularity grain, std::int64_t budget, std::int64_t tokens) {
  const std::int64_t k = std::min(budget, tokens);
  const triattn::decision_map map{grain, g.num_layers, g.num_kv_heads};
  std::vector<std::int64_t> keep;
  keep.reserve(static_cast<std::size_t>(map.decisions()) * static_cast<std::size_t>(k));
  for (int d = 0; d < map.decisions(); ++d) {
    int l = 0, h = 0;
    map.row(d, 0, l, h);  // every row of a decision holds its keep set
    const auto row = plan.row(l, h);
    if (static_cast<std::int64_t>(row.size()) != k)  // a policy rule keeping fewer than the budget
      throw triattn::error("select: layer " + std::to_string(l) + " kv_head " + std::to_string(h) + " keeps " +
                           std::to_string(row.size()) + " slots, not min(B, N) = " + std::to_string(k));
    keep.insert(keep.end(), row.begin(), row.end());
  }
  switch (grain) {
    case triattn::granularity::per_layer: {
      const std::int64_t shape[] = {g.num_layers, g.num_kv_heads, k};
      return write_int64(out, shape, keep);
    }
    case triattn::granularity::per_kv_head: {
      const std::int64_t shape[] = {g.num_kv_heads, k};
      return write_int64(out, shape, keep);
    }
    case triattn::granularity::whole_sequence: {
      const std::int64_t shape[] = {k};
      return write_int64(out, shape, keep);
    }
  }
}

// ------------------------------------------------------------------------------------------
// TriAttention.

struct triattention_inputs {
  triattn::query_stats stats;
  npy_cache cache;
  triattn::triattention_config config;
  triattn::key_state keys;
  std::int64_t prompt_length = 0;  ///< --protect-first
};

triattention_inputs read_triattention_inputs(const options& o) {
  const fs::path stats_path = o.required("--stats");
  triattn::query_stats stats = triattn::load_stats(stats_path);
  npy_cache cache(o.required("--keys"), o.optional_value("--positions"));
  if (cache.layers() != stats.num_layers || cache.kv_heads() != stats.num_kv_heads || cache.head_dim() != stats.head_dim)
    throw triattn::error(o.required("--keys") + ": keys [num_layers, num_kv_heads, num_tokens, head_dim] = [" +
                         std::to_string(cache.layers()) + ", " + std::to_string(cache.kv_heads()) + ", " +
                         std::to_string(cache.tokens()) + ", " + std::to_string(cache.head_dim()) + "] do not match " +
                         stats_path.string() + " (" + std::to_string(stats.num_layers) + " layers, " +
                         std::to_string(stats.num_kv_heads) + " kv-heads, head_dim " + std::to_string(stats.head_dim) +
                         ")");
  triattn::triattention_config c = triattn::triattention_config::paper();
  c.offset_max = o.integer("--offset-max", 1, c.offset_max, std::int64_t{1} << 62);
  c.aggregation = o.choice("--aggregation", {"mean", "max"}) == "mean" ? triattn::offset_aggregation::mean
                                                                         : triattn::offset_aggregation::max;
  c.disable_trig = o.has("--disable-trig");
  c.disable_norm = o.has("--disable-norm");
  c.normalize = !o.has("--no-normalize");
  c.round.grain = granularity_option(o, c.round.grain);  // default per_kv_head
  c.gqa_reduction = o.choice("--gqa", {"max", "mean"}) == "max" ? triattn::triattention_gqa_reduction::max
                                                                : triattn::triattention_gqa_reduction::mean;
  // Every token is a candidate unless --window / --protect-first say otherwise.
  c.window = o.integer("--window", 0, 0);
  const std::int64_t prompt_length = o.integer("--protect-first", 0, 0);
  c.round.protect_prompt = prompt_length > 0;
  const triattn::key_state keys = o.has("--pre-rope") ? triattn::key_state::pre_rope : triattn::key_state::post_rope;
  if (keys == triattn::key_state::pre_rope && !o.has("--positions"))
    throw usage_error{"--pre-rope needs --positions [num_layers, num_kv_heads, num_tokens]"};
  return {std::move(stats), std::move(cache), c, keys, prompt_length};
}

triattn::rope_desc stats_rope(const triattn::query_stats& s) {
  triattn::rope_desc r;
  r.style = s.style;
  r.attention_scale = s.attention_scale;
  r.inv_freq_table = s.inv_freq.data();  // the frequencies the stats were calibrated with
  return r;
}

int score_triattention(const options& o) {
  triattention_inputs in = read_triattention_inputs(o);
  const std::int64_t round_start = o.integer("--round-start", 0, {}, triattn::max_round_start);
  const fs::path out = o.required("--out");
  const triattn::dense_kv_view view = in.cache.view(in.stats.num_q_heads, in.keys, stats_rope(in.stats));
  const triattn::triattention policy(in.stats, in.config);
  // [num_layers, num_q_heads, num_tokens]
  std::vector<float> scores(static_cast<std::size_t>(in.stats.num_layers) *
                            static_cast<std::size_t>(in.stats.num_q_heads) * static_cast<std::size_t>(in.cache.tokens()));
  policy.score(view, round_start, scores);
  const std::int64_t shape[] = {in.stats.num_layers, in.stats.num_q_heads, in.cache.tokens()};
  io::write_npy(out, io::element_kind::f32, shape, scores.data());
  return 0;
}

int select_triattention(const options& o) {
  triattention_inputs in = read_triattention_inputs(o);
  const std::int64_t round_start = o.integer("--round-start", 0, {}, triattn::max_round_start);
  const std::int64_t budget = o.integer("--budget", 1);
  const fs::path out = o.required("--out");
  const triattn::dense_kv_view view = in.cache.view(in.stats.num_q_heads, in.keys, stats_rope(in.stats));
  const triattn::triattention policy(in.stats, in.config);
  const triattn::keep_plan plan = policy.plan(view, budget, triattn::round_context{round_start, in.prompt_length});
  write_keep(out, plan, view.geo, in.config.round.grain, budget, in.cache.tokens());
  return 0;
}

// ------------------------------------------------------------------------------------------
// Every policy without options of its own, through one path: the inputs its registry entry
// needs read and checked, the policy made by the registry, fed, then scored or asked for keep
// sets.

/// An input array checked against [num_layers, -, -, n] of the keys; returns its second axis
/// (the q-heads), which must be a multiple of the kv-heads.
int check_rows(const io::npy_array& a, const std::string& path, const npy_cache& cache, std::int64_t last,
               const char* what) {
  const std::int64_t expected[] = {cache.layers(), -1, -1, last};
  io::check_shape(a, expected, path, what);
  if (a.shape[1] < 1 || a.shape[1] % cache.kv_heads() != 0)
    throw triattn::error(path + ": " + std::to_string(a.shape[1]) + " q-heads are not a multiple of the keys' " +
                         std::to_string(cache.kv_heads()) + " kv-heads");
  if (a.shape[2] < 1) throw triattn::error(path + ": " + what + " has no rows");
  return static_cast<int>(a.shape[1]);
}

/// What a policy observes: rows of attention [L, Hq, rows, N] (`probs`) or of queries
/// [L, Hq, rows, D] (not `probs`); row r of (l, h) is the token at position N - rows + r.
struct observed_rows {
  std::vector<float> data;
  int q_heads = 0;
  std::int64_t rows = 0, width = 0;
  bool probs = false;
};

/// Reads `--attn` [L, Hq, rows, N]: probabilities of the last rows' queries.
observed_rows read_attention(const options& o, const npy_cache& cache) {
  const std::string path = o.required("--attn");
  const io::npy_array attn = io::read_npy(path);
  const int q_heads = check_rows(attn, path, cache, cache.tokens(), "attention [num_layers, num_q_heads, rows, num_tokens]");
  const std::int64_t rows = attn.shape[2], n = cache.tokens();
  // Row r is the query at position n - rows + r: more rows than tokens has no position.
  if (rows > n) throw triattn::error(path + ": " + std::to_string(rows) + " attention rows exceed num_tokens " + std::to_string(n));
  std::vector<float> p = finite_floats(attn, path, "attention");
  for (std::size_t i = 0; i < p.size(); ++i)
    if (p[i] < 0.0f || p[i] > 1.0f)
      throw triattn::error(path + ": attention holds " + std::to_string(p[i]) + " at element " + std::to_string(i) +
                           ": probabilities must be in [0, 1]");
  return {std::move(p), q_heads, rows, n, true};
}

/// Reads `--queries` [L, Hq, w, D]: the last w queries, post-RoPE.
observed_rows read_queries(const options& o, const npy_cache& cache) {
  const std::string path = o.required("--queries");
  const io::npy_array q = io::read_npy(path);
  const int q_heads = check_rows(q, path, cache, cache.head_dim(), "queries [num_layers, num_q_heads, w, head_dim]");
  const std::int64_t w = q.shape[2], n = cache.tokens();
  if (w > n) throw triattn::error(path + ": window " + std::to_string(w) + " exceeds num_tokens " + std::to_string(n));
  return {finite_floats(q, path, "queries"), q_heads, w, cache.head_dim(), false};
}

triattn::gqa_aggregation gqa_option(const options& o) {
  const std::string g = o.choice("--gqa", {"mean", "max", "sum"});
  return g == "mean" ? triattn::gqa_aggregation::mean : g == "max" ? triattn::gqa_aggregation::max
                                                                   : triattn::gqa_aggregation::sum;
}

/// The shape of an input a policy needs, for the usage error when it is missing.
constexpr const char* values_shape = "[num_layers, num_kv_heads, num_tokens, head_dim]";

/// Runs `score` or `select` for a registry policy: the inputs its entry needs are read and
/// checked, the policy made by the registry and fed them.
int run_registry_policy(const options& o, bool select, const triattn::policy_entry& entry) {
  if (entry.needs.values && !o.has("--values"))
    throw usage_error{std::string(entry.name) + " needs --values " + values_shape};
  triattn::policy_inputs in;
  if (entry.takes_gqa) in.gqa = gqa_option(o);
  // Slot j holds position j (cli.md's formulas; the rows fed sit at the last positions):
  // --positions is triattention's input, ignored here like every input a command does not use.
  npy_cache cache(o.required("--keys"), std::nullopt);
  if (const auto values = o.optional_value("--values")) cache.add_values(*values);
  // Expected Attention takes --stats in place of --queries: the stats' query means, their RoPE.
  std::optional<triattn::query_stats> stats;
  if (entry.queries_from_stats && o.has("--stats") && !o.has("--queries")) {
    stats = triattn::load_stats(o.required("--stats"));
    in.stats = &*stats;
    in.calibrated_queries = true;
  }
  const bool reads_queries = entry.needs.queries && !in.calibrated_queries;
  // A policy that reads only the cache observes nothing: one q-head per kv-head (the stats'
  // q-heads for a calibrated one).
  const observed_rows r = entry.needs.attention ? read_attention(o, cache)
                          : reads_queries       ? read_queries(o, cache)
                                                : observed_rows{{}, stats ? stats->num_q_heads : cache.kv_heads(), 0, 0, false};
  if (reads_queries) in.window = static_cast<int>(r.rows);  // the query window is the rows given
  triattn::any_policy policy = *entry.create(in);
  const triattn::dense_kv_view view =
      cache.view(r.q_heads, triattn::key_state::post_rope, stats ? stats_rope(*stats) : triattn::rope_desc{});
  policy.attach(view);
  const std::int64_t n = cache.tokens();
  const std::span<const float> all(r.data);
  for (int l = 0; l < cache.layers(); ++l)
    for (int h = 0; h < r.q_heads; ++h)
      for (std::int64_t i = 0; i < r.rows; ++i) {
        const auto row = all.subspan(static_cast<std::size_t>(((l * r.q_heads + h) * r.rows + i) * r.width),
                                     static_cast<std::size_t>(r.width));
        const auto position = static_cast<std::int32_t>(n - r.rows + i);
        if (r.probs) {
          policy.observe(l, h, position, {}, row);
        } else {
          policy.observe(l, h, position, row, {});
        }
      }
  if (select) {
    // `select <policy>`: a round of the policy's own at --granularity (default its own), int64
    // ascending keep sets (see write_keep).
    const std::int64_t budget = o.integer("--budget", 1);
    const fs::path out = o.required("--out");
    triattn::round_options round = policy.round();
    round.grain = granularity_option(o, round.grain);
    policy.set_round(round);
    // No prompt; the round starts after the last slot (slot j holds position j).
    const triattn::keep_plan plan = policy.plan(view, budget, triattn::round_context{});
    write_keep(out, plan, view.geo, round.grain, budget, n);
  } else {
    // `score <policy>`: float32 [num_layers, num_kv_heads, num_tokens] after GQA aggregation.
    const fs::path out = o.required("--out");
    std::vector<float> scores(static_cast<std::size_t>(cache.layers()) * static_cast<std::size_t>(cache.kv_heads()) *
                              static_cast<std::size_t>(n));
    policy.score(view, scores);
    const std::int64_t shape[] = {cache.layers(), cache.kv_heads(), n};
    io::write_npy(out, io::element_kind::f32, shape, scores.data());
  }
  return 0;
}

/// `select streaming_llm --keys K --budget B [--sinks S]`: the first S slots and the most
/// recent B - S (the keys give the shape only).
int streaming_llm_command(const options& o, bool select) {
  if (!select)
    throw usage_error{"streaming_llm has no score: it keeps slots by position alone (use select)"};
  npy_cache cache(o.required("--keys"), std::nullopt);
  const std::int64_t budget = o.integer("--budget", 1);
  const fs::path out = o.required("--out");
  triattn::streaming_llm_config c;
  c.sinks = o.integer("--sinks", 0, c.sinks);
  c.round.grain = granularity_option(o, c.round.grain);
  const triattn::streaming_llm policy(c);
  const triattn::dense_kv_view view = cache.view(cache.kv_heads(), triattn::key_state::post_rope, triattn::rope_desc{});
  const triattn::keep_plan plan = policy.plan(view, budget, triattn::round_context{});
  write_keep(out, plan, view.geo, c.round.grain, budget, cache.tokens());
  return 0;
}

// ------------------------------------------------------------------------------------------
// inspect, calibrate.

int inspect(const options& o) {
  if (o.positional().size() != 1) throw usage_error{"inspect takes one stats file"};
  const fs::path path = o.positional()[0];
  const triattn::query_stats s = triattn::load_stats(path);
  const int bands = s.num_bands();
  std::printf("%s\n  format triattn.stats.v1, rope_style %s, attention_scale %g\n", path.string().c_str(),
              s.style == triattn::rope_style::half ? "half" : "interleaved", s.attention_scale);
  std::printf("  q_mean_real, q_mean_imag, q_abs_mean: F32 [%d, %d, %d] (layers, q-heads, bands)\n", s.num_layers,
              s.num_q_heads, bands);
  std::printf("  inv_freq: [%d], from %.6g down to %.6g\n", bands, s.inv_freq.front(), s.inv_freq.back());
  std::printf("  num_kv_heads %d (GQA group %d)\n", s.num_kv_heads, s.num_q_heads / s.num_kv_heads);
  for (const auto& [key, value] : s.info)  // metadata from the file: escaped before the terminal sees it
    std::printf("  %s: %s\n", io::detail::printable(key, std::string_view::npos).c_str(),
                io::detail::printable(value, std::string_view::npos).c_str());
  // Mean resultant length R_f = |E q_f| / E|q_f|: how concentrated the queries are (1: every
  // query of the band points the same way; the paper's premise is R > 0.95 for most heads).
  const auto resultant = [&](int l, int h, int f) {
    const std::size_t i = s.row(l, h) + static_cast<std::size_t>(f);
    const double m = s.q_abs_mean[i];
    return m > 0.0 ? std::hypot(double{s.q_mean_real[i]}, double{s.q_mean_imag[i]}) / m : 0.0;
  };
  const auto share = [](std::size_t above, std::size_t n) { return 100.0 * static_cast<double>(above) / static_cast<double>(n); };
  std::printf("  mean R_f = |E[q_f]| / E[|q_f|] per layer (and the share of its (q-head, band) cells above 0.95):\n");
  double total = 0.0;
  std::vector<double> all;
  for (int l = 0; l < s.num_layers; ++l) {
    double sum = 0.0;
    std::size_t above = 0;
    for (int h = 0; h < s.num_q_heads; ++h)
      for (int f = 0; f < bands; ++f) {
        const double r = resultant(l, h, f);
        sum += r;
        above += r > 0.95 ? 1 : 0;
        all.push_back(r);
      }
    const double mean = sum / (s.num_q_heads * bands);
    total += mean;
    std::printf("    layer %3d  %.4f  (%5.1f%% > 0.95)\n", l, mean,
                share(above, static_cast<std::size_t>(s.num_q_heads) * static_cast<std::size_t>(bands)));
  }
  std::printf("  all layers  %.4f\n", total / s.num_layers);
  std::printf("  mean R_f per band over every (layer, q-head), band 0 the fastest-turning:\n");
  for (int f = 0; f < bands; ++f) {
    double sum = 0.0;
    std::size_t above = 0;
    for (int l = 0; l < s.num_layers; ++l)
      for (int h = 0; h < s.num_q_heads; ++h) {
        const double r = resultant(l, h, f);
        sum += r;
        above += r > 0.95 ? 1 : 0;
      }
    const std::size_t n = static_cast<std::size_t>(s.num_layers) * static_cast<std::size_t>(s.num_q_heads);
    std::printf("    band %3d  %.4f  (%5.1f%% > 0.95)  inv_freq %.4g\n", f, sum / static_cast<double>(n), share(above, n),
                s.inv_freq[static_cast<std::size_t>(f)]);
  }
  std::sort(all.begin(), all.end());
  const auto quantile = [&](double q) { return all[static_cast<std::size_t>(q * static_cast<double>(all.size() - 1) + 0.5)]; };
  const auto above = static_cast<std::size_t>(all.end() - std::upper_bound(all.begin(), all.end(), 0.95));
  std::printf("  all %zu (layer, q-head, band) cells: mean %.4f, quartiles %.4f %.4f %.4f, %.1f%% > 0.95\n", all.size(),
              std::accumulate(all.begin(), all.end(), 0.0) / static_cast<double>(all.size()), quantile(0.25), quantile(0.5),
              quantile(0.75), share(above, all.size()));
  return 0;
}

void progress(const char* what, std::int64_t done, std::int64_t total) {
  constexpr int width = 40;
  const int filled = static_cast<int>(width * done / std::max<std::int64_t>(total, 1));
  std::fprintf(stderr, "\r%s [%.*s%*s] %lld/%lld", what, filled, "########################################",
               width - filled, "", static_cast<long long>(done), static_cast<long long>(total));
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

/// `calibrate --prompts FILE`: on the model's own answers to the prompts of FILE (one a line),
/// each `--answer-tokens` long at least (default 1024), sampled at `--temperature` (default
/// 0.7) from `--seed` (default 1) with a repetition penalty of 1.2 over the last
/// `--repeat-window` tokens (default 128; 0: none), end-of-turn tokens excluded so that every
/// answer runs the whole length.
int calibrate_on_answers(const options& o, const triattn_runner::text_model& model, const fs::path& model_path,
                         const fs::path& out) {
  const char* api = "triattn calibrate";
  const fs::path prompts_path = *o.optional_value("--prompts");
  std::vector<std::vector<int>> prompts;
  std::size_t longest = 0;
  for (const std::string& p : triattn_runner::read_prompts(prompts_path, api)) {
    prompts.push_back(model.chat(p));
    longest = std::max(longest, prompts.back().size());
  }
  const std::int64_t answer = o.integer("--answer-tokens", 1, 1024);
  const std::int64_t length = static_cast<std::int64_t>(longest) + answer;
  if (length > model.model().config().seq_len)
    throw triattn::error("--answer-tokens " + std::to_string(answer) + " with a prompt of " + std::to_string(longest) +
                         " tokens exceeds the model's context of " + std::to_string(model.model().config().seq_len));
  const std::string temperature_text = o.optional_value("--temperature").value_or("0.7");
  double temperature = 0.0;
  const auto [end, ec] = std::from_chars(temperature_text.data(), temperature_text.data() + temperature_text.size(),
                                         temperature);
  if (ec != std::errc() || end != temperature_text.data() + temperature_text.size() || !(temperature > 0.0) ||
      !std::isfinite(temperature))
    throw usage_error{"--temperature \"" + temperature_text + "\" is not a number > 0"};
  const auto seed = static_cast<std::uint64_t>(o.integer("--seed", 0, 1));
  // triattn_eval long's sampler: SmolLM2's long answers loop without the penalty.
  const std::int64_t repeat_window = o.integer("--repeat-window", 0, triattn_runner::answer_sampler::default_window);
  const std::vector<std::uint8_t> allowed = model.non_ending_tokens();
  triattn::query_stats stats = triattn_runner::calibrate_on_answers(
      model.model(), prompts, static_cast<int>(length), seed, temperature, allowed,
      [](std::size_t done, std::size_t total) {
        progress("calibrate", static_cast<std::int64_t>(done), static_cast<std::int64_t>(total));
      },
      triattn_runner::answer_sampler::default_penalty, static_cast<int>(repeat_window));
  stats.info["model"] = model_path.filename().string();
  stats.info["source"] = prompts_path.filename().string() + ": the model's answers, " + std::to_string(answer) +
                         "+ tokens each, temperature " + temperature_text + ", repetition penalty 1.2 over " +
                         std::to_string(repeat_window) + " tokens, seed " + std::to_string(seed);
  triattn::save_stats(out, stats);
  std::fprintf(stderr, "calibrate: %s traces, %s tokens -> %s\n", stats.info["num_traces"].c_str(),
               stats.info["num_tokens"].c_str(), out.string().c_str());
  return 0;
}

int calibrate(const options& o) {
  const fs::path model_path = o.required("--model");
  const fs::path out = o.required("--out");
  const triattn_runner::text_model model =
      triattn_runner::text_model::load(model_path, o.optional_value("--tokenizer").value_or(""), "triattn calibrate");
  if (o.optional_value("--prompts")) return calibrate_on_answers(o, model, model_path, out);
  const fs::path text_path = o.required("--text");
  const std::int64_t max_windows = o.integer("--windows", 1, 100, INT32_MAX);
  // The model's context, at most 512 tokens (cli.md's windows; a GGUF model's context is longer).
  const int context = model.model().config().seq_len;
  const std::int64_t window = o.integer("--window-tokens", 1, std::min(context, 512), INT32_MAX);
  if (window > context)
    throw triattn::error("--window-tokens " + std::to_string(window) + " is longer than the context of " +
                         model_path.string() + ", " + std::to_string(context) + " tokens");
  const std::string text = triattn_runner::read_file(text_path, "triattn calibrate");
  const auto windows = triattn_runner::text_windows([&](std::string_view p) { return model.encode_paragraph(p); }, text,
                                             static_cast<int>(window), static_cast<int>(max_windows));
  if (windows.empty())
    throw triattn::error(text_path.string() + ": the text holds no full window of " + std::to_string(window) +
                         " tokens");
  triattn::query_stats stats = triattn_runner::calibrate(model.model(), windows, [](std::size_t done, std::size_t total) {
    progress("calibrate", static_cast<std::int64_t>(done), static_cast<std::int64_t>(total));
  });
  stats.info["model"] = model_path.filename().string();
  stats.info["source"] = text_path.filename().string();
  triattn::save_stats(out, stats);
  std::fprintf(stderr, "calibrate: %s traces, %s tokens -> %s\n", stats.info["num_traces"].c_str(),
               stats.info["num_tokens"].c_str(), out.string().c_str());
  return 0;
}

// ------------------------------------------------------------------------------------------

int triattention_command(const options& o, bool select) {
  return select ? select_triattention(o) : score_triattention(o);
}

/// `score` or `select` for the policy of `entry`: streaming_llm and triattention have options
/// of their own; every other policy goes through one path, fed what its entry needs.
int policy_command(const options& o, bool select, const triattn::policy_entry& entry) {
  if (entry.name == triattn::streaming_llm::name) return streaming_llm_command(o, select);
  if (entry.name == triattn::triattention::name) return triattention_command(o, select);
  return run_registry_policy(o, select, entry);
}

/// The usage text; its list of policies is the registry's.
std::string usage_text() {
  return "usage:\n"
         "  triattn score <policy> [inputs] --out SCORES.npy\n"
         "  triattn select <policy> [inputs] --budget B [--granularity per_layer|per_kv_head|union] --out KEEP.npy\n"
         "  triattn inspect S.safetensors\n"
         "  triattn calibrate --model M.bin --tokenizer T.bin --text FILE --out S.safetensors [--windows N]\n"
         "  triattn calibrate --model M.gguf --text FILE --out S.safetensors [--windows N] [--window-tokens W]\n"
         "  triattn calibrate --model M --prompts FILE --out S.safetensors [--answer-tokens 1024]\n"
         "                    [--temperature 0.7] [--seed 1]   (on the model's own answers)\n"
         "                    (GGUF: a build with llama.cpp; windows of min(context, 512) tokens by default)\n"
         "\n"
         "policies: " +
         triattn::policy_names(true) +
         " (streaming_llm: select only)\n"
         "inputs (.npy, little-endian, C order; float32, float16 or float64); each command ignores those it does not "
         "use:\n"
         "  --keys K        [num_layers, num_kv_heads, num_tokens, head_dim] post-RoPE keys (all policies)\n"
         "  --values V      [num_layers, num_kv_heads, num_tokens, head_dim] (" +
         triattn::policy_names_where([](const triattn::policy_entry& e) { return e.needs.values; }) +
         ")\n"
         "  --attn A        [num_layers, num_q_heads, rows, num_tokens] probabilities of the rows seen so far (" +
         triattn::policy_names_where([](const triattn::policy_entry& e) { return e.needs.attention; }) +
         ")\n"
         "  --queries Q     [num_layers, num_q_heads, w, head_dim] the last w queries, post-RoPE (" +
         triattn::policy_names_where([](const triattn::policy_entry& e) { return e.needs.queries; }) + ")\n"
         "  --stats S       triattn.stats.v1 safetensors (triattention)\n"
         "  --round-start R position of the next token (triattention)\n"
         "  --positions P   int [num_layers, num_kv_heads, num_tokens] positions (triattention; default: slot index)\n"
         "  --gqa mean|max|sum   GQA aggregation of " +
         triattn::policy_names_where([](const triattn::policy_entry& e) { return e.takes_gqa; }) +
         " (default mean); triattention: max|mean\n"
         "  --sinks S       attention sinks of streaming_llm (default 4)\n"
         "triattention options: --offset-max N (65536) --aggregation mean|max --disable-trig --disable-norm\n"
         "  --no-normalize --window W\n"
         "  --protect-first P (positions < P are always kept) --pre-rope (keys stored before RoPE)\n"
         "--granularity (every select): keep sets per (layer, kv-head), per kv-head shared by the layers, or one for\n"
         "  the whole sequence (rows combined by the mean of their normalised scores); default per_kv_head for\n"
         "  triattention, per_layer for the others.\n"
         "score writes float32 [num_layers, num_q_heads, num_tokens] raw scores for triattention and\n"
         "[num_layers, num_kv_heads, num_tokens] (after GQA aggregation; always-kept window slots +inf) for the others.\n"
         "select writes int64, ascending: [num_layers, num_kv_heads, min(B, num_tokens)] (per_layer),\n"
         "[num_kv_heads, min(B, num_tokens)] (per_kv_head) or [min(B, num_tokens)] (union).\n"
         "Errors print one line and exit with code 2; nothing is written then.\n";
}

int run(int argc, char** argv) {
  if (argc < 2 || std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h") {
    std::fputs(usage_text().c_str(), argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string_view command = argv[1];
  if (command == "score" || command == "select") {
    if (argc < 3 || std::string_view(argv[2]).starts_with("--"))
      throw usage_error{std::string(command) + " needs a policy name"};
    const options o(argc, argv, 3);
    if (o.has("--help")) return std::fputs(usage_text().c_str(), stdout), 0;
    check_out(o);
    const triattn::policy_entry* entry = triattn::find_policy(argv[2]);
    if (entry != nullptr && entry->compresses()) return policy_command(o, command == "select", *entry);
    throw usage_error{"unknown policy \"" + std::string(argv[2]) + "\" (known: " + triattn::policy_names(true) + ")"};
  }
  const options o(argc, argv, 2);
  if (o.has("--help")) return std::fputs(usage_text().c_str(), stdout), 0;
  check_out(o);
  if (command == "inspect") return inspect(o);
  if (command == "calibrate") return calibrate(o);
  throw usage_error{"unknown command \"" + std::string(command) + "\" (see triattn --help)"};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "triattn: %s\n", e.message.c_str());
  } catch (const triattn::error& e) {
    std::fprintf(stderr, "triattn: %s\n", e.what());
  } catch (const std::exception& e) {  // allocation failure and the like: still one line, exit 2
    std::fprintf(stderr, "triattn: %s\n", e.what());
  }
  return 2;
}
