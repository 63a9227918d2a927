#!/usr/bin/env python3
"""The library against PyTorch on the same shapes and machine, at the same thread count
(issue 14). Optional: prints a message and exits 0 when PyTorch is not installed.

  python3 bench/pytorch_compare.py --threads 1 TRIATTENTION_JSON ROUND_JSON

TRIATTENTION_JSON and ROUND_JSON are Google Benchmark JSON runs of triattn_bench_triattention
and triattn_bench_round (bench/cpu.sh writes both). Two measurements in PyTorch:

  fold    the TriAttention fold on 1 layer x 8 kv-heads x 4 q-heads x 128 dims x 32K tokens:
          the trig term as one batched product of the coefficients with the keys, the norm
          term as a second one with the band moduli (torch.hypot), added by baddbmm (the
          library's `score_post` of the same shape, f32 keys);
  snapkv  kvpress-style SnapKV on 36 layers x 8 kv-heads x 4 q-heads x 128 dims x 8K tokens,
          window 8, kernel 7: window queries against the keys repeated over the GQA group,
          causal mask in the window, fp32 softmax, mean over the window, max pooling, mean
          over the group, top-k (the library's `plan/snapkv`: scoring and selection).

Each PyTorch figure is the faster of keys held in f32 and in bf16 (cast to f32 for the
products); the median of 5 runs after a warm-up.
"""
import argparse
import json
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as fn
except ImportError:
    print("pytorch_compare: PyTorch is not installed (python3 -c 'import torch' failed): skipped")
    sys.exit(0)


def median_ms(f, runs=5):
    f()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def library_ms(path, name):
    run = json.load(open(path))
    for b in run["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("run_name", b["name"]).replace("/real_time", "") == name:
            unit = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b["time_unit"]]
            return b["real_time"] * unit
    raise SystemExit(f"pytorch_compare: {path} has no benchmark {name}")


def fold(dtype):
    kv, group, dim, tokens = 8, 4, 128, 32768
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(kv, tokens, dim, generator=g).to(dtype)
    q_mean = torch.randn(kv, group, dim // 2, dtype=torch.complex64, generator=g)
    inv_freq = 1e6 ** (-2.0 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    offsets = 2.0 ** torch.arange(17, dtype=torch.float64)
    phasor = torch.exp(1j * (40000 + offsets[:, None]) * inv_freq[None, :]).mean(0).to(torch.complex64)

    def run():
        c = q_mean * phasor  # [kv, group, F]
        trig = torch.cat([c.real, c.imag], -1)  # [kv, group, D]: Re(c conj K) = c_re K_re + c_im K_im
        e = (q_mean.abs() * 0.5).float()  # [kv, group, F]
        k = keys.float()
        modulus = torch.hypot(k[..., : dim // 2], k[..., dim // 2 :])  # [kv, tokens, F]
        return torch.baddbmm(torch.bmm(trig, k.transpose(1, 2)), e, modulus.transpose(1, 2))  # [kv, group, tokens]

    return median_ms(run)


def snapkv(dtype):
    layers, kv, group, dim, tokens, window, kernel, budget = 36, 8, 4, 128, 8192, 8, 7, 2048
    g = torch.Generator().manual_seed(2)
    keys = [torch.randn(kv, tokens, dim, generator=g).to(dtype) for _ in range(layers)]
    queries = [torch.randn(kv * group, window, dim, generator=g) for _ in range(layers)]
    mask = torch.full((window, window), float("-inf")).triu(1)

    def run():
        kept = []
        for l in range(layers):
            k = keys[l].float().repeat_interleave(group, dim=0)  # [q_heads, tokens, dim]
            logits = torch.matmul(queries[l], k.transpose(1, 2)) / dim**0.5  # [q_heads, window, tokens]
            logits[..., -window:] += mask
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            votes = probs[..., :-window].mean(dim=1)  # [q_heads, tokens - window]
            votes = fn.max_pool1d(votes[:, None, :], kernel, stride=1, padding=kernel // 2)[:, 0]
            votes = votes.view(kv, group, -1).mean(dim=1)
            kept.append(votes.topk(budget - window, dim=-1).indices)
        return kept

    return median_ms(run, runs=3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("triattention_json")
    ap.add_argument("round_json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} thread(s); BLAS/oneDNN: "
          f"{'mkldnn' if torch.backends.mkldnn.is_available() else 'no mkldnn'}")
    lib_fold = library_ms(a.triattention_json, "score_post/dtype:0")
    lib_snap = library_ms(a.round_json, f"plan/snapkv/threads:{a.threads}")
    t_fold = min(fold(torch.float32), fold(torch.bfloat16))
    t_snap = min(snapkv(torch.float32), snapkv(torch.bfloat16))
    print(f"  TriAttention fold: PyTorch {t_fold:8.1f} ms, triattn {lib_fold:8.1f} ms: triattn {t_fold / lib_fold:.1f}x faster")
    print(f"  SnapKV (window 8): PyTorch {t_snap:8.1f} ms, triattn {lib_snap:8.1f} ms: triattn {t_snap / lib_snap:.1f}x faster")


if __name__ == "__main__":
    main()
