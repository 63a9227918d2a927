/// \file runner/ggml_bridge.hpp
/// \brief The one place where the runner and the programs touch ggml and llama.cpp (MIT): reading a GGUF file
/// (metadata, tensors dequantised to f32 or as their raw blocks), ggml's CPU kernels for a block
/// format, llama.cpp's tokenizer and chat template, and llama.cpp's own forward pass as a
/// reference for parity tests.
///
/// Built with the CMake target `triattn_llama_cpp` (configure with TRIATTN_WITH_LLAMA_CPP=ON).
/// Every error is a `triattn::error` whose message names the API and the key, tensor or path.
///
/// Layout: ggml lists a tensor's sizes fastest first (`ne[0]` is the contiguous dimension), so
/// `dequantize` returns a row-major array whose last index is `ne[0]`: a 2-D weight with
/// `ne = {in, out}` is `W[out][in]` row-major, and the layer computes `y = W x`.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ggml-cpu.h>
#include <ggml.h>
#include <gguf.h>
#include <llama.h>

#include "triattn/core/error.hpp"

namespace ggml_bridge {

namespace detail {

inline std::atomic<bool>& verbose_flag() {
  static std::atomic<bool> verbose{false};
  return verbose;
}

/// The quiet logger: keeps errors (and their continuation lines), drops the rest.
inline void quiet_log(ggml_log_level level, const char* text, void* /*user_data*/) {
  static thread_local bool last_was_error = false;
  if (level != GGML_LOG_LEVEL_CONT) last_was_error = level == GGML_LOG_LEVEL_ERROR;
  if (last_was_error || verbose_flag()) std::fputs(text, stderr);
}

}  // namespace detail

/// Makes llama.cpp and ggml log everything (`true`) or only errors (`false`, the default).
inline void set_verbose(bool verbose) {
  detail::verbose_flag() = verbose;
  llama_log_set(detail::quiet_log, nullptr);
}

/// Calls `llama_backend_init()` once per process and installs the quiet logger (the first
/// call of any function in this header does this).
inline void init_backend() {
  static std::once_flag once;
  std::call_once(once, [] {
    llama_log_set(detail::quiet_log, nullptr);
    llama_backend_init();
    ggml_cpu_init();  // the CPU kernels' tables, for `quantized_kernels` used without a llama context
  });
}

namespace detail {

/// While alive, the error lines that ggml and llama.cpp log go into `reason()` instead of to
/// the logger installed before (which is back when this ends): a program refuses a file with
/// one line of its own that carries ggml's reason, not ggml's lines and then its own.
class captured_errors {
 public:
  captured_errors() {
    llama_log_get(&previous_, &previous_data_);  // ggml's, which llama.cpp shares
    llama_log_set(collect, this);
  }
  captured_errors(const captured_errors&) = delete;
  captured_errors& operator=(const captured_errors&) = delete;
  ~captured_errors() { llama_log_set(previous_, previous_data_); }

  /// The captured error lines as one, "; " between them, each without its "function: "
  /// prefix; "no reason given" when there was none.
  [[nodiscard]] std::string reason() const {
    std::string out;
    std::size_t begin = 0;
    while (begin < text_.size()) {
      std::size_t end = text_.find('\n', begin);
      if (end == std::string::npos) end = text_.size();
      std::string_view line(text_.data() + begin, end - begin);
      if (const std::size_t colon = line.find(": ");
          colon != std::string_view::npos &&
          line.substr(0, colon).find_first_not_of("abcdefghijklmnopqrstuvwxyz_0123456789") == std::string_view::npos)
        line.remove_prefix(colon + 2);
      if (!line.empty()) out.append(out.empty() ? "" : "; ").append(line);
      begin = end + 1;
    }
    return out.empty() ? "no reason given" : out;
  }

 private:
  static void collect(ggml_log_level level, const char* text, void* self) {
    auto* me = static_cast<captured_errors*>(self);
    if (level != GGML_LOG_LEVEL_CONT) me->last_was_error_ = level == GGML_LOG_LEVEL_ERROR;
    if (me->last_was_error_ && text != nullptr) me->text_ += text;
  }

