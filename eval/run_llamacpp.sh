#!/usr/bin/env bash
# triattn inside llama.cpp, measured in one command (docs/llamacpp.md):
# quality against llama.cpp with a full cache, the time triattn takes beside llama.cpp's
# decoding, a long answer through a small cache, and two answers side by side.
#
#   eval/run_llamacpp.sh [OUT_DIR] [--stats S.safetensors]
#
# OUT_DIR (default build/llamacpp): stats.safetensors (unless --stats), quality.csv and
# quality.md (eval/prompts/test.txt: every prompt answered with 2,048 tokens by llama.cpp with a
# full cache, then llama.cpp's own context shift, TriAttention, StreamingLLM, SnapKV and random
# eviction at budgets 256, 512 and 1024, each in budget + 64 + 64 cells, teacher-forced along it), long.txt (a 4,096-token answer through a 512-cell cache),
# side_by_side.md (one prompt, 512 tokens: the full cache's answer and TriAttention's at budget
# 256, the same sampler seed), summary.md. Environment: BUILD_DIR (default build/default, which
# has llama.cpp), SMOLLM2_GGUF (default: the configured or fetched model).
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
cmake --build "$build" --target triattn_cli triattn_llamacpp -j "$(nproc)"
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
  --policies context_shift,triattention,streaming_llm,snapkv,random --budgets 256,512,1024 --slack 64 --batch 64 --tokens 2048 \
  --csv "$out/quality.csv" > "$out/quality.md"
cat "$out/quality.md"

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
  grep -E '^(cells in use|rounds|triattn|llama.cpp decode)' "$out/long.txt"
  echo
  cat "$out/side_by_side.md"
} > "$out/summary.md"
echo "== wrote $out/summary.md in $((end - start)) s"
