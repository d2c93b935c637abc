#pragma once
// The entry point of the collective benchmarks: each *_perf program is a one-line main that names
// its collective; the engine (collective_perf.hpp) is compiled once, in collective_perf.cpp, and
// linked into all of them.

namespace weft_bench {

enum class collective { all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all, send_recv };

/// The whole program: MPI up, options, the sweep, MPI down. Exit status 0 when every checked
/// element was right, 1 for wrong results or a usage mistake; a failure inside a collective
/// aborts every rank (the others could otherwise wait for it forever).
int perf_main(collective k, int argc, char** argv);

}  // namespace weft_bench