  ggml_log_callback previous_ = nullptr;
  void* previous_data_ = nullptr;
  std::string text_;
  bool last_was_error_ = false;
};

}  // namespace detail

/// Where a tensor sits in a GGUF file and what it holds.
struct tensor_desc {
  ggml_type type = GGML_TYPE_F32;
  std::vector<std::int64_t> ne;  ///< sizes, fastest first; ne.size() is the tensor's rank
  std::size_t offset = 0;        ///< byte offset of the data from the start of the file
  std::size_t bytes = 0;         ///< size of the (possibly quantised) data in bytes
  /// The number of elements (product of ne).
  [[nodiscard]] std::int64_t elements() const {
    std::int64_t n = 1;
    for (const auto d : ne) n *= d;
    return n;
  }
};

/// A GGUF file opened for its metadata and tensor directory (no tensor data is loaded).
class gguf_file {
 public:
  /// Opens `path` with `gguf_init_from_file` (no_alloc). Throws naming the file if it is
  /// missing, does not start with the GGUF magic, or is not a valid GGUF (with ggml's reason).
  /// Installs no logger and initialises no backend, so a program with its own (llama-server)
  /// can check a file before llama.cpp loads it.
  explicit gguf_file(std::filesystem::path path) : path_(std::move(path)) {
    constexpr const char* api = "ggml_bridge::gguf_file";
    std::error_code ec;
    TRIATTN_CHECK(std::filesystem::is_regular_file(path_, ec), api, path_, ": no such file");
    std::ifstream in(path_, std::ios::binary);
    std::array<char, 4> magic{};
    in.read(magic.data(), magic.size());
    TRIATTN_CHECK(in.gcount() == 4 && std::string_view(magic.data(), 4) == "GGUF", api, path_,
                  ": not a GGUF file (it does not start with the magic \"GGUF\")");
    ggml_context* meta = nullptr;
    gguf_init_params params{};
    params.no_alloc = true;
    params.ctx = &meta;
    const detail::captured_errors errors;
    gguf_ = gguf_init_from_file(path_.string().c_str(), params);
    meta_.reset(meta);
    TRIATTN_CHECK(gguf_ != nullptr, api, path_, ": not a valid GGUF file: ", errors.reason());
  }
  gguf_file(const gguf_file&) = delete;
  gguf_file& operator=(const gguf_file&) = delete;
  /// Moves the open file; the source is left empty.
  gguf_file(gguf_file&& other) noexcept
      : path_(std::move(other.path_)), gguf_(std::exchange(other.gguf_, nullptr)), meta_(std::move(other.meta_)) {}
  /// Moves the open file; the source is left empty.
  gguf_file& operator=(gguf_file&& other) noexcept {
    if (this != &other) {
      if (gguf_ != nullptr) gguf_free(gguf_);
      path_ = std::move(other.path_);
      gguf_ = std::exchange(other.gguf_, nullptr);
      meta_ = std::move(other.meta_);
    }
    return *this;
  }
  ~gguf_file() {
    if (gguf_ != nullptr) gguf_free(gguf_);
  }

  /// The path the file was opened from.
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  /// The underlying gguf context (owned by this object).
  [[nodiscard]] const gguf_context* raw() const { return gguf_; }

  /// Whether the metadata has `key`.
  [[nodiscard]] bool has(const std::string& key) const { return gguf_find_key(gguf_, key.c_str()) >= 0; }

  /// A string value. Throws if the key is missing or not a string.
  [[nodiscard]] std::string get_string(const std::string& key) const {
    const auto id = find_key(key, "ggml_bridge::gguf_file::get_string");
    check_type(key, id, GGUF_TYPE_STRING, "ggml_bridge::gguf_file::get_string");
    return gguf_get_val_str(gguf_, id);
  }

  /// An integer value of any width and signedness. Throws if the key is missing, not an
  /// integer, or a u64 above the int64 range.
  [[nodiscard]] std::int64_t get_int(const std::string& key) const {
    constexpr const char* api = "ggml_bridge::gguf_file::get_int";
    const auto id = find_key(key, api);
    switch (gguf_get_kv_type(gguf_, id)) {
      case GGUF_TYPE_UINT8: return gguf_get_val_u8(gguf_, id);
      case GGUF_TYPE_INT8: return gguf_get_val_i8(gguf_, id);
      case GGUF_TYPE_UINT16: return gguf_get_val_u16(gguf_, id);
      case GGUF_TYPE_INT16: return gguf_get_val_i16(gguf_, id);
      case GGUF_TYPE_UINT32: return gguf_get_val_u32(gguf_, id);
      case GGUF_TYPE_INT32: return gguf_get_val_i32(gguf_, id);
      case GGUF_TYPE_INT64: return gguf_get_val_i64(gguf_, id);
      case GGUF_TYPE_UINT64: {
        const auto v = gguf_get_val_u64(gguf_, id);
        TRIATTN_CHECK(v <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), api, path_,
                      ": key ", key, " = ", v, " does not fit in int64");
        return static_cast<std::int64_t>(v);
      }
      default:
        triattn::detail::fail(api, path_, ": key ", key, " has type ", gguf_type_name(gguf_get_kv_type(gguf_, id)),
                              ", not an integer");
    }
  }

  /// A floating-point value (f32 or f64). Throws if the key is missing or of another type.
  [[nodiscard]] double get_float(const std::string& key) const {
    constexpr const char* api = "ggml_bridge::gguf_file::get_float";
    const auto id = find_key(key, api);
    const auto type = gguf_get_kv_type(gguf_, id);
    if (type == GGUF_TYPE_FLOAT32) return gguf_get_val_f32(gguf_, id);
    if (type == GGUF_TYPE_FLOAT64) return gguf_get_val_f64(gguf_, id);
    triattn::detail::fail(api, path_, ": key ", key, " has type ", gguf_type_name(type), ", not f32 or f64");
  }

