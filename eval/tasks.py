#!/usr/bin/env python3
"""Task accuracy through llama-server: a problem set answered with every slot's cache held at a
budget, graded (the contract: ../shared/spec/cli.md, "Task accuracy through llama-server").

    python3 eval/tasks.py --server PATH/llama-server --model M.gguf --problems P.jsonl \\
        --policies full,triattention,streaming_llm --budgets 256[,512] [--slack D] [--stats S.safetensors] \\
        [--parallel N] [--max-tokens T] --out results.csv

For each (policy, budget) the client starts the patched server on 127.0.0.1, sends every problem
not yet in results.csv as one chat request (greedy), keeps all N slots busy, grades each reply
(eval/math_grade.py) and appends its row as it arrives, so an interrupted run resumes where it
stopped. `full` runs once, without --kv-policy. `context_shift` is llama-server's own context
shift in slots of budget + slack cells with the whole prompt kept (n_keep -1): the baseline a
user has without triattn.

Beyond the contract:
  --threads N      the server's -t (default: llama.cpp's)
  --reuse-full     a problem whose full-cache answer never reached budget + slack cells takes the
                   full row (no round can run, so the answer cannot change); checked on a sample
                   by running once without it
  --log-dir D      the servers' logs (default: beside --out)
Python's standard library only.
"""
import argparse
import concurrent.futures
import csv
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_server  # noqa: E402
import math_grade  # noqa: E402

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
COLUMNS = ["id", "policy", "budget", "correct", "answer", "reference", "generated_tokens", "finished", "rounds",
           "peak_cells"]
# The runs that are not a --kv-policy of the server.
BASELINES = ("full", "context_shift")
# The server's --kv-policy names (the registry, include/triattn/registry.hpp); the server is the
# authority and refuses any other at start-up; tests/llamacpp/test_tasks.py checks that the two agree.
SERVER_POLICIES = ("streaming_llm", "h2o", "snapkv", "vatp", "rkv", "triattention", "knorm", "keydiff",
                   "expected_attention")
# Policies that read calibration statistics: only they get --kv-stats (Expected Attention
# reads the queries it observes, not the statistics' means).
NEEDS_STATS = ("triattention",)


