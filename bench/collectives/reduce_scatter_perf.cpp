// reduce_scatter bandwidth and latency over a sweep of message sizes, in nccl-tests' format.
#include "perf_main.hpp"

int main(int argc, char** argv) { return weft_bench::perf_main(weft_bench::collective::reduce_scatter, argc, argv); }
