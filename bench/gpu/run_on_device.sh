#!/usr/bin/env bash
# Builds the CUDA path, runs the cuda tests and benchmarks a TriAttention round, in one call.
# Needs only nvcc, CMake and a C++ compiler: no Eigen, Catch2, Google Benchmark or network
# (the CPU-only parts of the project are switched off). Under 5 minutes on one GPU.
#   bench/gpu/run_on_device.sh [build dir (build/gpu)]
# CUDA_ARCH (default 90) picks the architecture; the output also goes to <build dir>/gpu_run.txt.
# Warnings stay on but are not errors here: CI holds that line, and another host compiler
# must not stop the one run a GPU machine gives.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/gpu}
arch=${CUDA_ARCH:-90}
mkdir -p "$build"
log="$build/gpu_run.txt"
exec > >(tee "$log") 2>&1

echo "== $(date -u +%Y-%m-%dT%H:%MZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
nvcc --version | tail -1

start=$SECONDS
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DTRIATTN_ENABLE_CUDA=ON -DTRIATTN_BUILD_CUDA_TESTS=ON -DTRIATTN_BUILD_CUDA_BENCH=ON \
  -DTRIATTN_BUILD_TESTS=OFF -DTRIATTN_BUILD_EXAMPLES=OFF -DTRIATTN_BUILD_TOOLS=OFF -DTRIATTN_BUILD_BENCH=OFF \
  -DTRIATTN_WARNINGS_AS_ERRORS=OFF \
  >/dev/null || exit 1
cmake --build "$build" -j "$(nproc)" || exit 1
echo "== built in $((SECONDS - start)) s"

ctest --test-dir "$build" -L cuda --output-on-failure
tests=$?
echo "== cuda tests: exit $tests, $((SECONDS - start)) s so far"

"$build/bench/gpu/triattn_bench_gpu"
bench=$?
echo "== benchmark: exit $bench, $((SECONDS - start)) s in all"
exit $((tests != 0 || bench != 0))
