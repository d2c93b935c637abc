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

#define WEFT_CHECK_MPI(call) ::weft::detail::check_mpi((call), #call, std::source_location::current())