class bad_input(Exception):
    """One line for the user; exit code 2, results.csv untouched."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tasks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--problems", required=True)
    p.add_argument("--policies", required=True)
    p.add_argument("--budgets", default="")
    p.add_argument("--slack", type=int, default=64)
    p.add_argument("--stats", default="")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reuse-full", action="store_true")
    p.add_argument("--log-dir", default="")
    a = p.parse_args(argv)
    a.policies = [s for s in a.policies.split(",") if s]
    for name in a.policies:
        if name not in BASELINES + SERVER_POLICIES:
            raise bad_input(f"--policies: unknown policy '{name}' (known: {', '.join(BASELINES + SERVER_POLICIES)})")
    if not a.policies:
        raise bad_input("--policies: no policy given")
    try:
        a.budgets = [int(s) for s in a.budgets.split(",") if s]
    except ValueError:
        raise bad_input(f"--budgets {a.budgets}: not a list of integers") from None
    for b in a.budgets:
        if b < 1:
            raise bad_input(f"--budgets: budget {b} must be >= 1")
    if any(n != "full" for n in a.policies) and not a.budgets:
        raise bad_input("--budgets: the policies other than full need at least one budget")
    for flag, value, low in (("--slack", a.slack, 0), ("--parallel", a.parallel, 1), ("--max-tokens", a.max_tokens, 1),
                             ("--threads", a.threads, 0)):
        if value < low:
            raise bad_input(f"{flag} {value} must be >= {low}")
    for flag, path in (("--server", a.server), ("--model", a.model), ("--problems", a.problems)):
        if not os.path.isfile(path):
            raise bad_input(f"{flag} {path}: no such file")
    if any(n in NEEDS_STATS for n in a.policies) and not os.path.isfile(a.stats):
        raise bad_input(f"--stats {a.stats or '(none)'}: no such file (triattention reads calibration statistics)")
    return a


def read_problems(path):
    """[(id, problem, answer)] in file order; a malformed line names its number."""
    problems, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                pid, text, answer = row["id"], row["problem"], row["answer"]
                if not isinstance(pid, str) or not isinstance(text, str) or isinstance(answer, (dict, list, bool)):
                    raise ValueError("id and problem must be strings, answer a string or a number")
            except (ValueError, KeyError) as e:
                raise bad_input(f"{path} line {number}: {e.__class__.__name__}: {e}") from None
            if pid in seen:
                raise bad_input(f"{path} line {number}: id '{pid}' appears twice")
            seen.add(pid)
            problems.append((pid, text, str(answer)))
    if not problems:
        raise bad_input(f"{path}: no problems")
    return problems


def read_rows(path):
    """The rows already in results.csv, by (id, policy, budget)."""
    if not os.path.exists(path):
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return {}
        if header != COLUMNS:
            raise bad_input(f"{path}: columns {','.join(header)}, expected {','.join(COLUMNS)}")
        rows = {}
        for number, r in enumerate(reader, 2):
            if len(r) != len(COLUMNS):
                raise bad_input(f"{path} line {number}: {len(r)} fields, expected {len(COLUMNS)}")
            rows[(r[0], r[1], int(r[2]))] = dict(zip(COLUMNS, r))
        return rows


def runs(a):
    """(policy, budget) in order: full once (budget 0), the others at every budget."""
    out = []
    for name in a.policies:
        for b in [0] if name == "full" else a.budgets:
            if (name, b) not in out:
                out.append((name, b))
    return out


def slot_cells(a, problems, policy, budget):
    """The cells of one slot. A full slot fits the longest prompt and answer (a token is at least a
    byte; 128 for the chat template); context shift gets budget + slack; a held slot the same as
    full, which it never fills (the policy holds it at budget + slack + one batch)."""
    if policy == "context_shift":
        return budget + a.slack
    longest = max(len(text.encode()) for _, text, _ in problems) + len(INSTRUCTION) + 128
    return -(-(longest + a.max_tokens) // 256) * 256


def server_args(a, problems, policy, budget):
    cells = slot_cells(a, problems, policy, budget)
    args = ["-m", a.model, "-c", str(cells * a.parallel), "--parallel", str(a.parallel), "-fa", "on", "--no-webui",
            "--cont-batching", "--seed", "0"]
    if a.threads:
        args += ["-t", str(a.threads)]
    if policy == "context_shift":
        args += ["--context-shift"]
    elif policy != "full":
        args += ["--kv-policy", policy, "--kv-budget", str(budget), "--kv-slack", str(a.slack)]
        if policy in NEEDS_STATS:
            args += ["--kv-stats", a.stats]
    return args, cells


def shifts(prompt, generated, cells):
    """llama-server's context shifts in a slot of `cells` with the whole prompt kept, replayed:
    when the next token would fill the slot, half of what follows the prompt goes (the server's
    rule, tools/server/server-context.cpp). Returns (shifts, peak cells)."""
    n_keep = min(cells - 4, prompt)
    held = peak = prompt
    count = 0
    for _ in range(max(0, generated - 1)):  # the last token is sampled, never decoded
        if held + 1 >= cells:
            held -= (held - n_keep) // 2
            count += 1
        held += 1
        peak = max(peak, held)
    return count, peak


def answer(port, pid, text, reference, policy, budget, a, cells):
    def row(correct, extracted, generated, finished, rounds, peak):
        return {"id": pid, "policy": policy, "budget": budget, "correct": int(correct), "answer": extracted,
                "reference": reference, "generated_tokens": generated, "finished": int(finished), "rounds": rounds,
                "peak_cells": peak}

    body = {"messages": [{"role": "user", "content": f"{text}\n{INSTRUCTION}"}], "temperature": 0.0, "top_k": 1,
            "max_tokens": a.max_tokens, "cache_prompt": False, "seed": 0}
    if policy == "context_shift":
        body["n_keep"] = -1
    status, r = llama_server.request(port, "/v1/chat/completions", body, timeout=24 * 3600)
    if policy == "context_shift" and status == 400 and "exceeds the available context size" in str(r):
        # A prompt longer than the slot: llama-server refuses it, so the user gets no answer.
        return row(False, "", 0, False, 0, 0), str(r)
    if status != 200:
        raise llama_server.server_error(f"problem {pid}: HTTP {status}: {str(r)[:500]}")
    choice = r["choices"][0]
    reply = choice["message"].get("content") or ""
    finished = choice.get("finish_reason") == "stop"
    correct, extracted = math_grade.grade(reply, reference)
    t = r.get("timings", {})
    generated = int(r["usage"]["completion_tokens"])
    prompt = int(r["usage"]["prompt_tokens"])
    if "kv_rounds" in t:  # a held slot: the server's own count for this answer
        rounds, peak = int(t["kv_rounds"]), int(t["kv_peak_cells"])
    elif policy == "context_shift":
        rounds, peak = shifts(prompt, generated, cells)
    else:
        rounds, peak = 0, prompt + max(generated - 1, 0)
    return row(correct and finished, extracted, generated, finished, rounds, peak), reply


def reused_full(done, pid, budget, a):
    """The full row of `pid` as the row of a run at `budget`, when its answer never reached
    budget + slack cells (so no round and no shift ran); else None."""
    full = done.get((pid, "full", 0))
    if full is None or int(full["peak_cells"]) + 1 >= budget + a.slack:
        return None
    return full


def main(argv):
    try:
        a = parse_args(argv)
        problems = read_problems(a.problems)
        done = read_rows(a.out)
    except bad_input as e:
        print(f"tasks.py: {e}", file=sys.stderr)
        return 2
    log_dir = a.log_dir or os.path.dirname(os.path.abspath(a.out))
    os.makedirs(log_dir, exist_ok=True)
    new_file = not os.path.exists(a.out) or os.path.getsize(a.out) == 0
    lock = threading.Lock()
    with open(a.out, "a", newline="", encoding="utf-8") as out, \
            open(os.path.join(log_dir, "replies.jsonl"), "a", encoding="utf-8") as replies:
        writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        if new_file:
            writer.writeheader()
            out.flush()

        def emit(row, reply):
            with lock:
                writer.writerow(row)
                out.flush()
                done[(row["id"], row["policy"], int(row["budget"]))] = row
                if reply is not None:
                    replies.write(json.dumps({"id": row["id"], "policy": row["policy"], "budget": row["budget"],
                                              "reply": reply}) + "\n")
                    replies.flush()

        for policy, budget in runs(a):
            todo = [p for p in problems if (p[0], policy, budget) not in done]
            if policy != "full" and a.reuse_full:
                kept = []
                for p in todo:
                    full = reused_full(done, p[0], budget, a)
                    if full is None:
                        kept.append(p)
                    else:
                        emit(dict(full, policy=policy, budget=budget), None)
                todo = kept
            print(f"tasks.py: {policy} budget {budget}: {len(todo)} of {len(problems)} problems to answer", flush=True)
            if not todo:
                continue
            args, cells = server_args(a, problems, policy, budget)
            log = os.path.join(log_dir, f"server-{policy}-{budget}.log")
            with llama_server.running_server(a.server, args, log) as port, \
                    concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
                futures = [pool.submit(answer, port, pid, text, ref, policy, budget, a, cells)
                           for pid, text, ref in todo]
                for f in concurrent.futures.as_completed(futures):
                    try:
                        emit(*f.result())
                    except llama_server.server_error as e:
                        for g in futures:
                            g.cancel()
                        print(f"tasks.py: {policy} budget {budget}: {e}", file=sys.stderr)
                        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
