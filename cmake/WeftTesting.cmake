# Helpers for weft's own tests, examples and benchmarks.
#
#   weft_add_executable(name SOURCES ... [LIBS ...])        an executable with weft's warning flags
#   weft_add_unit_test(name SOURCES ... [PROGRAM p] [LIBS ...] [LABELS ...] [TIMEOUT s])
#       a single-process Catch2 test, registered as `name`
#   weft_add_mpi_test(name SOURCES ... [PROGRAM p] RANKS 2 4 8 [SANITIZE_RANKS n] [LIBS ...] [LABELS ...] [TIMEOUT s])
#       a multi-rank Catch2 test, registered once per rank count as `name.np<N>`, run through
#       mpiexec --oversubscribe under a timeout so a hang is a failure, never a stuck run.
#       Each entry claims as many of CTest's processors as it has ranks (`ctest --parallel`).
#       The ASan + UBSan run (scripts/sanitize.sh) runs one rank count of the program,
#       SANITIZE_RANKS (default: the largest count up to 4, which runs every case that needs
#       several groups); the other counts are labelled `extra_ranks` and run in the main build only.
#   PROGRAM: the tests naming the same program are built into it as one translation unit, and
#       each runs only its own files' test cases (weft_test_program, below); without it a test
#       is a program of its own.

# The environment every multi-rank run needs on a developer machine or CI: root is allowed,
# more ranks than cores, and all traffic stays on loopback.
set(WEFT_MPI_TEST_ENVIRONMENT
  OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1
  OMPI_MCA_oob_tcp_if_include=lo
  OMPI_MCA_btl_tcp_if_include=lo
  NCCL_SOCKET_IFNAME=lo)

# The Python the tests' checker scripts run under (standard library only): the system's, which
# CI and users have, else whatever CMake finds.
if(EXISTS /usr/bin/python3)
  set(WEFT_TEST_PYTHON /usr/bin/python3)
else()
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  set(WEFT_TEST_PYTHON ${Python3_EXECUTABLE})
endif()

# Tests run tiny models, and -O3's code generation was most of their compile time (test_collectives.cpp:
# 42 s of CPU at -O3, 24 s at -O1, 38 s at -O2), so the programs under tests/ and the docs' snippets
# (run as tests, read rather than timed) are built at WEFT_TEST_OPTIMIZATION in a Release build. The examples and benchmarks that users run keep -O3; the
# sanitizer trees set their own level (scripts/sanitize.sh).
set(WEFT_TEST_OPTIMIZATION "-O1" CACHE STRING
  "Optimization flag for weft's tests (programs under tests/ and examples/snippets) in a Release build; e.g. -O3 to build them as the examples")

# The test programs' optimization (and the precompiled header's, which must be built with the same
# flags as the files that use it).
function(weft_use_test_optimization target)
  target_compile_options(${target} PRIVATE
    $<$<AND:$<CONFIG:Release>,$<COMPILE_LANGUAGE:CXX>>:${WEFT_TEST_OPTIMIZATION}>)
endfunction()

# nvcc as a CMake language for weft's own .cu programs, where a working nvcc is found: afterwards
# CMAKE_CUDA_COMPILER is set exactly when it is. A macro, since enable_language must run at a
# directory's scope; each caller's directory keeps the language to itself.
macro(weft_enable_cuda_language)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    # CMake 3.25 knows no C++20 flag for nvcc.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
    enable_language(CUDA)
  endif()
endmacro()

