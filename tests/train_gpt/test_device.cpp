// --device and --precision against what a job has (train_gpt's choose_device, pure): which device
// each combination trains on, and the one message for each that cannot run; and which runs the
// trainer on GPUs takes (cuda_trainer_refusal, pure).
#include <catch2/catch.hpp>

#include <optional>
#include <string>

#include "device.hpp"
#include "device_support.hpp"

using namespace train_gpt;

namespace {

cuda_availability cpu_build() { return {}; }
cuda_availability cuda_build(int gpus, std::optional<std::string> refusal = std::nullopt, int rank_without = -1,
                             std::string detail = "") {
  cuda_availability a;
  a.runtime = true;
  a.gpus = gpus;
  a.rank_without = gpus == 0 && rank_without < 0 ? 0 : rank_without;
  a.detail = std::move(detail);
  a.trainer_refusal = std::move(refusal);
  return a;
}

std::string refusal(device_kind d, precision_kind p, const cuda_availability& a) {
  try {
    (void)choose_device(d, p, a);
  } catch (const weft_programs::input_error& e) {
    return e.what();
  }
  return "(accepted)";
}

weft::layout::layout_spec one_rank() {
  weft::layout::layout_spec d;
  d.world_size = 1;
  d.dp = 1;
  return d;
}

/// `ranks` ranks, all of them along `degree` (the other degrees 1).
weft::layout::layout_spec ranks_along(int weft::layout::layout_spec::*degree, int ranks) {
  weft::layout::layout_spec d = one_rank();
  d.world_size = ranks;
  d.*degree = ranks;
  return d;
}

}  // namespace

TEST_CASE("the flags' words") {
  CHECK(parse_device("auto") == device_kind::automatic);
  CHECK(parse_device("cpu") == device_kind::cpu);
  CHECK(parse_device("cuda") == device_kind::cuda);
  CHECK_FALSE(parse_device("gpu").has_value());
  CHECK(parse_precision("fp32") == precision_kind::fp32);
  CHECK(parse_precision("bf16") == precision_kind::bf16);
  CHECK_FALSE(parse_precision("fp16").has_value());
}

TEST_CASE("auto trains on CUDA only when every rank sees a GPU and the GPU trainer takes the run") {
  const auto fp32 = precision_kind::fp32;
  CHECK(choose_device(device_kind::automatic, fp32, cpu_build()) == device_kind::cpu);
  CHECK(choose_device(device_kind::automatic, fp32, cuda_build(0)) == device_kind::cpu);
  CHECK(choose_device(device_kind::automatic, fp32, cuda_build(1, "it runs dp alone")) == device_kind::cpu);
  CHECK(choose_device(device_kind::automatic, fp32, cuda_build(8)) == device_kind::cuda);
  // One rank without a GPU keeps the whole job on CPUs (the fewest GPUs of any rank is then 0).
  CHECK(choose_device(device_kind::automatic, fp32, cuda_build(0, std::nullopt, 3)) == device_kind::cpu);
  CHECK(choose_device(device_kind::cpu, fp32, cuda_build(8)) == device_kind::cpu);
  CHECK(choose_device(device_kind::cuda, fp32, cuda_build(1)) == device_kind::cuda);
}

TEST_CASE("--device cuda that cannot train on a GPU is refused with the reason") {
  const auto fp32 = precision_kind::fp32;
  CHECK(refusal(device_kind::cuda, fp32, cpu_build()) ==
        "--device cuda: no GPU to train on: this train_gpt was built without CUDA (weft builds its CUDA path where "
        "CMake finds the CUDA toolkit and NCCL; docs/train_gpt.md, \"On GPUs\"): run on a GPU node, or use --device cpu");
  CHECK(refusal(device_kind::cuda, fp32,
                cuda_build(0, std::nullopt, 0, "GPU selection: no GPU is visible to this process")) ==
        "--device cuda: no GPU to train on: no CUDA GPU is visible to rank 0 (GPU selection: no GPU is visible to this "
        "process): run on a GPU node, or use --device cpu");
  CHECK(refusal(device_kind::cuda, fp32, cuda_build(0, std::nullopt, 5)) ==
        "--device cuda: no GPU to train on: no CUDA GPU is visible to rank 5: run on a GPU node, or use --device cpu");
  // With GPUs, a run the GPU trainer does not take gets its reason.
  CHECK(refusal(device_kind::cuda, fp32, cuda_build(4, "the trainer on the GPU does not take --save-dir")) ==
        "--device cuda: the trainer on the GPU does not take --save-dir");
  // Without them, the missing GPU is said first (it is what to fix before anything else).
  CHECK(refusal(device_kind::cuda, fp32, cuda_build(0, "the trainer on the GPU does not take --save-dir")).find(
            "no GPU to train on") != std::string::npos);
}