  /// An array of strings (e.g. `tokenizer.ggml.tokens`). Throws if the key is missing or not
  /// a string array.
  [[nodiscard]] std::vector<std::string> get_string_array(const std::string& key) const {
    constexpr const char* api = "ggml_bridge::gguf_file::get_string_array";
    const auto id = find_key(key, api);
    check_type(key, id, GGUF_TYPE_ARRAY, api);
    TRIATTN_CHECK(gguf_get_arr_type(gguf_, id) == GGUF_TYPE_STRING, api, path_, ": key ", key, " is an array of ",
                  gguf_type_name(gguf_get_arr_type(gguf_, id)), ", not of strings");
    const auto n = gguf_get_arr_n(gguf_, id);
    std::vector<std::string> out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) out.emplace_back(gguf_get_arr_str(gguf_, id, i));
    return out;
  }

  /// The type of `key`'s value (GGUF_TYPE_ARRAY for an array). Throws if the key is missing.
  [[nodiscard]] gguf_type type_of(const std::string& key) const {
    return gguf_get_kv_type(gguf_, find_key(key, "ggml_bridge::gguf_file::type_of"));
  }

  /// The number of elements of array `key`. Throws if the key is missing or not an array.
  [[nodiscard]] std::size_t array_size(const std::string& key) const {
    constexpr const char* api = "ggml_bridge::gguf_file::array_size";
    const auto id = find_key(key, api);
    check_type(key, id, GGUF_TYPE_ARRAY, api);
    return gguf_get_arr_n(gguf_, id);
  }

  /// Whether the file has a tensor called `name`.
  [[nodiscard]] bool has_tensor(const std::string& name) const { return gguf_find_tensor(gguf_, name.c_str()) >= 0; }

  /// The names of all tensors, in file order.
  [[nodiscard]] std::vector<std::string> tensor_names() const {
    const auto n = gguf_get_n_tensors(gguf_);
    std::vector<std::string> out;
    out.reserve(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) out.emplace_back(gguf_get_tensor_name(gguf_, i));
    return out;
  }

  /// Type, sizes (fastest first) and file position of tensor `name`. Throws if it is missing.
  [[nodiscard]] tensor_desc tensor_info(const std::string& name) const {
    constexpr const char* api = "ggml_bridge::gguf_file::tensor_info";
    const auto id = gguf_find_tensor(gguf_, name.c_str());
    TRIATTN_CHECK(id >= 0, api, path_, ": no tensor ", name);
    const ggml_tensor* t = meta_ ? ggml_get_tensor(meta_.get(), name.c_str()) : nullptr;
    TRIATTN_CHECK(t != nullptr, api, path_, ": tensor ", name, " is missing from the ggml context");
    tensor_desc d;
    d.type = gguf_get_tensor_type(gguf_, id);
    d.ne.assign(t->ne, t->ne + ggml_n_dims(t));
    d.offset = gguf_get_data_offset(gguf_) + gguf_get_tensor_offset(gguf_, id);
    d.bytes = gguf_get_tensor_size(gguf_, id);
    return d;
  }

  /// Reads tensor `name` from the file and converts it to f32: F32 is copied, any type with a
  /// ggml `to_float` (F16, BF16, Q4_1, Q8_0, ...) is dequantised. The result is row-major with
  /// `ne[0]` fastest (ne = {in, out} is W[out][in]). Throws if the tensor is missing, its type
  /// has no conversion, or the file is shorter than the tensor's data.
  [[nodiscard]] std::vector<float> dequantize(const std::string& name) const {
    constexpr const char* api = "ggml_bridge::gguf_file::dequantize";
    const tensor_desc d = tensor_info(name);
    const auto* traits = ggml_get_type_traits(d.type);
    TRIATTN_CHECK(d.type == GGML_TYPE_F32 || (traits != nullptr && traits->to_float != nullptr), api, path_,
                  ": tensor ", name, " has type ", ggml_type_name(d.type), ", which has no conversion to f32");
    const std::vector<std::byte> raw = read(name, d, api);
    std::vector<float> out(static_cast<std::size_t>(d.elements()));
    if (d.type == GGML_TYPE_F32) {
      std::memcpy(out.data(), raw.data(), raw.size());
    } else {
      traits->to_float(raw.data(), out.data(), d.elements());
    }
    return out;
  }

  /// The bytes of tensor `name` as the file stores them (blocks of its type, rows of `ne[0]`
  /// elements). Throws if the tensor is missing or the file is shorter than its data.
  [[nodiscard]] std::vector<std::byte> raw_bytes(const std::string& name) const {
    return read(name, tensor_info(name), "ggml_bridge::gguf_file::raw_bytes");
  }

 private:
  struct ggml_context_deleter {
    void operator()(ggml_context* ctx) const { ggml_free(ctx); }
  };

  // The data of tensor `name` (described by `d`), checked against its type's size and the file's.
  std::vector<std::byte> read(const std::string& name, const tensor_desc& d, const char* api) const {
    const std::int64_t n = d.elements();
    TRIATTN_CHECK(d.bytes == ggml_row_size(d.type, n), api, path_, ": tensor ", name, " holds ", d.bytes,
                  " bytes, expected ", ggml_row_size(d.type, n), " for ", n, " elements of ", ggml_type_name(d.type));
    std::error_code ec;
    const auto file_bytes = std::filesystem::file_size(path_, ec);
    TRIATTN_CHECK(!ec, api, path_, ": cannot stat the file: ", ec.message());
    TRIATTN_CHECK(d.offset + d.bytes <= file_bytes, api, path_, ": truncated: tensor ", name, " needs bytes [",
                  d.offset, ", ", d.offset + d.bytes, ") but the file has ", file_bytes);

    std::ifstream in(path_, std::ios::binary);
    TRIATTN_CHECK(in.is_open(), api, path_, ": cannot open the file");
    std::vector<std::byte> raw(d.bytes);
    in.seekg(static_cast<std::streamoff>(d.offset));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
    TRIATTN_CHECK(in.gcount() == static_cast<std::streamsize>(raw.size()), api, path_, ": truncated: read ",
                  in.gcount(), " of the ", raw.size(), " bytes of tensor ", name);
    return raw;
  }

  std::int64_t find_key(const std::string& key, const char* api) const {
    const auto id = gguf_find_key(gguf_, key.c_str());
    TRIATTN_CHECK(id >= 0, api, path_, ": no metadata key ", key);
    return id;
  }
  void check_type(const std::string& key, std::int64_t id, gguf_type want, const char* api) const {
    const auto type = gguf_get_kv_type(gguf_, id);
    TRIATTN_CHECK(type == want, api, path_, ": key ", key, " has type ", gguf_type_name(type), ", not ",
                  gguf_type_name(want));
  }

  std::filesystem::path path_;
  gguf_context* gguf_ = nullptr;
  std::unique_ptr<ggml_context, ggml_context_deleter> meta_;
};

