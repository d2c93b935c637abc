#pragma once
// train_gpt's command line.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "command_line.hpp"
#include <weft/tune/layout.hpp>

#include "data.hpp"
#include "device.hpp"
#include "gpt_config.hpp"

namespace train_gpt {

inline constexpr const char* usage_text = R"(usage: train_gpt [options]
Trains GPT-2 on byte-level text or token shards on every rank of an MPI job (srun -n N ./train_gpt or
mpirun -n N ./train_gpt; launcher variables, torchrun's included, are checked against MPI's
view), on any tp x pp x dp x cp layout.

model
  --model NAME           a named shape: gpt2 (= gpt2-small), gpt2-medium, gpt2-large, gpt2-xl, tiny, small
                         (default small); the flags below override its fields
  --layers N --hidden N --heads N --vocab N --positions N
  --seq N                tokens per training sequence (at most --positions)
  --make-vocab-size-divisible-by N   the vocabulary is padded to a multiple of N x tp (default 128,
                         Megatron's): each tp rank holds an equal block of the embedding's rows; the
                         padding is never trained nor saved (checkpoints keep the true vocabulary)
  --init-from FILE       shape from FILE's metadata (GPT-2 config names) and weights from FILE
  --moe-experts E        mixture of experts: E experts (GPT-2 MLPs) in place of the MLP of every
                         --moe-every N-th block (blocks i with i % N == 0; default 1), each token using
                         the --moe-top-k K (default 2) that its router ranks highest
  --moe-capacity-factor F   each rank keeps per expert at most ceil(F x tokens x K / E) assignments,
                         the others pass through the residual (default 0: dropless)
  --moe-aux-loss-coef A --moe-z-loss-coef B   the loss is the mean over sequences of cross-entropy +
                         A x the load-balancing losses + B x the router z-losses (0.01, 0.001)
run
  --steps N              optimizer steps in all, counted from step 0: a run resumed at step S trains
                         steps S+1..N (default 20)
  --lr X                 AdamW learning rate (default 1e-3), --warmup N steps of linear warm-up (0)
  --beta1 X --beta2 X --eps X --weight-decay X   AdamW (0.9, 0.95, 1e-8, 0.1)
  --seed N               initialisation and data order (default 1234)
  --data FILE|GLOB       training data: llm.c token shards (found by their header) or byte-level text, several
                         files (a quoted glob) one after another (default: the text of weft's docs and headers)
  --data-format FORMAT   text (a byte a token), llmc (llm.c shards) or u16 (nanoGPT's headerless uint16 .bin);
                         default: llm.c shards by their header, other files text
  --val-data FILE|GLOB   validation data (the same format): with --val-every N, the loss of its first
                         --val-steps global batches (default 4) every N steps and after the last
device
  --device KIND          auto (default: CUDA when train_gpt is built with it, every rank sees a GPU and the
                         GPU trainer takes the run: dp, tp (--sequence-parallel too), cp, pp (every schedule),
                         every --sharding, checkpoints by --save and --resume FILE; else the CPU), cpu or cuda
                         (refused, with the reason, where it cannot run)
  --precision P          fp32 (default) or bf16, a GPU precision (bf16 parameters and activations, fp32
                         master weights, optimizer state and gradient reduction)
layout (degrees multiply to the ranks; dp defaults to ranks / (tp pp cp))
  --tp N --pp N --dp N --cp N --vp N   tensor, pipeline, data, context parallel degrees; virtual stages per rank
  --ep N                 expert parallel degree (MoE): each MoE block's experts are computed over N ranks
                         of one tp coordinate; ep x tp x pp must divide the ranks (default 1)
  --schedule KIND        gpipe, 1f1b (default), interleaved (needs --vp > 1) or zb-h1 (weight gradients
                         deferred into the bubble)
  --sequence-parallel    with tp > 1: layer norms and dropout-free regions on sequence slices
  --recompute MODE       activation recomputation: none (default), selective (the attention core is
                         recomputed in backward) or full (each layer's input is kept and its forward rerun
                         in backward); gradients equal none's bit for bit; not with --schedule zb-h1
  --micro-batch N        sequences per micro-batch (default 1)
  --global-batch N       sequences per optimizer step over all ranks (default dp x micro-batch);
                         micro-batches per step = global / (dp x micro-batch) (gradient accumulation)
  --sharding LEVEL       what is sharded over the dp x cp ranks: none (default), zero1 (the optimizer state),
                         zero2 (and the gradients), zero3 (and the parameters: FSDP, a unit per block and the
                         embeddings and final norm as the root), hsdp (zero3 inside a node, replicated across
                         nodes); zero2, zero3 and hsdp need --pp 1 and the 1f1b schedule
  --zero1                the same as --sharding zero1
  --ranks-per-node N     with --sharding hsdp: nodes of N consecutive ranks (default: the launcher's nodes)
  --no-overlap           reduce gradients after backward instead of during it
  --bucket-mb X          gradient bucket size in MiB (default: measured on the dp group at start-up)
  --hardware FILE        a description of these ranks measured by `weft-plan --probe FILE` (same launch):
                         each step also reports the tuner's predicted step time for the layout
  --plan                 with --hardware: the tuner picks the layout (degrees, virtual stages, micro-batch,
                         sequence parallelism, sharding, recomputation; ep for a mixture of experts) for
                         the ranks given and prints why
checkpoints and checks
  --save FILE            write the model to FILE (safetensors, GPT-2 names) and the optimizer state and
                         data position to FILE's name + ".optimizer" (asynchronously; atomic rename)
  --save-dir DIR         write distributed checkpoints DIR/<step>/: every rank its own pieces (tp slices,
                         pipeline stages, ZeRO / FSDP shards, optimizer moments) and the data position, in
                         the background; loads into any layout
  --save-every N         also every N steps (default: at the end only)
  --keep N               with --save-dir: keep the newest N checkpoints (default 0: all)
  --resume FILE|DIR      continue from a checkpoint written by --save (FILE) or --save-dir (DIR: its newest
                         complete checkpoint, or a step directory DIR/<step>), in this run's layout (the
                         same layout: bit-exact); a global batch other than the checkpoint's needs --global-batch
  --dump-grads FILE      with --steps 1: the first step's gradients (whole tensors, GPT-2 names), input_ids,
                         labels and loss, in safetensors
  --log-json FILE        one JSON object per step
  --trace FILE           a Chrome-trace timeline per rank (FILE with .rank<N> before the extension)
  --quiet                no per-step lines (the summary only)
  --comm-timeout SECONDS deadline of every communication (default WEFT_COMM_TIMEOUT or 600; 0: none)
  --help
)";

struct options {
  gpt_config model = *named_model("small");
  std::string model_name = "small";
  std::optional<std::string> init_from;
  int vocab_divisible_by = 128;  // --make-vocab-size-divisible-by
  int steps = 20;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  int warmup = 0;
  std::uint64_t seed = 1234;
  std::optional<std::string> data, val_data;
  data_format format = data_format::detect;
  int val_every = 0, val_steps = 4;
  device_kind device = device_kind::automatic;
  precision_kind precision = precision_kind::fp32;
  int tp = 1, pp = 1, dp = 0, cp = 1, vp = 1;
  int ep = 1;
  double moe_capacity_factor = 0, moe_aux_loss_coef = 0.01, moe_z_loss_coef = 0.001;
  std::string schedule = "1f1b";
  bool sequence_parallel = false;
  weft::tune::recompute recompute = weft::tune::recompute::none;
  int micro_batch = 1;
  int global_batch = 0;
  bool global_batch_given = false;  // --global-batch was on the command line (a resume may then change it)
  bool zero1 = false;
  /// zero2 (gradients), zero3 and hsdp (full) run weft::fsdp; none and zero1 the synchronizer.
  weft::tune::sharding sharding = weft::tune::sharding::none;
  bool hybrid = false;
  int ranks_per_node = 0;  // 0: the launcher's
  bool overlap = true;
  double bucket_mb = 0;  // 0: the synchronizer measures its cap
  std::optional<std::string> save, save_dir, resume, dump_grads, log_json, trace, hardware;
  int keep = 0;  // --keep: distributed checkpoints kept in --save-dir (0: all)
  bool plan = false;
  bool layout_flags = false;  // any of --tp --pp --dp --cp --vp --micro-batch --sequence-parallel --zero1 --schedule --recompute
  int save_every = 0;
  bool quiet = false;
  std::optional<std::chrono::milliseconds> comm_timeout;
  bool help = false;
  // Which model fields the command line set (they override --init-from's metadata only if equal).
  std::vector<std::string> model_flags;
};

/// The sharding in the run's header line: "" for none, else " +zero1" and so on.
inline std::string sharding_text(const options& o) {
  switch (o.sharding) {
    case weft::tune::sharding::none: return "";
    case weft::tune::sharding::optimizer: return " +zero1";
    case weft::tune::sharding::gradients: return " +zero2";
    case weft::tune::sharding::full: return o.hybrid ? " +hsdp" : " +zero3";
  }
  return "";
}

inline options parse_options(int argc, char** argv) {
  using weft_programs::parse_integer;
  using weft_programs::parse_real;
  using weft_programs::usage_error;
  options o;
  std::optional<std::string> model_name;
  std::vector<std::pair<std::string, std::string>> fields;
  std::vector<std::pair<std::string, int>> moe_fields;
  bool zero1_flag = false, overlap_flag = false, bucket_flag = false, keep_flag = false;
  std::optional<std::string> sharding_flag;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(std::string(flag) + " needs a value");
      return argv[++i];
    };
    auto integer = [&](int low, int high) { return parse_integer<int>(flag, value(), low, high); };
    auto real = [&](double low, double high) { return parse_real(flag, value(), low, high); };
    if (flag == "--help" || flag == "-h") o.help = true;
    else if (flag == "--model") model_name = value();
    else if (flag == "--layers" || flag == "--hidden" || flag == "--heads" || flag == "--vocab" ||
             flag == "--positions" || flag == "--seq")
      fields.emplace_back(std::string(flag), value());
    else if (flag == "--init-from") o.init_from = value();
    else if (flag == "--make-vocab-size-divisible-by") o.vocab_divisible_by = integer(1, 1 << 20);
    else if (flag == "--steps") o.steps = integer(1, 100'000'000);
    else if (flag == "--lr") o.lr = real(0, 10);
    else if (flag == "--warmup") o.warmup = integer(0, 100'000'000);
    else if (flag == "--beta1") o.beta1 = real(0, 0.999999);
    else if (flag == "--beta2") o.beta2 = real(0, 0.999999);
    else if (flag == "--eps") o.eps = real(0, 1);
    else if (flag == "--weight-decay") o.weight_decay = real(0, 10);
    else if (flag == "--seed") o.seed = parse_integer<std::uint64_t>(flag, value(), 0, ~std::uint64_t{0});
    else if (flag == "--data") o.data = value();
    else if (flag == "--data-format") {
      const std::string f = value();
      if (f == "text") o.format = data_format::text;
      else if (f == "llmc") o.format = data_format::llmc;
      else if (f == "u16") o.format = data_format::u16;
      else throw usage_error("--data-format '" + f + "' is not a format train_gpt reads: use text, llmc or u16" +
                             weft_programs::did_you_mean(f, weft_programs::listed_words("text, llmc, u16")));
    }
    else if (flag == "--val-data") o.val_data = value();
    else if (flag == "--val-every") o.val_every = integer(1, 100'000'000);
    else if (flag == "--val-steps") o.val_steps = integer(1, 1'000'000);
    else if (flag == "--moe-experts" || flag == "--moe-top-k" || flag == "--moe-every")
      moe_fields.emplace_back(std::string(flag), integer(1, 1 << 16));
    else if (flag == "--moe-capacity-factor") o.moe_capacity_factor = real(0, 1e6);
    else if (flag == "--moe-aux-loss-coef") o.moe_aux_loss_coef = real(0, 1e6);
    else if (flag == "--moe-z-loss-coef") o.moe_z_loss_coef = real(0, 1e6);
    else if (flag == "--ep") o.ep = integer(1, 1 << 20);
    else if (flag == "--device") {
      const std::string d = value();
      const auto parsed = parse_device(d);
      if (!parsed)
        throw usage_error("--device '" + d + "' is not a device train_gpt runs on: use auto, cpu or cuda" +
                          weft_programs::did_you_mean(d, weft_programs::listed_words("auto, cpu, cuda")));
      o.device = *parsed;
    }
    else if (flag == "--precision") {
      const std::string p = value();
      const auto parsed = parse_precision(p);
      if (!parsed)
        throw usage_error("--precision '" + p + "' is not a precision train_gpt trains in: use fp32 or bf16" +
                          weft_programs::did_you_mean(p, weft_programs::listed_words("fp32, bf16")));
      o.precision = *parsed;
    }
    else if (flag == "--tp") o.tp = integer(1, 1 << 20);
    else if (flag == "--pp") o.pp = integer(1, 1 << 20);
    else if (flag == "--dp") o.dp = integer(1, 1 << 20);
    else if (flag == "--cp") o.cp = integer(1, 1 << 20);
    else if (flag == "--vp") o.vp = integer(1, 1 << 10);
    else if (flag == "--schedule") o.schedule = value();
    else if (flag == "--sequence-parallel") o.sequence_parallel = true;
    else if (flag == "--recompute") {
      const std::string mode = value();
      const auto parsed = weft::tune::parse_recompute(mode);
      if (!parsed)
        throw usage_error("--recompute '" + mode + "' is not a mode train_gpt runs: use none, selective or full" +
                          weft_programs::did_you_mean(mode, weft_programs::listed_words("none, selective, full")));
      o.recompute = *parsed;
    }
    else if (flag == "--micro-batch") o.micro_batch = integer(1, 1 << 20);
    else if (flag == "--global-batch") o.global_batch = integer(1, 1 << 30), o.global_batch_given = true;
    else if (flag == "--zero1") o.zero1 = true, zero1_flag = true;
    else if (flag == "--sharding") {
      const std::string level = value();
      sharding_flag = level;
      if (level == "none") o.sharding = weft::tune::sharding::none;
      else if (level == "zero1") o.sharding = weft::tune::sharding::optimizer;
      else if (level == "zero2") o.sharding = weft::tune::sharding::gradients;
      else if (level == "zero3" || level == "hsdp") o.sharding = weft::tune::sharding::full;
      else throw usage_error("--sharding '" + level + "' is not a level train_gpt runs: use none, zero1, zero2, zero3 or hsdp");
      o.zero1 = level == "zero1";
      o.hybrid = level == "hsdp";
    }
    else if (flag == "--ranks-per-node") o.ranks_per_node = integer(1, 1 << 20);
    else if (flag == "--no-overlap") o.overlap = false, overlap_flag = true;
    else if (flag == "--bucket-mb") o.bucket_mb = real(0.001, 1 << 20), bucket_flag = true;
    else if (flag == "--hardware") o.hardware = value();
    else if (flag == "--plan") o.plan = true;
    else if (flag == "--save") o.save = value();
    else if (flag == "--save-dir") o.save_dir = value();
    else if (flag == "--keep") o.keep = integer(0, 100'000'000), keep_flag = true;
    else if (flag == "--save-every") o.save_every = integer(0, 100'000'000);
    else if (flag == "--resume") o.resume = value();
    else if (flag == "--dump-grads") o.dump_grads = value();
    else if (flag == "--log-json") o.log_json = value();
    else if (flag == "--trace") o.trace = value();
    else if (flag == "--quiet") o.quiet = true;
    else if (flag == "--comm-timeout") o.comm_timeout = weft_programs::parse_comm_timeout_flag(flag, value());
    else throw weft_programs::unknown_option(flag, usage_text);
  }
  for (int i = 1; i < argc; ++i)
    for (std::string_view f : {"--tp", "--pp", "--dp", "--cp", "--vp", "--ep", "--micro-batch", "--sequence-parallel",
                               "--zero1", "--schedule", "--sharding", "--recompute"})
      if (argv[i] == f) o.layout_flags = true;
  if (o.plan && o.layout_flags)
    throw usage_error("--plan chooses the layout: drop --tp --pp --dp --cp --vp --ep --micro-batch --sequence-parallel "
                      "--zero1 --sharding --schedule --recompute, or drop --plan to give them yourself");
  if (o.plan && !o.hardware)
    throw usage_error("--plan needs --hardware FILE, a description of these ranks: measure it first with "
                      "`weft-plan --probe FILE` under the same launcher and ranks");
  // Flags that contradict each other are refused: quietly running one of them would train
  // something other than what the command line says.
  if (zero1_flag && sharding_flag && *sharding_flag != "zero1")
    throw usage_error("--zero1 is --sharding zero1, but --sharding " + *sharding_flag +
                      " asks for another level: give one of them");
  if (zero1_flag) o.zero1 = true, o.hybrid = false, o.sharding = weft::tune::sharding::optimizer;
  if (o.sequence_parallel && o.tp == 1)
    throw usage_error("--sequence-parallel splits the tokens over the tp group, but --tp is 1: give --tp 2 or more, "
                      "or drop --sequence-parallel");
  const bool fully_sharded = o.sharding == weft::tune::sharding::gradients || o.sharding == weft::tune::sharding::full;
  if (fully_sharded && (overlap_flag || bucket_flag))
    throw usage_error(std::string(overlap_flag ? "--no-overlap" : "--bucket-mb") + " sets the gradient buckets of "
                      "--sharding none and zero1; zero2, zero3 and hsdp reduce-scatter each unit's gradients after its "
                      "backward instead: drop it, or choose --sharding none or zero1");
  if (o.save_every > 0 && !o.save && !o.save_dir)
    throw usage_error("--save-every " + std::to_string(o.save_every) + " saves to the file given by --save or the "
                      "directory given by --save-dir, and there is none: add --save FILE or --save-dir DIR");
  if (keep_flag && !o.save_dir)
    throw usage_error("--keep " + std::to_string(o.keep) + " keeps the newest checkpoints of --save-dir, and there is "
                      "none: add --save-dir DIR");
  if (o.resume && o.init_from)
    throw usage_error("--resume continues a checkpoint (its weights, optimizer state and step) and --init-from "
                      "starts from a file's weights: give one of them");
  if (model_name) {
    auto m = named_model(*model_name);
    if (!m) throw usage_error("--model '" + *model_name + "' is not a known shape; known: " + std::string(model_names));
    o.model = *m;
    o.model_name = *model_name;
  }
  for (const auto& [flag, text] : fields) {
    const int v = parse_integer<int>(flag, text, 1, 1 << 24);
    if (flag == "--layers") o.model.layers = v;
    else if (flag == "--hidden") o.model.hidden = v;
    else if (flag == "--heads") o.model.heads = v;
    else if (flag == "--vocab") o.model.vocab = v;
    else if (flag == "--positions") o.model.positions = v;
    else o.model.seq = v;
    o.model_flags.push_back(flag);
  }
  o.model.vocab_divisible_by = o.vocab_divisible_by;
  for (const auto& [flag, v] : moe_fields) {
    (flag == "--moe-experts" ? o.model.moe_experts : flag == "--moe-top-k" ? o.model.moe_top_k : o.model.moe_every) = v;
    o.model_flags.push_back(flag);
  }
  const bool moe_given = std::any_of(moe_fields.begin(), moe_fields.end(), [](const auto& f) { return f.first == "--moe-experts"; });
  if (!moe_given && !o.init_from) {
    for (const char* flag : {"--moe-top-k", "--moe-every", "--moe-capacity-factor", "--moe-aux-loss-coef",
                             "--moe-z-loss-coef", "--ep"})
      for (int i = 1; i < argc; ++i)
        if (argv[i] == std::string_view(flag))
          throw usage_error(std::string(flag) + " sets up the mixture of experts, and there is none: add --moe-experts E "
                            "(the experts of each MoE block), or drop " + flag);
  }
  if (o.schedule != "gpipe" && o.schedule != "1f1b" && o.schedule != "interleaved" && o.schedule != "zb-h1")
    throw usage_error("--schedule '" + o.schedule + "' is not one train_gpt runs: use gpipe, 1f1b, interleaved or zb-h1" +
                      weft_programs::did_you_mean(o.schedule, weft_programs::listed_words("gpipe, 1f1b, interleaved, zb-h1")));
  if (o.schedule == "interleaved" && o.vp < 2)
    throw usage_error("--schedule interleaved needs --vp 2 or more (virtual stages per rank)");
  if (o.schedule != "interleaved" && o.vp > 1)
    throw usage_error("--vp " + std::to_string(o.vp) + " needs --schedule interleaved");
  if (o.ranks_per_node > 0 && !o.hybrid)
    throw usage_error("--ranks-per-node is for --sharding hsdp (where nodes bound the shard groups)");
  if ((o.val_every > 0) != o.val_data.has_value())
    throw usage_error(o.val_data ? "--val-data needs --val-every N (the steps between validation losses)"
                                 : "--val-every needs --val-data FILE|GLOB, the validation data");
  if (o.val_data && (o.sharding == weft::tune::sharding::gradients || o.sharding == weft::tune::sharding::full))
    throw usage_error("--val-data runs forward passes alone, which --sharding zero2, zero3 and hsdp do not run yet: "
                      "use --sharding none or zero1 with --val-data");
  if (o.dump_grads && o.steps != 1) throw usage_error("--dump-grads writes the first step's gradients: give --steps 1");
  return o;
}

}  // namespace train_gpt
