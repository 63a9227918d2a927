/// \file eval/eval_policies.hpp
/// \brief The rows triattn_eval knows: the registry's policies (triattn::policy_registry), the
/// references `random` and `window`, and variants of TriAttention, among them the
/// parametrised rows (`parametric_policy`), the extensions beyond the paper among them.
#pragma once

#include <charconv>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "eval_common.hpp"
#include "random_eviction.hpp"
#include "triattn/triattn.hpp"

namespace triattn_eval {

/// Keeps the last `budget` slots of every (layer, kv_head): the plain recency reference. A plan
/// policy; `round()` carries the evaluation's schedule.
class recent_window : public triattn::policy_base<recent_window> {
 public:
  static constexpr std::string_view name = "window";

  explicit recent_window(triattn::schedule sched) { round_.sched = sched; }
  const triattn::round_options& round() const { return round_; }

  triattn::keep_plan plan(const triattn::dense_kv_view& view, std::int64_t budget, const triattn::round_context& = {}) {
    return triattn_eval::plan_each_row(view, budget, [](std::int32_t n, std::int32_t k, std::vector<std::int32_t>& slots) {
      slots.clear();
      for (std::int32_t s = n - k; s < n; ++s) slots.push_back(s);
    });
  }

 private:
  triattn::round_options round_{};
};

/// What every row of one evaluation shares: the schedule, and the protection protocol (unset:
/// each policy's own defaults, its paper's setting). The references `random` and `window`
/// choose by draw or position alone and take only the schedule.
struct row_setting {
  triattn::schedule sched = triattn::schedule::every_step();
  std::optional<triattn::round_protocol> protocol;
  std::optional<triattn::round_selection> selection;  ///< a row's `+seg<S>`, `+split_...` suffixes
};

/// `--protocol`'s value: `own` (each policy's defaults: std::nullopt), or a comma list of
/// `prompt` (protect the prompt), `sinks=N` and `recent=N`, anything unsaid off (`none`: all
/// off); e.g. `sinks=4,recent=16`. Throws usage_error naming the value.
inline std::optional<triattn::round_protocol> parse_protocol(const std::string& v) {
  if (v == "own") return std::nullopt;
  triattn::round_protocol p;
  if (v == "none") return p;
  for (const std::string& part : split(v)) {
    if (part == "prompt") p.protect_prompt = true;
    else if (part.starts_with("sinks=")) p.sinks = parse_int("--protocol sinks", part.substr(6), 0);
    else if (part.starts_with("recent=")) p.recent = parse_int("--protocol recent", part.substr(7), 0);
    else
      throw usage_error{"option --protocol: '" + v + "' is not own, none or a list of prompt, sinks=N, recent=N"};
  }
  return p;
}

/// `protocol` as `--protocol` writes it (`own` when unset), for tables and CSV files.
inline std::string protocol_name(const std::optional<triattn::round_protocol>& protocol) {
  if (!protocol) return "own";
  std::string out = protocol->protect_prompt ? "prompt" : "";
  if (protocol->sinks > 0) out += (out.empty() ? "sinks=" : ",sinks=") + std::to_string(protocol->sinks);
  if (protocol->recent > 0) out += (out.empty() ? "recent=" : ",recent=") + std::to_string(protocol->recent);
  return out.empty() ? "none" : out;
}

/// A fresh policy for one sequence under the evaluation's `row_setting`; std::nullopt for
/// `full`. `seed` is per sequence.
using policy_factory = std::function<std::optional<triattn::any_policy>(const triattn::query_stats*, std::uint64_t seed,
                                                                        const row_setting& setting)>;

struct eval_policy {
  std::string name;
  std::string summary;
  bool needs_stats = false;
  policy_factory make;
};

/// The registry's overrides for a row under `setting`.
inline triattn::policy_inputs inputs_for(const triattn::query_stats* stats, const row_setting& setting) {
  triattn::policy_inputs in;
  in.stats = stats;
  in.sched = setting.sched;
  in.protocol = setting.protocol;
  in.selection = setting.selection;
  return in;
}

/// A registry policy, as the registry builds it, under the evaluation's setting.
inline eval_policy from_registry(const triattn::policy_entry& e) {
  return {std::string(e.name), std::string(e.summary), e.needs.stats,
          [&e](const triattn::query_stats* s, std::uint64_t, const row_setting& setting) {
            return e.create(inputs_for(s, setting));
          }};
}

/// A TriAttention variant; its own trigger (the seed preset's) and protection give way to the
/// evaluation's setting, as the registry's policies do.
inline eval_policy tri(std::string name, std::string summary, triattn::triattention_config c) {
  return {std::move(name), std::move(summary), true,
          [c](const triattn::query_stats* s, std::uint64_t, const row_setting& setting) {
            return triattn::configured_policy(triattn::triattention(*s, c), inputs_for(s, setting));
          }};
}

/// TriAttention calibrated online on the sequence's queries at positions [0, tokens) (0: every
/// query before the first round), no statistics file; under the evaluation's setting.
inline eval_policy tri_online(std::string name, std::string summary, std::int64_t tokens) {
  return {std::move(name), std::move(summary), false,
          [tokens](const triattn::query_stats*, std::uint64_t, const row_setting& setting) {
            return triattn::configured_policy(triattn::triattention::online(tokens), inputs_for(nullptr, setting));
          }};
}

inline triattn::triattention_config tri_config(triattn::granularity g, std::int64_t offset_max, std::int64_t window = 0) {
  triattn::triattention_config c = triattn::triattention_config::paper();
  c.round.grain = g;
  c.offset_max = offset_max;
  c.window = window;
  return c;
}

/// An Expected Attention variant (`calibrated`: the stats' query means in place of the
/// observed queries), under the evaluation's setting.
inline eval_policy ea(std::string name, std::string summary, triattn::expected_attention_config c, bool calibrated) {
  return {std::move(name), std::move(summary), calibrated,
          [c, calibrated](const triattn::query_stats* s, std::uint64_t, const row_setting& setting) {
            return calibrated ? triattn::configured_policy(triattn::expected_attention(*s, c), inputs_for(s, setting))
                              : triattn::configured_policy(triattn::expected_attention(c), inputs_for(s, setting));
          }};
}

inline std::vector<eval_policy> all_policies() {
  using G = triattn::granularity;
  std::vector<eval_policy> p;
  const triattn::policy_entry* full = triattn::find_policy(triattn::full_name);
  p.push_back(from_registry(*full));
  p.push_back({std::string(triattn_eval::random_eviction::name), "uniformly random keep sets (the floor)", false,
               [](const triattn::query_stats*, std::uint64_t seed, const row_setting& setting) {
                 return std::optional(triattn::any_policy(triattn_eval::random_eviction(seed, setting.sched)));
               }});
  p.push_back({std::string(recent_window::name), "the last B tokens (plain recency)", false,
               [](const triattn::query_stats*, std::uint64_t, const row_setting& setting) {
                 return std::optional(triattn::any_policy(recent_window(setting.sched)));
               }});
  for (const triattn::policy_entry& e : triattn::policy_registry)
    if (e.compresses()) p.push_back(from_registry(e));
  const std::string tn(triattn::triattention::name);
  p.push_back(tri(tn + "_o128", "triattention, offsets to 128", tri_config(G::per_kv_head, 128)));
  p.push_back(tri(tn + "_per_layer", "triattention, one keep set per (layer, KV head)", tri_config(G::per_layer, 65536)));
  p.push_back(tri(tn + "_per_layer_o512", "triattention per layer, offsets to 512", tri_config(G::per_layer, 512)));
  p.push_back(tri(tn + "_per_layer_o128", "triattention per layer, offsets to 128", tri_config(G::per_layer, 128)));
  p.push_back(tri(tn + "_per_layer_o16", "triattention per layer, offsets to 16", tri_config(G::per_layer, 16)));
  p.push_back(tri(tn + "_per_layer_o128_w8", "triattention per layer, offsets to 128, the last 8 kept",
                  tri_config(G::per_layer, 128, 8)));
  p.push_back(tri_online(tn + "_online", "triattention calibrated on the sequence's own queries before its first round", 0));
  p.push_back(tri(tn + "_seed", "triattention's seed preset: one keep set for the sequence (union, max of rows)",
                  triattn::triattention_config::seed()));
  const std::string en(triattn::expected_attention::name);
  triattn::expected_attention_config c;
  c.covariance = false;
  p.push_back(ea(en + "_mean", "expected_attention, the queries' mean alone (no covariance term)", c, false));
  c = {};
  c.value_norm = false;
  p.push_back(ea(en + "_no_vnorm", "expected_attention without the value-norm weight", c, false));
  p.push_back(ea(en + "_calibrated", "expected_attention from the calibration file's query means (no covariance)", {},
                 true));
  return p;
}

/// Parametrised TriAttention rows, each on the paper defaults but for one value:
/// `triattention_o<N>` / `triattention_per_layer_o<N>` (offsets to N, one keep set per KV head /
/// per (layer, KV head)), and the extensions beyond the paper: `triattention_vp<F>`
/// (value_protect F), `triattention_red<D>` (redundancy D), `triattention_ema<B>` (score_ema
/// B); `triattention_online<N>` (calibrated on the sequence's queries at positions [0, N), no
/// statistics file); e.g. triattention_o4096, triattention_vp0.05. std::nullopt for any other
/// name; a value out of its range fails when the policy is made.
inline std::optional<eval_policy> parametric_policy(const std::string& name) {
  struct kind {
    std::string_view prefix, what;
    void (*set)(triattn::triattention_config&, double);
  };
  static constexpr kind kinds[] = {
      {"triattention_per_layer_o", "triattention per layer, offsets to N",
       [](triattn::triattention_config& c, double x) {
         c.round.grain = triattn::granularity::per_layer;
         c.offset_max = static_cast<std::int64_t>(x);
       }},
      {"triattention_o", "triattention, offsets to N",
       [](triattn::triattention_config& c, double x) { c.offset_max = static_cast<std::int64_t>(x); }},
      {"triattention_vp", "value-norm protection: the F x budget largest values of each row boosted",
       [](triattn::triattention_config& c, double x) { c.value_protect = x; }},
      {"triattention_red", "diversity: minus D x the z-scored key redundancy of each row",
       [](triattn::triattention_config& c, double x) { c.redundancy = static_cast<float>(x); }},
      {"triattention_ema", "score history: B x the previous rounds' score + (1 - B) x this round's",
       [](triattn::triattention_config& c, double x) { c.score_ema = static_cast<float>(x); }},
  };
  if (name.starts_with("triattention_online")) {  // calibrated on the first N positions
    const std::string_view v = std::string_view(name).substr(std::string_view("triattention_online").size());
    std::int64_t x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size() || x < 1) return std::nullopt;
    return tri_online(name, "triattention calibrated on the sequence's queries at positions [0, " + std::string(v) + ")", x);
  }
  if (name.starts_with("expected_attention_f")) {  // the future positions averaged
    const std::string_view v = std::string_view(name).substr(std::string_view("expected_attention_f").size());
    std::int64_t x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
    triattn::expected_attention_config c;
    c.future = x;
    return ea(name, "expected_attention, rotations averaged over the next " + std::string(v) + " positions", c, false);
  }
  for (const kind& k : kinds) {
    if (!name.starts_with(k.prefix)) continue;
    const std::string_view v = std::string_view(name).substr(k.prefix.size());
    double x = 0.0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (v.empty() || ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
    triattn::triattention_config c = triattn::triattention_config::paper();
    k.set(c, x);
    return tri(name, std::string(k.what) + ", " + std::string(v), c);
  }
  return std::nullopt;
}

/// `row` with the selection of `suffixes`, each `+seg<S>` (segment quotas), `+split_layer` /
/// `+split_seq` (head-adaptive budgets per layer / per sequence), `+floor<F>` (the split's
/// floor) or `+value` (value-aware correction by the model's output projection); e.g.
/// `snapkv+seg8`, `triattention+split_seq+floor0.5`, `expected_attention+value`. Throws usage_error naming
/// the suffix. The references `random` and `window` choose by draw or position and take none.
inline eval_policy with_selection(eval_policy row, const std::string& suffixes) {
  if (row.name == random_eviction::name || row.name == recent_window::name || row.name == triattn::full_name)
    throw usage_error{"policy " + row.name + suffixes + ": " + row.name + " takes no selection suffix"};
  triattn::round_selection sel;
  for (std::string_view rest = suffixes; !rest.empty();) {
    rest.remove_prefix(1);  // the '+'
    const std::string part(rest.substr(0, rest.find('+')));
    rest.remove_prefix(part.size());
    if (part.starts_with("seg")) {
      sel.segments = parse_int("policy " + row.name + suffixes + " suffix +seg", part.substr(3), 1);
    } else if (part == "split_layer" || part == "split_seq") {
      sel.split = part == "split_layer" ? triattn::budget_split::per_layer : triattn::budget_split::per_sequence;
    } else if (part.starts_with("floor")) {
      sel.split_floor =
          static_cast<float>(parse_double("policy " + row.name + suffixes + " suffix +floor", part.substr(5), 0.0, 1.0));
    } else if (part == "value") {
      sel.value_aware = true;
    } else {
      throw usage_error{"policy " + row.name + suffixes + ": unknown suffix +" + part +
                        " (known: +seg<S>, +split_layer, +split_seq, +floor<F>, +value)"};
    }
  }
  row.name += suffixes;
  row.make = [make = std::move(row.make), sel](const triattn::query_stats* s, std::uint64_t seed,
                                               const row_setting& setting) {
    row_setting with = setting;
    with.selection = sel;
    return make(s, seed, with);
  };
  return row;
}

/// The row called `name`: one of `all_policies()` or an extension (`extension_policy`), with
/// any selection suffixes (`with_selection`); throws usage_error listing the known names
/// otherwise.
inline eval_policy find_eval_policy(const std::string& name) {
  if (const auto plus = name.find('+'); plus != std::string::npos)
    return with_selection(find_eval_policy(name.substr(0, plus)), name.substr(plus));
  for (eval_policy& p : all_policies())
    if (p.name == name) return p;
  if (std::optional<eval_policy> e = parametric_policy(name)) return *e;
  std::string names;
  for (const eval_policy& p : all_policies()) names += (names.empty() ? "" : ", ") + p.name;
  throw usage_error{"unknown policy " + name + " (known: " + names +
                    ", and triattention_o<N>, triattention_per_layer_o<N>, triattention_vp<F>, triattention_red<D>, "
                    "triattention_ema<B>, triattention_online<N>; any of them + selection suffixes: +seg<S>, +split_layer, +split_seq, "
                    "+floor<F>, +value)"};
}

}  // namespace triattn_eval
