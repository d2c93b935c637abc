#pragma once
// weft-plan --probe: measures the ranks it runs on (under mpiexec / srun) and writes the hardware
// description that --hardware reads (weft/tune/hardware_file.hpp). Built only with MPI.

#include <string>

#include <weft/tune/model.hpp>

namespace weft_plan {

/// Measures GEMM throughput at `model`'s shapes (weft::tp's CPU matmul, every rank at once),
/// all-reduce / all-gather / reduce-scatter bus bandwidth inside a node and across nodes,
/// point-to-point bandwidth and latency, memory bandwidth and capacity; rank 0 writes the
/// description to `path` and prints a summary. Initialises and finalises MPI. Returns the exit status.
int run_probe(const std::string& path, const weft::tune::model_desc& model, int& argc, char**& argv);

}  // namespace weft_plan
