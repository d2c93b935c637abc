// Must not compile: std::string is not an element type; the static_assert lists the ones there are.
#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <string>
#include <vector>

int main() {
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  std::vector<std::string> names(3);
  world.all_reduce(names);
}