TEST_CASE("--precision bf16 is refused where the run trains on the CPU") {
  const auto bf16 = precision_kind::bf16;
  CHECK(refusal(device_kind::cpu, bf16, cuda_build(8)) ==
        "--precision bf16 trains on GPUs only (bf16 parameters and activations, fp32 master weights), and --device "
        "cpu computes in fp32 only: drop --precision bf16 to train in fp32 on the CPU");
  CHECK(refusal(device_kind::automatic, bf16, cpu_build()).find(
            "and --device auto chose the CPU: this train_gpt was built without CUDA") != std::string::npos);
  CHECK(refusal(device_kind::automatic, bf16, cuda_build(0, std::nullopt, 1)).find(
            "and --device auto chose the CPU: no CUDA GPU is visible to rank 1:") != std::string::npos);
  CHECK(refusal(device_kind::automatic, bf16, cuda_build(2, "the trainer on the GPU does not take --save-dir")).find(
            "and --device auto chose the CPU: the trainer on the GPU does not take --save-dir") != std::string::npos);
  // Where the GPU trainer takes the run, bf16 is its.
  CHECK(choose_device(device_kind::automatic, bf16, cuda_build(2)) == device_kind::cuda);
  CHECK(choose_device(device_kind::cuda, bf16, cuda_build(1)) == device_kind::cuda);
}

