/// \file triattn/core/schedule.hpp
/// \brief When to compress: the trigger schedules of the reference implementations.
#pragma once

#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"

TRIATTN_NAMESPACE_BEGIN

enum class trigger : std::uint8_t {
  every_step,  ///< whenever the cache holds more than the budget (StreamingLLM, H2O)
  slack,       ///< when the cache reaches budget + slack, cut to budget (TriAttention paper runs)
  aligned,     ///< when the cache holds >= budget and position % divide_length == 0 (R-KV, HF class default)
  once_after_prompt,  ///< once, right after the prompt (position == prompt length), if it exceeds the budget (SnapKV)
};

/// A trigger schedule. `length` is the cache's token count, `position` the number of tokens
/// processed so far (the position of the next token). A round, when it fires, always cuts the
/// cache to `budget`.
struct schedule {
  trigger kind = trigger::slack;
  std::int64_t slack = 128;          ///< `slack`: extra tokens admitted before a round
  std::int64_t divide_length = 128;  ///< `aligned`: rounds only at multiples of this position

  static constexpr schedule every_step() { return {trigger::every_step, 0, 1}; }
  static constexpr schedule with_slack(std::int64_t s = 128) { return {trigger::slack, s, 128}; }
  static constexpr schedule aligned_to(std::int64_t d = 128) { return {trigger::aligned, 0, d}; }
  /// One round when the prompt has been processed (the reference SnapKV): fires when the
  /// position of the next token equals the prompt's length, then never again.
  static constexpr schedule once_after_prompt() { return {trigger::once_after_prompt, 0, 1}; }

  /// Whether a round fires now for a cache of `length` tokens whose next token has
  /// `position`, after a prompt of `prompt_length` tokens. Throws for a budget < 1, a
  /// negative slack or a non-positive divide_length.
  bool should_compress(std::int64_t length, std::int64_t budget, std::int64_t position,
                       std::int64_t prompt_length = 0) const {
    TRIATTN_CHECK(budget >= 1, "triattn::schedule::should_compress", "budget ", budget, " must be >= 1");
    return fires(length, budget, position, prompt_length);
  }

  /// `should_compress` for a budget its caller has checked (>= 1): `maybe_compress` checks it
  /// once per round. Throws for a negative slack or a non-positive divide_length.
  bool fires(std::int64_t length, std::int64_t budget, std::int64_t position, std::int64_t prompt_length) const {
    switch (kind) {
      case trigger::every_step:
        return length > budget;
      case trigger::slack:
        TRIATTN_CHECK(slack >= 0, "triattn::schedule::should_compress", "slack ", slack, " must be >= 0");
        return length >= budget + slack && length > budget;
      case trigger::aligned:
        TRIATTN_CHECK(divide_length >= 1, "triattn::schedule::should_compress", "divide_length ", divide_length,
                      " must be >= 1");
        return length >= budget && position % divide_length == 0 && length > budget;
      case trigger::once_after_prompt:
        return position == prompt_length && length > budget;
    }
    return false;
  }

  /// The most tokens the cache ever holds under this schedule (what to allocate). Throws for
  /// `once_after_prompt`, which bounds nothing after its round.
  std::int64_t peak_tokens(std::int64_t budget) const {
    switch (kind) {
      case trigger::every_step: return budget + 1;
      case trigger::slack: return budget + (slack > 0 ? slack : 1);
      case trigger::aligned: return budget + divide_length;
      case trigger::once_after_prompt: break;
    }
    TRIATTN_CHECK(false, "triattn::schedule::peak_tokens",
                  "a once_after_prompt schedule does not bound the cache after its round (budget ", budget, ")");
    return budget;
  }
};

TRIATTN_NAMESPACE_END
