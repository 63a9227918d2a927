/// \file triattn/core/round.hpp
/// \brief The one CPU round pipeline every policy runs through: score, reduce by granularity,
/// protect, select, plan, compact. A policy only scores.
///
/// **A policy is a scorer** (`round_scorer`). It provides:
/// - `round()`: its `round_options` (granularity, budget semantics, prompt protection,
///   row reduction, schedule), normally `config.round`;
/// - `begin_round(api, view, info)`: validates everything else the round needs (config, state,
///   stats against the view; the pipeline has checked the budget and validated the view, once
///   per round), throwing `triattn::error` naming `api`, and returns a *row
///   scorer* `r` whose `r.score(layer, kv_head, candidate, out)` writes one score per slot of
///   that (layer, kv_head) into `out` [length], after the policy's own GQA reduction and
///   per-row normalisation (`candidate` [length]: 1 where the slot competes, 0 where it is
///   protected; normalisations use only the candidates);
/// - optionally `rule(info)`: its own protected slots (sinks, recent window) and how many slots
///   a decision keeps, at most the budget (H2O's heavy + recent); default: none, the budget.
///
/// Optional hooks, found by `requires`, as before: `state()` (per-slot arrays that move with
/// the cache), `after_compact(view, plan)`.
///
/// **The pipeline** (`plan_round`), for one sequence:
/// 1. checks the budget and the view, once for the round (`compress`, `plan_round` and
///    `maybe_compress` each at their entry, compaction not again), then the policy
///    (`begin_round`); resolves the round start;
/// 2. groups the (layer, kv_head) rows into decisions (`granularity.hpp`); rows that share a
///    decision must hold the same positions in the same slots;
/// 3. per decision: the protected slots (`protection`: the policy's rule joined with the
///    options' sinks and recent window, and the prompt when protected or kept beyond the
///    budget); a decision whose protected slots or length fit what it keeps is settled
///    without scoring; otherwise each row is scored, its candidates weighted by their values
///    when `value_aware` (core/value_weighting.hpp, in the policy's `score_domain`), and the
///    rows folded into one score per slot (`fold_row_score`: mean or max, in row order);
/// 4. under a budget split (`budget_split`, head-adaptive budgets), the decisions of a layer or
///    sequence pool their kept counts and a global top-k over their normalised scores sets each
///    one's count (`split_kept`); every decision with candidates in a pool that does not fit
///    is scored in step 3;
/// 5. `select_keep`: protected slots first, then the best of the rest (by segment quotas when
///    `segments` > 1), ties to the lower slot, ascending; the keep set goes to every row of
///    the decision.
/// `compress` then compacts K, V, positions and the policy's state with that plan. Nothing
/// moves until every check and every score of the round has succeeded.
///
/// **Threads** (`round_context::parallel`): the rows of step 3 are scored in parallel, each
/// into its own buffer (the round holds every scored row's scores at once: 4 bytes per slot
/// per (layer, kv_head), 1/64 of a bf16 cache of head_dim 128); step 3's fold and step 5 run per
/// decision in parallel, step 4 per pool, folding rows in row order; compaction runs per (layer, kv_head). The
/// row scorer `begin_round` returns is copied once per worker, so it must be copyable and
/// its `score` may only write its own scratch and the row it is given.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/granularity.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/parallel.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/core/value_weighting.hpp"

TRIATTN_NAMESPACE_BEGIN

/// What the engine knows about a round that the cache does not hold. One struct for every
/// policy: the same facts reach TriAttention, H2O and SnapKV the same way.
struct round_context {
  /// The position of the next token (the round start). Negative: 1 + the largest position
  /// the cache holds. Given, it must be above every cached position.
  std::int64_t position = -1;
  /// The prompt's token count: slots holding positions [0, prompt_length) are the prompt.
  std::int64_t prompt_length = 0;
  /// Where the round's (layer, kv_head) rows run: serial by default; `threads(n)` or the
  /// engine's own pool (core/parallel.hpp). The keep sets do not depend on it.
  parallel_for parallel{};
  /// The output projection a value-aware round weights values by (`round_options::value_aware`;
  /// core/value_weighting.hpp), or null: the plain value norm. Not read by other rounds.
  const value_projection* projection = nullptr;
};

/// What the budget counts when a prompt exists.
enum class budget_mode : std::uint8_t {
  with_prompt,    ///< the budget counts every kept token, the prompt's too (TriAttention paper, R-KV)
  beyond_prompt,  ///< the prompt is always kept, on top of the budget (TensorRT-LLM)
};

