# The cache folder and the compiler cache, for triattn's own build (top level only).
#
# Defines:
#   triattn_cache_dir         the folder the fetch scripts fill (scripts/fetch_common.sh):
#                             $TRIATTN_CACHE_DIR, else $XDG_CACHE_HOME/triattn, else
#                             ~/.cache/triattn; never inside the clone.
#   TRIATTN_CCACHE (option)   compile C, C++ and CUDA through ccache when it is installed, with
#                             its cache in ${triattn_cache_dir}/ccache.
#
# Why: CI builds everything from a clean clone on every run, and llama.cpp with its patched
# llama-server is most of that build. ccache's key is the one a reused build must have: the
# preprocessed source (so the llama.cpp release and patches/llama.cpp, whose patched tree
# is itself named by the patches' sha256), the compiler (its size and mtime) and every flag.
# A launcher the user sets (-DCMAKE_CXX_COMPILER_LAUNCHER=...) wins.

if(DEFINED ENV{TRIATTN_CACHE_DIR})
  set(triattn_cache_dir "$ENV{TRIATTN_CACHE_DIR}")
elseif(DEFINED ENV{XDG_CACHE_HOME})
  set(triattn_cache_dir "$ENV{XDG_CACHE_HOME}/triattn")
else()
  set(triattn_cache_dir "$ENV{HOME}/.cache/triattn")
endif()

option(TRIATTN_CCACHE "Compile through ccache when it is installed (its cache: <cache folder>/ccache)" ON)
find_program(TRIATTN_CCACHE_PROGRAM ccache)
if(TRIATTN_CCACHE AND TRIATTN_CCACHE_PROGRAM)
  # Each CI run clones to a new folder: paths under the source folder are hashed relative to
  # it (base_dir), and the working folder is left out of the key (hash_dir), so a new clone
  # hits the old one's objects. The cost: a hit's debug info may name the first clone's paths.
  # Through `cmake -E env`: Debian's ccache 4.7 takes no settings on its command line.
  set(_triattn_launcher "${CMAKE_COMMAND}" -E env "CCACHE_DIR=${triattn_cache_dir}/ccache"
                        "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}" CCACHE_NOHASHDIR=true "${TRIATTN_CCACHE_PROGRAM}")
  foreach(_lang C CXX CUDA)
    if(NOT DEFINED CMAKE_${_lang}_COMPILER_LAUNCHER)
      set(CMAKE_${_lang}_COMPILER_LAUNCHER ${_triattn_launcher})
    endif()
  endforeach()
  message(STATUS "triattn: compiling through ${TRIATTN_CCACHE_PROGRAM} (cache: ${triattn_cache_dir}/ccache)")
endif()
