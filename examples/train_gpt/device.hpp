#pragma once
// Where train_gpt computes (--device auto|cpu|cuda) and in what precision (--precision fp32|bf16):
// the flags' values, what this build and machine offer, and the choice between them. The choice is
// pure (choose_device: one process, no CUDA) so that every refusal is testable on a CPU. What the
// machine offers comes from probe_cuda(), and the GPU run from train_on_cuda(): cuda/probe.cpp and
// cuda/trainer.cpp where train_gpt is built with its CUDA operations, cpu_probe.cpp otherwise
// (CMake picks the files: no #if here).

#include <optional>
#include <string>
#include <string_view>

#include "command_line.hpp"

namespace train_gpt {

enum class device_kind { automatic, cpu, cuda };
enum class precision_kind { fp32, bf16 };

inline std::optional<device_kind> parse_device(std::string_view text) {
  if (text == "auto") return device_kind::automatic;
  if (text == "cpu") return device_kind::cpu;
  if (text == "cuda") return device_kind::cuda;
  return std::nullopt;
}
inline std::optional<precision_kind> parse_precision(std::string_view text) {
  if (text == "fp32") return precision_kind::fp32;
  if (text == "bf16") return precision_kind::bf16;
  return std::nullopt;
}
inline const char* to_string(device_kind d) {
  switch (d) {
    case device_kind::automatic: return "auto";
    case device_kind::cpu: return "cpu";
    case device_kind::cuda: return "cuda";
  }
  return "?";
}

/// What the CUDA path has to run on, for one rank or (after the ranks' answers are combined) for
/// the whole job: every rank must be able to, or none trains there.
struct cuda_availability {
  bool runtime = false;  ///< built with the CUDA runtime and train_gpt's CUDA operations
  int gpus = 0;          ///< devices the runtime sees (the fewest of any rank, for a job)
  int rank_without = -1; ///< for a job: the first rank that sees none (-1: every rank sees one)
  std::string detail;    ///< why there is none, in the runtime's words (rank 0's, for a job)
  /// Why the trainer on the GPU does not take this run (its layout, flags or precision); unset
  /// when it does (cuda_trainer_refusal, device_support.hpp).
  std::optional<std::string> trainer_refusal;
};

/// This process's view: what the build has (`runtime`) and, with `count_devices`,
/// cudaGetDeviceCount's answer (and its error string when it fails); without it, or in a build
/// without CUDA, `gpus` is 0 and the runtime is not called. Never throws: a failing runtime is
/// reported as no GPU.
cuda_availability probe_cuda(bool count_devices);

struct options;
struct gpt_config;
struct run_layout;
class corpus;
/// Trains the run on this process's GPU (cuda/trainer.cpp) and returns the exit status; called
/// only when choose_device chose CUDA.
int train_on_cuda(const options& o, const gpt_config& m, const run_layout& layout, const corpus& data);

/// The device the run trains on, or an input_error (exit status 1, one message from rank 0) saying
/// why the flags cannot be met here. `auto` is CUDA when train_gpt is built with CUDA, every rank
/// sees a GPU and the trainer on the GPU takes the run, else the CPU; `--precision bf16` is a GPU
/// precision (the CPU path computes in fp32 and is refused it).
inline device_kind choose_device(device_kind requested, precision_kind precision, const cuda_availability& job) {
  using weft_programs::input_error;
  const bool gpus_everywhere = job.runtime && job.gpus > 0 && job.rank_without < 0;
  const std::string no_gpu =
      !job.runtime ? std::string("this train_gpt was built without CUDA (weft builds its CUDA path where CMake finds "
                                 "the CUDA toolkit and NCCL; docs/train_gpt.md, \"On GPUs\")")
                   : "no CUDA GPU is visible to rank " + std::to_string(job.rank_without < 0 ? 0 : job.rank_without) +
                         (job.detail.empty() ? std::string() : " (" + job.detail + ")");
  if (requested == device_kind::cuda) {
    if (!gpus_everywhere)
      throw input_error("--device cuda: no GPU to train on: " + no_gpu + ": run on a GPU node, or use --device cpu");
    if (job.trainer_refusal) throw input_error("--device cuda: " + *job.trainer_refusal);
    return device_kind::cuda;
  }
  const device_kind chosen = requested == device_kind::automatic && gpus_everywhere && !job.trainer_refusal
                                 ? device_kind::cuda
                                 : device_kind::cpu;
  if (chosen == device_kind::cpu && precision == precision_kind::bf16) {
    const std::string why = requested == device_kind::cpu ? "--device cpu computes in fp32 only"
                            : !gpus_everywhere            ? "--device auto chose the CPU: " + no_gpu
                                                          : "--device auto chose the CPU: " + *job.trainer_refusal;
    throw input_error("--precision bf16 trains on GPUs only (bf16 parameters and activations, fp32 master weights), "
                      "and " + why + ": drop --precision bf16 to train in fp32 on the CPU");
  }
  return chosen;
}

}  // namespace train_gpt
