#!/usr/bin/env python3
"""Needle retrieval through llama-server with prompts longer than a slot's cells.

    server_passkey.py --server S --model M.gguf --samples passkey_prompts.tsv --out DIR
        [--cells 512] [--budget 256] [--slack 64] [--stats S.safetensors]
        [--policies streaming_llm,triattention] [--answer-tokens 12] [--threads T]

Sends every sample of `triattn_eval retrieval`'s passkey_prompts.tsv (family, context, depth,
trial, key, the prompt's token ids) to /completion as token ids, greedy, `--answer-tokens`
tokens, no prompt reuse; an answer is correct when its first run of digits is the key, as
triattn_eval scores it. One server at a time, one slot each:

- `full`: a slot with room for the longest prompt and its answer (the reference);
- `context_shift`: today's llama-server with `--cells` cells and its context shift on: it
  refuses a prompt of `--cells` tokens or more (HTTP 400), which counts as a miss;
- each `--policies` name: the patched server, `--kv-policy NAME --kv-budget --kv-slack` in
  `--cells` cells (prefilled in batches that fit the slot's free cells, a round after each).

Writes DIR/server_passkey.csv (one row a sample and server: status, answer, correct, and the
slot's peak cells and rounds since its server started) and DIR/server_passkey.md (accuracy ± standard error per server).
Python's standard library only.
"""
import argparse
import csv
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_server  # noqa: E402  (eval/llama_server.py)


def read_samples(path):
    samples = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 6:
                sys.exit(f"server_passkey.py: {path} line {n}: {len(cols)} tab-separated columns, expected 6")
            family, context, depth, trial, key, ids = cols
            try:
                samples.append({"family": family, "context": int(context), "depth": depth, "trial": int(trial),
                                "key": key, "ids": [int(t) for t in ids.split()]})
            except ValueError as e:
                sys.exit(f"server_passkey.py: {path} line {n}: {e}")
    if not samples:
        sys.exit(f"server_passkey.py: {path}: no sample")
    return samples


def first_number(text):
    m = re.search(r"[0-9]+", text)
    return m.group(0) if m else ""


def server_args(name, a, longest):
    """The flags of server `name`: its cells, and for a policy the --kv-* flags."""
    common = ["-m", a.model, "--parallel", "1", "-fa", "on", "-t", str(a.threads), "--no-warmup"]
    if name == "full":
        return common + ["-c", str(longest + a.answer_tokens + 16)]
    if name == "context_shift":
        return common + ["-c", str(a.cells), "--context-shift"]
    args = common + ["-c", str(a.cells), "--kv-policy", name, "--kv-budget", str(a.budget), "--kv-slack", str(a.slack)]
    return args + (["--kv-stats", a.stats] if a.stats else [])


def run_server(name, a, samples, longest, rows):
    log = os.path.join(a.out, f"server_{name}.log")
    with llama_server.running_server(a.server, server_args(name, a, longest), log) as port:
        for s in samples:
            status, body = llama_server.request(port, "/completion", {
                "prompt": s["ids"], "n_predict": a.answer_tokens, "temperature": 0, "top_k": 1,
                "cache_prompt": False}, timeout=1800)
            text = body.get("content", "") if status == 200 and isinstance(body, dict) else ""
            kv = {}
            if status == 200:
                slots = llama_server.request(port, "/slots")[1]
                kv = slots[0].get("kv_cache") or {}
            rows.append({"server": name, "family": s["family"], "context": s["context"], "depth": s["depth"],
                         "trial": s["trial"], "prompt_tokens": len(s["ids"]), "status": status,
                         "correct": int(status == 200 and first_number(text) == s["key"]), "key": s["key"],
                         "answer": text.replace("\n", " ")[:80], "peak_cells": kv.get("peak_cells", ""),
                         "rounds": kv.get("rounds", "")})
            error = "" if status == 200 else f" HTTP {status}: {str(body)[:160]}"
            print(f"{name:>14} depth {s['depth']:>5} trial {s['trial']}: "
                  f"{'correct' if rows[-1]['correct'] else 'wrong  '} {text[:40]!r}{error}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--samples", required=True, help="triattn_eval retrieval's passkey_prompts.tsv")
    p.add_argument("--out", required=True)
    p.add_argument("--cells", type=int, default=512)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--slack", type=int, default=64)
    p.add_argument("--stats")
    p.add_argument("--policies", default="streaming_llm,triattention")
    p.add_argument("--answer-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    for flag, value, low in (("--cells", a.cells, 2), ("--budget", a.budget, 1), ("--slack", a.slack, 0),
                             ("--answer-tokens", a.answer_tokens, 1), ("--threads", a.threads, 1)):
        if value < low:
            p.error(f"{flag} {value} must be >= {low}")
    samples = read_samples(a.samples)
    longest = max(len(s["ids"]) for s in samples)
    shortest = min(len(s["ids"]) for s in samples)
    if shortest < a.cells:
        p.error(f"--samples {a.samples}: a prompt of {shortest} tokens fits --cells {a.cells}; the comparison needs "
                "every prompt longer than a slot")
    os.makedirs(a.out, exist_ok=True)
    servers = ["full", "context_shift"] + [n for n in a.policies.split(",") if n]
    rows = []
    for name in servers:
        try:
            run_server(name, a, samples, longest, rows)
        except llama_server.server_error as e:
            sys.exit(f"server_passkey.py: server {name}: {e}")

    with open(os.path.join(a.out, "server_passkey.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "server_passkey.md"), "w") as f:
        f.write(f"Needle retrieval through llama-server: {len(samples)} prompts of {shortest} to {longest} tokens "
                f"(`triattn_eval retrieval` samples), one slot of {a.cells} cells (the full cache: "
                f"{longest + a.answer_tokens + 16}); policies at budget {a.budget} + slack {a.slack}; greedy "
                f"{a.answer_tokens}-token answers. Accuracy ± standard error over the prompts.\n\n")
        f.write("| server | correct | accuracy | HTTP errors | peak cells |\n| --- | --- | --- | --- | --- |\n")
        for name in servers:
            mine = [r for r in rows if r["server"] == name]
            n, k = len(mine), sum(r["correct"] for r in mine)
            acc = k / n
            se = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan")
            errors = sorted({r["status"] for r in mine if r["status"] != 200})
            err = f"{sum(r['status'] != 200 for r in mine)} ({', '.join(map(str, errors))})" if errors else "0"
            peaks = [r["peak_cells"] for r in mine if r["peak_cells"] != ""]
            label = {"full": "full cache", "context_shift": "llama-server today (context shift)"}.get(name, name)
            f.write(f"| {label} | {k}/{n} | {acc:.3f} ± {se:.3f} | {err} | {max(peaks) if peaks else '—'} |\n")
    with open(os.path.join(a.out, "server_passkey.md")) as f:
        print(f.read(), end="")


if __name__ == "__main__":
    main()
