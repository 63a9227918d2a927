"""Hostile HTTP requests and start-up flags against the patched llama-server (issue 40).

    python3 test_server_hostile.py LLAMA-SERVER MODEL.gguf WORK_DIR

The server of the issue (SmolLM2, -c 1024 --parallel 2, every slot held at 256 cells) must
answer every malformed request with a 4xx, never a 5xx, and keep serving; refuse saving and
restoring a held slot and slot ids outside its slots; end an answer that has no n_predict at
its position limit (--kv-max-positions) and refuse a longer prompt with a 400 naming it; free
the slot of a client that leaves during a long prefill within 5 s while another client polls
/slots; and hold every slot at budget + slack + one batch. Start-up refuses the flags a held
slot cannot honour. Prints one line a check; exits 1 if any failed.
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "eval"))
import llama_server  # noqa: E402

BUDGET, SLACK, MAX_POSITIONS = 256, 32, 400
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def raw(port, method, path, body=b"", timeout=120):
    """(status, text) of a request whose body is sent as it is."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        c.close()


def refused_at_start(server, model, args, work, name, says):
    """The server exits with an error (not a signal) within 60 s, its log saying `says`."""
    log = os.path.join(work, f"start-{name}.log")
    with open(log, "w") as f:
        p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(llama_server.free_port()),
                              "-t", "1"] + args, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
    text = open(log).read()
    check(rc is not None and rc > 0 and says in text,
          f"start-up refuses {name} ({' '.join(args)}): exit {rc}, log says '{says}': {says in text}")


