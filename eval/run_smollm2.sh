#!/usr/bin/env bash
# SmolLM2-135M-Instruct quality in one command (the SmolLM2 quality issue): calibration on the
# model's own answers, the R distribution, the tuning of TriAttention's extensions on the
# development prompts, decode-time compression of 2,048-token answers on the test prompts,
# and passkey retrieval after a compressed prefill; CSV, markdown and PNG plots.
#
#   eval/run_smollm2.sh [OUT_DIR] [--quick]
#
# OUT_DIR (default build/smollm2): stats.safetensors, inspect.txt, dev/, tuned.txt, test/,
# passkey_full/, passkey/, long.png, passkey.png, summary.md, run.log. Nothing is read from
# eval/results: the committed copy in eval/results/smollm2/ is this directory's output.
# --quick: the same pipeline on short answers and contexts, for CI (under 3 minutes).
#
# Splits: eval/prompts/calibration.txt (calibration only), dev.txt (the only prompts the
# tuning step reads), test.txt (the reported figures; read once, after tuning).
# Environment: BUILD_DIR (default build/default, the `default` preset, which has llama.cpp),
# SMOLLM2_GGUF (default: the configured or fetched model), THREADS (default nproc).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/build/smollm2
quick=0
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    -*) echo "run_smollm2.sh: unknown option $a" >&2; exit 2 ;;
    *) out=$a ;;
  esac
done
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
exec > >(tee "$out/run.log") 2>&1

source "$root/eval/smollm2_model.sh"
echo "== model $model"

if [[ ! -f $build/CMakeCache.txt ]]; then
  if [[ $build == "$root/build/default" ]]; then cmake --preset default -S "$root" >/dev/null
  else cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DTRIATTN_WITH_LLAMA_CPP=ON >/dev/null; fi
fi
cmake --build "$build" --target triattn_cli triattn_eval_cli -j "$(nproc)"
triattn=$build/bin/triattn
triattn_eval=$build/bin/triattn_eval

# Sizes. The full grid: 1,024-token calibration answers; 2,048-token test answers at budgets
# 128, 256 and 512 (1024 does not fit the 90 minutes beside the rest); passkey at 1K, 2K and
# 4K tokens with the full cache (5 depths x 2 keys), then with the policies at every context
# where the full cache scores at least 80 % (5 depths x 1 key: the first key of each depth).
# --quick keeps every stage and shrinks each, for CI.
if (( quick )); then
  answer=32 tokens=96 budgets=64 dev_budgets=64 contexts=192 depths=0.5 fractions=0.25 full_trials=1 trials=1
  candidates="triattention_vp0.2 triattention_red1 triattention_ema0.5"
  take() { grep -v '^#' "$1" | grep . | head -n 1; }
else
  answer=1024 tokens=2048 budgets=128,256,512 dev_budgets=128 contexts=1024,2048,4096 depths=0.1,0.3,0.5,0.7,0.9
  fractions=0.1,0.25,0.5 full_trials=2 trials=1
  candidates="triattention_vp0.05 triattention_vp0.2 triattention_red0.3 triattention_red1 triattention_ema0.5 triattention_ema0.9"
  take() { grep -v '^#' "$1" | grep .; }
fi
slack=64
take "$prompts/calibration.txt" > "$out/calibration_prompts.txt"
take "$prompts/dev.txt" > "$out/dev_prompts.txt"

echo "== 1. calibrate on SmolLM2's own answers ($answer+ tokens each)"
"$triattn" calibrate --model "$model" --prompts "$out/calibration_prompts.txt" --answer-tokens "$answer" \
  --out "$out/stats.safetensors"
"$triattn" inspect "$out/stats.safetensors" > "$out/inspect.txt"
tail -n 1 "$out/inspect.txt"
stage_done "1. calibration"

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

echo "== 3. decode-time compression on the test prompts ($tokens tokens each)"
take "$prompts/test.txt" > "$out/test_prompts.txt"
policies="full,random,window,streaming_llm,h2o,snapkv,vatp,rkv,triattention,triattention_per_layer,triattention_o4096,triattention_seed,${tuned// /,}"
"$triattn_eval" long --model "$model" --prompts "$out/test_prompts.txt" --stats "$out/stats.safetensors" \
  --policies "$policies" --budgets "$budgets" --tokens "$tokens" --slack "$slack" --threads "$threads" --out "$out/test"
stage_done "3. regime 1 (test)"

echo "== 4. passkey with the full cache: which contexts SmolLM2 can do"
"$triattn_eval" passkey --model "$model" --policies full --contexts "$contexts" --depths "$depths" \
  --trials "$full_trials" --threads "$threads" --out "$out/passkey_full"
