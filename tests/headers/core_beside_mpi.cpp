// Must compile and run: a program that links weft::core alone (weft's planning, no backend) while
// <mpi.h> is on its include path for MPI code of its own, as on a system whose MPI sits on the
// default include path. weft's targets say the definitions come from them (WEFT_CONFIGURED), so
// weft/config.hpp does not take this for a bare mpicxx build.
#include <weft/layout/layout.hpp>
#include <weft/weft.hpp>

#include <cstdio>

#if WEFT_HAS_MPI
#error "weft::core alone must not define WEFT_HAS_MPI"
#endif

int main() {
  const weft::layout::rank_layout layout({.world_size = 4, .tp = 2});
  std::printf("core beside MPI: tp %d x dp %d\n", layout.tp(), layout.dp());
  return layout.tp() == 2 && layout.dp() == 2 ? 0 : 1;
}