/// How a round splits the budget between the decisions of a sequence (head-adaptive budgets,
/// Ada-KV, arXiv 2407.11550): `equal` gives each decision the budget; the others pool the
/// budgets of a group of decisions and split the pool by a global top-k over the decisions'
/// normalised scores, so that the (layer, kv_head) rows keep different lengths.
enum class budget_split : std::uint8_t {
  equal,         ///< every decision keeps the budget
  per_layer,     ///< the kv heads of a layer pool budget x kv_heads (per_layer granularity only)
  per_sequence,  ///< every decision of the sequence pools budget x decisions
};

/// Decisions per pool of `split` over `map`'s decisions: a layer's kv heads (`per_layer`), every
/// decision of the sequence (`per_sequence`), or one (`equal`). Pool p holds decisions
/// [p x n, (p + 1) x n): decisions are numbered layer by layer (granularity.hpp).
TRIATTN_HOST_DEVICE int pool_decisions(budget_split split, const decision_map& map) {
  return split == budget_split::per_layer ? map.num_kv_heads : split == budget_split::per_sequence ? map.decisions() : 1;
}

/// The CLI's names: "equal", "per_layer", "per_sequence".
constexpr std::string_view budget_split_name(budget_split s) {
  switch (s) {
    case budget_split::equal: return "equal";
    case budget_split::per_layer: return "per_layer";
    case budget_split::per_sequence: return "per_sequence";
  }
  return "?";
}

/// The split called `name`, or nullopt.
constexpr std::optional<budget_split> parse_budget_split(std::string_view name) {
  for (budget_split s : {budget_split::equal, budget_split::per_layer, budget_split::per_sequence})
    if (budget_split_name(s) == name) return s;
  return std::nullopt;
}

/// How a policy's rounds decide, shared by every policy (each config has one as `round`).
struct round_options {
  granularity grain = granularity::per_layer;
  row_reduction reduction = row_reduction::mean;  ///< how the rows of a shared decision combine
  budget_mode budget = budget_mode::with_prompt;
  bool protect_prompt = false;  ///< keep the prompt's slots (counted in the budget unless beyond_prompt)
  schedule sched = schedule::with_slack(128);  ///< when `maybe_compress` runs a round
  /// Slots every round keeps on top of the policy's own rule, whatever the policy: the first
  /// `sinks` and the last `recent` of each (layer, kv_head), counted in the budget. With
  /// `protect_prompt` they make one protocol that any policy can be run under (a comparison
  /// of policies holds them equal); 0 leaves the policy's own protection alone.
  std::int64_t sinks = 0;
  std::int64_t recent = 0;
  /// Segment quotas: a decision's candidates, in slot order, split into this many equal runs,
  /// each keeping its share of the slots left after protection (`segment_begin`), so that no
  /// stretch of a long prompt is evicted whole; 1: one top-k over all of them.
  std::int64_t segments = 1;
  /// Head-adaptive budgets (`budget_split`). Each decision of a pool first keeps
  /// `split_floor` x its own share of the pool, best first (Ada-KV's safeguard, 0.2 there);
  /// the rest of the pool goes to the best normalised scores of the group.
  budget_split split = budget_split::equal;
  float split_floor = 0.2f;
  /// Value-aware correction (CriticalKV, core/value_weighting.hpp): each candidate's score
  /// weighted by its value's norm through the layer's output projection
  /// (`round_context::projection`), or by its plain norm when none is given.
  bool value_aware = false;

  /// Whether a round protects the prompt's slots: asked for, or kept on top of the budget.
  TRIATTN_HOST_DEVICE bool keeps_prompt() const { return protect_prompt || budget == budget_mode::beyond_prompt; }
  /// What these options protect besides the policy's rule, for a prompt of `prompt_length` tokens.
  TRIATTN_HOST_DEVICE protection protected_slots(std::int64_t prompt_length) const {
    return {sinks, recent, keeps_prompt() ? prompt_length : 0};
  }
};

/// A round as the policy sees it: the resolved round start, the prompt, the caller's budget.
struct round_info {
  std::int64_t round_start = 0;
  std::int64_t prompt_length = 0;
  std::int64_t budget = 0;
};

