# Helpers for weft's own tests, examples and benchmarks.
#
#   weft_add_executable(name SOURCES ... [LIBS ...])        an executable with weft's warning flags
#   weft_add_unit_test(name SOURCES ... [LIBS ...] [LABELS ...] [TIMEOUT s])
#       a single-process Catch2 test, registered as `name`
#   weft_add_mpi_test(name SOURCES ... RANKS 2 4 8 [LIBS ...] [LABELS ...] [TIMEOUT s])
#       a multi-rank Catch2 test, registered once per rank count as `name.np<N>`, run through
#       mpiexec --oversubscribe under a timeout so a hang is a failure, never a stuck run.

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

function(weft_add_executable name)
  cmake_parse_arguments(arg "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE weft_warnings ${arg_LIBS})
  # Command-line pieces shared by the programs (examples/common), not part of the library.
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/examples/common)
endfunction()

function(weft_add_unit_test name)
  cmake_parse_arguments(arg "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 120)
  endif()
  weft_add_executable(${name} SOURCES ${arg_SOURCES} LIBS weft_catch_main ${arg_LIBS})
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${arg_TIMEOUT} LABELS "unit;${arg_LABELS}")
endfunction()

function(weft_add_mpi_test name)
  cmake_parse_arguments(arg "" "TIMEOUT" "SOURCES;LIBS;LABELS;RANKS;ARGS" ${ARGN})
  if(NOT TARGET weft_catch_mpi_main)
    message(FATAL_ERROR "weft_add_mpi_test(${name}) needs the MPI backend")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 120)
  endif()
  if(NOT arg_RANKS)
    set(arg_RANKS 2 4)
  endif()
  weft_add_executable(${name} SOURCES ${arg_SOURCES} LIBS weft_catch_mpi_main ${arg_LIBS})
  foreach(np IN LISTS arg_RANKS)
    add_test(NAME ${name}.np${np}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe --bind-to none
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS} ${arg_ARGS})
    set_tests_properties(${name}.np${np} PROPERTIES
      TIMEOUT ${arg_TIMEOUT}
      PROCESSORS 2
      LABELS "mpi;np${np};${arg_LABELS}"
      ENVIRONMENT "${WEFT_MPI_TEST_ENVIRONMENT}")
  endforeach()
endfunction()
