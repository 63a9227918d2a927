#!/usr/bin/env python3
"""Prints the ratios README quotes from one Google Benchmark JSON run (standard library only):

  build/default/bench/triattn_bench_triattention --benchmark_repetitions=3 \\
      --benchmark_format=json | python3 bench/summarize.py

With repetitions, the median of each benchmark is used."""
import json
import sys

run = json.load(sys.stdin)
times = {}
for b in run["benchmarks"]:
    name = b["name"].split("/")[0]
    if b.get("run_type") == "aggregate":
        if b.get("aggregate_name") == "median":
            times[name] = b["real_time"]
    else:
        times.setdefault(name, b["real_time"])
ctx = run["context"]
print(f"{ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, {ctx.get('date')}")
for name, t in times.items():
    print(f"  {name:12s} {t:10.2f} ms")
if {"plain_read", "folded", "per_offset"} <= times.keys():
    print(f"  folded is {times['per_offset'] / times['folded']:.1f}x faster than per_offset")
    print(f"  folded takes {times['folded'] / times['plain_read']:.2f}x the time of a plain read of the keys")