/// Checks a model file against itself before any loader trusts it: llama.cpp's loader aborts
/// on some of these (block_count 0 or 2^31, a NaN norm epsilon, a tokenizer with a repeated
/// token) and accepts others that make it compute with the wrong sizes (a tokenizer shorter
/// than the embedding's rows, a block_count short of the tensors). Checked: the architecture is
/// named; `<arch>.block_count` is in [1, 4096] and the tensors hold exactly blocks 0 to
/// block_count - 1; the sizes that are scalars are bounded, the heads a multiple of the KV
/// heads, the norm epsilons in (0, 1) and the RoPE base finite and positive; the tokenizer's
/// arrays are as long as each other, as `<arch>.vocab_size` and as the rows of
/// token_embd.weight and output.weight, and its tokens distinct; each chat template is at most
/// 1 MiB. Keys a model lacks are left to its loader: this holds for any architecture. Throws
/// `triattn::error` naming the file and the key or tensor.
inline void check_model_file(const gguf_file& f) {
  constexpr const char* api = "ggml_bridge::check_model_file";
  const auto& path = f.path();
  TRIATTN_CHECK(f.has("general.architecture"), api, path, ": no general.architecture: not a model file");
  const std::string arch = f.get_string("general.architecture");
  const auto key = [&](const char* k) { return arch + "." + k; };
  // A scalar integer key within [lo, hi], or nothing when absent or per layer (an array).
  const auto size_key = [&](const char* k, std::int64_t lo, std::int64_t hi) -> std::optional<std::int64_t> {
    const std::string name = key(k);
    if (!f.has(name) || f.type_of(name) == GGUF_TYPE_ARRAY) return std::nullopt;
    const std::int64_t v = f.get_int(name);
    TRIATTN_CHECK(v >= lo && v <= hi, api, path, ": ", name, " = ", v, " is outside [", lo, ", ", hi, "]");
    return v;
  };
  const auto positive_float = [&](const std::string& name, double below) {
    if (!f.has(name) || f.type_of(name) == GGUF_TYPE_ARRAY) return;
    const double v = f.get_float(name);
    TRIATTN_CHECK(std::isfinite(v) && v > 0.0 && v < below, api, path, ": ", name, " = ", v, " is not in (0, ", below,
                  ")");
  };

  constexpr std::int64_t max_blocks = 4096;
  TRIATTN_CHECK(f.has(key("block_count")), api, path, ": no ", key("block_count"));
  const std::int64_t blocks = *size_key("block_count", 1, max_blocks);
  std::int64_t last_block = -1;
  for (const std::string& name : f.tensor_names()) {
    if (!name.starts_with("blk.")) continue;
    std::int64_t b = -1;
    const char* first = name.data() + 4;
    const auto [end, ec] = std::from_chars(first, name.data() + name.size(), b);
    TRIATTN_CHECK(ec == std::errc() && end != first && *end == '.' && b >= 0 && b < max_blocks, api, path, ": tensor ",
                  name, " has no block number");
    last_block = std::max(last_block, b);
  }
  TRIATTN_CHECK(last_block + 1 == blocks, api, path, ": ", key("block_count"), " = ", blocks,
                " but the tensors hold blocks 0 to ", last_block);

  const auto width = size_key("embedding_length", 1, 1 << 20);
  size_key("feed_forward_length", 0, 1 << 24);
  size_key("context_length", 1, std::numeric_limits<std::int32_t>::max());
  const auto heads = size_key("attention.head_count", 0, 1 << 16);
  const auto kv_heads = size_key("attention.head_count_kv", 0, 1 << 16);
  if (heads && kv_heads && *kv_heads > 0)
    TRIATTN_CHECK(*heads > 0 && *heads % *kv_heads == 0, api, path, ": ", key("attention.head_count"), " = ", *heads,
                  " is not a positive multiple of ", key("attention.head_count_kv"), " = ", *kv_heads);
  if (heads && *heads > 0 && width && !f.has(key("attention.key_length")))
    TRIATTN_CHECK(*width % *heads == 0, api, path, ": ", key("embedding_length"), " = ", *width,
                  " is not a multiple of ", key("attention.head_count"), " = ", *heads);
  positive_float(key("attention.layer_norm_rms_epsilon"), 1.0);
  positive_float(key("attention.layer_norm_epsilon"), 1.0);
  positive_float(key("rope.freq_base"), std::numeric_limits<double>::infinity());
  // llama.cpp asserts on these (LLAMA_MAX_EXPERTS, a scaling type it does not name)
  const auto experts = size_key("expert_count", 0, 1024);
  if (const auto used = size_key("expert_used_count", 0, 1024))
    TRIATTN_CHECK(*used <= experts.value_or(0), api, path, ": ", key("expert_used_count"), " = ", *used, " exceeds ",
                  key("expert_count"), " = ", experts.value_or(0));
  if (f.has(key("rope.scaling.type"))) {
    const std::string type = f.get_string(key("rope.scaling.type"));
    TRIATTN_CHECK(type == "none" || type == "linear" || type == "yarn" || type == "longrope", api, path, ": ",
                  key("rope.scaling.type"), " is \"", type, "\"; llama.cpp knows none, linear, yarn and longrope");
  }
  positive_float(key("rope.scaling.factor"), std::numeric_limits<double>::infinity());

  std::optional<std::size_t> n_tokens;
  if (f.has("tokenizer.ggml.tokens")) {
    const std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
    n_tokens = tokens.size();
    TRIATTN_CHECK(!tokens.empty(), api, path, ": tokenizer.ggml.tokens is empty");
    for (const char* k : {"tokenizer.ggml.scores", "tokenizer.ggml.token_type"})
      TRIATTN_CHECK(!f.has(k) || f.array_size(k) == tokens.size(), api, path, ": ", k, " has ", f.array_size(k),
                    " entries, tokenizer.ggml.tokens ", tokens.size());
    if (const auto v = size_key("vocab_size", 0, std::numeric_limits<std::int64_t>::max()))
      TRIATTN_CHECK(static_cast<std::size_t>(*v) == tokens.size(), api, path, ": ", key("vocab_size"), " = ", *v,
                    " but tokenizer.ggml.tokens has ", tokens.size(), " entries");
    // What llama.cpp's vocabulary loader takes: a model it knows, with the arrays that model
    // reads (it aborts, or throws while tokenising, where they are missing), token types it
    // names, and special-token ids inside the vocabulary.
    const std::string model = f.has("tokenizer.ggml.model") ? f.get_string("tokenizer.ggml.model") : "llama";
    constexpr std::array<std::string_view, 9> models{"llama", "bert", "gpt2", "hybriddna", "whitespace",
                                                     "t5",    "rwkv", "plamo2", "gemma4"};
    TRIATTN_CHECK(std::find(models.begin(), models.end(), model) != models.end(), api, path,
                  ": tokenizer.ggml.model is \"", model, "\", not a tokenizer llama.cpp can run");
    TRIATTN_CHECK(model != "llama" || f.has("tokenizer.ggml.scores"), api, path,
                  ": tokenizer.ggml.model llama needs tokenizer.ggml.scores");
    TRIATTN_CHECK(model != "gpt2" || f.has("tokenizer.ggml.merges"), api, path,
                  ": tokenizer.ggml.model gpt2 needs tokenizer.ggml.merges");
    if (f.has("tokenizer.ggml.token_type")) {
      const auto id = gguf_find_key(f.raw(), "tokenizer.ggml.token_type");
      TRIATTN_CHECK(gguf_get_arr_type(f.raw(), id) == GGUF_TYPE_INT32, api, path,
                    ": tokenizer.ggml.token_type is not an array of int32");
      const auto* types = static_cast<const std::int32_t*>(gguf_get_arr_data(f.raw(), id));
      for (std::size_t i = 0; i < f.array_size("tokenizer.ggml.token_type"); ++i)
        TRIATTN_CHECK(types[i] >= 0 && types[i] <= 6, api, path, ": tokenizer.ggml.token_type[", i, "] = ", types[i],
                      " is not a token type (0 to 6)");
    }
    if (f.has("tokenizer.ggml.eos_token_ids")) {  // the end tokens of a model with several
      const auto id = gguf_find_key(f.raw(), "tokenizer.ggml.eos_token_ids");
      const gguf_type t = gguf_get_arr_type(f.raw(), id);
      TRIATTN_CHECK(t == GGUF_TYPE_INT32 || t == GGUF_TYPE_UINT32, api, path,
                    ": tokenizer.ggml.eos_token_ids is not an array of 32-bit integers");
      const auto* ids = static_cast<const std::uint32_t*>(gguf_get_arr_data(f.raw(), id));
      for (std::size_t i = 0; i < f.array_size("tokenizer.ggml.eos_token_ids"); ++i)
        TRIATTN_CHECK(ids[i] < tokens.size(), api, path, ": tokenizer.ggml.eos_token_ids[", i, "] = ",
                      static_cast<std::int32_t>(ids[i]), " is outside the vocabulary's ", tokens.size(), " tokens");
    }
    for (std::int64_t i = 0; i < gguf_get_n_kv(f.raw()); ++i) {
      const std::string k = gguf_get_key(f.raw(), i);
      if (!k.starts_with("tokenizer.ggml.") || !k.ends_with("_token_id")) continue;
      const std::int64_t v = f.get_int(k);
      TRIATTN_CHECK(v >= 0 && static_cast<std::size_t>(v) < tokens.size(), api, path, ": ", k, " = ", v,
                    " is outside the vocabulary's ", tokens.size(), " tokens");
    }
    std::unordered_map<std::string_view, std::size_t> first_at;
    first_at.reserve(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto [at, fresh] = first_at.emplace(tokens[i], i);
      TRIATTN_CHECK(fresh, api, path, ": tokenizer.ggml.tokens holds the same text at ids ", at->second, " and ", i);
    }
  }
  for (const char* name : {"token_embd.weight", "output.weight"}) {
    if (!f.has_tensor(name)) continue;
    const tensor_desc t = f.tensor_info(name);
    TRIATTN_CHECK(t.ne.size() == 2, api, path, ": tensor ", name, " has ", t.ne.size(), " dimensions, not 2");
    TRIATTN_CHECK(!width || t.ne[0] == *width, api, path, ": tensor ", name, " has rows of ", t.ne[0], ", ",
                  key("embedding_length"), " is ", width.value_or(0));
    TRIATTN_CHECK(!n_tokens || static_cast<std::size_t>(t.ne[1]) == *n_tokens, api, path, ": tensor ", name, " has ",
                  t.ne[1], " rows but tokenizer.ggml.tokens has ", n_tokens.value_or(0), " entries");
  }
  constexpr std::size_t max_template = std::size_t{1} << 20;
  for (std::int64_t i = 0; i < gguf_get_n_kv(f.raw()); ++i) {
    const std::string_view k = gguf_get_key(f.raw(), i);
    if (!k.starts_with("tokenizer.chat_template") || gguf_get_kv_type(f.raw(), i) != GGUF_TYPE_STRING) continue;
    const std::size_t bytes = std::strlen(gguf_get_val_str(f.raw(), i));
    TRIATTN_CHECK(bytes <= max_template, api, path, ": ", k, " holds ", bytes, " bytes, more than a chat template's ",
                  max_template);
  }
}