/// A policy's own protection and kept count for one decision (`rule`). In triattn `keep` is
/// always a list of slots (a keep set, a `keep_plan`) and `kept` a count.
struct row_rule {
  protection prot{};       ///< `protection::sinks_and_recent` (the pipeline adds the prompt: `with_prompt`)
  std::int64_t kept = 0;   ///< slots a decision keeps, <= the budget (0 keeps nothing)
};

/// A policy the round pipeline can run on views of type `V` (see the file comment).
template <class P, class V>
concept round_scorer = KVCacheView<V> && requires(const P& p, const V& v, const round_info& info) {
  { p.round() } -> std::convertible_to<const round_options&>;
  p.begin_round("api", v, info);
};

namespace detail {

/// The largest position any slot of `view` holds, or -1 for an empty cache.
template <KVCacheView V>
std::int64_t largest_position(const V& view) {
  std::int64_t last = -1;
  const kv_geometry& g = view.geometry();
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h)
      for (std::int32_t s = 0; s < view.length(l, h); ++s) last = std::max<std::int64_t>(last, view.position(l, h, s));
  return last;
}

/// Shared decisions apply one index set to several rows, which is only meaningful when those
/// rows hold the same positions in the same slots.
template <KVCacheView V>
void check_shared_rows(const char* api, const V& view, const decision_map& map) {
  for (int d = 0; d < map.decisions(); ++d) {
    int l0, h0;
    map.row(d, 0, l0, h0);
    for (int r = 1; r < map.rows(); ++r) {
      int l, h;
      map.row(d, r, l, h);
      const std::int32_t n = view.length(l, h), n0 = view.length(l0, h0);
      TRIATTN_CHECK(n == n0, api, "layer ", l, " kv_head ", h, " holds ", n, " slots but layer ", l0, " kv_head ", h0,
                    " holds ", n0, ": ", granularity_name(map.grain),
                    " granularity needs the rows of a decision to hold the same slots");
      for (std::int32_t s = 0; s < n; ++s)
        TRIATTN_CHECK(view.position(l, h, s) == view.position(l0, h0, s), api, "layer ", l, " kv_head ", h, " slot ", s,
                      " holds position ", view.position(l, h, s), " but layer ", l0, " kv_head ", h0, " holds ",
                      view.position(l0, h0, s), ": ", granularity_name(map.grain),
                      " granularity needs the rows of a decision to hold the same slots");
    }
  }
}

template <class P>
row_rule rule_of(const P& policy, const round_info& info) {
  if constexpr (requires { policy.rule(info); }) {
    return policy.rule(info);
  } else {
    return {protection{}, info.budget};
  }
}

}  // namespace detail

/// The largest round start: cached positions are int32, so the next token's is at most
/// 2^31. Bounding it keeps round start + offset (TriAttention's phases) far from overflow.
inline constexpr std::int64_t max_round_start = std::int64_t{INT32_MAX} + 1;

/// The round start `ctx` implies for `view`; throws naming `api` when a given position is not
/// above every cached position, or is above `max_round_start`.
template <KVCacheView V>
std::int64_t resolve_round_start(const char* api, const V& view, const round_context& ctx) {
  const std::int64_t last = detail::largest_position(view);
  if (ctx.position < 0) return last + 1;
  TRIATTN_CHECK(ctx.position <= max_round_start, api, "round start ", ctx.position, " must be <= 2^31 (",
                max_round_start, "): cached positions are int32");
  TRIATTN_CHECK(ctx.position > last, api, "round start ", ctx.position, " must be above the largest cached position ",
                last);
  return ctx.position;
}

/// A decision's candidate scores normalised for the comparison between decisions: shifted by
/// the smallest finite one and divided by their sum, a distribution over the candidates (for
/// attention weights, whose smallest is near 0, Ada-KV's normalisation; any score's scale and
/// offset drop out). Equal scores share 1 / count; non-finite scores stay as they are.
TRIATTN_HOST_DEVICE float split_normalised(float x, double lowest, double sum, std::int64_t finite) {
#if defined(__CUDA_ARCH__)
  if (!isfinite(x)) return x;
#else
  if (!std::isfinite(x)) return x;
#endif
  return static_cast<float>(sum > 0.0 ? (static_cast<double>(x) - lowest) / sum : 1.0 / static_cast<double>(finite));
}

/// The candidates a decision keeps first under a budget split: `floor_share` x its `share`
/// of the pool, at most its `candidates`.
TRIATTN_HOST_DEVICE std::int64_t split_floor_count(float floor_share, std::int64_t share, std::int64_t candidates) {
  const auto f = static_cast<std::int64_t>(static_cast<double>(floor_share) * static_cast<double>(share));  // >= 0: floor
  return f < candidates ? f : candidates;
}