def malformed_requests(port):
    long_prompt = "hello " * (MAX_POSITIONS + 50)
    cases = [
        ("a body that is not JSON", "POST", "/completion", b"{not json"),
        ("an empty body", "POST", "/completion", b""),
        ("/tokenize with a number as content", "POST", "/tokenize", json.dumps({"content": 5}).encode()),
        ("n_predict of the wrong type", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": "ten"}).encode()),
        ("n_probs 10^9", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": 2, "n_probs": 10**9}).encode()),
        ("id_slot 99 of 2", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": 2, "id_slot": 99}).encode()),
        ("messages that are not a list", "POST", "/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
        ("/slots/99 save", "POST", "/slots/99?action=save", json.dumps({"filename": "a.bin"}).encode()),
        ("/slots/-1 save", "POST", "/slots/-1?action=save", json.dumps({"filename": "a.bin"}).encode()),
        ("/slots/99 erase", "POST", "/slots/99?action=erase", b""),
        ("saving a held slot", "POST", "/slots/0?action=save", json.dumps({"filename": "a.bin"}).encode()),
        ("restoring a held slot", "POST", "/slots/0?action=restore", json.dumps({"filename": "a.bin"}).encode()),
        ("an unknown slot action", "POST", "/slots/0?action=bogus", b""),
        ("a grammar trigger of type 99 (the sampler aborted on it)", "POST", "/completion",
         json.dumps({"prompt": "hi", "n_predict": 3, "grammar": 'root ::= "a"', "grammar_lazy": True,
                     "grammar_triggers": [{"type": 99, "value": "x"}]}).encode()),
        ("tools whose function is a number", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": 5}]}).encode()),
        ("an unknown reasoning format", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "hi"}], "reasoning_format": "zzz"}).encode()),
        ("/detokenize with ids outside the vocabulary", "POST", "/detokenize",
         json.dumps({"tokens": [999999999, -5]}).encode()),
        ("/detokenize with 2^40", "POST", "/detokenize", json.dumps({"tokens": [1 << 40]}).encode()),
        ("a prompt token 2^40 (read as token 0 before)", "POST", "/completion",
         json.dumps({"prompt": [1 << 40], "n_predict": 2}).encode()),
        ("id_slot 2^40", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": 2, "id_slot": 1 << 40}).encode()),
        ("n_probs -2^40", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": 2, "n_probs": -(1 << 40)}).encode()),
        ("n_predict 2^63", "POST", "/completion", json.dumps({"prompt": "hi", "n_predict": 1 << 63}).encode()),
        (f"a prompt past --kv-max-positions {MAX_POSITIONS}", "POST", "/completion",
         json.dumps({"prompt": long_prompt, "n_predict": 4}).encode()),
    ]
    for name, method, path, body in cases:
        status, text = raw(port, method, path, body)
        check(400 <= status < 500, f"{name}: HTTP {status}: {text[:160]}")
        if "kv-max-positions" in name:
            check(f"--kv-max-positions {MAX_POSITIONS}" in text, f"{name}: the error names the limit")
        check(raw(port, "GET", "/health")[0] == 200, f"the server still serves after {name}")
    check(llama_server.request(port, "/slots/0?action=erase", {})[0] == 200, "erasing a held slot is allowed")
    # Valid values at the edges stay valid: seed -1 (random) and 2^32 - 1 of an unsigned field.
    for seed in (-1, 2**32 - 1):
        status, _ = llama_server.request(port, "/completion", {"prompt": "hi", "n_predict": 2, "seed": seed})
        check(status == 200, f"seed {seed} is served: HTTP {status}")


def bounded_answers(port):
    # No n_predict and the end token ignored: only the position limit ends it.
    status, r = llama_server.request(port, "/completion", {"prompt": "Once upon a time", "ignore_eos": True,
                                                           "temperature": 0}, timeout=600)
    t = r.get("timings", {}) if isinstance(r, dict) else {}
    positions = r.get("tokens_evaluated", 0) + r.get("tokens_predicted", 0) if isinstance(r, dict) else 0
    check(status == 200 and r.get("stop_type") == "limit" and positions <= MAX_POSITIONS,
          f"an answer with no n_predict stops at the position limit: HTTP {status}, stop_type {r.get('stop_type')}, "
          f"{positions} positions <= {MAX_POSITIONS}")
    check(0 < t.get("kv_peak_cells", 10**9) <= BUDGET + SLACK + 1 and t.get("kv_rounds", 0) >= 1,
          f"cells stay at budget + slack + 1 while decoding: peak {t.get('kv_peak_cells')}, "
          f"{t.get('kv_rounds')} rounds")
    status, props = llama_server.request(port, "/props")
    kv = props.get("kv_policy") if isinstance(props, dict) else None
    check(status == 200 and isinstance(kv, dict) and kv.get("max_positions") == MAX_POSITIONS
          and kv.get("budget") == BUDGET, f"/props reports the held slots: {kv}")


def slot_busy(port, slot):
    status, slots = llama_server.request(port, "/slots", timeout=10)
    return status == 200 and any(s.get("id") == slot and s.get("is_processing") for s in slots)


def disconnect_during_prefill(server, model, work):
    """A client that leaves during a long prefill, while another polls /slots a few times a
    second (upstream then never noticed): the slot is free within 5 s."""
    args = ["-m", model, "-c", "1024", "--parallel", "2", "-t", "2", "--kv-policy", "streaming_llm",
            "--kv-budget", str(BUDGET), "--kv-slack", str(SLACK)]
    with llama_server.running_server(server, args, os.path.join(work, "server-prefill.log")) as port:
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                try:
                    llama_server.request(port, "/slots", timeout=10)
                except OSError:
                    pass
                time.sleep(0.2)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            body = json.dumps({"prompt": "The quiet sea and the stars. " * 900, "n_predict": 8, "id_slot": 0}).encode()
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 30
            while not slot_busy(port, 0) and time.time() < deadline:
                time.sleep(0.2)
            busy = slot_busy(port, 0)
            time.sleep(2)
            still = slot_busy(port, 0)  # a long prefill: still busy two seconds on
            s.close()
            left = time.time()
            while slot_busy(port, 0) and time.time() - left < 10:
                time.sleep(0.2)
            freed_s = time.time() - left
            check(busy and still, f"the long prefill holds slot 0 (busy {busy}, 2 s on {still})")
            check(freed_s <= 5, f"a client that leaves mid-prefill frees its slot in {freed_s:.1f} s (<= 5)")
        finally:
            stop.set()
            poller.join()
        check(llama_server.request(port, "/completion", {"prompt": "hi", "n_predict": 4})[0] == 200,
              "the server serves after the client left")


def four_slots_by_default(server, model, work):
    """--kv-policy without --parallel: four slots of their own cells (not one unified pool, in
    which four concurrent answers all got HTTP 500), every answer served."""
    args = ["-m", model, "-c", "2048", "-t", "2", "--kv-policy", "streaming_llm", "--kv-budget", str(BUDGET),
            "--kv-slack", str(SLACK)]
    with llama_server.running_server(server, args, os.path.join(work, "server-default.log")) as port:
        results = [None] * 4

        def ask(i):
            results[i] = llama_server.request(port, "/completion", {"prompt": f"Story {i}: " + "the sea " * 150,
                                                                  "n_predict": 120, "ignore_eos": True})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = [r[0] for r in results]
        peaks = [r[1].get("timings", {}).get("kv_peak_cells") for r in results if r[0] == 200]
        check(statuses == [200] * 4, f"four concurrent answers with the default slots: HTTP {statuses}")
        check(all(p is not None and p <= 512 for p in peaks), f"each within its slot's 512 cells: peaks {peaks}")


def main(argv):
    server, model, work = argv
    os.makedirs(work, exist_ok=True)
    held = ["-c", "1024", "--parallel", "2"]
    policy = ["--kv-policy", "streaming_llm"]
    refused_at_start(server, model, ["-c", "256", "--parallel", "2"] + policy + ["--kv-budget", "256"], work,
                     "a budget larger than a slot", "do not fit a slot")
    refused_at_start(server, model, held + ["--kv-unified"] + policy + ["--kv-budget", "200"], work,
                     "a unified pool", "--kv-unified")
    refused_at_start(server, model, held + ["-md", model] + policy + ["--kv-budget", "200"], work,
                     "a draft model", "speculative decoding")
    refused_at_start(server, model, held + ["--kv-budget", "200"], work, "a budget without a policy",
                     "need --kv-policy")
    refused_at_start(server, model, held + policy + ["--kv-budget", "200", "--kv-max-positions", "-1"], work,
                     "negative max positions", "--kv-max-positions -1")

    args = ["-m", model, "-t", "2", "--kv-budget", str(BUDGET), "--kv-slack", str(SLACK), "--kv-max-positions",
            str(MAX_POSITIONS), "--slot-save-path", os.path.join(work, "slots") + os.sep] + held + policy
    os.makedirs(os.path.join(work, "slots"), exist_ok=True)
    with llama_server.running_server(server, args, os.path.join(work, "server.log")) as port:
        malformed_requests(port)
        bounded_answers(port)
    disconnect_during_prefill(server, model, work)
    four_slots_by_default(server, model, work)
    print(f"test_server_hostile: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
