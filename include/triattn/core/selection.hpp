/// \file triattn/core/selection.hpp
/// \brief Turning scores into keep indices: deterministic top-k, union selection, 1-D
/// pooling and protected sets.
///
/// Determinism is part of the contract: a higher score wins; equal scores go to the lower
/// slot index; NaN ranks below every number (a NaN score is never preferred to a real one);
/// the returned indices are ascending, which is what makes in-place compaction safe.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Total order used by every selection: true when slot `a` (score `sa`) ranks before slot
/// `b`. Written once for the host and device paths.
TRIATTN_HOST_DEVICE bool ranks_before(float sa, std::int64_t a, float sb, std::int64_t b) {
  const bool na = sa != sa, nb = sb != sb;  // NaN test that survives -ffast-math
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return a < b;
}

/// `ranks_before` as one unsigned sort key, for radix sorts (the CUDA selection): for slots in
/// ascending order, a stable ascending sort by `rank_key` puts them in `ranks_before` order.
/// Protected slots get 0 (first, by slot); higher scores get smaller keys; -0 ties +0; NaN
/// gets the largest key. 0 and 0xffffffff are not the key of any number.
TRIATTN_HOST_DEVICE std::uint32_t rank_key(float score, bool protected_slot) {
  if (protected_slot) return 0u;
  if (score != score) return 0xffffffffu;
  std::uint32_t u = detail::float_bits(score);
  if (u == 0x80000000u) u = 0u;  // -0 == +0: ranks_before ties them
  const std::uint32_t ordered = (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);  // monotone in the score
  return ~ordered;
}

/// Segment quotas (`round_options::segments`): the m candidates of a decision, in slot order,
/// split into `segments` equal runs; run j holds candidates [segment_begin(j), segment_begin(j +
/// 1)) and keeps `quota_begin(j + 1) - quota_begin(j)` of the `r` slots left to choose, its
/// share of them. Quotas follow the runs' cumulative sizes, so no run is asked for more slots
/// than it holds (r <= m) and the quotas sum to r exactly. Shared by the CPU and CUDA paths.
/// The most segments a round takes: 8 spread a long prompt's evictions (field-2026.md); a bound
/// keeps the per-run loops short on both paths.
inline constexpr std::int64_t max_segments = 65536;
TRIATTN_HOST_DEVICE std::int64_t segment_begin(std::int64_t j, std::int64_t m, std::int64_t segments) {
  return j * m / segments;
}
TRIATTN_HOST_DEVICE std::int64_t quota_begin(std::int64_t j, std::int64_t m, std::int64_t segments, std::int64_t r) {
  return m == 0 ? 0 : segment_begin(j, m, segments) * r / m;
}

/// Top-`k` of `scores` restricted to the slots where `candidate` is true (all slots when
/// `candidate` is empty), split into `segments` runs that each keep their quota (see
/// `segment_begin`; 1: one global top-k). Appends the chosen slot indices to `out` and returns
/// how many were chosen (min(k, candidates)). The appended indices are NOT sorted; callers
/// sort once after merging protected slots (see `select_keep`).
inline std::int64_t top_k_append(std::span<const float> scores, std::int64_t k, std::span<const bool> candidate,
                                 std::vector<std::int32_t>& out, std::int64_t segments = 1) {
  // One 64-bit key per candidate, `rank_key` above the slot: ascending keys are `ranks_before`
  // order, ties to the lower slot, so the selection compares integers in one array.
  std::vector<std::uint64_t> keys;
  keys.reserve(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i)
    if (candidate.empty() || candidate[i]) keys.push_back(std::uint64_t{rank_key(scores[i], false)} << 32 | i);
  const auto m = static_cast<std::int64_t>(keys.size());
  const std::int64_t take = std::clamp<std::int64_t>(k, 0, m);
  for (std::int64_t j = 0; j < segments; ++j) {  // keys are in slot order: each run is a subrange
    const auto first = keys.begin() + segment_begin(j, m, segments), last = keys.begin() + segment_begin(j + 1, m, segments);
    const auto quota = quota_begin(j + 1, m, segments, take) - quota_begin(j, m, segments, take);
    std::nth_element(first, first + quota, last);
    for (auto it = first; it != first + quota; ++it) out.push_back(static_cast<std::int32_t>(*it & 0xffffffffu));
  }
  return take;
}