/// ggml's CPU kernels for the rows of a block format: `to_float` decodes a row, `quantize_input`
/// encodes an f32 input row in `input_type` (the format `vec_dot` takes beside the weights), and
/// `vec_dot` is ggml's own dot product of a weight row with an input row, as its CPU product
/// calls it (`ggml_vec_dot_t`).
struct cpu_kernels {
  ggml_to_float_t to_float = nullptr;
  ggml_from_float_t quantize_input = nullptr;
  ggml_vec_dot_t vec_dot = nullptr;
  ggml_type input_type = GGML_TYPE_F32;
};

/// The kernels of a quantised `type` (Q4_K, Q6_K, Q8_0, ...), or nothing for a type that is not
/// quantised or lacks one of them.
[[nodiscard]] inline std::optional<cpu_kernels> quantized_kernels(ggml_type type) {
  init_backend();
  if (!ggml_is_quantized(type)) return std::nullopt;
  const auto* traits = ggml_get_type_traits(type);
  const auto* cpu = ggml_get_type_traits_cpu(type);
  if (traits == nullptr || cpu == nullptr || traits->to_float == nullptr || cpu->vec_dot == nullptr) return std::nullopt;
  const auto* input = ggml_get_type_traits_cpu(cpu->vec_dot_type);
  if (input == nullptr || input->from_float == nullptr) return std::nullopt;
  return cpu_kernels{traits->to_float, input->from_float, cpu->vec_dot, cpu->vec_dot_type};
}

