/// \file runner/triattn_llama_server.hpp
/// \brief llama-server's slots held at a budget: what `patches/llama.cpp/0002-server-kv-policy.patch`
/// calls from the server's decode loop. One `held_sequence` per slot (the slot id is its
/// sequence id), its policy made by the registry from `--kv-policy`; a policy that reads queries
/// or attention sees its slot's own through `query_capture` (the patch installs `callback`).
///
/// The server keeps every slot's token history and continues each at its largest position +
/// 1, so eviction needs no change to its positions: after each decode, `end_batch` runs a
/// round for every slot that had tokens in the batch, and the freed cells take the slot's
/// next tokens. So a prompt longer than a slot's cells goes in batches that fit the slot's
/// free cells (`cells_now`), a round after each. What the server must do differently for a
/// slot that evicted (no prefix reuse, no context shift, capacity counted in cells) is in the
/// patch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runner/triattn_llama.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/registry.hpp"

namespace triattn_llama {

/// The server's `--kv-*` flags.
struct server_options {
  std::string policy;         ///< --kv-policy: a registry name; empty: no eviction
  std::int64_t budget = 0;    ///< --kv-budget: cells a round keeps per slot
  std::int64_t slack = 64;    ///< --kv-slack: cells past the budget before a round
  std::string stats;          ///< --kv-stats: calibration statistics (TriAttention; Expected Attention's queries)
};

/// What a slot reports (`/slots`): its cells now and at most, and its rounds and evicted
/// tokens since the server started.
struct slot_report {
  std::int32_t cells = 0;
  std::int64_t peak_cells = 0;
  std::int64_t rounds = 0;
  std::int64_t evicted = 0;
};

/// Every slot of one llama-server context held at `budget` cells by the policy `--kv-policy`.
class server_cache {
 public:
  using policy_type = triattn::basic_any_policy<cells_view>;

  /// Checks the flags against the model and the context (an unknown policy, a budget that
  /// does not fit a slot, statistics missing or of another model, a cache the view cannot
  /// read) and throws `triattn::error` with one line naming the flag and its value.
  server_cache(server_options o, const llama_model* model, llama_context* ctx, int n_slots, int n_ctx_slot)
      : opts_(std::move(o)), model_(model), ctx_(ctx), capture_(model) {
    const char* api = "--kv-policy";
    entry_ = triattn::find_policy<cells_view>(opts_.policy);
    TRIATTN_CHECK(entry_ != nullptr && entry_->compresses(), api, "unknown policy '", opts_.policy,
                  "' (known: ", usable_policies(), ")");
    TRIATTN_CHECK(opts_.budget >= 1, "--kv-budget", opts_.budget, " must be >= 1");
    TRIATTN_CHECK(opts_.slack >= 0, "--kv-slack", opts_.slack, " must be >= 0");
    TRIATTN_CHECK(opts_.budget + opts_.slack + 1 < n_ctx_slot, "--kv-budget", opts_.budget, " + --kv-slack ", opts_.slack,
                  " + 1 token do not fit a slot's ", n_ctx_slot, " cells (-c / --parallel)");
    if (!opts_.stats.empty()) {
      stats_ = triattn::load_stats(opts_.stats);
      const std::string flag = "--kv-stats " + opts_.stats;
      stats_->check_against(flag.c_str(), geometry_of(model));
    }
    inputs_ = inputs_for(*entry_, stats_ ? &*stats_ : nullptr);
    TRIATTN_CHECK(!entry_->needs.stats || stats_.has_value(), api, opts_.policy, " needs --kv-stats (triattn calibrate --model M.gguf)");
    capture_.bind(ctx);
    for (int s = 0; s < n_slots; ++s) {
      slots_.push_back(make_slot(s));
      reports_.emplace_back();
    }
  }

  /// Whether the policy of `o` reads queries or attention (`reads_of`): then the server must
  /// create its context with `callback` as cb_eval, and cb_eval_user_data the address of the
  /// `std::unique_ptr<server_cache>` that will hold this cache. False for an unknown name,
  /// which the constructor refuses.
  static bool reads_queries(const server_options& o) {
    const auto* e = triattn::find_policy<cells_view>(o.policy);
    const triattn::query_stats none;  // stands for the file here: only whether one is given matters
    return e != nullptr && e->compresses() && reads_of(*e, inputs_for(*e, o.stats.empty() ? nullptr : &none)) != reads::keys;
  }
  /// The context's graph callback for a policy that `reads_queries`: every slot's Qcur to its
  /// policy (`query_capture`). Asks for nothing while the cache does not exist yet (the
  /// server's warm-up decode).
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    const auto& cache = *static_cast<const std::unique_ptr<server_cache>*>(user);
    if (!cache) return !ask;
    return query_capture<policy_type>::callback(t, ask, &cache->capture_);
  }

