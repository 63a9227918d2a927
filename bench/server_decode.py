#!/usr/bin/env python3
"""Decode throughput of the patched llama-server, per policy: what reading queries or attention
costs against a key-only policy, and what batching buys (every slot busy against one slot).

    python3 bench/server_decode.py --server PATH/llama-server --model M.gguf --problems P.jsonl \\
        [--stats S.safetensors] [--parallel 2] [--threads 2] [--tokens 256] [--budget 128] [--slack 32]

For each policy the server starts once (the same flags as eval/tasks.py) and answers, greedily and
with the end-of-sequence token ignored so that every answer has --tokens tokens:
  one slot    the first problem alone: the server's own decode rate (timings.predicted_per_second)
  all slots   the first --parallel problems at once: their decoded tokens over the longest decode
              time (all start together), and the wall time from the first send to the last reply
Run it alone on the machine: a second busy process halves what it measures. Prints one Markdown
table; the policy `full` is the uncompressed cache. Python's standard library only.
"""
import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eval"))
import llama_server  # noqa: E402
import tasks  # noqa: E402  (the server's flags and the chat request, as the task grid sends them)

# (policy, what its scorer reads): the registry's split (runner/triattn_llama.hpp, reads_of).
POLICIES = (("full", "-"), ("streaming_llm", "keys"), ("knorm", "keys"), ("keydiff", "keys"),
            ("triattention", "keys"), ("snapkv", "queries"), ("rkv", "queries"),
            ("expected_attention", "queries"), ("h2o", "attention"), ("vatp", "attention"))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="server_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--problems", required=True)
    p.add_argument("--stats", default="")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--slack", type=int, default=32)
    p.add_argument("--policies", default=",".join(name for name, _ in POLICIES))
    a = p.parse_args(argv)
    known = dict(POLICIES)
    a.policies = [s for s in a.policies.split(",") if s]
    for name in a.policies:
        if name not in known:
            p.error(f"--policies: unknown policy '{name}' (known: {', '.join(known)})")
    if "triattention" in a.policies and not os.path.isfile(a.stats):
        p.error(f"--stats {a.stats or '(none)'}: no such file (triattention reads calibration statistics)")
    if a.parallel < 2 or a.tokens < 1:
        p.error("--parallel must be >= 2 (one slot is measured against all) and --tokens >= 1")
    # The task client's settings object, for its server flags.
    a.max_tokens = a.tokens
    return a


def decode(port, text, tokens):
    """(decoded tokens, decode ms) of one answer of exactly `tokens` tokens."""
    body = {"messages": [{"role": "user", "content": f"{text}\n{tasks.INSTRUCTION}"}], "temperature": 0.0,
            "top_k": 1, "max_tokens": tokens, "ignore_eos": True, "cache_prompt": False, "seed": 0}
    status, r = llama_server.request(port, "/v1/chat/completions", body, timeout=3600)
    if status != 200:
        raise llama_server.server_error(f"HTTP {status}: {str(r)[:300]}")
    t = r["timings"]
    return int(t["predicted_n"]), float(t["predicted_ms"])


def measure(a, problems, policy, log_path):
    args, _ = tasks.server_args(a, problems, policy, a.budget)
    with llama_server.running_server(a.server, args, log_path) as port:
        n, ms = decode(port, problems[0][1], a.tokens)
        one = n / ms * 1000
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
            done = list(pool.map(lambda p: decode(port, p[1], a.tokens), problems[:a.parallel]))
        wall = time.perf_counter() - start
    tokens = sum(n for n, _ in done)
    return one, tokens / max(ms for _, ms in done) * 1000, tokens / wall


def main(argv):
    a = parse_args(argv)
    problems = tasks.read_problems(a.problems)
    if len(problems) < a.parallel:
        sys.exit(f"server_decode.py: {a.problems}: {len(problems)} problems, --parallel {a.parallel} needs as many")
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for name in a.policies:
            one, busy, wall = measure(a, problems, name, os.path.join(logs, f"{name}.log"))
            rows.append((name, dict(POLICIES)[name], one, busy, wall))
            print(f"server_decode: {name}: {one:.2f} tok/s one slot, {busy:.2f} all slots", file=sys.stderr)
    key_only = next((r[2] for r in rows if r[1] == "keys"), None)
    print(f"llama-server, {a.parallel} slots, -t {a.threads}, {a.tokens} tokens an answer, "
          f"budget {a.budget} + slack {a.slack}:\n")
    print("| policy | reads | one slot tok/s | vs key-only | all slots tok/s (decode) | (wall) | all / one |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, reads, one, busy, wall in rows:
        versus = f"{one / key_only:.2f}" if key_only else "-"
        print(f"| {name} | {reads} | {one:.2f} | {versus} | {busy:.2f} | {wall:.2f} | {busy / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
