#pragma once
/// \file
/// The one choke point for MPI calls: `WEFT_CHECK_MPI(MPI_Xxx(...))` throws weft::backend_error
/// with MPI's own error string, the call's text, the source location, the rank and the host.
/// weft's communicators use MPI_ERRORS_RETURN so that failures reach this check.

#include <mpi.h>

#include <cstdio>
#include <source_location>
#include <string>

#include <weft/core/error.hpp>

namespace weft::detail {

[[noreturn]] inline void throw_mpi_error(int code, const char* call, std::source_location location) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) std::snprintf(text, sizeof(text), "unknown MPI error");
  throw backend_error(backend_library::mpi, code, std::string(text, static_cast<std::size_t>(length)), call, location);
}

inline void check_mpi(int code, const char* call, std::source_location location = std::source_location::current()) {
  if (code != MPI_SUCCESS) [[unlikely]]
    throw_mpi_error(code, call, location);
}

}  // namespace weft::detail

namespace weft::detail::mpi {

/// weft's communicators need MPI running: before MPI_Init an MPI call aborts the process inside
/// MPI ("called before MPI_INIT"), so `what` (the call that needs MPI) throws weft::error instead.
inline void expect_initialized(const char* what) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) [[likely]]
    return;
  weft::fail(std::string(what) + (finalized ? " was called after MPI_Finalize" : " was called before MPI was initialised") +
       ". Keep a weft::mpi_environment (weft/launch/mpi_environment.hpp) alive for as long as weft's MPI "
       "communicators are used: `weft::mpi_environment env(weft::mpi_init_mode::init_if_needed, &argc, &argv);` "
       "first thing in main() initialises MPI (with MPI_THREAD_MULTIPLE) and finalizes it at the end of the "
       "scope; a program that owns MPI calls MPI_Init_thread itself first");
}

}  // namespace weft::detail::mpi

#define WEFT_CHECK_MPI(call) ::weft::detail::check_mpi((call), #call, std::source_location::current())
