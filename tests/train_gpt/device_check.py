#!/usr/bin/env python3
"""train_gpt on GPUs (--device cuda, fp32) against the CPU trainer (needs a GPU: label gpu).

  device_check.py [--rank-wrapper SCRIPT] [--four] TRAIN_GPT LAUNCH...

1. the first step's loss and every gradient (--dump-grads) of --device cuda against --device cpu on
   the same weights and tokens (one CPU rank), two micro-batches of two sequences: on one GPU
   (gradient accumulation, and attention over each sequence of a micro-batch), as dp 2 (the
   synchronizer summing over NCCL), as tp 2 (Megatron's column- and row-parallel layers, the
   vocabulary-parallel embedding and loss, each sum over tp on NCCL; the dump gathers the slices
   into whole tensors), as tp 2 with sequence parallelism (the rows outside the blocks split
   over tp, all-gathered and reduce-scattered around them), as cp 2 (each rank 2 chunks of every
   sequence, ring attention over NCCL) and as pp 2 under 1f1b (the pipeline executor's transfers on
   NCCL, the tied embedding's two copies summed) and under zb-h1 (the layers' weight gradients in
   the executor's weight passes, from the output gradients each slot keeps), as dp 2 under ZeRO-3
   (the sharded units on the device, the dump gathered from the gradient shards) and as tp 2 with
   sequence parallelism under ZeRO-3 (the units' gradients summed over tp where each rank computed
   them from its rows, wpe's not): the loss within 1e-5 relative, each gradient within 1e-3 of
   its largest element (the products and sums run in other orders, GELU and the loss use the GPU's
   exp; a wrong term or index is off by the gradient's own size); and with recomputation
   (selective on one GPU and as dp 2 under ZeRO-3, full as tp 2 with sequence parallelism and as
   pp 2): the same bounds, and every gradient equal to the bit to the run's without it;
2. 20 steps on each: every loss within 2e-4 relative of the CPU's (AdamW compounds the first
   step's rounding);
3. two GPU runs print the same 20 losses to the last digit (every kernel is deterministic);
4. the GPU's refusals name what to do: mixture of experts, --precision bf16 on a hidden size of 60, --save-dir.

--four: item 1 alone on four ranks instead, as dp 2 x tp 2 (the synchronizer over dp, the sums
over tp, both on NCCL) and as dp 2 x tp 2 with sequence parallelism under ZeRO-3 (the units
sharded over dp, their tp sums), against the same one-rank CPU run.

--rank-wrapper runs each rank of the multi-rank runs through SCRIPT (tests/nccl/per_rank_hostid.sh,
where the ranks share one GPU).
"""
import os
import re
import struct
import subprocess
import sys
import tempfile

import safetensors_file

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--seed", "7",
         "--micro-batch", "2", "--global-batch", "4", "--lr", "3e-3"]


def RECOMPUTED(one, two):
    """The runs repeated with recomputation: (the run's name, its command, the mode)."""
    return (("cuda", one + ["--device", "cuda"], "selective"),
            ("cuda dp2 zero3", two + ["--device", "cuda", "--dp", "2", "--sharding", "zero3"], "selective"),
            ("cuda tp2 sp", two + ["--device", "cuda", "--tp", "2", "--sequence-parallel"], "full"),
            ("cuda pp2", two + ["--device", "cuda", "--pp", "2"], "full"))


def run(command, expect=0):
    r = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if r.returncode != expect:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        program = os.path.splitext(os.path.basename(sys.argv[0]))[0]  # this script or one importing run()
        sys.exit(f"{program}: '{' '.join(command)}' exited with {r.returncode}, not {expect}")
    return r.stdout + r.stderr


def floats(path):
    """name -> the float32 values of each F32 tensor of a safetensors file."""
    return {name: struct.unpack(f"<{len(data) // 4}f", data)
            for name, (dtype, _, data) in safetensors_file.read(path)[1].items() if dtype == "F32"}


def losses(text):
    return [m.group(1) for m in re.finditer(r"^step \d+/\d+ \| loss ([0-9.]+)", text, re.M)]


