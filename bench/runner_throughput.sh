#!/usr/bin/env bash
# Runner throughput beside llama.cpp (bench/RESULTS.md, "Runner throughput on
# SmolLM2-135M-Instruct (CPU)"): configures the default preset (llama.cpp and the benchmarks
# are in it), builds only the benchmark, runs it. Arguments go to the program:
# [model.gguf] [steps] [reps].
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/default
cmake --preset default >/dev/null
cmake --build "$build" --target triattn_bench_runner_throughput -j "${JOBS:-2}"
lscpu | grep 'Model name' || true
echo "vCPUs: $(nproc)"
exec "$build/bench/triattn_bench_runner_throughput" "$@"