  /// A slot starts a task: its sequence starts over (the server clears or keeps a prefix it
  /// never evicted from), with a fresh policy.
  void restart(int slot) { slots_.at(static_cast<std::size_t>(slot)) = make_slot(slot); }

  /// After a successful decode that carried tokens of `slot`: a round when its schedule says
  /// so. `prompt_length`: the task's prompt tokens.
  void end_batch(int slot, std::int64_t prompt_length) {
    held_sequence<policy_type>& h = *slots_.at(static_cast<std::size_t>(slot));
    slot_report& r = reports_[static_cast<std::size_t>(slot)];
    const sequence_stats before = h.stats();
    h.end_batch(prompt_length);
    r.cells = h.cells();
    r.peak_cells = std::max(r.peak_cells, h.stats().peak_cells);
    r.rounds += h.stats().rounds - before.rounds;
    r.evicted += h.stats().evicted - before.evicted;
  }

  /// What the rounds did to `slot`'s current task (its sequence since `restart`).
  const sequence_stats& task(int slot) const { return slots_.at(static_cast<std::size_t>(slot))->stats(); }

  /// Whether `slot`'s current sequence lost tokens: its cache is no longer the prefix of any
  /// prompt, so the server must not reuse it.
  bool evicted(int slot) const { return slots_.at(static_cast<std::size_t>(slot))->stats().evicted > 0; }
  /// Cells `slot` holds (as of its last batch).
  std::int32_t cells(int slot) const { return slots_.at(static_cast<std::size_t>(slot))->cells(); }
  /// Cells `slot` holds in llama.cpp now (one pass over the cache's cells): what a prompt batch
  /// being filled for it must fit beside, after the server dropped the cells it does not reuse.
  std::int32_t cells_now(int slot) const {
    TRIATTN_CHECK(slot >= 0 && slot < std::ssize(slots_), "triattn_llama::server_cache", "slot ", slot, " of ",
                  slots_.size());
    return llama_memory_seq_cells(llama_get_memory(ctx_), slot, nullptr, nullptr, 0);
  }
  const slot_report& report(int slot) const { return reports_.at(static_cast<std::size_t>(slot)); }

  /// One line for the server's log.
  std::string describe() const {
    return "triattn: every slot held at " + std::to_string(opts_.budget) + " cells (+ " + std::to_string(opts_.slack) +
           " slack) by " + opts_.policy + (opts_.stats.empty() ? "" : " with " + opts_.stats) +
           "; context shift and prompt reuse after eviction are off";
  }

 private:
  // The registry's names that the server runs: every policy that compresses.
  static std::string usable_policies() {
    std::string out;
    for (const auto& e : triattn::policy_registry_for<cells_view>)
      if (e.compresses()) out += (out.empty() ? "" : ", ") + std::string(e.name);
    return out;
  }

  // A policy's inputs: the statistics when given; a policy that can take its queries from
  // them does (Expected Attention with --kv-stats), the others observe the slot's queries.
  static triattn::policy_inputs inputs_for(const triattn::basic_policy_entry<cells_view>& e, const triattn::query_stats* stats) {
    triattn::policy_inputs in;
    in.stats = stats;
    in.calibrated_queries = e.needs.queries && e.queries_from_stats && stats != nullptr;
    return in;
  }

  // The slot's sequence, bound to the context, with a fresh policy; its queries routed to it.
  std::unique_ptr<held_sequence<policy_type>> make_slot(int slot) {
    options o;
    o.budget = opts_.budget;
    o.feed = reads_of(*entry_, inputs_);
    auto h = std::make_unique<held_sequence<policy_type>>(model_, slot, cells_policy(*entry_, inputs_, opts_.slack), o);
    h->bind(ctx_);
    capture_.route(slot, o.feed == reads::keys ? nullptr : h.get());
    return h;
  }

  server_options opts_;
  const llama_model* model_;
  llama_context* ctx_;
  const triattn::basic_policy_entry<cells_view>* entry_ = nullptr;
  std::optional<triattn::query_stats> stats_;
  triattn::policy_inputs inputs_;
  query_capture<policy_type> capture_;  // before slots_: they are routed from it
  std::vector<std::unique_ptr<held_sequence<policy_type>>> slots_;
  std::vector<slot_report> reports_;
};

}  // namespace triattn_llama