usable=$(awk -F, 'NR > 1 && $3 != "all" && $5 >= 0.8 { printf "%s%s", (n++ ? "," : ""), $3 }' "$out/passkey_full/passkey.csv")
echo "contexts with full-cache accuracy >= 80%: ${usable:-none}"
stage_done "4. passkey, full cache"

if [[ -n $usable ]]; then
  echo "== 5. passkey after a compressed prefill at $usable tokens"
  # Every policy of regime 1 but the two floors (random and window: a key is found only where
  # it happens to be kept) and the TriAttention variants, which the 2-core time does not allow.
  "$triattn_eval" passkey --model "$model" --stats "$out/stats.safetensors" \
    --policies "full,streaming_llm,h2o,snapkv,vatp,rkv,triattention,triattention_per_layer" \
    --contexts "$usable" --depths "$depths" --trials "$trials" --fractions "$fractions" --threads "$threads" \
    --out "$out/passkey"
  stage_done "5. passkey, policies"
fi

echo "== 6. plots"
if (( quick )) && ! command -v gnuplot >/dev/null 2>&1; then
  echo "(no gnuplot: the quick run skips the plots)"
elif ! command -v gnuplot >/dev/null 2>&1; then
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd=sudo
  $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq gnuplot-nox >/dev/null
fi
command -v gnuplot >/dev/null 2>&1 && gnuplot -e "csv='$out/test/long.csv'; out='$out/long.png'; model='SmolLM2-135M-Instruct ($tokens-token answers)'; kl_column=3; title_note=' (D = $slack)'" \
  "$root/eval/plot_quality.gp"
[[ -f $out/passkey/passkey.csv ]] && command -v gnuplot >/dev/null 2>&1 && gnuplot -e "csv='$out/passkey/passkey.csv'; out='$out/passkey.png'; title_note=' (contexts $usable)'" \
  "$root/eval/plot_passkey.gp"

end=$(date +%s)
{
  echo "# SmolLM2-135M-Instruct quality (eval/run_smollm2.sh$( ((quick)) && echo ' --quick'))"
  echo
  echo "Wall time: $((end - start)) s on $(nproc) cores ($threads threads)."
  echo
  echo '| stage | seconds |'
  echo '|---|---:|'
  printf '%s' "$stage_times" | awk 'NF { t = $NF; $NF = ""; sub(/ $/, ""); printf "| %s | %s |\n", $0, t }'
  echo
  echo '## R (mean resultant length) of the calibrated query bands'
  echo
  echo '```'
  grep -E '^  all|layer|band' "$out/inspect.txt" | grep -E 'all| layer +[0-9]+ ' | head -n 40
  echo '```'
  echo
  echo "## Tuning (development prompts): $tuned"
  echo
  cat "$out/dev/long.md"
  echo
  cat "$out/test/long.md"
  echo
  echo "## Paired differences from the paper default (test prompts)"
  echo
  echo "KL(variant) - KL(triattention) per prompt, then the mean ± its standard error across prompts"
  echo "(negative: the variant is closer to the full cache)."
  echo
  # long_prompts.csv: policy,budget,prompt,kl,...
  awk -F, -v budgets="$budgets" '
    NR > 1 { kl[$1, $2, $3] = $4; if (!($1 in seen)) { seen[$1] = 1; order[++n] = $1 } ; prompts[$3] = 1 }
    END {
      nb = split(budgets, b, ",")
      printf "| variant |"; for (j = 1; j <= nb; j++) printf " B = %s |", b[j]; printf "\n|---|"
      for (j = 1; j <= nb; j++) printf "---:|"; printf "\n"
      for (i = 1; i <= n; i++) {
        v = order[i]
        if (v == "triattention" || v !~ /^triattention_/) continue
        printf "| %s |", v
        for (j = 1; j <= nb; j++) {
          s = 0; ss = 0; m = 0
          for (p in prompts) { d = kl[v, b[j], p] - kl["triattention", b[j], p]; s += d; ss += d * d; m++ }
          mean = s / m; se = m > 1 ? sqrt((ss - m * mean * mean) / (m - 1) / m) : 0
          printf " %+.4f ± %.4f |", mean, se
        }
        printf "\n"
      }
    }' "$out/test/long_prompts.csv"
  echo
  cat "$out/passkey_full/passkey.md"
  [[ -f $out/passkey/passkey.md ]] && { echo; cat "$out/passkey/passkey.md"; }
} > "$out/summary.md"
echo "== wrote $out/summary.md in $((end - start)) s"
