// Single-process micro-costs, with Google Benchmark: 16-bit float conversions, and what weft's
// communicator adds to an operation (its checks and bookkeeping on the blocking path, a round trip
// through the progress thread on the async path, the agreement check of
// check_level::communication), each measured on a one-rank communicator next to the raw MPI call.
// Collectives over several ranks do not belong here: Google Benchmark picks iteration counts per
// process, and ranks that run different counts fall out of step.
//
//   micro_costs --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/float16.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace {

using mpi_comm = weft::communicator<weft::mpi_backend>;

constexpr std::size_t conversion_count = 4096;

std::vector<float> conversion_inputs() {
  std::vector<float> v(conversion_count);
  // Normal, subnormal-for-half and rounding-boundary values, so every branch is exercised.
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = (static_cast<float>(i % 977) - 488.0f) * (i % 3 == 0 ? 1e-6f : 0.37f);
  return v;
}

template <class T>
void float_to_16bit(benchmark::State& state) {
  const std::vector<float> in = conversion_inputs();
  std::vector<T> out(in.size());
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = T(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(in.size()));
}

template <class T>
void from_16bit_to_float(benchmark::State& state) {
  const std::vector<float> source = conversion_inputs();
  std::vector<T> in(source.size());
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = T(source[i]);
  std::vector<float> out(in.size());
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = static_cast<float>(in[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(in.size()));
}

BENCHMARK_TEMPLATE(float_to_16bit, weft::bfloat16);
BENCHMARK_TEMPLATE(float_to_16bit, weft::half);
BENCHMARK_TEMPLATE(from_16bit_to_float, weft::bfloat16);
BENCHMARK_TEMPLATE(from_16bit_to_float, weft::half);

// One-rank communicators, made in main() once MPI is up and released before MPI_Finalize.
std::unique_ptr<mpi_comm> local_comm;
std::unique_ptr<mpi_comm> checked_comm;

void raw_allreduce(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> send(n, 1.0f), recv(n);
  const MPI_Comm c = local_comm->native().native();
  for (auto _ : state) {
    MPI_Allreduce(send.data(), recv.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, c);
    benchmark::DoNotOptimize(recv.data());
  }
}

void weft_allreduce(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> send(n, 1.0f), recv(n);
  for (auto _ : state) {
    local_comm->all_reduce(send, recv);
    benchmark::DoNotOptimize(recv.data());
  }
}

void weft_allreduce_async_wait(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> send(n, 1.0f), recv(n);
  for (auto _ : state) {
    local_comm->all_reduce_async(send, recv).wait();
    benchmark::DoNotOptimize(recv.data());
  }
}

void weft_allreduce_communication_checks(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<float> send(n, 1.0f), recv(n);
  for (auto _ : state) {
    checked_comm->all_reduce(send, recv);
    benchmark::DoNotOptimize(recv.data());
  }
}

void weft_allreduce_bfloat16(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<weft::bfloat16> send(n, weft::bfloat16(1.0f)), recv(n);
  for (auto _ : state) {
    local_comm->all_reduce(send, recv);
    benchmark::DoNotOptimize(recv.data());
  }
}

BENCHMARK(raw_allreduce)->Arg(1)->Arg(1024);
BENCHMARK(weft_allreduce)->Arg(1)->Arg(1024);
BENCHMARK(weft_allreduce_async_wait)->Arg(1)->Arg(1024);
BENCHMARK(weft_allreduce_communication_checks)->Arg(1)->Arg(1024);
BENCHMARK(weft_allreduce_bfloat16)->Arg(1)->Arg(1024);

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int status = 0;
  {
    local_comm = std::make_unique<mpi_comm>(weft::mpi_backend::comm::duplicate(MPI_COMM_SELF), "self",
                                            weft::check_level::local);
    checked_comm = std::make_unique<mpi_comm>(weft::mpi_backend::comm::duplicate(MPI_COMM_SELF), "self-checked",
                                              weft::check_level::communication);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
      status = 1;
    } else {
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
    }
    checked_comm.reset();
    local_comm.reset();
  }
  MPI_Finalize();
  return status;
}
