#!/usr/bin/env bash
# triattn inside llama.cpp, measured in one command (docs/llamacpp.md): quality against
# llama.cpp with a full cache and against its own context shift, needle retrieval through
# llama-server with prompts longer than a slot, the time triattn takes beside llama.cpp's
# decoding, a long answer through a small cache, and two answers side by side.
#
#   eval/run_llamacpp.sh [OUT_DIR] [--stats S.safetensors]
#
# OUT_DIR (default build/llamacpp):
# - stats.safetensors (unless --stats): TriAttention's statistics, `triattn calibrate --model`;
# - quality.csv, quality.md: the first $PROMPTS prompts of eval/prompts/test.txt (default 10
#   of 18), each answered with $TOKENS tokens (default 1,024) by llama.cpp with a full cache, then llama.cpp's own context shift,
#   TriAttention, StreamingLLM, SnapKV and random eviction at budgets $BUDGETS (default
#   256,512), each in budget + 64 + 64 cells, teacher-forced along it;
# - retrieval/: needles in 2,048-token prompts of the model's own prose ($TRIALS samples per
#   depth, default 6, at 5 depths), written and scored with the full cache by `triattn_eval
#   retrieval`, then sent by eval/server_passkey.py through llama-server with slots of 512 cells (the full cache, today's server, and the
#   patched server's policies at budget 256);
# - long.txt: a 4,096-token answer through a 512-cell cache;
# - side_by_side.md: one prompt, 512 tokens, the full cache's answer and TriAttention's at
#   budget 256 with the same sampler seed;
# - summary.md: all of it.
# Environment: BUILD_DIR (default build/default, which has llama.cpp), SMOLLM2_GGUF (default:
# the configured or fetched model), PROMPTS, TOKENS, BUDGETS, TRIALS.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/build/llamacpp
stats=
while (($#)); do
  case $1 in
    --stats) stats=$2; shift 2 ;;
    -*) echo "run_llamacpp.sh: unknown option $1" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
build=${BUILD_DIR:-$root/build/default}
start=$(date +%s)
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1

source "$root/eval/smollm2_model.sh"
[[ -f $build/CMakeCache.txt ]] || cmake --preset default -S "$root" >/dev/null
cmake --build "$build" --target triattn_cli triattn_eval_cli triattn_llamacpp llama-server -j "$(nproc)"
run=$build/bin/triattn_llamacpp

if [[ -z $stats ]]; then
  echo "== TriAttention's statistics: SmolLM2's own 1,024-token answers to eval/prompts/calibration.txt"
  grep -v '^#' "$root/eval/prompts/calibration.txt" | grep . > "$out/calibration_prompts.txt"
  "$build/bin/triattn" calibrate --model "$model" --prompts "$out/calibration_prompts.txt" --answer-tokens 1024 \
    --out "$out/stats.safetensors"
  stats=$out/stats.safetensors
fi

echo "== quality: llama.cpp's full cache against its context shift and each policy, teacher-forced along its answers"
"$run" quality --model "$model" --stats "$stats" --prompts "$root/eval/prompts/test.txt" \
  --policies context_shift,triattention,streaming_llm,snapkv,random --budgets "${BUDGETS:-256,512}" --slack 64 --batch 64 \
  --tokens "${TOKENS:-1024}" --count "${PROMPTS:-10}" \
  --csv "$out/quality.csv" > "$out/quality.md"
cat "$out/quality.md"

echo "== retrieval: needles in 2,048-token prompts, through llama-server's 512-cell slots"
# triattn_eval writes the samples (passkey_prompts.tsv) and scores them with the full cache;
# its progress bar goes to retrieval.log.
"$build/bin/triattn_eval" retrieval --model "$model" --stats "$stats" --families single --contexts 2048 \
  --depths 0.1,0.3,0.5,0.7,0.9 --trials "${TRIALS:-6}" --haystack-prompts "$root/eval/prompts/haystack.txt" \
  --answer-tokens 12 --policies full --out "$out/retrieval" 2> "$out/retrieval.log" ||
  { tail -c 2000 "$out/retrieval.log"; exit 1; }
python3 "$root/eval/server_passkey.py" --server "$build/bin/llama-server" --model "$model" --stats "$stats" \
  --samples "$out/retrieval/passkey_prompts.tsv" --cells 512 --budget 256 --slack 64 --answer-tokens 12 \
  --policies streaming_llm,triattention,knorm,keydiff,expected_attention --out "$out/retrieval"

echo "== a 4,096-token answer through a 512-cell cache (budget 384 + slack 64 + batch 64)"
"$run" generate --model "$model" --stats "$stats" --policy triattention --budget 384 --slack 64 --batch 64 \
  --tokens 4096 > "$out/long.txt"
tail -n 5 "$out/long.txt"

echo "== one prompt, two answers: the full cache and TriAttention at budget 256"
prompt=$(grep -v '^#' "$root/eval/prompts/test.txt" | grep . | head -n 1)
"$run" generate --model "$model" --policy full --tokens 512 --prompt "$prompt" > "$out/full.txt"
"$run" generate --model "$model" --stats "$stats" --policy triattention --budget 256 --tokens 512 --prompt "$prompt" \
  > "$out/triattention_256.txt"
# The answer: the lines between the prompt's line (and the blank one after it) and the figures.
answer() { awk '/^prompt \(/ { on = 1; getline; next } /^(cells in use|llama.cpp decode): / { on = 0 } on' "$1"; }
{
  echo "Prompt: $prompt"
  echo
  echo "| llama.cpp, full cache | llama.cpp, TriAttention at 256 cells (+ 64 slack + 64 batch) |"
  echo "| --- | --- |"
  paste -d '\t' <(answer "$out/full.txt" | tr '\n' ' ' | sed 's/|/\\|/g') \
    <(answer "$out/triattention_256.txt" | tr '\n' ' ' | sed 's/|/\\|/g') | sed 's/\t/ | /; s/^/| /; s/$/ |/'
} > "$out/side_by_side.md"

end=$(date +%s)
{
  echo "# triattn inside llama.cpp: SmolLM2-135M-Instruct ($(nproc) threads, $((end - start)) s)"
  echo
  cat "$out/quality.md"
  echo
  cat "$out/retrieval/server_passkey.md"
  echo
  grep -E '^(cells in use|rounds|triattn|llama.cpp decode)' "$out/long.txt"
  echo
  cat "$out/side_by_side.md"
} > "$out/summary.md"
echo "== wrote $out/summary.md in $((end - start)) s"