def compare(cpu, gpu, what, failures):
    """The loss and every gradient of a GPU dump against the CPU's."""
    if sorted(cpu) != sorted(gpu):
        failures.append(f"{what}: the dumps hold different tensors: {sorted(set(cpu) ^ set(gpu))}")
    loss_error = abs(gpu["loss"][0] - cpu["loss"][0]) / abs(cpu["loss"][0])
    print(f"first-step loss ({what}): cpu {cpu['loss'][0]:.7f} cuda {gpu['loss'][0]:.7f} (relative {loss_error:.1e})")
    if loss_error > 1e-5:
        failures.append(f"{what}: loss: cuda {gpu['loss'][0]} against cpu {cpu['loss'][0]}")
    worst = 0.0
    for name in sorted(cpu):
        if name == "loss" or name not in gpu:
            continue
        scale = max(abs(v) for v in cpu[name]) or 1.0
        error = max(abs(a - b) for a, b in zip(cpu[name], gpu[name])) / scale
        worst = max(worst, error)
        if error > 1e-3 or len(cpu[name]) != len(gpu[name]):
            failures.append(f"{what}: gradient {name}: off by {error:.2e} of its largest element {scale:.3e}")
    print(f"gradients ({what}): {len(cpu) - 1} tensors, worst error {worst:.1e} of the tensor's largest element")