namespace detail {

struct model_deleter {
  void operator()(llama_model* m) const { llama_model_free(m); }
};
struct context_deleter {
  void operator()(llama_context* c) const { llama_free(c); }
};
using model_ptr = std::unique_ptr<llama_model, model_deleter>;
using context_ptr = std::unique_ptr<llama_context, context_deleter>;

/// Loads a model with llama.cpp on the CPU (only its vocabulary when `vocab_only`), once the
/// file has passed `check_model_file`. Throws naming the file, with llama.cpp's reason.
inline model_ptr load_model(const std::filesystem::path& path, bool vocab_only, const char* api) {
  init_backend();
  check_model_file(gguf_file(path));
  auto params = llama_model_default_params();
  params.vocab_only = vocab_only;
  params.n_gpu_layers = 0;
  const captured_errors errors;
  model_ptr model(llama_model_load_from_file(path.string().c_str(), params));
  TRIATTN_CHECK(model != nullptr, api, path, ": llama.cpp cannot load it: ", errors.reason());
  return model;
}

}  // namespace detail

/// llama.cpp's tokenizer and chat template for a GGUF model (only the vocabulary is loaded).
class vocab {
 public:
  /// Loads the vocabulary of the GGUF model at `path`. Throws naming the path on failure.
  explicit vocab(const std::filesystem::path& path)
      : model_(detail::load_model(path, true, "ggml_bridge::vocab")), vocab_(llama_model_get_vocab(model_.get())) {
    TRIATTN_CHECK(vocab_ != nullptr, "ggml_bridge::vocab", path, ": llama_model_get_vocab returned null");
    // llama.cpp loads some broken vocabularies and throws only when it tokenises with them (an
    // `std::out_of_range` that names nothing): once here, so the refusal names the file.
    try {
      (void)tokenize("Hello, world!\n 12 <|im_start|>", true, true);
    } catch (const std::exception& e) {
      triattn::detail::fail("ggml_bridge::vocab", path, ": llama.cpp cannot tokenise with its vocabulary: ", e.what());
    }
  }