/// Deterministic top-k: the `min(k, n)` best slots of `scores`, ascending.
inline std::vector<std::int32_t> top_k(std::span<const float> scores, std::int64_t k) {
  TRIATTN_CHECK(k >= 0, "triattn::top_k", "k ", k, " must be >= 0");
  std::vector<std::int32_t> out;
  top_k_append(scores, k, {}, out);
  std::sort(out.begin(), out.end());
  return out;
}

/// Union selection over rows of scores [num_rows, n] (row-major), as TriAttention's reference
/// `_select_union_based`: every row takes its own top-k, and the k best slots of the union by
/// the combined score (max over rows) are kept. Returns min(k, n) slots, ascending.
inline std::vector<std::int32_t> union_select(std::span<const float> rows, std::int64_t num_rows, std::int64_t n,
                                              std::int64_t k) {
  const char* api = "triattn::union_select";
  TRIATTN_CHECK(num_rows >= 1 && n >= 0 && static_cast<std::int64_t>(rows.size()) == num_rows * n, api,
                "rows holds ", rows.size(), " scores, expected num_rows ", num_rows, " x n ", n);
  TRIATTN_CHECK(k >= 0, api, "k ", k, " must be >= 0");
  const auto un = static_cast<std::size_t>(n);
  std::vector<float> combined(un, -std::numeric_limits<float>::infinity());
  const auto in_union = std::make_unique<bool[]>(un);  // value-initialised: all false
  std::vector<std::int32_t> picked;
  for (std::int64_t r = 0; r < num_rows; ++r) {
    const auto row = rows.subspan(static_cast<std::size_t>(r) * un, un);
    for (std::size_t j = 0; j < un; ++j)
      if (row[j] > combined[j]) combined[j] = row[j];  // a NaN never wins a comparison
    picked.clear();
    top_k_append(row, k, {}, picked);
    for (auto j : picked) in_union[j] = true;
  }
  // Each row contributed min(k, n) distinct slots, so the union never holds fewer than the
  // min(k, n) slots to keep: the reference's "fill from outside the union" step cannot fire.
  std::vector<std::int32_t> out;
  top_k_append(combined, k, {in_union.get(), un}, out);
  std::sort(out.begin(), out.end());
  return out;
}

/// Pooling kinds of SnapKV-style smoothing.
enum class pooling : std::uint8_t {
  max,  ///< padding counts as -inf
  avg,  ///< padding counts as 0 and the divisor is always `kernel` (PyTorch count_include_pad)
};

/// Output j of a 1-D pooling of `x` [n] with an odd `kernel`, stride 1 and padding kernel/2,
/// so that the output has n elements too. Shared by the CPU and CUDA paths.
TRIATTN_HOST_DEVICE float pool_at(const float* x, std::int64_t n, std::int64_t j, int kernel, pooling kind) {
  const std::int64_t lo = j - kernel / 2, hi = j + kernel / 2;
  float acc = kind == pooling::max ? -INFINITY : 0.0f;  // INFINITY: usable in device code, unlike numeric_limits
  for (std::int64_t i = lo < 0 ? 0 : lo; i <= hi && i < n; ++i) {
    if (kind == pooling::max) {
      acc = x[i] > acc ? x[i] : acc;
    } else {
      acc += x[i];
    }
  }
  return kind == pooling::max ? acc : acc / static_cast<float>(kernel);
}

/// Pools `x` into `out` (both [n]); see `pool_at`.
inline void pool1d(std::span<const float> x, std::span<float> out, int kernel, pooling kind) {
  TRIATTN_CHECK(kernel >= 1 && kernel % 2 == 1, "triattn::pool1d", "kernel ", kernel, " must be odd and >= 1");
  TRIATTN_CHECK(out.size() == x.size(), "triattn::pool1d", "output size ", out.size(), " differs from input size ",
                x.size());
  const auto n = static_cast<std::int64_t>(x.size());
  const std::int64_t r = kernel / 2;
  if (n <= 2 * r) {
    for (std::int64_t j = 0; j < n; ++j) out[j] = pool_at(x.data(), n, j, kernel, kind);
    return;
  }
  // The interior [r, n - r) window by window offset, so that the loop over j vectorises: the
  // same operations in the same order as `pool_at` (which the edges use).
  float* o = out.data() + r;
  const std::int64_t m = n - 2 * r;
  std::fill_n(o, m, kind == pooling::max ? -INFINITY : 0.0f);
  for (int k = 0; k < kernel; ++k) {
    const float* xs = x.data() + k;  // x[j - r + k] for output j = r + t
    if (kind == pooling::max) {
      for (std::int64_t t = 0; t < m; ++t) o[t] = xs[t] > o[t] ? xs[t] : o[t];
    } else {
      for (std::int64_t t = 0; t < m; ++t) o[t] += xs[t];
    }
  }
  if (kind == pooling::avg)
    for (std::int64_t t = 0; t < m; ++t) o[t] /= static_cast<float>(kernel);
  for (std::int64_t j = 0; j < r; ++j) {
    out[j] = pool_at(x.data(), n, j, kernel, kind);
    out[n - 1 - j] = pool_at(x.data(), n, n - 1 - j, kernel, kind);
  }
}

