#!/usr/bin/env bash
# The quality evaluation in one command (quality-evaluation issue): builds `triattn` and
# `triattn_eval` if needed, calibrates TriAttention on the train text (100 windows), runs the
# default grid on the validation text and plots KL against the budget.
#
#   eval/run_quality.sh [OUT_DIR] [extra triattn_eval options, e.g. --quick or --threads 2]
#
# Environment: TRIATTN_DATA_DIR (default ../shared next to the repository), BUILD_DIR (default
# build/default, the `default` CMake preset). Outputs in OUT_DIR (default build/quality):
# stats_train.safetensors, quality.csv, quality.md, quality.png, eval.log.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data=${TRIATTN_DATA_DIR:-$root/../shared}
build=${BUILD_DIR:-$root/build/default}
out=${1:-$root/build/quality}
[[ $# -gt 0 ]] && shift
model=$data/models/stories260K/stories260K.bin
tokenizer=$data/models/stories260K/tok512.bin
for f in "$model" "$tokenizer" "$data/data/tinystories_train_head.txt" "$data/data/tinystories_valid_head.txt"; do
  [[ -f $f ]] || { echo "run_quality.sh: missing $f (set TRIATTN_DATA_DIR)" >&2; exit 2; }
done

# Build (incremental: a no-op when up to date).
if [[ ! -f $build/CMakeCache.txt ]]; then
  if [[ $build == "$root/build/default" ]]; then
    cmake --preset default -S "$root" >/dev/null
  else
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  fi
fi
cmake --build "$build" --target triattn_cli triattn_eval_cli -j "$(nproc)"
triattn=$build/bin/triattn
triattn_eval=$build/bin/triattn_eval

mkdir -p "$out"
stats=$out/stats_train.safetensors
echo "== calibrate on tinystories_train_head.txt (100 windows) -> $stats" >&2
"$triattn" calibrate --model "$model" --tokenizer "$tokenizer" --text "$data/data/tinystories_train_head.txt" \
  --windows 100 --out "$stats"
echo >&2

echo "== triattn_eval on tinystories_valid_head.txt" >&2
start=$(date +%s.%N)
"$triattn_eval" --model "$model" --tokenizer "$tokenizer" --text "$data/data/tinystories_valid_head.txt" \
  --stats "$stats" --out "$out" "$@" 2> >(tee "$out/eval.log" >&2)
end=$(date +%s.%N)
printf '== triattn_eval wall time: %.1f s (%s cores)\n' "$(echo "$end - $start" | bc)" "$(nproc)" >&2

# Plot (gnuplot from Debian when missing).
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "== installing gnuplot-nox" >&2
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd=sudo
  $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq gnuplot-nox >/dev/null
fi
# The policies to plot: the program's list (triattn_eval --list-policies, the registry's order),
# those of them the grid evaluated.
policies=$("$triattn_eval" --list-policies | while read -r p; do
  if grep -q "^$p," "$out/quality.csv"; then printf '%s ' "$p"; fi
done)
windows=$(tail -n +2 "$out/quality.csv" | awk -F, 'NR==2{print $12}')
divide=$(tail -n +2 "$out/quality.csv" | awk -F, 'NR==1{print $14}')
gnuplot -e "csv='$out/quality.csv'; out='$out/quality.png'; policies='${policies% }'; title_note=' ($windows windows, D = $divide)'" \
  "$root/eval/plot_quality.gp"
echo "== wrote $out/quality.csv, $out/quality.md, $out/quality.png" >&2
