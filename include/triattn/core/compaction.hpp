/// \file triattn/core/compaction.hpp
/// \brief Keep plans and in-place compaction of K, V, positions and per-slot policy state.
///
/// Compaction is a forward gather: slot keep[i] moves to slot i. Because keep indices are
/// strictly ascending, keep[i] >= i, so no row is overwritten before it has been read and no
/// scratch buffer is needed. Consecutive keep indices move as one run, and rows adjacent in
/// memory (HND, one page) as one block, so a compaction runs at the speed of a `memcpy` of
/// the kept rows. Everything is validated before the first byte moves: a plan that
/// fails validation leaves the cache untouched.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/parallel.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Keep indices for every (layer, kv_head) of one sequence, stored as CSR: row
/// r = layer * num_kv_heads + kv_head holds `indices[offsets[r] .. offsets[r + 1])`,
/// ascending. Granularity (one set shared by all layers, one per kv_head, one per
/// (layer, kv_head)) is a property of how the plan was filled, not of its type.
struct keep_plan {
  int num_layers = 0;
  int num_kv_heads = 0;
  std::vector<std::int64_t> offsets{0};  // [num_layers * num_kv_heads + 1]
  std::vector<std::int32_t> indices;

  keep_plan() = default;
  keep_plan(int layers, int kv_heads) : num_layers(layers), num_kv_heads(kv_heads) {
    offsets.reserve(static_cast<std::size_t>(layers) * kv_heads + 1);
  }

  /// Appends the next row, in (layer, kv_head) order.
  void push_row(std::span<const std::int32_t> keep) {
    indices.insert(indices.end(), keep.begin(), keep.end());
    offsets.push_back(static_cast<std::int64_t>(indices.size()));
  }
  /// The keep indices of (layer, kv_head).
  std::span<const std::int32_t> row(int l, int h) const {
    const auto r = static_cast<std::size_t>(l) * num_kv_heads + h;
    return {indices.data() + offsets[r], static_cast<std::size_t>(offsets[r + 1] - offsets[r])};
  }
  /// Number of rows pushed so far.
  std::size_t rows() const { return offsets.size() - 1; }

  /// The same keep set for every (layer, kv_head).
  static keep_plan shared(int layers, int kv_heads, std::span<const std::int32_t> keep) {
    keep_plan p(layers, kv_heads);
    for (std::int64_t r = 0; r < std::int64_t{layers} * kv_heads; ++r) p.push_row(keep);
    return p;
  }
};

/// Per-slot state that must move with the cache (H2O accumulators, cached value norms, ...).
/// Element (layer, row, slot) lives at
/// `data + (layer * layer_stride + row * row_stride + slot) * elem_bytes`; KV head h owns rows
/// [h * rows_per_kv_head, (h + 1) * rows_per_kv_head) (the GQA group for per-q-head state).
struct slot_state {
  std::byte* data = nullptr;
  std::size_t elem_bytes = 0;
  int rows_per_kv_head = 1;
  std::int64_t layer_stride = 0;  ///< in elements
  std::int64_t row_stride = 0;    ///< in elements
};

/// Describes a `T` array [num_layers, num_kv_heads * rows_per_kv_head, capacity].
template <class T>
slot_state make_slot_state(T* data, int num_kv_heads, int rows_per_kv_head, std::int64_t capacity) {
  return {reinterpret_cast<std::byte*>(data), sizeof(T), rows_per_kv_head,
          std::int64_t{num_kv_heads} * rows_per_kv_head * capacity, capacity};
}

/// What a compaction did beyond the view's own arrays.
struct compaction_result {
  /// Views with a `freed_pages` hook (paged views): page ids (from the tail of the block
  /// table) that no (layer, kv_head) uses any more, in block-table order. The engine returns
  /// them to its allocator and shortens the block table. Empty for other views.
  std::vector<std::int32_t> freed_pages;
};

