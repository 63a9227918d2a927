#!/usr/bin/env bash
# The CPU benchmarks of issue 14 in one run: builds them (-march=native, Release), runs both
# (medians of 5 repetitions, interleaved in random order so that a machine that slows down
# slows every benchmark alike, 1 s each), prints the ratios docs/performance.md quotes, then the PyTorch
# comparison (skipped with a message when no python3 on PATH or /usr/bin has torch).
#
#   bench/cpu.sh [OUT_DIR]      # JSON runs land in OUT_DIR (default build/bench-cpu)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/bench-cpu}
mkdir -p "$out"
cmake -S "$root" -B "$root/build/bench-cpu-build" -DCMAKE_BUILD_TYPE=Release -DTRIATTN_BUILD_TESTS=OFF \
  -DTRIATTN_BUILD_EXAMPLES=OFF -DTRIATTN_BUILD_TOOLS=OFF -DTRIATTN_ENABLE_CUDA=OFF -DTRIATTN_BENCH_NATIVE=ON >/dev/null
cmake --build "$root/build/bench-cpu-build" -j 2 --target triattn_bench_triattention triattn_bench_round >/dev/null
for b in triattention round; do
  "$root/build/bench-cpu-build/bench/triattn_bench_$b" --benchmark_repetitions=5 --benchmark_min_time=1 \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json >&2
done
py=python3
for p in python3 /usr/bin/python3; do
  if "$p" -c 'import torch' 2>/dev/null; then py=$p; break; fi
done
echo "$(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(nproc) CPUs; $(grep -q -w avx512f /proc/cpuinfo && echo AVX-512 || echo no AVX-512)"
python3 "$root/bench/cpu_ratios.py" "$out/triattention.json" "$out/round.json"
echo
# One thread each: the library's `triattention::score` (what the fold is compared with) runs on one.
"$py" "$root/bench/pytorch_compare.py" --threads 1 "$out/triattention.json" "$out/round.json"
