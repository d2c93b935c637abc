#pragma once
// Counts the CUDA runtime calls that make the host wait for the device (stream, event and device
// synchronization; the synchronous cudaMalloc, cudaFree, cudaMemcpy and cudaMemset) and the
// streams created, made by code compiled into the test program while counting is on. The calls
// are interposed in host_sync_counter.cpp (the program's definitions take precedence over the
// shared CUDA runtime's, which they forward to).
namespace weft_test::host_syncs {

struct counts {
  long synchronizations = 0;  ///< cudaStream/Event/DeviceSynchronize
  long blocking_memory = 0;   ///< cudaMalloc, cudaFree, cudaMemcpy, cudaMemset
  long streams_created = 0;
  long total() const { return synchronizations + blocking_memory + streams_created; }
};

void start();
counts stop();

}  // namespace weft_test::host_syncs
