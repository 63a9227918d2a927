# Runs the demo as README's Quick start does, and fails unless it exits 0 and prints its
# table (a `full` and a `triattention` row) after calibrating on text the model sampled.
#   cmake -DDEMO=<triattn_demo> -P run_demo.cmake
# CTest runs it with TRIATTN_DATA_DIR unset: the demo needs nothing outside the repository.
if(DEFINED ENV{TRIATTN_DATA_DIR})
  message(FATAL_ERROR "TRIATTN_DATA_DIR is set in the environment; this test runs the demo without it")
endif()
execute_process(COMMAND "${DEMO}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "${DEMO} exited with ${rc}")
endif()
foreach(pattern
    "\ncalibrating TriAttention on 20 windows of 512 tokens that the model samples from BOS\n"
    "\nfull +[0-9]+ +[0-9.]+ KiB +[0-9.]+ KiB +0\\.0% +0 +0\\.00000 "
    "\ntriattention +[0-9]+ +[0-9.]+ KiB +[0-9.]+ KiB +[0-9.]+% +[1-9][0-9]* +[0-9]\\.[0-9]+ ")
  if(NOT out MATCHES "${pattern}")
    message(FATAL_ERROR "the demo's output has no line matching \"${pattern}\"")
  endif()
endforeach()