/// The first slot of the recent window, the last `recent` of `n` slots (0 when the window
/// holds them all): the slots before it compete.
TRIATTN_HOST_DEVICE std::int64_t recent_window_begin(std::int64_t n, std::int64_t recent) {
  return n > recent ? n - recent : 0;
}

/// Slots that are kept whatever their score: the one protection rule of every policy, on both
/// paths. A slot of a (layer, kv_head) holding `n` slots is protected when it is among the
/// first `first` slots (attention sinks), among the last `last` slots (the recent window), or
/// holds a position below `prompt_length` (the prompt's tokens). A policy states its sinks and
/// recent window (`sinks_and_recent`); the round joins its own options' sinks, recent window
/// and prompt (`round_options::protected_slots`) to it (`joined`).
struct protection {
  std::int64_t first = 0;          ///< attention sinks
  std::int64_t last = 0;           ///< recent window
  std::int64_t prompt_length = 0;  ///< positions [0, prompt_length) are the prompt

  /// A policy's own protection: its first `sinks` slots and its last `recent` slots.
  static TRIATTN_HOST_DEVICE protection sinks_and_recent(std::int64_t sinks, std::int64_t recent) {
    return {sinks, recent, 0};
  }
  /// The slots either protection protects (each bound the larger of the two).
  TRIATTN_HOST_DEVICE protection joined(const protection& o) const {
    return {first > o.first ? first : o.first, last > o.last ? last : o.last,
            prompt_length > o.prompt_length ? prompt_length : o.prompt_length};
  }
};

/// Whether slot `s` of `n` slots, holding `position`, is protected.
TRIATTN_HOST_DEVICE bool is_protected(const protection& p, std::int64_t s, std::int64_t n, std::int64_t position) {
  return s < p.first || s >= recent_window_begin(n, p.last) || position < p.prompt_length;
}

namespace detail {
/// `select_keep` for arguments its caller has checked (the round pipeline checks its budget
/// once per round, and passes every position).
inline std::vector<std::int32_t> select_keep_unchecked(std::span<const float> scores,
                                                       std::span<const std::int32_t> positions, const protection& prot,
                                                       std::int64_t budget, std::int64_t segments = 1) {
  const auto n = static_cast<std::int64_t>(scores.size());
  std::vector<std::int32_t> out;
  if (budget >= n) {
    out.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(i);
    return out;
  }
  const auto candidate = std::make_unique<bool[]>(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) {
    const bool prot_s = is_protected(prot, s, n, positions.empty() ? s : positions[s]);
    candidate[s] = !prot_s;
    if (prot_s && static_cast<std::int64_t>(out.size()) < budget) out.push_back(static_cast<std::int32_t>(s));
  }
  top_k_append(scores, budget - static_cast<std::int64_t>(out.size()), {candidate.get(), static_cast<std::size_t>(n)},
               out, segments);
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace detail

/// Keep set of one (layer, kv_head) or one shared decision: protected slots first (if they
/// alone exceed the budget, the lowest protected slots), then the best-scoring of the rest,
/// each of `segments` runs of them keeping its quota (see `segment_begin`). `positions` [n]
/// may be empty when `prot.prompt_length` is 0. Returns min(budget, n) slots, ascending.
inline std::vector<std::int32_t> select_keep(std::span<const float> scores, std::span<const std::int32_t> positions,
                                             const protection& prot, std::int64_t budget, std::int64_t segments = 1) {
  const char* api = "triattn::select_keep";
  TRIATTN_CHECK(budget >= 1, api, "budget ", budget, " must be >= 1");
  TRIATTN_CHECK(segments >= 1 && segments <= max_segments, api, "segments ", segments, " must be in [1, ",
                max_segments, "]");
  const auto n = static_cast<std::int64_t>(scores.size());
  TRIATTN_CHECK(prot.prompt_length == 0 || static_cast<std::int64_t>(positions.size()) == n, api, "positions holds ",
                positions.size(), " slots, expected ", n);
  return detail::select_keep_unchecked(scores, positions, prot, budget, segments);
}

TRIATTN_NAMESPACE_END