namespace detail {
/// The budget check of a round, made once by its entry point.
inline void check_budget(const char* api, std::int64_t budget) {
  TRIATTN_CHECK(budget >= 1, api, "budget ", budget, " must be >= 1");
}
inline void check_prompt_length(const char* api, const round_context& ctx) {
  TRIATTN_CHECK(ctx.prompt_length >= 0, api, "prompt_length ", ctx.prompt_length, " must be >= 0");
}

/// Checks the round's options against views of type `V`, naming `api`.
template <KVCacheView V>
void check_round_options(const char* api, const round_options& opts) {
  TRIATTN_CHECK(opts.sinks >= 0 && opts.recent >= 0, api, "round sinks ", opts.sinks, " and recent ", opts.recent,
                " must be >= 0");
  TRIATTN_CHECK(opts.segments >= 1 && opts.segments <= max_segments, api, "round segments ", opts.segments,
                " must be in [1, ", max_segments, "]");
  TRIATTN_CHECK(!holds_equal_lengths<V>() || opts.grain == granularity::whole_sequence, api, "granularity ",
                granularity_name(opts.grain), " decides more than one keep set, but this view's rows hold the same tokens "
                "(equal_lengths): use union (whole_sequence)");
  if (opts.split == budget_split::equal) return;
  TRIATTN_CHECK(opts.split == budget_split::per_layer || opts.split == budget_split::per_sequence, api,
                "budget split ", static_cast<int>(opts.split), " is not a triattn::budget_split");
  TRIATTN_CHECK(opts.split_floor >= 0.0f && opts.split_floor <= 1.0f, api, "split floor ", opts.split_floor,
                " must be in [0, 1]");
  TRIATTN_CHECK(opts.grain != granularity::whole_sequence, api, "budget split ", budget_split_name(opts.split),
                " needs decisions to split the budget between, but union granularity makes one keep set");
  TRIATTN_CHECK(opts.split != budget_split::per_layer || opts.grain == granularity::per_layer, api,
                "budget split per_layer needs per_layer granularity: a ", granularity_name(opts.grain),
                " decision spans every layer (use per_sequence)");
}

/// One decision of a round: its slots' positions, which compete, what it keeps.
struct round_decision {
  std::vector<std::int32_t> positions;
  std::vector<std::uint8_t> candidate;  // 1: competes, 0: protected
  std::int64_t protected_slots = 0;
  std::int64_t kept = 0;
  std::int64_t scores_at = -1;  // offset of its rows' scores, -1: not scored
  std::vector<float> score;     // [n] folded over its rows, when scored
  std::int64_t length() const { return std::ssize(positions); }
  std::int64_t candidates() const { return length() - protected_slots; }
};

/// The pool of a group of decisions under a budget split: what the protected slots leave of
/// the kept counts (decisions that keep nothing take no part).
inline std::int64_t split_pool(std::span<round_decision* const> group) {
  std::int64_t pool = 0;
  for (const round_decision* d : group)
    if (d->kept > 0) pool += d->kept - std::min(d->protected_slots, d->kept);
  return pool;
}

/// Whether the decisions of a group keep every slot they hold.
inline bool split_fits(std::span<round_decision* const> group) {
  std::int64_t held = 0, kept = 0;
  for (const round_decision* d : group)
    if (d->kept > 0) held += d->length(), kept += d->kept;
  return held <= kept;
}

/// The kept counts of a group of decisions under a budget split (see `budget_split`): each
/// keeps its protected slots (at most its kept count), then `floor` x its share of the pool
/// of its best candidates, and the rest of the pool goes to the group's best normalised scores
/// (ties to the lower decision, then the lower slot). Only the counts change: each decision's
/// slots are then chosen by `select_keep` with its new count, the same best candidates.
inline void split_kept(std::span<round_decision* const> group, float floor_share) {
  if (split_fits(group)) {
    for (round_decision* d : group)
      if (d->kept > 0) d->kept = d->length();
    return;
  }
  std::int64_t rest = split_pool(group);
  struct item {
    float score;
    std::int64_t order;  // group-local decision << 32 | slot
  };
  std::vector<item> items;
  std::vector<std::int64_t> taken(group.size(), 0);
  for (std::size_t i = 0; i < group.size(); ++i) {
    round_decision& d = *group[i];
    if (d.kept <= 0 || d.score.empty()) continue;
    std::vector<std::int32_t> order;  // its candidates, best first
    double lowest = INFINITY, sum = 0.0;
    std::int64_t finite = 0;
    for (std::int32_t s = 0; s < d.length(); ++s)
      if (d.candidate[s] != 0) {
        order.push_back(s);
        if (std::isfinite(d.score[s])) lowest = std::min<double>(lowest, d.score[s]), ++finite;
      }
    for (const std::int32_t s : order)
      if (std::isfinite(d.score[s])) sum += static_cast<double>(d.score[s]) - lowest;  // slot order
    std::sort(order.begin(), order.end(),
              [&](std::int32_t a, std::int32_t b) { return ranks_before(d.score[a], a, d.score[b], b); });
    const std::int64_t share = d.kept - std::min(d.protected_slots, d.kept);
    taken[i] = split_floor_count(floor_share, share, std::ssize(order));
    rest -= taken[i];
    for (auto s = order.begin() + taken[i]; s != order.end(); ++s)
      items.push_back({split_normalised(d.score[*s], lowest, sum, finite), static_cast<std::int64_t>(i) << 32 | *s});
  }
  const std::int64_t take = std::min<std::int64_t>(rest, std::ssize(items));
  std::nth_element(items.begin(), items.begin() + take, items.end(),
                   [](const item& a, const item& b) { return ranks_before(a.score, a.order, b.score, b.order); });
  for (auto it = items.begin(); it != items.begin() + take; ++it) ++taken[static_cast<std::size_t>(it->order >> 32)];
  for (std::size_t i = 0; i < group.size(); ++i)
    if (group[i]->kept > 0) group[i]->kept = std::min(group[i]->protected_slots, group[i]->kept) + taken[i];
}

/// `plan_round` once its entry point has checked the budget, the prompt length and the view
/// (each once per round; the policy's `begin_round` and the selection rely on them).
template <class P, KVCacheView V>
  requires round_scorer<P, V>
keep_plan plan_validated(const P& policy, const V& view, std::int64_t budget, const round_context& ctx,
                         const char* api) {
  const round_options& opts = policy.round();
  check_round_options<V>(api, opts);
  const value_projection* projection = opts.value_aware ? ctx.projection : nullptr;
  if (projection != nullptr) projection->validate(api, view.geometry());
  const round_info info{resolve_round_start(api, view, ctx), ctx.prompt_length, budget};
  auto rows = policy.begin_round(api, view, info);

  const kv_geometry& g = view.geometry();
  const decision_map map{opts.grain, g.num_layers, g.num_kv_heads};
  if (map.rows() > 1) detail::check_shared_rows(api, view, map);

  const row_rule rule = detail::rule_of(policy, info);
  const protection prot = rule.prot.joined(opts.protected_slots(ctx.prompt_length));

  // Per decision: its protected slots and kept count (serial, one pass over positions).
  std::vector<round_decision> decisions(static_cast<std::size_t>(map.decisions()));
  for (int d = 0; d < map.decisions(); ++d) {
    int l0, h0;
    map.row(d, 0, l0, h0);
    const std::int32_t n = view.length(l0, h0);
    round_decision& dec = decisions[static_cast<std::size_t>(d)];
    dec.positions.resize(static_cast<std::size_t>(n));
    dec.candidate.resize(static_cast<std::size_t>(n));
    std::int64_t prompt_slots = 0;
    for (std::int32_t s = 0; s < n; ++s) {
      dec.positions[s] = view.position(l0, h0, s);
      const bool p = is_protected(prot, s, n, dec.positions[s]);
      dec.candidate[s] = p ? 0 : 1;
      dec.protected_slots += p ? 1 : 0;
      prompt_slots += dec.positions[s] < ctx.prompt_length ? 1 : 0;
    }
    dec.kept = rule.kept + (opts.budget == budget_mode::beyond_prompt ? prompt_slots : 0);
  }
  // The groups of decisions that pool their budgets (one decision each without a split).
  const int per_pool = pool_decisions(opts.split, map);
  std::vector<std::vector<round_decision*>> groups(static_cast<std::size_t>(map.decisions() / per_pool));
  for (int d = 0; d < map.decisions(); ++d)
    groups[static_cast<std::size_t>(d / per_pool)].push_back(&decisions[static_cast<std::size_t>(d)]);
  // Scored only when protection alone does not decide and the rows do not fit whole: per
  // decision, or per pool under a split (where every decision with candidates competes).
  std::int64_t score_floats = 0;
  for (const auto& group : groups) {
    const bool pooled = opts.split != budget_split::equal && !split_fits(group) && split_pool(group) > 0;
    for (round_decision* dec : group)
      if (dec->kept > 0 && (pooled ? dec->candidates() > 0
                                   : opts.split == budget_split::equal && dec->length() > dec->kept &&
                                         dec->protected_slots < dec->kept)) {
        dec->scores_at = score_floats;
        score_floats += std::int64_t{map.rows()} * dec->length();
      }
  }

  // Every scored row into its own part of `scores` [row of decision, slot], in parallel: one
  // row scorer (with its scratch) per worker.
  const parallel_for& par = ctx.parallel;
  std::vector<float> scores(static_cast<std::size_t>(score_floats));
  std::vector<std::int64_t> items;  // d * rows + r of every scored row
  for (int d = 0; d < map.decisions(); ++d)
    if (decisions[static_cast<std::size_t>(d)].scores_at >= 0)
      for (int r = 0; r < map.rows(); ++r) items.push_back(std::int64_t{d} * map.rows() + r);
  std::vector<decltype(rows)> scorers;
  std::vector<std::vector<float>> values(opts.value_aware ? static_cast<std::size_t>(std::max(par.workers, 1)) : 0);
  scorers.reserve(static_cast<std::size_t>(std::max(par.workers, 1)));
  scorers.push_back(std::move(rows));
  for (int w = 1; w < par.workers && std::ssize(items) > 1; ++w) scorers.push_back(scorers.front());
  par(std::ssize(items), [&](std::int64_t i, int worker) {
    const int d = static_cast<int>(items[static_cast<std::size_t>(i)] / map.rows());
    const int r = static_cast<int>(items[static_cast<std::size_t>(i)] % map.rows());
    const round_decision& dec = decisions[static_cast<std::size_t>(d)];
    const std::int64_t n = dec.length();
    int l, h;
    map.row(d, r, l, h);
    const std::span<float> row(scores.data() + dec.scores_at + r * n, static_cast<std::size_t>(n));
    scorers[static_cast<std::size_t>(worker)].score(l, h, dec.candidate, row);
    if (opts.value_aware)
      weight_by_values(api, view, l, h, projection, score_domain_of<P>(), dec.candidate, row,
                       values[static_cast<std::size_t>(worker)]);
  });

  // Per decision: fold its rows in row order (the same sums at every thread count); per pool,
  // the kept counts; per decision, select.
  par(map.decisions(), [&](std::int64_t d, int) {
    round_decision& dec = decisions[static_cast<std::size_t>(d)];
    if (dec.scores_at < 0) return;
    const std::int64_t n = dec.length();
    dec.score.assign(static_cast<std::size_t>(n), row_fold_start(opts.reduction));
    for (int r = 0; r < map.rows(); ++r) {
      const float* row = scores.data() + dec.scores_at + r * n;
      for (std::int64_t s = 0; s < n; ++s) dec.score[s] = fold_row_score(dec.score[s], row[s], opts.reduction);
    }
  });
  if (opts.split != budget_split::equal)
    par(std::ssize(groups), [&](std::int64_t i, int) { split_kept(groups[static_cast<std::size_t>(i)], opts.split_floor); });
  std::vector<std::vector<std::int32_t>> keep(static_cast<std::size_t>(map.decisions()));
  par(map.decisions(), [&](std::int64_t d, int) {
    round_decision& dec = decisions[static_cast<std::size_t>(d)];
    std::vector<std::int32_t>& out = keep[static_cast<std::size_t>(d)];
    if (dec.kept <= 0) return;  // a rule may keep nothing (H2O's fractions of a short prompt)
    if (dec.length() <= dec.kept) {
      out.resize(static_cast<std::size_t>(dec.length()));
      std::iota(out.begin(), out.end(), 0);
      return;
    }
    if (dec.score.empty()) dec.score.assign(static_cast<std::size_t>(dec.length()), row_fold_start(opts.reduction));
    out = select_keep_unchecked(dec.score, dec.positions, prot, dec.kept, opts.segments);
  });

  keep_plan plan(g.num_layers, g.num_kv_heads);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) plan.push_row(keep[static_cast<std::size_t>(map.decision_of(l, h))]);
  return plan;
}
}  // namespace detail

