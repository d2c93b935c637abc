// Interposes the CUDA runtime's host-synchronizing calls for host_sync_counter.hpp. Compiled by the
// host compiler (the CUDA headers' device attributes do not apply) and linked into a program that
// uses the shared CUDA runtime: its calls bind here, and each forwards to the runtime's own.
#include "host_sync_counter.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace {

std::atomic<bool> counting{false};
std::atomic<long> synchronizations{0}, blocking_memory{0}, streams_created{0};

template <class F>
F next(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    std::fprintf(stderr, "host_sync_counter: the CUDA runtime has no %s (is it linked statically?)\n", name);
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

void count(std::atomic<long>& counter) {
  if (counting.load(std::memory_order_relaxed)) counter.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

namespace weft_test::host_syncs {

void start() {
  synchronizations = 0;
  blocking_memory = 0;
  streams_created = 0;
  counting = true;
}

counts stop() {
  counting = false;
  return {synchronizations.load(), blocking_memory.load(), streams_created.load()};
}

}  // namespace weft_test::host_syncs

extern "C" {

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  static const auto f = next<cudaError_t (*)(cudaStream_t)>("cudaStreamSynchronize");
  count(synchronizations);
  return f(stream);
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  static const auto f = next<cudaError_t (*)(cudaEvent_t)>("cudaEventSynchronize");
  count(synchronizations);
  return f(event);
}
cudaError_t cudaDeviceSynchronize() {
  static const auto f = next<cudaError_t (*)()>("cudaDeviceSynchronize");
  count(synchronizations);
  return f();
}
cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  static const auto f = next<cudaError_t (*)(void**, size_t)>("cudaMalloc");
  count(blocking_memory);
  return f(pointer, bytes);
}
cudaError_t cudaFree(void* pointer) {
  static const auto f = next<cudaError_t (*)(void*)>("cudaFree");
  count(blocking_memory);
  return f(pointer);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  static const auto f = next<cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind)>("cudaMemcpy");
  count(blocking_memory);
  return f(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* pointer, int value, size_t bytes) {
  static const auto f = next<cudaError_t (*)(void*, int, size_t)>("cudaMemset");
  count(blocking_memory);
  return f(pointer, value, bytes);
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  static const auto f = next<cudaError_t (*)(cudaStream_t*, unsigned int, int)>("cudaStreamCreateWithPriority");
  count(streams_created);
  return f(stream, flags, priority);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  static const auto f = next<cudaError_t (*)(cudaStream_t*, unsigned int)>("cudaStreamCreateWithFlags");
  count(streams_created);
  return f(stream, flags);
}

}  // extern "C"