/// Checks that `plan` fits `view`: one row per (layer, kv_head), every row strictly
/// ascending and inside [0, length). Throws `triattn::error` naming `api`.
template <KVCacheView V>
void validate_plan(const char* api, const V& view, const keep_plan& plan) {
  const kv_geometry& g = view.geometry();
  // The CSR arrays first: a hand-built plan's offsets must frame `indices` exactly before any
  // row is read through them.
  TRIATTN_CHECK(!plan.offsets.empty() && plan.offsets.front() == 0 &&
                    plan.offsets.back() == static_cast<std::int64_t>(plan.indices.size()),
                api, "keep plan offsets must run from 0 to the ", plan.indices.size(), " indices");
  for (std::size_t r = 1; r < plan.offsets.size(); ++r)
    TRIATTN_CHECK(plan.offsets[r] >= plan.offsets[r - 1], api, "keep plan offsets decrease at row ", r - 1, ": ",
                  plan.offsets[r - 1], " then ", plan.offsets[r]);
  TRIATTN_CHECK(plan.num_layers == g.num_layers && plan.num_kv_heads == g.num_kv_heads &&
                    plan.rows() == static_cast<std::size_t>(g.num_layers) * g.num_kv_heads,
                api, "keep plan has ", plan.rows(), " rows for ", plan.num_layers, " layers x ", plan.num_kv_heads,
                " kv_heads, the view has ", g.num_layers, " x ", g.num_kv_heads);
  for (int l = 0; l < g.num_layers; ++l) {
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const auto keep = plan.row(l, h);
      const std::int32_t n = view.length(l, h);
      for (std::size_t i = 0; i < keep.size(); ++i) {
        TRIATTN_CHECK(keep[i] >= 0 && keep[i] < n, api, "keep index ", keep[i], " of layer ", l, " kv_head ", h,
                      " is out of range [0, ", n, ")");
        TRIATTN_CHECK(i == 0 || keep[i] > keep[i - 1], api, "keep indices of layer ", l, " kv_head ", h,
                      " are not strictly ascending: ", keep[i - 1], " then ", keep[i]);
      }
      if constexpr (holds_equal_lengths<V>())
        TRIATTN_CHECK(std::ranges::equal(keep, plan.row(0, 0)), api, "keep indices of layer ", l, " kv_head ", h,
                      " differ from those of layer 0 kv_head 0, but the view's rows hold the same tokens (equal_lengths)");
    }
  }
}

