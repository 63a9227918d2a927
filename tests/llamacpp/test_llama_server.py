#!/usr/bin/env python3
"""llama-server with triattn (patches/llama.cpp/0002-server-kv-policy.patch), as users run it.

Starts the patched llama-server on 127.0.0.1 with SmolLM2, 2 parallel slots of 512 cells and
TriAttention at budget 256 (slack 64; statistics from `triattn calibrate --model`). Two
concurrent /v1/chat/completions requests of 1,500 tokens must complete with well-formed
responses of that length, while every slot's cells (the server's own /slots report) stay
within budget + slack + one token; a request with a bad parameter gets HTTP 400 and the
server answers the next one; a prompt more than twice a slot's cells is prefilled through it
(today's server refuses it). Bad flags stop start-up with a line naming them. Python's
standard library only.

Usage: test_llama_server.py SERVER TRIATTN MODEL SOURCE_DIR SCRATCH
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "eval"))
import llama_server  # noqa: E402  (eval/llama_server.py)
from llama_server import free_port, request  # noqa: E402

BUDGET, SLACK, CELLS_PER_SLOT, TOKENS = 256, 64, 512, 1500


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


# Every server here runs one thread (-t 1): CTest runs two tests at once on CI's two cores, and
# two processes whose OpenMP teams spin at ggml's per-node barriers slow each other badly (CI, stop 36:
# the adapter test past 900 s beside this one, against ~100 s here).
def start_up_fails(server, model, extra, want, scratch):
    """The server with `extra` flags must exit non-zero before serving, naming `want`."""
    cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(free_port()), "-c", "1024", "--parallel", "2",
           "-t", "1"] + extra
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(extra)}: the server did not stop")
    out = r.stdout + r.stderr
    if r.returncode == 0 or want not in out:
        fail(f"{' '.join(extra)}: exit {r.returncode}, expected an error naming {want!r}:\n{out[-3000:]}")
    print(f"ok: {' '.join(extra)} -> exit {r.returncode}: "
          f"{next((l for l in out.splitlines() if want in l), '')}", flush=True)


def main():
    server, triattn, model, source, scratch = sys.argv[1:6]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    stats = os.path.join(scratch, "smollm2.safetensors")
    subprocess.run([triattn, "calibrate", "--model", model, "--prompts",
                    os.path.join(source, "eval", "prompts", "calibration.txt"), "--answer-tokens", "64", "--out", stats],
                   check=True, stderr=subprocess.DEVNULL)
    other = os.path.join(scratch, "stories260k.safetensors")
    stories = os.path.join(source, "models", "stories260K")
    subprocess.run([triattn, "calibrate", "--model", os.path.join(stories, "stories260K.bin"), "--tokenizer",
                    os.path.join(stories, "tok512.bin"), "--text", os.path.join(source, "eval", "prompts",
                                                                               "calibration.txt"), "--out", other],
                   check=True, stderr=subprocess.DEVNULL)

    # Bad flags: one line naming the flag and its value, no server.
    start_up_fails(server, model, ["--kv-policy", "nope", "--kv-budget", "256"], "unknown policy 'nope'", scratch)
    start_up_fails(server, model, ["--kv-policy", "streaming_llm", "--kv-budget", "0"], "--kv-budget 0", scratch)
    start_up_fails(server, model, ["--kv-policy", "triattention", "--kv-budget", "256", "--kv-stats", other],
                   "--kv-stats " + other, scratch)
    start_up_fails(server, model, ["--kv-policy", "triattention", "--kv-budget", "256"], "needs --kv-stats", scratch)
    start_up_fails(server, model, ["--kv-policy", "streaming_llm", "--kv-budget", "500"], "do not fit", scratch)

    srv = llama_server.running_server(server, ["-m", model, "-c", str(2 * CELLS_PER_SLOT), "--parallel", "2", "-t", "1",
                                               "-fa", "on", "--kv-policy", "triattention", "--kv-budget", str(BUDGET),
                                               "--kv-slack", str(SLACK), "--kv-stats", stats],
                                      os.path.join(scratch, "server.log"))
    try:
        with srv as port:
            try:
                serve(port)
            except SystemExit:
                print(srv.log_tail(), flush=True)
                raise
    except llama_server.server_error as e:
        fail(str(e))
    print("ok: the server stopped", flush=True)


def serve(port):
    status, slots = request(port, "/slots")
    if status != 200 or len(slots) != 2 or any(s["n_ctx"] != CELLS_PER_SLOT for s in slots):
        fail(f"/slots: {status} {slots}")

    prompts = ["Write a long story about a lighthouse keeper who finds a message in a bottle.",
               "Explain, step by step and at length, how a steam engine works."]
    results = [None, None]

    def ask(i):
        results[i] = request(port, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0.7, "seed": i + 1}, timeout=1800)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # The server's own report, polled while both answers run: the peak is the server's.
    seen_busy = 0
    while any(t.is_alive() for t in threads):
        status, slots = request(port, "/slots")
        if status != 200:
            fail(f"/slots during generation: {status} {slots}")
        for s in slots:
            kv = s.get("kv_cache")
            if kv is not None and kv["cells"] > BUDGET + SLACK + 1:
                fail(f"slot {s['id']} holds {kv['cells']} cells > {BUDGET + SLACK + 1}")
        seen_busy = max(seen_busy, sum(1 for s in slots if s["is_processing"]))
        time.sleep(0.25)
    for t in threads:
        t.join()
    if seen_busy < 2:
        fail("the two requests never ran at the same time")

    for i, (status, body) in enumerate(results):
        if status != 200:
            fail(f"request {i}: HTTP {status} {body}")
        choice = body["choices"][0]
        text = choice["message"]["content"]
        usage = body["usage"]
        if not isinstance(text, str) or not text.strip() or choice["finish_reason"] != "length" or \
                usage["completion_tokens"] != TOKENS:
            fail(f"request {i}: finish {choice['finish_reason']}, {usage}, text {text[:200]!r}")
        print(f"ok: request {i}: {usage['completion_tokens']} tokens, {len(text)} characters, finish length", flush=True)

    status, slots = request(port, "/slots")
    for s in slots:
        kv = s["kv_cache"]
        if kv["peak_cells"] > BUDGET + SLACK + 1 or kv["rounds"] < 1 or kv["evicted"] < TOKENS - BUDGET - SLACK:
            fail(f"slot {s['id']}: {kv}")
        print(f"ok: slot {s['id']}: {kv}", flush=True)

    status, body = request(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": -5})
    if status != 400 or "max_tokens" not in json.dumps(body):
        fail(f"a bad max_tokens: HTTP {status} {body}")
    print(f"ok: a bad max_tokens -> HTTP {status}", flush=True)
    status, body = request(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 8, "ignore_eos": True})
    if status != 200 or body["usage"]["completion_tokens"] != 8:
        fail(f"the request after the bad one: HTTP {status} {body}")
    print("ok: the server answers the next request", flush=True)

    # A prompt more than twice a slot's cells: llama-server refuses it (HTTP 400, "exceeds the
    # available context size"); a held slot prefills it in batches that fit its free cells, a
    # round after each, and answers.
    before = {s["id"]: s["kv_cache"] for s in request(port, "/slots")[1]}
    text = " ".join(prompts) + " "
    status, body = request(port, "/completion", {"prompt": text * 40, "n_predict": 16, "ignore_eos": True,
                                                 "temperature": 0}, timeout=1800)
    if status != 200 or body["tokens_predicted"] != 16 or body["tokens_evaluated"] <= 2 * CELLS_PER_SLOT:
        fail(f"a prompt past the slot's cells: HTTP {status} {str(body)[:500]}")
    slot = body["id_slot"]
    kv = next(s["kv_cache"] for s in request(port, "/slots")[1] if s["id"] == slot)
    evicted = kv["evicted"] - before[slot]["evicted"]
    if kv["peak_cells"] > CELLS_PER_SLOT or kv["rounds"] - before[slot]["rounds"] < 3 or \
            evicted < body["tokens_evaluated"] + 16 - CELLS_PER_SLOT or kv["cells"] > BUDGET + SLACK + 1:
        fail(f"a prompt of {body['tokens_evaluated']} tokens: slot {slot} {before[slot]} -> {kv}")
    print(f"ok: a prompt of {body['tokens_evaluated']} tokens in {CELLS_PER_SLOT} cells: slot {slot} {kv}, "
          f"{evicted} evicted", flush=True)


if __name__ == "__main__":
    main()