TEST_CASE("the trainer on GPUs takes data, tensor, context and pipeline parallelism in fp32 or bf16 with --save and --resume, and says "
          "what to do otherwise") {
  options o;
  CHECK_FALSE(cuda_trainer_refusal(o, one_rank(), 1).has_value());
  o.micro_batch = 4;
  o.global_batch = 8;  // gradient accumulation is the GPU trainer's too
  CHECK_FALSE(cuda_trainer_refusal(o, one_rank(), 1).has_value());

  // Data, tensor (with sequence parallelism or without), context and pipeline parallelism are the
  // GPU trainer's (the synchronizer, the sums over tp, ring attention and the pipeline executor on
  // NCCL); expert parallelism and the split-backward schedule are not.
  using spec = weft::layout::layout_spec;
  const spec dp2 = ranks_along(&spec::dp, 2), tp2 = ranks_along(&spec::tp, 2);
  for (int spec::*degree : {&spec::dp, &spec::tp, &spec::cp, &spec::pp})
    CHECK_FALSE(cuda_trainer_refusal(o, ranks_along(degree, 2), 2).has_value());
  spec pp2 = ranks_along(&spec::pp, 2);
  pp2.virtual_stages = 2;
  options interleaved = o;
  interleaved.schedule = "interleaved";
  CHECK_FALSE(cuda_trainer_refusal(interleaved, pp2, 2).has_value());
  options zero_bubble = o;  // the split backward: the weight passes run apart (one_gpu_model::weight)
  zero_bubble.schedule = "zb-h1";
  CHECK_FALSE(cuda_trainer_refusal(zero_bubble, ranks_along(&spec::pp, 2), 2).has_value());
  CHECK_FALSE(cuda_trainer_refusal(zero_bubble, one_rank(), 1).has_value());
  CHECK(cuda_trainer_refusal(o, ranks_along(&spec::ep, 2), 2) ==
        std::string("the trainer on the GPU runs data, tensor, context and pipeline parallelism (ep 1, one GPU a rank), "
                    "and this run has 2 ranks with ep 2: drop --ep, or use --device cpu for expert parallelism"));

  // bf16 on GPT-2's shapes (the default model's, and GPT-2 small's vocabulary padded to 50304).
  options bf16;
  bf16.precision = precision_kind::bf16;
  CHECK_FALSE(cuda_trainer_refusal(bf16, one_rank(), 1).has_value());
  bf16.model.vocab = 50257;
  bf16.model.hidden = 768;
  CHECK_FALSE(cuda_trainer_refusal(bf16, dp2, 2).has_value());
  // Its products need rows of 16 bytes: the hidden size and the padded vocabulary multiples of 8.
  bf16.model.hidden = 100;
  CHECK(cuda_trainer_refusal(bf16, one_rank(), 1) ==
        std::string("--precision bf16 needs --hidden a multiple of 8 (the bf16 products read rows of 16 bytes), and it "
                    "is 100: give --hidden 104, or train in fp32"));
  bf16.precision = precision_kind::fp32;
  CHECK_FALSE(cuda_trainer_refusal(bf16, one_rank(), 1).has_value());  // fp32 takes any size
  bf16.precision = precision_kind::bf16;
  bf16.model.hidden = 768;
  bf16.model.vocab_divisible_by = 1;
  CHECK(cuda_trainer_refusal(bf16, one_rank(), 1).value_or("").find(
            "--vocab 50257 padded to a multiple of --make-vocab-size-divisible-by 1 is not: give "
            "--make-vocab-size-divisible-by 8") != std::string::npos);
  bf16.model.vocab_divisible_by = 8;
  CHECK_FALSE(cuda_trainer_refusal(bf16, one_rank(), 1).has_value());  // 50264
  bf16.model.vocab = 256;
  bf16.model.vocab_divisible_by = 1;
  CHECK_FALSE(cuda_trainer_refusal(bf16, one_rank(), 1).has_value());  // 256 itself
  // Under tp the products' rows are each rank's slices: hidden / tp and its block of the vocabulary.
  bf16.model.vocab = 50257;
  bf16.model.vocab_divisible_by = 128;
  CHECK_FALSE(cuda_trainer_refusal(bf16, tp2, 2).has_value());  // 768 / 2, 50304 / 2
  bf16.model.hidden = 72;  // 36 a rank
  CHECK(cuda_trainer_refusal(bf16, tp2, 2) ==
        std::string("--precision bf16 with --tp 2 needs --hidden a multiple of 16 (each rank's slice, hidden / tp, is "
                    "a row of the bf16 products, which read rows of 16 bytes), and it is 72: give --hidden 80, or "
                    "train in fp32"));
  bf16.model.hidden = 768;
  bf16.model.vocab = 256;
  bf16.model.vocab_divisible_by = 4;  // 256 whole (a multiple of 8), but blocks of 4 x k over tp 4: 64 a rank
  const weft::layout::layout_spec tp4 = ranks_along(&weft::layout::layout_spec::tp, 4);
  CHECK_FALSE(cuda_trainer_refusal(bf16, tp4, 4).has_value());
  bf16.model.vocab = 250;  // padded to 256 over tp 4 (multiples of 16): 64 a rank
  CHECK_FALSE(cuda_trainer_refusal(bf16, tp4, 4).has_value());
  bf16.model.vocab = 258;  // padded to 272: 68 a rank
  CHECK(cuda_trainer_refusal(bf16, tp4, 4).value_or("").find(
            "--vocab 258 padded to a multiple of --make-vocab-size-divisible-by 4 x tp 4 gives each rank a block that "
            "is not: give --make-vocab-size-divisible-by 8") != std::string::npos);
  options experts;
  experts.model.moe_experts = 4;
  CHECK(cuda_trainer_refusal(experts, one_rank(), 1).value_or("").find("drop --moe-experts") != std::string::npos);
  // ZeRO-2, ZeRO-3 and HSDP run on the GPU as sharded units, with the gradient dump and the
  // checkpoint files gathered from the shards.
  options zero3;
  zero3.sharding = weft::tune::sharding::full;
  CHECK_FALSE(cuda_trainer_refusal(zero3, one_rank(), 1).has_value());
  CHECK_FALSE(cuda_trainer_refusal(zero3, dp2, 2).has_value());
  zero3.dump_grads = "grads.safetensors";
  zero3.precision = precision_kind::bf16;
  zero3.save = "gpt.safetensors";
  zero3.resume = "gpt.safetensors";
  CHECK_FALSE(cuda_trainer_refusal(zero3, dp2, 2).has_value());
  zero3.hybrid = true;
  CHECK_FALSE(cuda_trainer_refusal(zero3, dp2, 2).has_value());
  zero3.hybrid = false;
  zero3.sharding = weft::tune::sharding::gradients;
  CHECK_FALSE(cuda_trainer_refusal(zero3, dp2, 2).has_value());
  // Recomputation, selective and full, is the GPU trainer's too.
  options recompute;
  recompute.recompute = weft::tune::recompute::selective;
  CHECK_FALSE(cuda_trainer_refusal(recompute, one_rank(), 1).has_value());
  recompute.recompute = weft::tune::recompute::full;
  CHECK_FALSE(cuda_trainer_refusal(recompute, one_rank(), 1).has_value());
  // ZeRO-1 is the GPU trainer's, with its checkpoints and gradient dump (the shards gathered whole).
  options zero1;
  zero1.sharding = weft::tune::sharding::optimizer;
  zero1.zero1 = true;
  CHECK_FALSE(cuda_trainer_refusal(zero1, dp2, 2).has_value());
  zero1.precision = precision_kind::bf16;
  CHECK_FALSE(cuda_trainer_refusal(zero1, dp2, 2).has_value());
  zero1.save = "gpt.safetensors";
  zero1.resume = "gpt.safetensors";
  zero1.dump_grads = "grads.safetensors";
  CHECK_FALSE(cuda_trainer_refusal(zero1, dp2, 2).has_value());
  options saving;
  saving.save_dir = "ckpt";
  CHECK(cuda_trainer_refusal(saving, one_rank(), 1).value_or("").find("does not take --save-dir") != std::string::npos);
  options from_file;
  from_file.init_from = "gpt2.safetensors";
  CHECK(cuda_trainer_refusal(from_file, one_rank(), 1).value_or("").find("does not take --init-from") !=
        std::string::npos);
  // The checkpoint files of --save and --resume are the GPU trainer's too.
  options resuming;
  resuming.save = "gpt.safetensors";
  resuming.save_every = 10;
  resuming.resume = "gpt.safetensors";
  CHECK_FALSE(cuda_trainer_refusal(resuming, one_rank(), 1).has_value());
  resuming.precision = precision_kind::bf16;
  CHECK_FALSE(cuda_trainer_refusal(resuming, dp2, 2).has_value());
}
