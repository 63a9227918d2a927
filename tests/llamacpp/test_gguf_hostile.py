"""Hostile GGUF files through every program that loads one (issue 40): `triattn_eval tokenize`,
`triattn_eval logits`, `triattn calibrate` and the patched llama-server.

    python3 test_gguf_hostile.py MODEL.gguf WORK_DIR --eval BIN --cli BIN [--server BIN]

Each mutant of gguf_mutants.py, made from the real model, must get from each tool exit code 2
and exactly one line on stderr that names the file, within 60 s and under 1 GB of memory; the
server must refuse it at start-up (an exit with an error, not a signal, and never a /health that
answers). The valid model must still work: tokenizing it peaks under 300 MB, and each tool and
the server accept it. Prints one line a failure; exits 1 if any.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_mutants  # noqa: E402

TIME_LIMIT_S, MEMORY_LIMIT_MB, TOKENIZE_LIMIT_MB = 60, 1024, 300
# What the one line must say, beside the file's name, where the cause has one name.
EXPECT = {
    "bad_magic": "not a GGUF file", "empty": "not a GGUF file", "version_99": "not a valid GGUF file",
    "block_count_minus_1": "block_count", "block_count_plus_1": "block_count", "block_count_0": "block_count",
    "rms_eps_nan": "layer_norm_rms_epsilon", "rope_base_nan": "freq_base", "vocab_size_1000": "vocab_size",
    "tokens_minus_1": "tokenizer.ggml.tokens", "tokens_plus_8": "tokenizer.ggml.tokens",
    "tokens_empty": "tokenizer.ggml.tokens", "tokens_duplicate": "same text", "chat_template_16mb": "chat_template", "embd_swapped": "token_embd.weight",
    "ffn_gate_swapped": "blk.0.ffn_gate.weight", "attn_k_swapped": "blk.0.attn_k.weight",
    "truncated_last_byte": "truncated", "tokenizer_none": "tokenizer.ggml.model", "tokenizer_llama_on_bpe": "scores",
    "token_type_99": "token_type", "bos_id_huge": "bos_token_id", "eos_ids_outside": "eos_token_ids", "expert_count_huge": "expert_count",
    "expert_used_above_count": "expert_used_count", "rope_scaling_unknown": "rope.scaling.type",
}


def tool_cases(a, work):
    text = os.path.join(work, "text.txt")
    with open(text, "w") as f:
        f.write("Once upon a time, a small robot learned to count the stars over the quiet sea.\n")
    tokens = os.path.join(work, "tokens.npy")
    return {
        "tokenize": lambda m: [a.eval, "tokenize", "--model", m, "--text", text, "--out", os.path.join(work, "t.npy")],
        "logits": lambda m: [a.eval, "logits", "--model", m, "--tokens", tokens, "--out", os.path.join(work, "l.npy")],
        "calibrate": lambda m: [a.cli, "calibrate", "--model", m, "--text", text, "--windows", "1", "--window-tokens", "16",
                                "--out", os.path.join(work, "s.safetensors")],
    }, tokens


def measured(cmd):
    """run() in a fresh Python child, so that RUSAGE_CHILDREN is the one tool's peak."""
    probe = ("import resource, subprocess, sys, time\n"
             "t = time.monotonic()\n"
             "p = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=float(sys.argv[1]))\n"
             "sys.stdout.write(f'{p.returncode} {time.monotonic() - t:.2f} "
             "{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}\\n')\n"
             "sys.stdout.flush()\n"
             "sys.stderr.buffer.write(p.stderr)\n")
    try:
        p = subprocess.run([sys.executable, "-c", probe, str(TIME_LIMIT_S)] + cmd, capture_output=True,
                           timeout=TIME_LIMIT_S + 10)
    except subprocess.TimeoutExpired:
        return None, b"", TIME_LIMIT_S, 0
    if p.returncode != 0:  # the probe itself: the tool ran past the limit
        return None, b"", TIME_LIMIT_S, 0
    rc, seconds, mb = p.stdout.decode().split()
    return int(rc), p.stderr, float(seconds), float(mb)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_outcome(server, model, log_path):
    """'refused' (exited with an error), 'signal N', 'served' (answered /health) or 'hung'."""
    port = free_port()
    with open(log_path, "wb") as log:
        p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                              "--parallel", "1", "-t", "1"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIME_LIMIT_S
    try:
        while time.monotonic() < deadline:
            rc = p.poll()
            if rc is not None:
                return "refused" if rc > 0 else f"signal {-rc}" if rc < 0 else "exited 0"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return "served"
            except OSError:
                pass
            time.sleep(0.25)
        return "hung"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("work")
    ap.add_argument("--eval", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--server", default="")
    ap.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    cases, tokens = tool_cases(a, a.work)
    failures = []

    # The valid model first: every tool accepts it, tokenizing stays small.
    rc, err, _, mb = measured(cases["tokenize"](a.model))
    if rc != 0:
        failures.append(f"valid model: tokenize exit {rc}: {err.decode(errors='replace').strip()[:300]}")
    elif mb > TOKENIZE_LIMIT_MB:
        failures.append(f"valid model: tokenize peaked at {mb:.0f} MB (limit {TOKENIZE_LIMIT_MB})")
    else:
        print(f"ok valid model: tokenize peaked at {mb:.0f} MB")
    if rc == 0:
        os.replace(os.path.join(a.work, "t.npy"), tokens)
        for tool in ("logits", "calibrate"):
            rc, err, _, _ = measured(cases[tool](a.model))
            if rc != 0:
                failures.append(f"valid model: {tool} exit {rc}: {err.decode(errors='replace').strip()[:300]}")
    if a.server:
        outcome = server_outcome(a.server, a.model, os.path.join(a.work, "server-valid.log"))
        if outcome != "served":
            failures.append(f"valid model: the server {outcome}")

    only = set(filter(None, a.only.split(",")))
    n_mutants = 0
    for name, what, path in gguf_mutants.write_each(a.model, os.path.join(a.work, "mutants"), only):
        n_mutants += 1
        expect = EXPECT.get(name, "")
        for tool, make in cases.items():
            rc, err, seconds, mb = measured(make(path))
            lines = err.decode(errors="replace").strip().splitlines()
            problem = None
            if rc is None:
                problem = f"ran past {TIME_LIMIT_S} s"
            elif rc != 2:
                problem = f"exit {rc}"
            elif len(lines) != 1:
                problem = f"{len(lines)} lines on stderr"
            elif path not in lines[0]:
                problem = "the line does not name the file"
            elif expect not in lines[0]:
                problem = f"the line does not say '{expect}'"
            elif mb > MEMORY_LIMIT_MB:
                problem = f"peaked at {mb:.0f} MB"
            if problem:
                failures.append(f"{name} ({what}): {tool}: {problem}: {' | '.join(lines)[:400]}")
            else:
                print(f"ok {name}: {tool}: {lines[0][:160]} ({seconds:.1f} s, {mb:.0f} MB)")
        if a.server:
            outcome = server_outcome(a.server, path, os.path.join(a.work, f"server-{name}.log"))
            if outcome != "refused":
                failures.append(f"{name} ({what}): the server {outcome}")
        os.remove(path)
    for f in failures:
        print("FAIL " + f)
    print(f"test_gguf_hostile: {n_mutants} mutants x {len(cases) + bool(a.server)} programs, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
