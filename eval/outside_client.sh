#!/usr/bin/env bash
# An outside client for the task grid (issue 39): curl sends the first N problems of a problem
# file, one at a time, to a llama-server started with the flags given after `--`, and each reply's
# token count and last \boxed{} are compared with the row eval/tasks.py wrote for that
# (problem, policy, budget). It shares no code with tasks.py or math_grade.py, and it decodes one
# sequence at a time where the grid kept every slot busy, so agreement also says that an answer
# does not depend on which problem shared its batch.
#
#   eval/outside_client.sh CSV PROBLEMS.jsonl POLICY BUDGET N -- LLAMA-SERVER [FLAGS...]
#
# Prints one line a problem (same / DIFFERENT) and exits 1 when any differs.
set -euo pipefail
(($# >= 7)) && [[ $6 == -- ]] || { echo "usage: $0 CSV PROBLEMS.jsonl POLICY BUDGET N -- LLAMA-SERVER [FLAGS...]" >&2; exit 2; }
csv=$1 problems=$2 policy=$3 budget=$4 n=$5
shift 6
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
"$@" --host 127.0.0.1 --port "$port" > "$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "the server exited:" >&2; tail -20 "$log" >&2; exit 1; }
  sleep 1
done

differ=0
while IFS=$'\t' read -r id body; do
  reply=$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$body")
  # tokens and the last \boxed{...} (braces balanced), from the reply; the CSV's row of the same key
  verdict=$(python3 - "$csv" "$id" "$policy" "$budget" "$reply" <<'EOF'
import csv, json, sys
path, pid, policy, budget, reply = sys.argv[1:]
r = json.loads(reply)
text, tokens = r["choices"][0]["message"]["content"] or "", r["usage"]["completion_tokens"]
start, boxed = text.rfind("\\boxed{"), ""
if start >= 0:
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            boxed = text[i + 1:j].strip()
            break
row = next((x for x in csv.DictReader(open(path)) if (x["id"], x["policy"], x["budget"]) == (pid, policy, budget)), None)
if row is None:
    print(f"{pid}: no row for {policy} at {budget} in {path}")
elif (row["answer"], int(row["generated_tokens"])) == (boxed, tokens):
    print(f"{pid}: same ({tokens} tokens, answer {boxed!r})")
else:
    print(f"{pid}: DIFFERENT: {tokens} tokens, answer {boxed!r}; the CSV: {row['generated_tokens']} tokens, answer {row['answer']!r}")
EOF
)
  echo "$verdict"
  [[ $verdict == *": same ("* ]] || differ=1
done < <(head -n "$n" "$problems" | python3 -c '
import json, sys
for line in sys.stdin:
    p = json.loads(line)
    content = p["problem"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0.0, "top_k": 1,
            "max_tokens": int(sys.argv[1]), "cache_prompt": False, "seed": 0}
    print(p["id"], json.dumps(body), sep="\t")' "${MAX_TOKENS:-400}")
exit $differ