namespace detail {
/// Moves rows [src, src + count) of one (layer, kv_head) to [dst, dst + count), src > dst:
/// `row(s)` is the address of slot s. Slots whose rows are adjacent in memory on both sides
/// move as one block (`memmove`: the source and destination of a run may overlap); a row
/// that stands alone is one copy of `Bytes` (a compile-time size when it is a common row
/// size, which the compiler turns into a few vector moves instead of a call).
template <std::size_t Bytes, class RowFn>
void move_rows(const RowFn& row, std::int64_t src, std::int64_t dst, std::int64_t count, std::size_t row_bytes) {
  std::int64_t t = 0;
  while (t < count) {
    std::byte* to = row(dst + t);
    const std::byte* from = row(src + t);
    std::int64_t len = 1;
    while (t + len < count && row(src + t + len) == from + len * static_cast<std::int64_t>(row_bytes) &&
           row(dst + t + len) == to + len * static_cast<std::int64_t>(row_bytes))
      ++len;
    if (len == 1) {
      if constexpr (Bytes != 0) {
        std::memcpy(to, from, Bytes);  // distinct rows never overlap
      } else {
        std::memcpy(to, from, row_bytes);
      }
    } else {
      std::memmove(to, from, static_cast<std::size_t>(len) * row_bytes);
    }
    t += len;
  }
}

/// Gathers `keep` [m] within one array of `Bytes`-byte elements: element keep[i] to i, in
/// ascending i (keep[i] >= i, so nothing is overwritten before it is read).
template <std::size_t Bytes>
void gather_elements(std::byte* base, std::span<const std::int32_t> keep, std::int64_t from) {
  for (auto i = static_cast<std::size_t>(from); i < keep.size(); ++i)
    std::memcpy(base + i * Bytes, base + static_cast<std::size_t>(keep[i]) * Bytes, Bytes);
}

/// The first index of `keep` that moves: the kept prefix [0, first) stays where it is.
inline std::int64_t first_moved(std::span<const std::int32_t> keep) {
  std::int64_t first = 0;
  while (first < static_cast<std::int64_t>(keep.size()) && keep[static_cast<std::size_t>(first)] == first) ++first;
  return first;
}

/// Gathers every state row of (layer l, kv_head h) by `keep`, from index `first` on.
inline void gather_states(int l, int h, std::span<const std::int32_t> keep, std::int64_t first,
                          std::span<const slot_state> states) {
  const auto m = static_cast<std::int64_t>(keep.size());
  for (const slot_state& st : states) {
    const auto e = static_cast<std::int64_t>(st.elem_bytes);
    for (int r = h * st.rows_per_kv_head; r < (h + 1) * st.rows_per_kv_head; ++r) {
      std::byte* base = st.data + (l * st.layer_stride + r * st.row_stride) * e;
      switch (st.elem_bytes) {  // the sizes of float and double state: element copies the compiler inlines
        case 4: gather_elements<4>(base, keep, first); break;
        case 8: gather_elements<8>(base, keep, first); break;
        default:
          for (std::int64_t i = first; i < m; ++i) std::memmove(base + i * e, base + keep[i] * e, static_cast<std::size_t>(e));
      }
    }
  }
}

/// Compacts one (layer, kv_head): K, then V (each a stream of reads, the source rows
/// requested `ahead` runs early: the hardware prefetcher does not follow a gather), then
/// positions and every state row, each in one pass over the keep indices.
template <std::size_t Bytes, KVCacheView V>
void compact_row(const V& view, int l, int h, std::span<const std::int32_t> keep, std::size_t row_bytes,
                 std::span<const slot_state> states) {
  const auto m = static_cast<std::int64_t>(keep.size());
  const std::int64_t first = first_moved(keep);
  const auto move_all = [&](auto row) {
    constexpr std::int64_t ahead = 16;
    for (std::int64_t i = first; i < m;) {
      std::int64_t j = i + 1;
      while (j < m && keep[j] == keep[j - 1] + 1) ++j;
      if (j + ahead < m) prefetch_bytes(row(keep[j + ahead]), row_bytes);
      move_rows<Bytes>(row, keep[i], i, j - i, row_bytes);
      i = j;
    }
  };
  move_all([&](std::int64_t s) { return view.key(l, h, s); });
  move_all([&](std::int64_t s) { return view.value(l, h, s); });
  for (std::int64_t i = first; i < m; ++i) view.position(l, h, i) = view.position(l, h, keep[i]);
  gather_states(l, h, keep, first, states);
  view.set_length(l, h, static_cast<std::int32_t>(m));
}

/// `compact` of a view its caller has validated (a round validates its view once, before
/// planning): checks the plan and the states, naming `api`, then moves.
template <KVCacheView V>
compaction_result compact_validated(const char* api, const V& view, const keep_plan& plan,
                                    std::span<const slot_state> states, const parallel_for& parallel) {
  validate_plan(api, view, plan);
  for (const slot_state& st : states)
    TRIATTN_CHECK(st.data != nullptr && st.elem_bytes > 0 && st.rows_per_kv_head >= 1, api,
                  "slot_state is null or has elem_bytes ", st.elem_bytes, ", rows_per_kv_head ", st.rows_per_kv_head);

  const kv_geometry& g = view.geometry();
  if constexpr (requires { view.free_evicted(plan); }) {
    // The engine frees the evicted slots in place (it may refuse, before anything changed);
    // only the policy's state moves.
    view.free_evicted(plan);
    parallel(std::int64_t{g.num_layers} * g.num_kv_heads, [&](std::int64_t r, int) {
      const int l = static_cast<int>(r / g.num_kv_heads), h = static_cast<int>(r % g.num_kv_heads);
      gather_states(l, h, plan.row(l, h), first_moved(plan.row(l, h)), states);
    });
    return {};
  } else {  // the rows move: the compaction proper
    const std::size_t row_bytes = static_cast<std::size_t>(g.head_dim) * dtype_bytes(g.type);
    const std::int32_t before = max_length(view);
    const auto each_row = [&]<std::size_t Bytes>() {
      parallel(std::int64_t{g.num_layers} * g.num_kv_heads, [&](std::int64_t r, int) {
        const int l = static_cast<int>(r / g.num_kv_heads), h = static_cast<int>(r % g.num_kv_heads);
        compact_row<Bytes>(view, l, h, plan.row(l, h), row_bytes, states);
      });
    };
    switch (row_bytes) {  // the row sizes of head_dim 64 / 128 / 256 in 1, 2 and 4 bytes
      case 64: each_row.template operator()<64>(); break;
      case 128: each_row.template operator()<128>(); break;
      case 256: each_row.template operator()<256>(); break;
      case 512: each_row.template operator()<512>(); break;
      case 1024: each_row.template operator()<1024>(); break;
      default: each_row.template operator()<0>(); break;
    }
    compaction_result result;
    if constexpr (requires { view.freed_pages(before, before); }) {
      const auto freed = view.freed_pages(before, max_length(view));
      result.freed_pages.assign(freed.begin(), freed.end());
    }
    return result;
  }
}
}  // namespace detail

/// Applies `plan` in place: K and V rows, positions, lengths and every `states` array, one
/// (layer, kv_head) per item of `parallel`. Validates everything first; on error nothing has
/// been modified.
template <KVCacheView V>
compaction_result compact(const V& view, const keep_plan& plan, std::span<const slot_state> states = {},
                          const parallel_for& parallel = {}) {
  const char* api = "triattn::compact";
  view.validate(api);
  return detail::compact_validated(api, view, plan, states, parallel);
}

TRIATTN_NAMESPACE_END
