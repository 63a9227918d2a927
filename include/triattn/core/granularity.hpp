/// \file triattn/core/granularity.hpp
/// \brief How many keep sets a round makes, and which (layer, kv_head) rows share each one:
/// the index mapping that the CPU and CUDA round pipelines both use.
///
/// A round scores every (layer, kv_head) row of a sequence, then reduces the rows that share a
/// decision into one score per slot, and selects once per decision:
///
/// | granularity      | decisions per sequence | rows per decision | row r of decision d     |
/// | ---------------- | ---------------------- | ----------------- | ----------------------- |
/// | `per_layer`      | layers x kv_heads      | 1                 | (d / kv_heads, d % kv_heads) |
/// | `per_kv_head`    | kv_heads               | layers            | (r, d)                  |
/// | `whole_sequence` | 1                      | layers x kv_heads | (r / kv_heads, r % kv_heads) |
///
/// `whole_sequence` is the CLI's `union`: every layer and head keeps the same tokens, which is
/// what a cell-based cache (llama.cpp: one cell holds a token for every layer and head) or
/// TensorRT-LLM's default can hold. Shared decisions need their rows to hold the same positions
/// in the same slots; keeping the same sets round after round preserves that.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

enum class granularity : std::uint8_t {
  per_layer,       ///< one keep set per (layer, kv_head)
  per_kv_head,     ///< one per kv_head, shared by every layer (TriAttention paper runs)
  whole_sequence,  ///< one for the whole sequence ("union")
};

/// How the rows of one decision combine into one score per slot.
enum class row_reduction : std::uint8_t {
  mean,  ///< the mean of the rows' (normalised) scores
  max,   ///< the largest (TriAttention's seed preset: union selection)
};

/// The CLI's names: "per_layer", "per_kv_head", "union".
constexpr std::string_view granularity_name(granularity g) {
  switch (g) {
    case granularity::per_layer: return "per_layer";
    case granularity::per_kv_head: return "per_kv_head";
    case granularity::whole_sequence: return "union";
  }
  return "?";
}

/// The granularity called `name` ("per_layer", "per_kv_head", "union"), or nullopt.
constexpr std::optional<granularity> parse_granularity(std::string_view name) {
  for (granularity g : {granularity::per_layer, granularity::per_kv_head, granularity::whole_sequence})
    if (granularity_name(g) == name) return g;
  return std::nullopt;
}

/// The rows of a sequence's decisions under one granularity (see the file comment).
struct decision_map {
  granularity grain = granularity::per_layer;
  int num_layers = 0;
  int num_kv_heads = 0;

  /// Keep sets per sequence.
  TRIATTN_HOST_DEVICE int decisions() const {
    return grain == granularity::per_layer     ? num_layers * num_kv_heads
           : grain == granularity::per_kv_head ? num_kv_heads
                                               : 1;
  }
  /// (layer, kv_head) rows per keep set.
  TRIATTN_HOST_DEVICE int rows() const {
    return grain == granularity::per_layer     ? 1
           : grain == granularity::per_kv_head ? num_layers
                                               : num_layers * num_kv_heads;
  }
  /// The (layer, kv_head) of row `r` of decision `d`.
  TRIATTN_HOST_DEVICE void row(int d, int r, int& layer, int& kv_head) const {
    const int flat = grain == granularity::per_layer     ? d
                     : grain == granularity::per_kv_head ? r * num_kv_heads + d
                                                         : r;
    layer = flat / num_kv_heads;
    kv_head = flat % num_kv_heads;
  }
  /// The decision that (layer, kv_head) belongs to.
  TRIATTN_HOST_DEVICE int decision_of(int layer, int kv_head) const {
    return grain == granularity::per_layer     ? layer * num_kv_heads + kv_head
           : grain == granularity::per_kv_head ? kv_head
                                               : 0;
  }
};

/// Folds row score `x` into the decision's running score `acc`. Start `acc` at
/// `row_fold_start(r)`. Shared by the CPU and CUDA paths, so a decision's score is the same
/// float on both (rows folded in row order). A NaN row score never wins the max.
///
/// The mean is folded as the rows' sum: its 1 / rows factor orders no slot differently, and
/// without it equal sums of integer scores (SnapKV's per-q-head ranks) stay exactly equal,
/// so their tie goes to the lower slot. Summing x / rows instead rounds such ties apart.
TRIATTN_HOST_DEVICE float row_fold_start(row_reduction r) { return r == row_reduction::max ? -INFINITY : 0.0f; }
TRIATTN_HOST_DEVICE float fold_row_score(float acc, float x, row_reduction r) {
#if defined(__CUDA_ARCH__)
  return r == row_reduction::max ? (x > acc ? x : acc) : __fadd_rn(acc, x);
#else
  return r == row_reduction::max ? (x > acc ? x : acc) : acc + x;
#endif
}

TRIATTN_NAMESPACE_END
