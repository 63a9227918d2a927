/// \file runner/runner.hpp
/// \brief triattn's model runner, whole: a Llama-family model (loaded from a llama2.c version-0
/// checkpoint such as stories260K, or from GGUF by `runner/gguf_model.hpp`), the llama2.c
/// tokenizer, and per-sequence sessions whose KV caches triattn compresses in place, decoded
/// one token at a time or many sequences together (`batch_decoder`).
///
/// The forward pass and the tokenizer follow llama2.c's `run.c` (github.com/karpathy/llama2.c,
/// MIT, Copyright (c) 2023 Andrej), with two differences: the cache keeps one length per
/// (layer, kv_head), and each query head attends over the slots its own kv head still holds;
/// and sequences decoded together share every read of the weights. Each product is summed in
/// run.c's order whatever the batch, so a sequence's logits are the same bits alone or in any
/// batch. The cache is NHD per layer (f32, f16 or bf16), keys stored after RoPE.
///
/// The runner is an application of the library, not part of it: it sits between the library
/// (include/triattn) and the programs (tools, eval, bench), and includes only the library.
#pragma once

#include "runner/kernels.hpp"
#include "runner/metrics.hpp"
#include "runner/model.hpp"
#include "runner/session.hpp"
#include "runner/thread_team.hpp"
#include "runner/tokenizer.hpp"