  /// Token ids of `text`. `add_special` adds the model's start/end tokens if its metadata
  /// asks for them (SmolLM2 adds none); `parse_special` turns "<|im_start|>" and the like into
  /// their special ids instead of plain text.
  [[nodiscard]] std::vector<int> tokenize(std::string_view text, bool add_special, bool parse_special) const {
    constexpr const char* api = "ggml_bridge::vocab::tokenize";
    TRIATTN_CHECK(text.size() < static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()), api,
                  "text of ", text.size(), " bytes is too long");
    const auto len = static_cast<std::int32_t>(text.size());
    std::vector<llama_token> out(text.size() + 8);
    std::int32_t n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<std::int32_t>(out.size()),
                                    add_special, parse_special);
    if (n < 0) {  // buffer too small: -n is the count needed
      TRIATTN_CHECK(n != std::numeric_limits<std::int32_t>::min(), api, "llama_tokenize overflowed on ", text.size(),
                    " bytes");
      out.resize(static_cast<std::size_t>(-n));
      n = llama_tokenize(vocab_, text.data(), len, out.data(), static_cast<std::int32_t>(out.size()), add_special,
                         parse_special);
      TRIATTN_CHECK(n >= 0, api, "llama_tokenize returned ", n, " with a buffer of ", out.size());
    }
    out.resize(static_cast<std::size_t>(n));
    return {out.begin(), out.end()};
  }

  /// The text of token `id`, special tokens rendered (e.g. "<|im_end|>"). Throws if `id` is
  /// out of range.
  [[nodiscard]] std::string piece(int id) const {
    constexpr const char* api = "ggml_bridge::vocab::piece";
    TRIATTN_CHECK(id >= 0 && id < n_vocab(), api, "token ", id, " is outside [0, ", n_vocab(), ")");
    std::string buf(32, '\0');
    std::int32_t n = llama_token_to_piece(vocab_, id, buf.data(), static_cast<std::int32_t>(buf.size()), 0, true);
    if (n < 0) {
      buf.resize(static_cast<std::size_t>(-n));
      n = llama_token_to_piece(vocab_, id, buf.data(), static_cast<std::int32_t>(buf.size()), 0, true);
      TRIATTN_CHECK(n >= 0, api, "llama_token_to_piece(", id, ") returned ", n, " with a buffer of ", buf.size());
    }
    buf.resize(static_cast<std::size_t>(n));
    return buf;
  }

  /// The concatenated pieces of `ids`.
  [[nodiscard]] std::string detokenize(std::span<const int> ids) const {
    std::string out;
    for (const int id : ids) out += piece(id);
    return out;
  }

  /// The start token id (SmolLM2: 1, "<|im_start|>").
  [[nodiscard]] int bos() const { return llama_vocab_bos(vocab_); }
  /// The end token id (SmolLM2: 2, "<|im_end|>").
  [[nodiscard]] int eos() const { return llama_vocab_eos(vocab_); }
  /// The number of tokens.
  [[nodiscard]] int n_vocab() const { return llama_vocab_n_tokens(vocab_); }
  /// Whether `id` ends a generation (end of turn, end of text, ...).
  [[nodiscard]] bool is_eog(int id) const { return llama_vocab_is_eog(vocab_, id); }

  /// A one-turn prompt in the model's chat template (`tokenizer.chat_template`), ending with
  /// the assistant's turn opened: for SmolLM2 (ChatML) "<|im_start|>system\n" + system +
  /// "<|im_end|>\n<|im_start|>user\n" + message + "<|im_end|>\n<|im_start|>assistant\n".
  /// `system_message` empty: the template's own default (`default_system_message`), which
  /// llama.cpp's built-in form of the template would leave out. Tokenize the result with
  /// parse_special.
  [[nodiscard]] std::string chat_prompt(std::string_view user_message, std::string_view system_message = {}) const {
    constexpr const char* api = "ggml_bridge::vocab::chat_prompt";
    const char* tmpl = llama_model_chat_template(model_.get(), nullptr);
    TRIATTN_CHECK(tmpl != nullptr, api, "the model has no tokenizer.chat_template");
    const std::string user(user_message);
    const std::string system(system_message.empty() ? default_system_message() : std::string(system_message));
    std::vector<llama_chat_message> chat;
    if (!system.empty()) chat.push_back({"system", system.c_str()});
    chat.push_back({"user", user.c_str()});
    std::string buf(2 * (user.size() + system.size()) + 256, '\0');
    std::int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), true, buf.data(),
                                               static_cast<std::int32_t>(buf.size()));
    TRIATTN_CHECK(n >= 0, api, "llama_chat_apply_template does not support the model's template");
    if (static_cast<std::size_t>(n) > buf.size()) {
      buf.resize(static_cast<std::size_t>(n));
      n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), true, buf.data(),
                                    static_cast<std::int32_t>(buf.size()));
      TRIATTN_CHECK(n >= 0 && static_cast<std::size_t>(n) <= buf.size(), api, "llama_chat_apply_template returned ",
                    n, " with a buffer of ", buf.size());
    }
    buf.resize(static_cast<std::size_t>(n));
    return buf;
  }

  /// The system message a ChatML template writes when the chat has none (SmolLM2: "You are a
  /// helpful AI assistant named SmolLM, trained by Hugging Face"; Qwen2.5: "You are Qwen,
  /// created by Alibaba Cloud. You are a helpful assistant."): the first literal
  /// "<|im_start|>system\n...<|im_end|>" of the template whose text is plain (no quote, brace
  /// or bracket, so not an expression). Empty when the template has none.
  [[nodiscard]] std::string default_system_message() const {
    const char* tmpl = llama_model_chat_template(model_.get(), nullptr);
    if (tmpl == nullptr) return {};
    const std::string_view t(tmpl);
    constexpr std::string_view open = "<|im_start|>system", close = "<|im_end|>";
    for (std::size_t at = t.find(open); at != std::string_view::npos; at = t.find(open, at + 1)) {
      std::size_t begin = at + open.size();
      // The newline after the role: a real one, or the two characters of a string literal's escape.
      if (t.substr(begin, 2) == "\\n") begin += 2;
      else if (t.substr(begin, 1) == "\n") begin += 1;
      else continue;
      const std::size_t end = t.find(close, begin);
      if (end == std::string_view::npos) break;
      const std::string_view text = t.substr(begin, end - begin);
      if (!text.empty() && text.find_first_of("'\"{}[]+") == std::string_view::npos) return std::string(text);
    }
    return {};
  }

  /// The underlying llama.cpp vocabulary (owned by this object).
  [[nodiscard]] const llama_vocab* raw() const { return vocab_; }

 private:
  detail::model_ptr model_;
  const llama_vocab* vocab_ = nullptr;
};

