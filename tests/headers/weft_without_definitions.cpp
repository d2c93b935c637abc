// Must not compile: <mpi.h> is on the include path (as under mpicxx) but WEFT_HAS_MPI is not
// defined, so <weft/weft.hpp> would silently leave out the MPI backend; the build stops with a
// message naming the WEFT_HAS_* definitions instead of "'mpi_environment' is not a member of 'weft'".
#include <weft/weft.hpp>

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  return 0;
}
