#pragma once
/// \file
/// Which optional backends this build has. The CMake targets define these (weft::mpi sets
/// WEFT_HAS_MPI=1, weft::nccl sets WEFT_HAS_NCCL=1 and WEFT_HAS_CUDA=1); a plain include
/// without them gets the core alone. Always test with `#if WEFT_HAS_X` (safe under -Wundef).

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