/// The keep plan of one round of `policy` over `view`: `budget` tokens per decision (the
/// policy's rule may keep fewer; `beyond_prompt` keeps the prompt on top). Throws
/// `triattn::error` naming `api` for budget < 1, a malformed view, a policy not ready for it,
/// a bad context or rows that a shared decision cannot share. Changes nothing.
template <class P, KVCacheView V>
  requires round_scorer<P, V>
keep_plan plan_round(const P& policy, const V& view, std::int64_t budget, const round_context& ctx = {},
                     const char* api = "triattn::plan_round") {
  detail::check_budget(api, budget);
  detail::check_prompt_length(api, ctx);
  view.validate(api);
  return detail::plan_validated(policy, view, budget, ctx, api);
}

/// A policy usable with `compress`: a `round_scorer`, or a policy that builds its own plan
/// with `plan(view, budget, ctx)` (a type-erased wrapper, an engine's experiment, or a
/// baseline such as random eviction).
template <class P, class V>
concept compression_policy =
    round_scorer<P, V> || (KVCacheView<V> && requires(P& p, const V& v, std::int64_t b, const round_context& c) {
      { p.plan(v, b, c) } -> std::same_as<keep_plan>;
    });

namespace detail {
/// The plan of a round of a `compression_policy`, its budget and view checked here, once.
template <class P, KVCacheView V>
keep_plan plan_for(P& policy, const V& view, std::int64_t budget, const round_context& ctx, const char* api) {
  if constexpr (round_scorer<P, V>) {
    return plan_round(policy, view, budget, ctx, api);
  } else {
    check_budget(api, budget);
    view.validate(api);
    return policy.plan(view, budget, ctx);
  }
}

/// Compacts the view `plan_for` validated with `plan`, moving the policy's state along.
template <class P, KVCacheView V>
compaction_result apply_plan(P& policy, const V& view, const keep_plan& plan, const parallel_for& par) {
  std::vector<slot_state> states;
  if constexpr (requires { policy.state(); }) states = policy.state();
  compaction_result result = compact_validated("triattn::compact", view, plan, states, par);
  if constexpr (requires { policy.after_compact(view, plan); }) policy.after_compact(view, plan);
  return result;
}
}  // namespace detail

