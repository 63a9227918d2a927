#!/usr/bin/env python3
"""Prints the CPU ratios docs/performance.md and bench/RESULTS.md quote from one run of the two
CPU benchmarks (standard library only; bench/cpu.sh runs everything):

  python3 bench/cpu_ratios.py TRIATTENTION_JSON ROUND_JSON

With repetitions, the median of each benchmark is used. Every ratio divides two measurements
of the same run."""
import json
import sys


def load(path):
    run = json.load(open(path))
    times, counters = {}, {}
    for b in run["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        name = b.get("run_name", b["name"]).replace("_median", "").replace("/real_time", "")
        unit = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b["time_unit"]]
        times[name] = b["real_time"] * unit
        if "same_keep_sets" in b:
            counters[name] = b["same_keep_sets"]
    return run["context"], times, counters


def main():
    ctx, t, _ = load(sys.argv[1])
    _, r, same = load(sys.argv[2])
    print(f"{ctx.get('host_name')}: {ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, {ctx.get('date')}")
    print("\nTriAttention scorer, 1 layer x 8 kv-heads x 4 q-heads x 128 dims x 32K tokens, 1 thread")
    print("| dtype | stream read | plain read | score (post-RoPE) | / plain read | / stream read | ns per key | pre-RoPE / post-RoPE |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, name in enumerate(["f32", "f16", "bf16"]):
        sr, pr = t[f"stream_read/dtype:{i}"], t[f"plain_read/dtype:{i}"]
        post, pre = t[f"score_post/dtype:{i}"], t[f"score_pre/dtype:{i}"]
        print(f"| {name} | {sr:.2f} ms | {pr:.2f} ms | {post:.2f} ms | {post / pr:.2f}x | {post / sr:.2f}x "
              f"| {post * 1e6 / (8 * 32768):.1f} | {pre / post:.2f}x |")
    print("\nWhole rounds, 36 layers x 8 kv-heads x 4 q-heads x 128 dims x 8K tokens, bf16, budget 2048")
    print("| policy | threads | plan (score + select) | compact | round | round / read of K and V "
          "| compact / memcpy of the kept rows | compact / memcpy of as many bytes | round 1 thread / 2 threads "
          "| same keep sets at 1 and 2 threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    policies = list(dict.fromkeys(k.split("/")[1] for k in r if k.startswith("round/")))  # the bench's order
    for p in policies:
        for th in (1, 2):
            key = f"{p}/threads:{th}"
            if f"round/{key}" not in r:
                continue
            rd = r[f"round/{key}"]
            speed = r[f"round/{p}/threads:1"] / r[f"round/{p}/threads:2"] if f"round/{p}/threads:2" in r else float("nan")
            print(f"| {p} | {th} | {r[f'plan/{key}']:.1f} ms | {r[f'compact/{key}']:.1f} ms | {rd:.1f} ms "
                  f"| {rd / r[f'read_kv/threads:{th}']:.2f}x | {r[f'compact/{key}'] / r[f'memcpy_rows/threads:{th}']:.2f}x "
                  f"| {r[f'compact/{key}'] / r[f'memcpy_kept/threads:{th}']:.2f}x "
                  f"| {speed:.2f}x | {'yes' if same.get(f'plan/{key}') == 1 else 'NO'} |")
    print(f"\nread of K and V: {r['read_kv/threads:1']:.1f} ms (1 thread), {r['read_kv/threads:2']:.1f} ms (2 threads); "
          f"memcpy of the kept rows (TriAttention's plan, row by row): {r['memcpy_rows/threads:1']:.1f} ms, "
          f"{r['memcpy_rows/threads:2']:.1f} ms; of as many bytes from one block: {r['memcpy_kept/threads:1']:.1f} ms, "
          f"{r['memcpy_kept/threads:2']:.1f} ms; "
          f"select_keep over 8 decisions of 8K: {r['select']:.2f} ms")


if __name__ == "__main__":
    main()
