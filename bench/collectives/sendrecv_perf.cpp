// send_recv bandwidth and latency over a sweep of message sizes, in nccl-tests' format.
#include "perf_main.hpp"

int main(int argc, char** argv) { return weft_bench::perf_main(weft_bench::collective::send_recv, argc, argv); }