/// One compression round: keeps at most `budget` tokens per decision of `view`, in place (see
/// the file comment). Throws `triattn::error` (cache untouched) for budget < 1, a malformed
/// view or context, or a policy not ready for the view.
template <class P, KVCacheView V>
  requires compression_policy<P, V>
compaction_result compress(P& policy, const V& view, std::int64_t budget, const round_context& ctx = {}) {
  const keep_plan plan = detail::plan_for(policy, view, budget, ctx, "triattn::compress");
  return detail::apply_plan(policy, view, plan, ctx.parallel);
}

/// The most slots one (layer, kv_head) row keeps after a round of `budget`: the budget, or
/// under a budget split its pool's (budget x the pool's decisions, a row may take them all).
/// What a dense cache allocates per row is `opts.sched.peak_tokens(row_budget(...))`.
inline std::int64_t row_budget(const round_options& opts, const kv_geometry& g, std::int64_t budget) {
  return budget * pool_decisions(opts.split, decision_map{opts.grain, g.num_layers, g.num_kv_heads});
}

/// The budget `sched` compares the cache with: the budget, plus the prompt when it is kept
/// beyond the budget (its tokens are never evicted, so all of them are in the cache).
inline std::int64_t scheduled_budget(const round_options& opts, std::int64_t budget, const round_context& ctx) {
  return opts.budget == budget_mode::beyond_prompt ? budget + ctx.prompt_length : budget;
}

