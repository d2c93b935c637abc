#pragma once
/// \file
/// Which optional backends this build has. The CMake targets define these (weft::mpi sets
/// WEFT_HAS_MPI=1, weft::nccl sets WEFT_HAS_NCCL=1 and WEFT_HAS_CUDA=1); a plain include
/// without them gets the core alone, except that <mpi.h> on the include path with WEFT_HAS_MPI
/// undefined stops the build (say which: WEFT_HAS_MPI=1 or 0). Always test with `#if WEFT_HAS_X`
/// (safe under -Wundef).

// <mpi.h> on the include path (mpicxx, or MPI's flags by hand) with WEFT_HAS_MPI undefined is a
// build that meant to use MPI without CMake: without this stop, weft's MPI parts would silently
// vanish and the compiler would only say "'mpi_backend' is not a member of 'weft'". weft's CMake
// targets define WEFT_CONFIGURED, so a program that links weft::core alone on a system whose
// <mpi.h> sits on the default include path still gets the core without a word.
#if !defined(WEFT_HAS_MPI) && !defined(WEFT_CONFIGURED) && defined(__has_include)
#if __has_include(<mpi.h>)
#error "weft: <mpi.h> is available but WEFT_HAS_MPI is not defined, so weft's MPI backend (weft::mpi_backend, weft::mpi_environment) would be left out. With CMake, link weft::weft or weft::mpi, which define it. Without CMake, define what your build has: -DWEFT_HAS_MPI=1 -DOMPI_SKIP_MPICXX=1 for MPI (e.g. mpicxx -std=c++20 -DWEFT_HAS_MPI=1 -DOMPI_SKIP_MPICXX=1 -I weft/include), plus -DWEFT_HAS_NCCL=1 -DWEFT_HAS_CUDA=1 with CUDA and NCCL's flags for the NCCL backend; or -DWEFT_HAS_MPI=0 for weft's core alone."
#endif
#endif

#ifndef WEFT_HAS_MPI
#define WEFT_HAS_MPI 0
#endif
#ifndef WEFT_HAS_NCCL
#define WEFT_HAS_NCCL 0
#endif
#ifndef WEFT_HAS_CUDA
#define WEFT_HAS_CUDA 0
#endif

#define WEFT_VERSION_MAJOR 0
#define WEFT_VERSION_MINOR 1
#define WEFT_VERSION_PATCH 0
