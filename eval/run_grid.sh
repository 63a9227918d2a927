#!/usr/bin/env bash
# A real model's quality in one command (the quality issues): calibration on the model's own
# answers, the R distribution, the tuning of TriAttention's extensions on the development
# prompts, decode-time compression of long answers on the test prompts under each policy's own
# protection and under one protocol for every policy, and retrieval of needles in the model's
# own prose after a compressed prefill; CSV, markdown and PNG plots.
#
#   eval/run_grid.sh [--model smollm2|qwen-coder] [OUT_DIR] [--quick] [--stages LIST]
#
# --model: smollm2 (SmolLM2-135M-Instruct, the default: the build fetches it) or qwen-coder
# (Qwen2.5-Coder-1.5B-Instruct from scripts/fetch_qwen_coder.sh, on a smaller grid: see Sizes).
# OUT_DIR (default build/MODEL): stats.safetensors, inspect.txt, dev/, tuned.txt, test_own/, haystack.txt,
# test_harmonised/, retrieval_full/, retrieval_end_own/, retrieval_end_harmonised/,
# retrieval_chunks/, long.png, summary.md, run.log. Nothing is read from eval/results: the
# committed copy in eval/results/MODEL/ is this directory's output.
# --quick: the same pipeline on short answers and contexts, for CI (under 3 minutes).
# --stages 1,2,3: only those stages (1 calibration, 2 tuning, 3 regime 1 with each policy's own
# protection, 4 regime 1 under the harmonised protocol, 5 retrieval with the full cache, 6
# retrieval after a full prefill, 7 retrieval during a chunked prefill); a stage reads what the
# earlier ones wrote in OUT_DIR. Default: the model's whole grid (all seven; Qwen's: see Sizes).
#
# Splits: eval/prompts/calibration.txt (calibration only), dev.txt (the only prompts the
# tuning step reads), test.txt (the reported figures; read once, after tuning), haystack.txt
# (what the model writes the retrieval haystacks from; never scored).
# Environment: BUILD_DIR (default build/default, the `default` preset, which has llama.cpp),
# SMOLLM2_GGUF / QWEN_GGUF (default: the configured or fetched model), THREADS (default nproc),
# MAX_CACHE_MIB (the KV cache one batch of retrieval samples may hold, default 8192: more makes
# bigger batches, which Qwen's 4K samples, 3.5 GB each after a full prefill, run faster in).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=""
quick=0
stages=""
name=smollm2
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --model) [[ $# -ge 2 ]] || { echo "run_grid.sh: --model needs a name" >&2; exit 2; }; name=$2; shift ;;
    --stages) [[ $# -ge 2 ]] || { echo "run_grid.sh: --stages needs a list" >&2; exit 2; }; stages=$2; shift ;;
    -*) echo "run_grid.sh: unknown option $1" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
[[ $name == smollm2 || $name == qwen-coder ]] || { echo "run_grid.sh: --model '$name' is not smollm2 or qwen-coder" >&2; exit 2; }
# The model's whole grid (see Sizes for what Qwen's cuts).
all_stages=1,2,3,4,5,6,7
[[ $name == qwen-coder ]] && ((!quick)) && all_stages=1,2,4,5,6
stages=${stages:-$all_stages}
[[ $stages =~ ^[1-7](,[1-7])*$ ]] || { echo "run_grid.sh: --stages '$stages' is not a list of 1 to 7" >&2; exit 2; }
out=${out:-$root/build/$name}
stage() { [[ ,$stages, == *,$1,* ]]; }
build=${BUILD_DIR:-$root/build/default}
threads=${THREADS:-$(nproc)}
prompts=$root/eval/prompts
start=$(date +%s)
stage_times=""  # "name seconds" lines, for the summary
stage_start=$start
stage_done() {
  local now
  now=$(date +%s)
  stage_times+="$1 $((now - stage_start))"$'\n'
  stage_start=$now
}
mkdir -p "$out"
# A run of some stages adds to the log of the run it continues; a whole run starts it afresh.
[[ $stages == "$all_stages" ]] && : > "$out/run.log"
exec > >(tee -a "$out/run.log") 2>&1

if [[ $name == smollm2 ]]; then
  source "$root/eval/smollm2_model.sh"
  title=SmolLM2-135M-Instruct
else
  model=${QWEN_GGUF:-}
  [[ -n $model && -f $model ]] || model=$(bash "$root/scripts/fetch_qwen_coder.sh" | sed -n 's/^model=//p')
  title=Qwen2.5-Coder-1.5B-Instruct
fi
echo "== model $model"

if [[ ! -f $build/CMakeCache.txt ]]; then
  if [[ $build == "$root/build/default" ]]; then cmake --preset default -S "$root" >/dev/null
  else cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTRIATTN_WITH_LLAMA_CPP=ON >/dev/null; fi
fi
cmake --build "$build" --target triattn_cli triattn_eval_cli -j "$(nproc)"
triattn=$build/bin/triattn
triattn_eval=$build/bin/triattn_eval

# Sizes. SmolLM2's grid: 1,024-token calibration answers; 1,024-token test answers on the 18 test
# prompts at budgets 128, 256 and 512; retrieval of needles in the model's own prose at 2K and 4K
# tokens (10 depths), first with the full cache, then at every (family, context) where the full
# cache scores at least 80 %, at 10 % and 25 % of the context. Qwen2.5-Coder-1.5B (11x SmolLM2's
# products per token) gets a smaller grid, so that it fits 150 minutes on 2 cores: 512-token
# calibration answers, no tuning (the paper's TriAttention only), the first 8 test prompts with
# 1,536-token answers at budgets 256 and 1,024 under the harmonised protocol only (no stage 3),
# single needles at 4K tokens only (no multikey or paraphrase, no 8K), after a full prefill
# under the harmonised protocol only (no stage 7). --quick keeps every stage and shrinks each,
# for CI.
if (( quick )); then
  answer=32 tokens=96 budgets=64 dev_budgets=64 contexts=256 depths=0.5 fractions=0.25 trials=1 chunk_trials=1 min_samples=1
  haystack_tokens=96 chunk_contexts=256 first=1 families="single multikey paraphrase" end_protocols="own harmonised"
  candidates="triattention_vp0.2 triattention_red1 triattention_ema0.5"
elif [[ $name == smollm2 ]]; then
  answer=1024 tokens=1024 budgets=128,256,512 dev_budgets=128 contexts=2048,4096 depths=0.05,0.15,0.25,0.35,0.45,0.55,0.65,0.75,0.85,0.95
  fractions=0.1,0.25 trials=1 chunk_trials=3 min_samples=30 haystack_tokens=1024 chunk_contexts=2048 first=0
  families="single multikey paraphrase" end_protocols="own harmonised"
  candidates="triattention_vp0.05 triattention_vp0.2 triattention_red0.3 triattention_red1 triattention_ema0.5 triattention_ema0.9"
else
  answer=512 tokens=1536 budgets=256,1024 dev_budgets=256 contexts=4096 depths=0.05,0.15,0.25,0.35,0.45,0.55,0.65,0.75,0.85,0.95
  fractions=0.1,0.25 trials=1 chunk_trials=3 min_samples=30 haystack_tokens=1024 chunk_contexts=4096 first=8
  families=single end_protocols=harmonised
  candidates=""
fi
# The prompts of a file (blank and '#' lines skipped), only the first $first when it is not 0.
take() { grep -v '^#' "$1" | grep . | if ((first)); then head -n "$first"; else cat; fi; }
slack=64
# The verdict's setting: every policy keeps the first 4 and the last 16 slots on top of its own
# rule, and nothing protects the prompt (triattn_eval --protocol).
harmonised=sinks=4,recent=16
policies="streaming_llm,h2o,snapkv,vatp,rkv,triattention,triattention_per_layer"
take "$prompts/calibration.txt" > "$out/calibration_prompts.txt"
take "$prompts/dev.txt" > "$out/dev_prompts.txt"

if stage 1; then
  echo "== 1. calibrate on $title's own answers ($answer+ tokens each)"
  "$triattn" calibrate --model "$model" --prompts "$out/calibration_prompts.txt" --answer-tokens "$answer" \
    --out "$out/stats.safetensors"
  "$triattn" inspect "$out/stats.safetensors" > "$out/inspect.txt"
  tail -n 1 "$out/inspect.txt"
  stage_done "1. calibration"
fi

if stage 2 && [[ -z $candidates ]]; then
  echo "== 2. no tuning for $title: the paper's TriAttention only"
  : > "$out/tuned.txt"
  stage_done "2. tuning (dev): none"
elif stage 2; then
  echo "== 2. tune the extensions on the development prompts"
  "$triattn_eval" long --model "$model" --prompts "$out/dev_prompts.txt" --stats "$out/stats.safetensors" \
    --policies "triattention,${candidates// /,}" --budgets "$dev_budgets" --tokens "$tokens" --slack "$slack" \
    --threads "$threads" --out "$out/dev"
  # Each extension's value: the lowest mean KL over the development budgets (ties: the first listed).
  tuned=$(awk -F, -v cands="$candidates" '
    NR > 1 { kl[$1] += $3; n[$1]++ }
    END {
      split(cands, c, " ")
      for (i = 1; i in c; i++) { p = c[i]; sub(/[0-9.]+$/, "", p); if (!(p in best) || kl[c[i]] / n[c[i]] < score[p]) { best[p] = c[i]; score[p] = kl[c[i]] / n[c[i]] } ; if (!(p in order)) { order[p] = ++k; names[k] = p } }
      for (j = 1; j <= k; j++) printf "%s%s", (j > 1 ? " " : ""), best[names[j]]
    }' "$out/dev/long.csv")
  { echo "# chosen on dev/long.csv: lowest mean KL over budgets $dev_budgets"; for t in $tuned; do echo "$t"; done; } > "$out/tuned.txt"
  echo "tuned: $tuned"
  stage_done "2. tuning (dev)"
fi
tuned=$(grep -v '^#' "$out/tuned.txt" 2>/dev/null | tr '\n' ' ' | sed 's/ $//' || true)

take "$prompts/test.txt" > "$out/test_prompts.txt"
if stage 3; then
  echo "== 3. decode-time compression on the test prompts ($tokens tokens each), each policy's own protection"
  "$triattn_eval" long --model "$model" --prompts "$out/test_prompts.txt" --stats "$out/stats.safetensors" \
    --policies "full,random,window,$policies${tuned:+,${tuned// /,}}" --budgets "$budgets" --tokens "$tokens" \
    --slack "$slack" --threads "$threads" --out "$out/test_own"
  stage_done "3. regime 1, own protection (test)"
fi
if stage 4; then
  echo "== 4. decode-time compression on the test prompts, every policy under --protocol $harmonised"
  "$triattn_eval" long --model "$model" --prompts "$out/test_prompts.txt" --stats "$out/stats.safetensors" \
    --policies "full,$policies" --budgets "$budgets" --tokens "$tokens" --slack "$slack" --threads "$threads" \
    --protocol "$harmonised" --out "$out/test_harmonised"
  stage_done "4. regime 1, harmonised (test)"
fi

# The model writes the haystack once (the first retrieval run); the later runs read it back
# (--haystack), which gives the same haystack without its minutes of decoding.
retrieval() {  # retrieval OUT FAMILY CONTEXTS TRIALS [ARGS...]
  local dir=$1 family=$2 ctx=$3 n=$4 hay
  shift 4
  if [[ -f $out/haystack.txt ]]; then hay=(--haystack "$out/haystack.txt")
  else hay=(--haystack-prompts "$prompts/haystack.txt" --haystack-tokens "$haystack_tokens"); fi
  "$triattn_eval" retrieval --model "$model" --stats "$out/stats.safetensors" --families "$family" --contexts "$ctx" \
    --depths "$depths" --trials "$n" "${hay[@]}" --answer-tokens 12 --threads "$threads" \
    --max-cache-mib "${MAX_CACHE_MIB:-8192}" --out "$dir" "$@"
  [[ -f $out/haystack.txt ]] || cp "$dir/haystack.txt" "$out/haystack.txt"
}
if stage 5; then
  echo "== 5. retrieval with the full cache: which (family, context) $title can do"
  rm -f "$out/haystack.txt"  # the first retrieval run writes it afresh
  for f in $families; do retrieval "$out/retrieval_full/$f" "$f" "$contexts" "$trials" --policies full; done
  stage_done "5. retrieval, full cache"
fi
# "family contexts" lines: the contexts where the full cache scores at least 80 %.
usable() {
  for f in $families; do
    local c
    c=$(awk -F, 'NR > 1 && $3 != "all" && $5 >= 0.8 { printf "%s%s", (n++ ? "," : ""), $3 }' \
      "$out/retrieval_full/$f/passkey.csv" 2>/dev/null || true)
    [[ -n $c ]] && echo "$f $c"
  done
  return 0
}
if stage 6; then
  echo "== 6. retrieval after a full prefill, one round to the budget (kvpress's setting)"
  usable | while read -r f c; do
    # Enough samples per depth that each (family, policy, fraction) cell, pooled over the depths
    # and the usable contexts, has at least $min_samples.
    n_ctx=$(tr ',' '\n' <<< "$c" | grep -c .) n_depths=$(tr ',' '\n' <<< "$depths" | grep -c .)
    n=$(( (min_samples + n_ctx * n_depths - 1) / (n_ctx * n_depths) ))
    echo "-- $f at $c tokens, $n sample(s) per depth"
    for p in $end_protocols; do
      spec=own
      [[ $p == harmonised ]] && spec=$harmonised
      retrieval "$out/retrieval_end_$p/$f" "$f" "$c" "$n" --policies "full,$policies" --fractions "$fractions" \
        --compress-at end --protocol "$spec"
    done
  done
  stage_done "6. retrieval, one round after the prefill"
fi
if stage 7; then
  echo "== 7. retrieval during a chunked prefill (chunks of 128, a round after each), single needle"
  if usable | grep -q "^single .*\b${chunk_contexts}\b"; then
    retrieval "$out/retrieval_chunks" single "$chunk_contexts" "$chunk_trials" --policies "full,$policies" \
      --fractions "$fractions" --protocol "$harmonised"
  else
    echo "(the full cache scores below 80 % on single needles at $chunk_contexts tokens: stage 7 skipped)"
  fi
  stage_done "7. retrieval, chunked prefill"
fi

echo "== 8. plots"
if (( quick )) && ! command -v gnuplot >/dev/null 2>&1; then
  echo "(no gnuplot: the quick run skips the plots)"
elif ! command -v gnuplot >/dev/null 2>&1; then
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd=sudo
  $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq gnuplot-nox >/dev/null
fi
if command -v gnuplot >/dev/null 2>&1; then
  for p in own harmonised; do
    [[ -f $out/test_$p/long.csv ]] && gnuplot -e "csv='$out/test_$p/long.csv'; out='$out/long_$p.png'; model='$title ($tokens-token answers)'; kl_column=3; title_note=' (D = $slack, protection: $p)'" \
      "$root/eval/plot_quality.gp"
  done
fi

# Paired differences against the best row of each budget: KL(row) - KL(best) per prompt, the mean
# ± its standard error across prompts; the best is the compressing row with the lowest mean KL.
paired() {  # paired LONG_PROMPTS_CSV
  awk -F, -v budgets="$budgets" '
    NR > 1 { kl[$1, $2, $3] = $4; if (!($1 in seen)) { seen[$1] = 1; order[++n] = $1 } ; prompts[$3] = 1 }
    END {
      nb = split(budgets, b, ",")
      for (j = 1; j <= nb; j++) {
        best[j] = ""
        for (i = 1; i <= n; i++) {
          v = order[i]; s = 0; m = 0
          for (p in prompts) { s += kl[v, b[j], p]; m++ }
          if (best[j] == "" || s / m < bs[j]) { best[j] = v; bs[j] = s / m }
        }
      }
      printf "| policy |"; for (j = 1; j <= nb; j++) printf " B = %s (best: %s) |", b[j], best[j]; printf "\n|---|"
      for (j = 1; j <= nb; j++) printf "---:|"; printf "\n"
      for (i = 1; i <= n; i++) {
        v = order[i]; printf "| %s |", v
        for (j = 1; j <= nb; j++) {
          s = 0; ss = 0; m = 0
          for (p in prompts) { d = kl[v, b[j], p] - kl[best[j], b[j], p]; s += d; ss += d * d; m++ }
          mean = s / m; se = m > 1 ? sqrt((ss - m * mean * mean) / (m - 1) / m) : 0
          if (v == best[j]) printf " 0 (best) |"; else printf " %+.4f ± %.4f |", mean, se
        }
        printf "\n"
      }
    }' "$1"
}

# The same for retrieval: per fraction, the compressing policy with the highest accuracy is the
# best; each policy's correct (0 or 1) minus the best's on the same sample (family, context,
# depth, trial), the mean ± its standard error over the samples.
paired_retrieval() {  # paired_retrieval PASSKEY_SAMPLES_CSV
  awk -F, '
    NR > 1 && $1 != "full" {
      id = $9 SUBSEP $3 SUBSEP $4 SUBSEP $5
      ok[$1, $2, id] = $7; hits[$1, $2] += $7; n[$1, $2]++; ids[$2, id] = 1
      if (!($1 in seen)) { seen[$1] = 1; order[++np] = $1 }
      if (!($2 in fseen)) { fseen[$2] = 1; fr[++nf] = $2 }
    }
    END {
      for (j = 1; j <= nf; j++) {
        f = fr[j]; best = ""
        for (i = 1; i <= np; i++) if (best == "" || hits[order[i], f] > hits[best, f]) best = order[i]
        b[j] = best
      }
      printf "| policy |"; for (j = 1; j <= nf; j++) printf " %s of the context (best: %s) |", fr[j], b[j]; printf "\n|---|"
      for (j = 1; j <= nf; j++) printf "---:|"; printf "\n"
      for (i = 1; i <= np; i++) {
        v = order[i]; printf "| %s |", v
        for (j = 1; j <= nf; j++) {
          f = fr[j]; s = 0; ss = 0; m = 0
          for (k in ids) { split(k, key, SUBSEP); if (key[1] != f) continue
            id = key[2] SUBSEP key[3] SUBSEP key[4] SUBSEP key[5]; d = ok[v, f, id] - ok[b[j], f, id]; s += d; ss += d * d; m++ }
          mean = s / m; se = m > 1 ? sqrt((ss - m * mean * mean) / (m - 1) / m) : 0
          if (v == b[j]) printf " 0 (best) |"; else printf " %+.3f ± %.3f |", mean, se
        }
        printf "\n"
      }
    }' "$1"
}

end=$(date +%s)
{
  echo "# $title quality (eval/run_grid.sh --model $name$( ((quick)) && echo ' --quick')$( [[ $stages != "$all_stages" ]] && echo " --stages $stages"))"
  echo
  echo "Wall time: $((end - start)) s on $(nproc) cores ($threads threads)."
  echo
  echo '| stage | seconds |'
  echo '|---|---:|'
  printf '%s' "$stage_times" | awk 'NF { t = $NF; $NF = ""; sub(/ $/, ""); printf "| %s | %s |\n", $0, t }'
  if [[ -f $out/inspect.txt ]]; then
    echo
    echo '## R (mean resultant length) of the calibrated query bands'
    echo
    echo '```'
    grep -E '^  all|layer|band' "$out/inspect.txt" | grep -E 'all| layer +[0-9]+ ' | head -n 40
    echo '```'
  fi
  if [[ -f $out/dev/long.md ]]; then
    echo
    echo "## Tuning (development prompts): $tuned"
    echo
    cat "$out/dev/long.md"
  fi
  for p in own harmonised; do
    [[ -f $out/test_$p/long.md ]] || continue
    echo
    echo "## Regime 1, protection: $p"
    echo
    cat "$out/test_$p/long.md"
    echo
    echo "### Paired differences against the best policy (KL, test prompts; negative: closer to the full cache)"
    echo
    paired "$out/test_$p/long_prompts.csv"
  done
  for d in "$out"/retrieval_full/* "$out"/retrieval_end_own/* "$out"/retrieval_end_harmonised/* "$out/retrieval_chunks"; do
    [[ -f $d/passkey.md ]] || continue
    echo
    echo "## ${d#"$out"/}"
    echo
    cat "$d/passkey.md"
    [[ $d == */retrieval_full/* ]] && continue
    echo
    echo "### Paired differences against the best policy (accuracy, same samples; negative: fewer keys found)"
    echo
    paired_retrieval "$d/passkey_samples.csv"
  done
} > "$out/summary.md"
echo "== wrote $out/summary.md in $((end - start)) s"
