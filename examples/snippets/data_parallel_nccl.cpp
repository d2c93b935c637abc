// docs/data_parallel.md's GPU example as a program (needs a GPU per rank): the gradient
// synchronizer on the NCCL backend with 4 micro-steps of accumulation, on a model whose
// "kernels" add a known gradient into each parameter's device buffer in the compute stream's
// order. The optimizer checks the reduced gradients (the mean over ranks and micro-batches) on
// the host; rank 0 prints "data_parallel_nccl: ok" when every check passed on every rank.
#include <weft/backend/nccl/backend.hpp>
#include <weft/grad/synchronizer.hpp>

#include <weft/launch/mpi_environment.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

namespace {

int failures = 0;

void cuda_ok(cudaError_t status) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "data_parallel_nccl: FAILED: CUDA: %s\n", cudaGetErrorString(status));
    ++failures;
  }
}

/// Three parameters; backward adds input x (p + 1) into every element of parameter p's gradient,
/// last parameter first, in the compute stream's order (through the host: a stand-in for kernels).
struct device_model {
  weft::grad::synchronizer<weft::nccl_backend, float>& sync;
  float input = 0;

  void forward(float x, cudaStream_t) { input = x; }
  void backward(cudaStream_t stream, const std::function<void(std::size_t)>& ready) {
    for (std::size_t p = 3; p-- > 0;) {
      const std::span<float> grad = sync.grad(p);
      std::vector<float> host(grad.size());
      cuda_ok(cudaMemcpyAsync(host.data(), grad.data(), grad.size_bytes(), cudaMemcpyDeviceToHost, stream));
      cuda_ok(cudaStreamSynchronize(stream));
      for (float& g : host) g += input * static_cast<float>(p + 1);
      cuda_ok(cudaMemcpyAsync(grad.data(), host.data(), grad.size_bytes(), cudaMemcpyHostToDevice, stream));
      cuda_ok(cudaStreamSynchronize(stream));
      ready(p);
    }
  }
};

/// Checks each reduced gradient against the mean input x (p + 1).
struct checking_optimizer {
  float mean_input;
  void step(std::vector<float>& params, weft::grad::flat_buffer<float, weft::memory_space::device>& grads,
            cudaStream_t stream) const {
    for (std::size_t p = 0; p < 3; ++p) {
      const std::span<float> g = grads.view(p);
      std::vector<float> host(g.size());
      cuda_ok(cudaMemcpyAsync(host.data(), g.data(), g.size_bytes(), cudaMemcpyDeviceToHost, stream));
      cuda_ok(cudaStreamSynchronize(stream));
      const float want = mean_input * static_cast<float>(p + 1);
      for (float x : {host.front(), host.back()})
        if (std::abs(x - want) > 1e-5f * std::max(1.0f, want)) {
          std::fprintf(stderr, "data_parallel_nccl: FAILED: parameter %zu's gradient is %g, expected %g\n", p, x, want);
          ++failures;
        }
      params[p] -= 0.1f * want;
    }
  }
};

void train(weft::communicator<weft::nccl_backend>& dp) {
  cudaStream_t compute = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  {
    std::vector<float> batch;  // micro-batch m of rank r has input r + m
    for (int micro = 0; micro < 4; ++micro) batch.push_back(static_cast<float>(dp.rank() + micro));
    const checking_optimizer optimizer{static_cast<float>(dp.size() - 1) / 2 + 1.5f};
    std::vector<float> params(3, 0.0f);

    weft::grad::synchronizer<weft::nccl_backend, float> sync(dp, {.accumulation_steps = 4});
    sync.set_compute_stream(compute);                     // the stream backward and the optimizer run on
    device_model model{sync};
    sync.add_param("embedding", 300000);                  // add_param(...) in forward order, freeze()
    sync.add_param("layer", 1000);
    sync.add_param("head", 3);
    sync.freeze();
    for (int micro = 0; micro < 4; ++micro) {
      model.forward(batch[micro], compute);
      model.backward(compute, [&](std::size_t p) {        // after queueing the kernels that add into grad(p)
        sync.mark_ready(p);
      });
      sync.finish();                                      // queues, does not wait
    }
    optimizer.step(params, sync.grads(), compute);        // ordered after the reductions
    sync.zero_grad();                                     // cudaMemsetAsync on the compute stream
    cuda_ok(cudaStreamSynchronize(compute));
  }
  cuda_ok(cudaStreamDestroy(compute));
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  int failed = 0;
  {
    weft::communicator<weft::nccl_backend> world = weft::nccl_world();
    train(world);
    failed = failures;
  }
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0 && failed == 0) std::printf("data_parallel_nccl: ok\n");
  return failed == 0 ? 0 : 1;
}
