// Must not compile: the NCCL backend in a program linked to weft's core alone (no NCCL in the build).
#include <weft/backend/nccl/backend.hpp>

int main() { return 0; }