function(weft_add_executable name)
  cmake_parse_arguments(arg "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE weft_warnings ${arg_LIBS})
  # Command-line pieces shared by the programs (examples/common), not part of the library.
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/examples/common)
  file(RELATIVE_PATH caller "${PROJECT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
  if(caller STREQUAL "tests" OR caller MATCHES "^tests/" OR caller STREQUAL "examples/snippets")
    weft_use_test_optimization(${name})
  endif()
endfunction()

# The Catch2 tests share one precompiled header (Catch2's single header, <mpi.h> and the standard
# headers most tests include: about 2 s of each file's compile time), built once in tests/ as
# weft_test_pch; never for CUDA sources, never for the installed targets. Only in a build without a
# compiler launcher (CI's): ccache caches a file that uses a precompiled header only with extra
# sloppiness, and GCC writes a different .gch each time, so every test would miss the cache in each
# new tree; there the cache saves more than the header would.
if(NOT DEFINED WEFT_TEST_PCH)
  if(CMAKE_CXX_COMPILER_LAUNCHER)
    set(WEFT_TEST_PCH OFF)
  else()
    set(WEFT_TEST_PCH ON)
  endif()
endif()

function(weft_use_test_pch name sources)
  if(WEFT_TEST_PCH AND TARGET weft_test_pch AND NOT sources MATCHES "\\.cu(;|$)")
    target_precompile_headers(${name} REUSE_FROM weft_test_pch)
  endif()
endfunction()

# weft_test_program(test program runner sources libs out_args): the Catch2 program `program` with
# the test's sources. Tests of one folder share a program (PROGRAM): each test's files are compiled as
# one translation unit with the others' (a unity build), since most of a test file's compile time
# is instantiating the same headers (the six tests/fsdp files: 201 s of CPU apart, 68 s together,
# under ASan + UBSan). Each test then runs its own files' cases, selected by file name
# (Catch2's `-#`: a file's cases carry the tag `#<file name without extension>`); `--warn NoTests`
# fails a test whose selection runs nothing. Sets out_args to those arguments (none for a test
# with a program of its own).
function(weft_test_program test program runner sources libs out_args)
  if(NOT TARGET ${program})
    weft_add_executable(${program} SOURCES ${sources} LIBS ${runner} ${libs})
    set_target_properties(${program} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0
                                                WEFT_TEST_RUNNER ${runner})
    weft_use_test_pch(${program} "${sources}")
  else()
    get_target_property(program_runner ${program} WEFT_TEST_RUNNER)
    if(NOT program_runner STREQUAL runner)
      message(FATAL_ERROR "test program ${program} mixes single-process and multi-rank tests (${runner})")
    endif()
    target_sources(${program} PRIVATE ${sources})
    target_link_libraries(${program} PRIVATE ${libs})
  endif()
  set(${out_args} "" PARENT_SCOPE)
  if(program STREQUAL test)  # a program of its own runs whole
    return()
  endif()
  set(files "")
  foreach(source IN LISTS sources)
    get_filename_component(stem ${source} NAME_WE)
    list(APPEND files "[#${stem}]")
  endforeach()
  list(JOIN files "," spec)
  set(${out_args} "-#" --warn NoTests "${spec}" PARENT_SCOPE)
endfunction()

function(weft_add_unit_test name)
  cmake_parse_arguments(arg "" "TIMEOUT;PROGRAM" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 120)
  endif()
  if(NOT arg_PROGRAM)
    set(arg_PROGRAM ${name})
  endif()
  weft_test_program(${name} ${arg_PROGRAM} weft_catch_main "${arg_SOURCES}" "${arg_LIBS}" select)
  add_test(NAME ${name} COMMAND ${arg_PROGRAM} ${select})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${arg_TIMEOUT} LABELS "unit;${arg_LABELS}")
endfunction()

# weft_sanitize_ranks(out "RANKS" "CHOSEN"): the one rank count of a multi-rank test that the
# ASan + UBSan run runs: CHOSEN if given (it must be one of RANKS), else the largest count up to 4
# (else the smallest). Under ASan a rank count costs far more than in the main build (test_collectives
# at 4 ranks: 78 s against 4 s), and the main build runs every count.
function(weft_sanitize_ranks out ranks chosen)
  if(chosen)
    if(NOT chosen IN_LIST ranks)
      message(FATAL_ERROR "SANITIZE_RANKS ${chosen} is not one of the rank counts (${ranks})")
    endif()
    set(${out} ${chosen} PARENT_SCOPE)
    return()
  endif()
  set(best "")
  foreach(np IN LISTS ranks)
    if(np LESS_EQUAL 4 AND (best STREQUAL "" OR np GREATER best))
      set(best ${np})
    endif()
  endforeach()
  if(best STREQUAL "")
    list(SORT ranks COMPARE NATURAL)
    list(GET ranks 0 best)
  endif()
  set(${out} ${best} PARENT_SCOPE)
endfunction()

function(weft_add_mpi_test name)
  cmake_parse_arguments(arg "" "TIMEOUT;SANITIZE_RANKS;PROGRAM" "SOURCES;LIBS;LABELS;RANKS;ARGS" ${ARGN})
  if(NOT TARGET weft_catch_mpi_main)
    message(FATAL_ERROR "weft_add_mpi_test(${name}) needs the MPI backend")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 120)
  endif()
  if(NOT arg_RANKS)
    set(arg_RANKS 2 4)
  endif()
  if(NOT arg_PROGRAM)
    set(arg_PROGRAM ${name})
  endif()
  weft_test_program(${name} ${arg_PROGRAM} weft_catch_mpi_main "${arg_SOURCES}" "${arg_LIBS}" select)
  weft_sanitize_ranks(sanitize_np "${arg_RANKS}" "${arg_SANITIZE_RANKS}")
  foreach(np IN LISTS arg_RANKS)
    set(labels mpi np${np} ${arg_LABELS})
    if(NOT np EQUAL sanitize_np)
      list(APPEND labels extra_ranks)
    endif()
    add_test(NAME ${name}.np${np}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe --bind-to none
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${arg_PROGRAM}> ${MPIEXEC_POSTFLAGS} ${select} ${arg_ARGS})
    set_tests_properties(${name}.np${np} PROPERTIES
      TIMEOUT ${arg_TIMEOUT}
      PROCESSORS ${np}
      LABELS "${labels}"
      ENVIRONMENT "${WEFT_MPI_TEST_ENVIRONMENT}")
  endforeach()
endfunction()
