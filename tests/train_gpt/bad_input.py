#!/usr/bin/env python3
"""train_gpt refuses bad input on every rank with one message, and never hangs.

  bad_input.py TRAIN_GPT LAUNCH...

Each case runs train_gpt on 2 or 4 ranks with one mistake and checks: a non-zero exit within the
time limit (status 1, a mistake in the flags or files), the message (a fragment that says what was wrong and what to do) printed exactly once,
and no traceback of an abort. The checkpoint cases first save a good checkpoint, then damage a copy.
The cases are independent jobs that spend most of their time starting MPI, so two run at a time
(the results are printed in the cases' order).
"""
import concurrent.futures
import os
import shutil
import struct
import subprocess
import sys
import tempfile

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--quiet"]


def main():
    train_gpt, launch = sys.argv[1], sys.argv[2:]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        good = os.path.join(tmp, "good.safetensors")
        r = subprocess.run(launch + ["-n", "1", train_gpt] + SMALL + ["--steps", "1", "--save", good],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            sys.exit("bad_input: could not save the checkpoint the damaged copies start from:\n" + r.stderr[-3000:])
        truncated = os.path.join(tmp, "truncated.safetensors")
        with open(good, "rb") as f:
            data = f.read()
        with open(truncated, "wb") as f:
            f.write(data[: len(data) // 2])
        corrupt = os.path.join(tmp, "corrupt.safetensors")
        with open(corrupt, "wb") as f:
            f.write(data[:8] + b"{" * 16 + data[24:])
        shutil.copy(good + ".optimizer", truncated + ".optimizer")
        stateless = os.path.join(tmp, "stateless.safetensors")  # a model file without its optimizer state
        shutil.copy(good, stateless)
        # Token shards with one fault each (llm.c's header: magic, version, count; then uint16 tokens).
        def shard(name, tokens, magic=20240520, count=None, cut=0):
            path = os.path.join(tmp, name)
            data = struct.pack("<256i", magic, 1, len(tokens) if count is None else count, *([0] * 253))
            data += struct.pack(f"<{len(tokens)}H", *tokens)
            with open(path, "wb") as f:
                f.write(data[:len(data) - cut])
            return path
        tokens = [i % 200 for i in range(300)]
        wrong_magic = shard("magic.bin", tokens, magic=1234)
        truncated_shard = shard("short.bin", tokens, cut=7)
        big_token = shard("big.bin", tokens[:100] + [300] + tokens[101:])
        # --device cuda without a GPU says why it cannot train on one (where a GPU is visible the
        # run trains: tests/train_gpt/device_check.py, label gpu, covers that).
        gpu_visible = shutil.which("nvidia-smi") is not None and subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True).stdout.startswith("GPU ")
        cases = [
            ("an unknown device", 2, ["--device", "gpu"],
             "--device 'gpu' is not a device train_gpt runs on: use auto, cpu or cuda"),
            ("bf16 on the CPU", 2, ["--device", "cpu", "--precision", "bf16"],
             "--precision bf16 trains on GPUs only (bf16 parameters and activations, fp32 master weights), and "
             "--device cpu computes in fp32 only: drop --precision bf16"),
            ("bf16 where auto chooses the CPU", 2, ["--precision", "bf16"], "and --device auto chose the CPU: "),
            ("a token shard with the wrong magic", 2, ["--data", wrong_magic],
             f"'{wrong_magic}' is not an llm.c token shard: its first int32 is 1234, not the magic 20240520"),
            ("a truncated token shard", 2, ["--data", truncated_shard],
             f"'{truncated_shard}' is truncated: its header says 300 tokens"),
            ("a token shard with a token beyond the vocabulary", 2, ["--data", big_token],
             f"'{big_token}' holds token 300 (token 100, byte offset 1224), not below the vocabulary of 256"),
            ("degrees that do not multiply to the ranks", 4, ["--tp", "2", "--pp", "2", "--dp", "2"],
             "ranks, but 4 were launched"),
            ("degrees that do not divide the ranks", 4, ["--tp", "3"], "does not divide the 4 ranks"),
            ("heads not divisible by tp", 2, ["--tp", "2", "--heads", "3", "--hidden", "63"],
             "3 attention heads do not divide over tp=2"),
            ("hidden not divisible by heads", 2, ["--hidden", "66"], "is not divisible by --heads 4"),
            ("layers not divisible by pp", 2, ["--pp", "2", "--layers", "3"], "3 layers do not divide over pp=2"),
            ("a sequence longer than the positions", 2, ["--seq", "100"], "is longer than the model's 64 positions"),
            ("a global batch that dp does not divide", 2, ["--global-batch", "3"], "is not a multiple of dp 2"),
            ("a missing data file", 2, ["--data", os.path.join(tmp, "missing.txt")], "cannot open the data file"),
            ("a checkpoint of another shape", 2, ["--resume", good, "--hidden", "128"],
             "has shape [256, 64] but this model needs [256, 128]"),
            ("flags that disagree with --init-from", 2, ["--init-from", good, "--layers", "3"],
             "--layers 3 disagrees with"),
            ("a truncated checkpoint", 2, ["--resume", truncated], "truncated"),
            ("a corrupt checkpoint", 2, ["--init-from", corrupt], corrupt),
            ("a missing checkpoint", 2, ["--resume", os.path.join(tmp, "none.safetensors")], "cannot open it"),
            ("resume without the optimizer state", 2, ["--resume", stateless], "stateless.safetensors.optimizer"),
            ("full sharding with pipeline stages", 2, ["--pp", "2", "--sharding", "zero3"],
             "run with --pp 1"),
            ("full sharding with a schedule that overlaps micro-batches", 2, ["--sharding", "zero2", "--schedule", "gpipe"],
             "need --schedule 1f1b"),
            ("recomputation with a schedule that defers the weight gradients", 2,
             ["--pp", "2", "--recompute", "full", "--schedule", "zb-h1"], "use another schedule or --recompute none"),
            ("an unknown recomputation mode", 2, ["--recompute", "attention"], "use none, selective or full"),
            ("an unknown sharding level", 2, ["--sharding", "zero4"], "is not a level train_gpt runs"),
            ("a node size without hybrid sharding", 2, ["--sharding", "zero3", "--ranks-per-node", "1"],
             "--ranks-per-node is for --sharding hsdp"),
            ("hybrid sharding over unequal nodes", 4, ["--sharding", "hsdp", "--ranks-per-node", "3"],
             "has 3 ranks on node 0 but 1 on node 1; hybrid sharding needs equal shard groups"),
            ("sequence parallelism without tensor parallelism", 2, ["--sequence-parallel"],
             "--sequence-parallel splits the tokens over the tp group, but --tp is 1"),
            ("two sharding levels at once", 2, ["--sharding", "zero3", "--zero1"],
             "--zero1 is --sharding zero1, but --sharding zero3 asks for another level"),
            ("gradient buckets with full sharding", 2, ["--sharding", "zero2", "--no-overlap"],
             "--no-overlap sets the gradient buckets of --sharding none and zero1"),
            ("a bucket size with full sharding", 2, ["--bucket-mb", "4", "--sharding", "hsdp"],
             "--bucket-mb sets the gradient buckets of --sharding none and zero1"),
            ("a save interval without a file", 2, ["--save-every", "2"], "add --save FILE"),
            ("a resume and an initial file at once", 2, ["--resume", good, "--init-from", good],
             "--resume continues a checkpoint"),
            ("a resume with nothing left to train", 2, ["--resume", good],
             "is at step 1 and --steps 1 counts every step from the start"),
            # Mixture of experts (issue 23); the first two are refused before the layout, so one rank shows them.
            ("experts that ep does not divide", 1, ["--moe-experts", "3", "--ep", "2"],
             "--moe-experts 3 do not divide over --ep 2"),
            ("a top-k above the experts", 1, ["--moe-experts", "2", "--moe-top-k", "3"],
             "--moe-top-k 3 is more than the 2 experts"),
            ("an ep that does not divide the expert data-parallel ranks", 2, ["--moe-experts", "6", "--ep", "3"],
             "expert-tp=1 x ep=3 x pp=1 = 3 does not divide the world size 2"),
            ("full sharding of experts held by their ep ranks", 2,
             ["--moe-experts", "2", "--ep", "2", "--sharding", "zero3"],
             "with --ep 2 each rank holds only its E / ep experts, reduced over the expert data-parallel ranks: "
             "use --sharding zero1"),
            ("a --save-dir that cannot be made", 2, ["--save-dir", os.path.join(good, "ckpt")],
             f"'{os.path.join(good, 'ckpt')}' is not a folder checkpoints can be written to (ranks 0, 1 cannot make"),
            ("a --save in a folder that cannot be made", 2, ["--save", os.path.join(good, "gpt.safetensors")],
             f"'{good}' is not a folder checkpoints can be written to (rank 0 cannot make"),
            ("a resume on another global batch", 2, ["--resume", good, "--steps", "2"],
             "was trained with a global batch of 1 sequences per step, but this run's default is 2 (dp 2 x "
             "micro-batch 1): give --global-batch 1"),
        ]
        if not gpu_visible:
            cases.append(("--device cuda without a GPU", 2, ["--device", "cuda"], "--device cuda: no GPU to train on: "))
        def run_case(case):
            what, ranks, flags, fragment = case
            command = launch + ["-n", str(ranks), train_gpt] + SMALL + ["--steps", "1"] + flags
            try:
                return command, subprocess.run(command, capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:
                return command, None
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(run_case, cases))
        for (what, ranks, flags, fragment), (command, r) in zip(cases, results):
            if r is None:
                failures.append(f"{what}: hung (no exit within 60 s): {' '.join(command)}")
                continue
            text = r.stdout + r.stderr
            lines = [line for line in text.splitlines() if fragment in line]
            status = "ok"
            if r.returncode != 1:
                status = f"exited {r.returncode}, not 1 (a mistake in the flags or files)"
            elif len(lines) != 1:
                status = f"the message ({fragment!r}) appeared {len(lines)} times, expected once"
            elif "MPI_ABORT" in text or "rank 1:" in text:
                status = "aborted instead of a clean exit on every rank"
            print(f"{what}: exit {r.returncode}: {lines[0].strip() if lines else '(no message)'}")
            if status != "ok":
                failures.append(f"{what}: {status}\n{text[-2000:]}")
        # The way out the global-batch message names: the same resume with the batch given is accepted.
        command = launch + ["-n", "2", train_gpt] + SMALL + ["--resume", good, "--steps", "2", "--global-batch", "2"]
        r = subprocess.run(command, capture_output=True, text=True, timeout=120)
        print(f"a resume on another global batch, given with --global-batch: exit {r.returncode}")
        if r.returncode != 0 or "resumed from" not in r.stdout:
            failures.append(f"a resume with --global-batch 2: exit {r.returncode}\n{(r.stdout + r.stderr)[-2000:]}")
    if failures:
        print("bad_input: FAILED:\n" + "\n".join(failures))
        return 1
    print(f"bad_input: all {len(cases)} cases refused with one message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