def check_four(one, four):
    """Item 1 on four ranks: dp 2 x tp 2, and dp 2 x tp 2 + sp under ZeRO-3, against one CPU rank."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        dumps = {}
        for what, command in (("cpu", one + ["--device", "cpu"]),
                              ("cuda dp2 tp2", four + ["--device", "cuda", "--dp", "2", "--tp", "2"]),
                              ("cuda dp2 tp2 sp zero3", four + ["--device", "cuda", "--dp", "2", "--tp", "2",
                                                                "--sequence-parallel", "--sharding", "zero3"])):
            path = os.path.join(tmp, what.replace(" ", "_") + ".safetensors")
            out = run(command + MODEL + ["--steps", "1", "--dump-grads", path, "--quiet"])
            if what != "cpu" and "GPU(s) in fp32" not in out:
                failures.append(f"{what}: --device cuda did not say it trains on GPUs:\n" + out[-2000:])
            dumps[what] = floats(path)
        for what in ("cuda dp2 tp2", "cuda dp2 tp2 sp zero3"):
            compare(dumps["cpu"], dumps[what], what, failures)
    if failures:
        print("device_check: FAILED:\n" + "\n".join(failures))
        return 1
    print("device_check: the GPU trainer on four ranks agrees with the CPU trainer")
    return 0


def main():
    args = sys.argv[1:]
    wrapper = []
    if args[:1] == ["--rank-wrapper"]:
        wrapper, args = [args[1]], args[2:]
    four = args[:1] == ["--four"]
    if four:
        args = args[1:]
    train_gpt, launch = args[0], args[1:]
    one = launch + ["-n", "1", train_gpt]
    two = launch + ["-n", "2"] + wrapper + [train_gpt]
    failures = []
    if four:
        return check_four(one, launch + ["-n", "4"] + wrapper + [train_gpt])
    with tempfile.TemporaryDirectory() as tmp:
        dumps = {}
        for what, command in (("cpu", one + ["--device", "cpu"]), ("cuda", one + ["--device", "cuda"]),
                              ("cuda dp2", two + ["--device", "cuda", "--dp", "2"]),
                              ("cuda tp2", two + ["--device", "cuda", "--tp", "2"]),
                              ("cuda tp2 sp", two + ["--device", "cuda", "--tp", "2", "--sequence-parallel"]),
                              ("cuda cp2", two + ["--device", "cuda", "--cp", "2"]),
                              ("cuda pp2", two + ["--device", "cuda", "--pp", "2"]),
                              ("cuda pp2 zb-h1", two + ["--device", "cuda", "--pp", "2", "--schedule", "zb-h1"]),
                              ("cuda dp2 zero3", two + ["--device", "cuda", "--dp", "2", "--sharding", "zero3"]),
                              ("cuda tp2 sp zero3", two + ["--device", "cuda", "--tp", "2", "--sequence-parallel",
                                                           "--sharding", "zero3"])) + tuple(
                (what + " " + mode, command + ["--recompute", mode]) for what, command, mode in RECOMPUTED(one, two)):
            path = os.path.join(tmp, what.replace(" ", "_") + ".safetensors")
            out = run(command + MODEL + ["--steps", "1", "--dump-grads", path, "--quiet"])
            if what != "cpu" and "GPU(s) in fp32" not in out:
                failures.append(f"{what}: --device cuda did not say it trains on GPUs:\n" + out[-2000:])
            dumps[what] = floats(path)
        compare(dumps["cpu"], dumps["cuda"], "cuda", failures)
        compare(dumps["cpu"], dumps["cuda dp2"], "cuda dp2", failures)
        compare(dumps["cpu"], dumps["cuda tp2"], "cuda tp2", failures)
        compare(dumps["cpu"], dumps["cuda tp2 sp"], "cuda tp2 sp", failures)
        compare(dumps["cpu"], dumps["cuda cp2"], "cuda cp2", failures)
        compare(dumps["cpu"], dumps["cuda pp2"], "cuda pp2", failures)
        compare(dumps["cpu"], dumps["cuda pp2 zb-h1"], "cuda pp2 zb-h1", failures)
        compare(dumps["cpu"], dumps["cuda dp2 zero3"], "cuda dp2 zero3", failures)
        compare(dumps["cpu"], dumps["cuda tp2 sp zero3"], "cuda tp2 sp zero3", failures)
        # Recomputation reruns the same kernels on the same inputs: the gradients are the bits of
        # the run without it (and so, as it, within the bounds of the CPU's).
        for what, _, mode in RECOMPUTED(one, two):
            compare(dumps["cpu"], dumps[what + " " + mode], what + " " + mode, failures)
            same = dumps[what + " " + mode] == dumps[what]
            print(f"recompute {mode} ({what}): gradients {'equal to the bit' if same else 'differ from'} "
                  f"those without it")
            if not same:
                differing = sorted(k for k in dumps[what] if dumps[what][k] != dumps[what + " " + mode].get(k))
                failures.append(f"{what} with --recompute {mode}: gradients differ from those without it: {differing[:5]}")

        curves = {}
        for device, tag in (("cpu", "cpu"), ("cuda", "cuda"), ("cuda", "cuda again")):
            curves[tag] = losses(run(one + MODEL + ["--device", device, "--steps", "20"]))
        if len(curves["cpu"]) != 20 or len(curves["cuda"]) != 20:
            failures.append(f"20 steps printed {len(curves['cpu'])} (cpu) and {len(curves['cuda'])} (cuda) losses")
        drift = max((abs(float(g) - float(c)) / float(c) for c, g in zip(curves["cpu"], curves["cuda"])), default=1.0)
        print(f"20 steps: cpu {curves['cpu'][-1:]} cuda {curves['cuda'][-1:]}, largest relative difference {drift:.1e}")
        if drift > 2e-4:
            failures.append(f"the cuda curve left the cpu's by {drift:.2e} (bound 2e-4)")
        if curves["cuda"] != curves["cuda again"]:
            failures.append("two cuda runs printed different losses: " +
                            str([(a, b) for a, b in zip(curves["cuda"], curves["cuda again"]) if a != b][:3]))

        refusals = [
            (one + MODEL + ["--device", "cuda", "--moe-experts", "4", "--steps", "1"],
             "--device cuda: the trainer on the GPU runs the dense model"),
            (one + MODEL + ["--device", "cuda", "--precision", "bf16", "--hidden", "60", "--steps", "1"],
             "--device cuda: --precision bf16 needs --hidden a multiple of 8"),
            (one + MODEL + ["--device", "cuda", "--steps", "1", "--save-dir", os.path.join(tmp, "ckpt")],
             "--device cuda: the trainer on the GPU does not take --save-dir"),
        ]
        for command, fragment in refusals:
            text = run(command, expect=1)
            if sum(fragment in line for line in text.splitlines()) != 1:
                failures.append(f"'{' '.join(command)}' did not say '{fragment}' once:\n{text[-2000:]}")
    if failures:
        print("device_check: FAILED:\n" + "\n".join(failures))
        return 1
    print("device_check: the GPU trainer agrees with the CPU trainer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