/// The length `sched` compares with the budget: the longest row, or under a budget split the
/// largest mean length of a pool (rounded up), whose rows may each hold more than the budget.
template <KVCacheView V>
std::int64_t scheduled_length(const V& view, const round_options& opts) {
  if (opts.split == budget_split::equal) return max_length(view);
  const kv_geometry& g = view.geometry();
  const decision_map map{opts.grain, g.num_layers, g.num_kv_heads};
  const int per_pool = pool_decisions(opts.split, map);
  const std::int64_t rows = std::int64_t{per_pool} * map.rows();  // (layer, kv_head) rows of a pool
  std::int64_t longest = 0;
  for (int first = 0; first < map.decisions(); first += per_pool) {
    std::int64_t held = 0;
    for (int d = first; d < first + per_pool; ++d)
      for (int r = 0; r < map.rows(); ++r) {
        int l, h;
        map.row(d, r, l, h);
        held += view.length(l, h);
      }
    longest = std::max(longest, (held + rows - 1) / rows);
  }
  return longest;
}

/// Runs a round when the policy's schedule says so for a cache at `ctx.position` (the number
/// of tokens processed so far, which must be given). Returns whether a round ran; freed pages
/// (views with a `freed_pages` hook) are appended to `freed` if given.
template <class P, KVCacheView V>
  requires(compression_policy<P, V> && requires(const P& p) { p.round(); })
