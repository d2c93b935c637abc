// A program a trainer might write against an installed or vendored weft: it must build and run
// with nothing but the package's own targets.
#include <weft/weft.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  weft::bfloat16 x(1.5f);
  if (float(x) != 1.5f) return 1;
#if WEFT_HAS_MPI
  weft::mpi_environment env(weft::mpi_init_mode::init_and_finalize, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  std::vector<int> one{1};
  world.all_reduce(one);
  if (one[0] != world.size()) return 2;
  // The data-parallel synchronizer, as a trainer without per-parameter hooks uses it.
  weft::grad::synchronizer<weft::mpi_backend, float> sync(world);
  sync.add_param("w", 5);
  sync.freeze();
  for (float& g : sync.grad(0)) g = static_cast<float>(world.rank() + 1);
  sync.reduce_all();
  if (sync.grad(0)[4] != static_cast<float>(world.size() + 1) / 2.0f) return 3;  // mean of 1..size
  std::printf("consumer: weft %d.%d.%d, MPI world of %d\n", WEFT_VERSION_MAJOR, WEFT_VERSION_MINOR,
              WEFT_VERSION_PATCH, world.size());
#else
  (void)argc;
  (void)argv;
  std::printf("consumer: weft %d.%d.%d without MPI\n", WEFT_VERSION_MAJOR, WEFT_VERSION_MINOR, WEFT_VERSION_PATCH);
#endif
  return 0;
}
