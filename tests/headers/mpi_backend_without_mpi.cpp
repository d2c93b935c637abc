// Must not compile: the MPI backend in a program linked to weft's core alone (no MPI in the build).
#include <weft/backend/mpi/backend.hpp>

int main() { return 0; }
