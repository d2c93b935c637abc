// The collective benchmarks' engine, compiled once for the seven *_perf programs.
#include "collective_perf.hpp"