/// llama.cpp's own forward pass (CPU, `n_threads` threads) over `tokens` as one sequence from
/// position 0: the logits after every token, row-major [tokens.size()][n_vocab]. Loads the
/// model from `gguf` on each call; for parity tests.
[[nodiscard]] inline std::vector<float> reference_logits(const std::filesystem::path& gguf,
                                                         std::span<const int> tokens, int n_threads) {
  constexpr const char* api = "ggml_bridge::reference_logits";
  TRIATTN_CHECK(!tokens.empty(), api, "no tokens");
  TRIATTN_CHECK(n_threads >= 1, api, "n_threads ", n_threads, " must be >= 1");
  TRIATTN_CHECK(tokens.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max() / 2), api,
                tokens.size(), " tokens are too many");
  const auto model = detail::load_model(gguf, false, api);
  const llama_vocab* voc = llama_model_get_vocab(model.get());
  const int n_vocab = llama_vocab_n_tokens(voc);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TRIATTN_CHECK(tokens[i] >= 0 && tokens[i] < n_vocab, api, gguf, ": token ", tokens[i], " at ", i,
                  " is outside [0, ", n_vocab, ")");
  }

  const auto n = static_cast<std::int32_t>(tokens.size());
  const std::int32_t chunk = std::min<std::int32_t>(n, 512);
  auto cparams = llama_context_default_params();
  cparams.n_ctx = static_cast<std::uint32_t>(n);
  cparams.n_batch = static_cast<std::uint32_t>(chunk);
  cparams.n_ubatch = static_cast<std::uint32_t>(chunk);
  cparams.n_seq_max = 1;
  cparams.n_threads = n_threads;
  cparams.n_threads_batch = n_threads;
  cparams.no_perf = true;
  detail::context_ptr ctx(llama_init_from_model(model.get(), cparams));
  TRIATTN_CHECK(ctx != nullptr, api, gguf, ": llama_init_from_model failed for n_ctx ", n);

  struct batch_guard {
    llama_batch b;
    ~batch_guard() { llama_batch_free(b); }
  } batch{llama_batch_init(chunk, 0, 1)};

  std::vector<float> logits(tokens.size() * static_cast<std::size_t>(n_vocab));
  for (std::int32_t start = 0; start < n; start += chunk) {
    const std::int32_t len = std::min(chunk, n - start);
    batch.b.n_tokens = len;
    for (std::int32_t j = 0; j < len; ++j) {
      batch.b.token[j] = tokens[static_cast<std::size_t>(start + j)];
      batch.b.pos[j] = start + j;
      batch.b.n_seq_id[j] = 1;
      batch.b.seq_id[j][0] = 0;
      batch.b.logits[j] = 1;
    }
    const std::int32_t rc = llama_decode(ctx.get(), batch.b);
    TRIATTN_CHECK(rc == 0, api, gguf, ": llama_decode returned ", rc, " for tokens [", start, ", ", start + len, ")");
    for (std::int32_t j = 0; j < len; ++j) {
      const float* row = llama_get_logits_ith(ctx.get(), j);
      TRIATTN_CHECK(row != nullptr, api, gguf, ": llama_get_logits_ith(", j, ") returned null");
      std::memcpy(logits.data() + static_cast<std::size_t>(start + j) * static_cast<std::size_t>(n_vocab), row,
                  static_cast<std::size_t>(n_vocab) * sizeof(float));
    }
  }
  return logits;
}

}  // namespace ggml_bridge