bool maybe_compress(P& policy, const V& view, std::int64_t budget, const round_context& ctx,
                    std::vector<std::int32_t>* freed = nullptr) {
  const char* api = "triattn::maybe_compress";
  TRIATTN_CHECK(ctx.position >= 0, api, "position ", ctx.position, " must be given (>= 0): the schedule reads it");
  view.validate(api);  // max_length reads the lengths: check the view first
  detail::check_budget(api, budget);
  const round_options& opts = policy.round();
  if (!opts.sched.fires(scheduled_length(view, opts), scheduled_budget(opts, budget, ctx), ctx.position,
                        ctx.prompt_length))
    return false;
  // The round proper, as `compress` runs it, without checking the budget and the view again.
  const char* round_api = "triattn::compress";
  keep_plan plan;
  if constexpr (round_scorer<P, V>) {
    detail::check_prompt_length(round_api, ctx);
    plan = detail::plan_validated(policy, view, budget, ctx, round_api);
  } else {
    plan = policy.plan(view, budget, ctx);
  }
  compaction_result r = detail::apply_plan(policy, view, plan, ctx.parallel);
  if (freed != nullptr) freed->insert(freed->end(), r.freed_pages.begin(), r.freed_pages.end());
  return true;
}

/// A round over a batch of sequences: `views[i]` cut to `budgets[i]` with `contexts[i]` (all
/// default when `contexts` is empty), by `policy_of(i)`, the policy of sequence i (a policy
/// with per-sequence state, such as H2O's accumulated attention, is one object per sequence).
/// Every sequence is planned before any is compacted: when one fails, no cache has changed.
template <class PolicyOf, KVCacheView V>
std::vector<compaction_result> compress_batch(PolicyOf&& policy_of, std::span<const V> views,
                                              std::span<const std::int64_t> budgets,
                                              std::span<const round_context> contexts = {}) {
  const char* api = "triattn::compress_batch";
  TRIATTN_CHECK(budgets.size() == views.size(), api, "budgets holds ", budgets.size(), " entries for ", views.size(),
                " views");
  TRIATTN_CHECK(contexts.empty() || contexts.size() == views.size(), api, "contexts holds ", contexts.size(),
                " entries for ", views.size(), " views");
  std::vector<keep_plan> plans;
  plans.reserve(views.size());
  for (std::size_t i = 0; i < views.size(); ++i)
    plans.push_back(detail::plan_for(policy_of(i), views[i], budgets[i], contexts.empty() ? round_context{} : contexts[i],
                                     api));
  std::vector<compaction_result> results;
  results.reserve(views.size());
  for (std::size_t i = 0; i < views.size(); ++i)
    results.push_back(
        detail::apply_plan(policy_of(i), views[i], plans[i], contexts.empty() ? parallel_for{} : contexts[i].parallel));
  return results;
}

/// `compress_batch` with one policy for every sequence: a policy without per-sequence state
/// (StreamingLLM), or one whose `stateless()` says it has none in its configuration
/// (TriAttention without `score_ema`); otherwise throws naming the API before anything runs.
template <class P, KVCacheView V>
  requires(compression_policy<P, V> &&
           (!requires(P& p) { p.state(); } || requires(const P& p) { { p.stateless() } -> std::convertible_to<bool>; }))
std::vector<compaction_result> compress_batch(P& policy, std::span<const V> views, std::span<const std::int64_t> budgets,
                                              std::span<const round_context> contexts = {}) {
  if constexpr (requires(const P& p) { p.stateless(); })
    TRIATTN_CHECK(policy.stateless(), "triattn::compress_batch",
                  "the policy keeps per-sequence state in this configuration: pass policy_of(i), one object per sequence");
  return compress_batch([&](std::size_t) -> P& { return policy; }, views, budgets, contexts);
}

TRIATTN_NAMESPACE_END
