#!/usr/bin/env python3
"""train_gpt's distributed checkpoints (--save-dir, --resume DIR): saved in one layout, resumed in others.

  distributed_checkpoint_check.py matrix|zero3|moe|unequal_caps TRAIN_GPT WEFT_CKPT LAUNCH...

Each case trains 6 steps uninterrupted while saving at steps 3 and 6, then resumes step 3 in other
layouts: steps 4-6 must print the uninterrupted run's losses, to the last digit in the same layout
(and there the final checkpoint's files must be the same bytes), within 1e-6 (relative) in another
(the float32 sums are ordered differently; train_gpt_curve's tolerance).

matrix (4 ranks): saved as dp2 x tp2 + ZeRO-1, vocabulary 250 (padded over tp), resumed as the same
  layout (from the save root, whose newest step directory has no index: the newest complete one is
  taken; with --keep 1), as tp2 x pp2, on 1 rank and as dp4 + ZeRO-3. weft-ckpt inspect and verify
  read the checkpoint, and its export is the model file `--save FILE` wrote of the same state.
zero3 (2 ranks): saved as dp2 + ZeRO-3, resumed as the same and as tp2; then bad checkpoints: a
  corrupted piece (train_gpt and weft-ckpt verify name its file and tensor), a missing rank file,
  another model's directory: exit status 1 and one message, printed once.
moe (4 ranks): a mixture of experts (2 MoE blocks of 4 experts, top 2) saved at step 3 of 7 as
  dp4 x ep2 + ZeRO-1 (each rank holds 2 experts, their moments sharded over the expert
  data-parallel pair), resumed on 1 rank and as ep4 to step 6; the 1-rank run's --save file of
  step 6 resumed as ep2 for step 7. The
  directory holds each expert once, written by the ep rank that owns it, and --save's file of the
  same step every expert (gathered from their ep ranks), equal to the directory's export. Each
  run's max_rank_parameters (--log-json) is the count computed here: the dense part and E / ep
  experts per MoE block.
unequal_caps (4 ranks): dp2 x tp2 + ZeRO-1 with the bucket cap measured, where the two tp ranks'
  dp groups measure different caps (a library preloaded into ranks 0 and 1, $WEFT_TEST_PRELOAD,
  makes large reduce-scatters slow on the first group and every one a little slow on the second),
  so their ZeRO-1 shards cut the tensors tp replicates at other places: saved at step 2 of 3, the
  directory passes weft-ckpt verify and resumes on 1 rank to the uninterrupted step 3.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import safetensors_file

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--vocab", "250",
         "--lr", "3e-3", "--seed", "5", "--global-batch", "4", "--quiet"]
failures = []


def fail(message):
    failures.append(message)
    print("FAILED: " + message)


def run(command, cwd, expect=0):
    r = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=cwd)
    if r.returncode != expect:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        sys.exit(f"distributed_checkpoint_check: '{' '.join(command)}' exited with {r.returncode}, expected {expect}")
    return r


def losses(path):
    with open(path) as f:
        return {json.loads(line)["step"]: line.split('"loss": ')[1].split(",")[0] for line in f if line.strip()}


def compare_curve(what, whole, resumed, exact, steps=(4, 5, 6)):
    if sorted(resumed) != list(steps):
        return fail(f"{what}: the resumed run logged steps {sorted(resumed)}, expected {list(steps)}")
    for step in steps:
        a, b = whole[step], resumed[step]
        rel = abs(float(a) - float(b)) / abs(float(a))
        print(f"{what}: step {step}: uninterrupted {a}  resumed {b}  ({rel:.1e})")
        if exact and a != b:
            fail(f"{what}: step {step}: the resumed loss {b} is not the uninterrupted {a} to the last digit")
        elif rel > 1e-6:
            fail(f"{what}: step {step}: the resumed loss {b} differs from the uninterrupted {a} by {rel:.1e} (> 1e-6)")


def safetensors(path):
    """(metadata, {name: (dtype, shape, bytes)})."""
    return safetensors_file.read(path)


def refused(what, command, cwd, fragments):
    """A bad checkpoint: exit status 1, every fragment on one line, that line printed once, no abort."""
    r = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    text = r.stdout + r.stderr
    lines = [line for line in text.splitlines() if all(f in line for f in fragments)]
    print(f"{what}: exit {r.returncode}: {lines[0].strip() if lines else '(no message)'}")
    if r.returncode != 1:
        fail(f"{what}: exit status {r.returncode}, not 1\n{text[-2000:]}")
    elif len(lines) != 1:
        fail(f"{what}: a line with {fragments} appeared {len(lines)} times, expected once\n{text[-2000:]}")
    elif "MPI_ABORT" in text:
        fail(f"{what}: aborted instead of a clean exit on every rank\n{text[-2000:]}")


def matrix(train_gpt, weft_ckpt, launch, tmp):
    def train(ranks, layout, *flags):
        return launch + ["-n", str(ranks), train_gpt] + MODEL + layout + list(flags)

    saved = ["--dp", "2", "--tp", "2", "--zero1"]
    run(train(4, saved, "--steps", "6", "--save-every", "3", "--save-dir", "ckpt", "--save", "model.safetensors",
              "--log-json", "whole.json"), tmp)
    whole = losses(os.path.join(tmp, "whole.json"))
    ckpt = os.path.join(tmp, "ckpt")
    if sorted(os.listdir(ckpt)) != ["3", "6"]:
        fail(f"--save-every 3 --steps 6 left {sorted(os.listdir(ckpt))} in the save directory, expected 3 and 6")

    # The newest step directory without its index (a save that was interrupted): the root resumes step 3.
    root = os.path.join(tmp, "interrupted")
    shutil.copytree(os.path.join(ckpt, "3"), os.path.join(root, "3"))
    shutil.copytree(os.path.join(ckpt, "6"), os.path.join(root, "6"))
    os.remove(os.path.join(root, "6", "index.json"))
    out = run(train(4, saved, "--steps", "6", "--resume", "interrupted", "--save-dir", "interrupted", "--keep", "1",
                    "--log-json", "same.json"), tmp).stdout
    if "resumed from interrupted/3 at step 3" not in out:
        fail(f"the root whose newest step has no index did not resume its step 3: {out[-500:]}")
    compare_curve("dp2 x tp2 + ZeRO-1 -> the same", whole, losses(os.path.join(tmp, "same.json")), exact=True)
    if sorted(os.listdir(root)) != ["6"]:
        fail(f"--keep 1 left {sorted(os.listdir(root))}, expected the newest step, 6")
    for name in sorted(os.listdir(os.path.join(ckpt, "6"))):
        if name.endswith(".safetensors"):
            with open(os.path.join(ckpt, "6", name), "rb") as a, open(os.path.join(root, "6", name), "rb") as b:
                if a.read() != b.read():
                    fail(f"the resumed run's step-6 {name} differs from the uninterrupted run's (same layout)")

    for ranks, layout, what in [(4, ["--tp", "2", "--pp", "2"], "tp2 x pp2"), (1, [], "1 rank"),
                                (4, ["--dp", "4", "--sharding", "zero3"], "dp4 + ZeRO-3")]:
        log = what.replace(" ", "_") + ".json"
        out = run(train(ranks, layout, "--steps", "6", "--resume", "ckpt/3", "--log-json", log), tmp).stdout
        if "resumed from ckpt/3 at step 3" not in out:
            fail(f"{what}: the run did not say it resumed from ckpt/3: {out[-500:]}")
        compare_curve(f"dp2 x tp2 + ZeRO-1 -> {what}", whole, losses(os.path.join(tmp, log)), exact=False)

    # weft-ckpt on train_gpt's checkpoint.
    out = run([weft_ckpt, "verify", "ckpt"], tmp).stdout
    if not out.startswith("ok: ckpt/6: 84 tensors"):
        fail(f"weft-ckpt verify: {out}")
    out = run([weft_ckpt, "inspect", "ckpt/3"], tmp).stdout
    for fragment in ["step: 3", "layout: cp=1 dp=2 ep=1 global_batch=4 hsdp=0 micro_batch=1 pp=1 sequence_parallel=0 tp=2 "
                     "vp=1 world_size=4 zero_stage=1", "data position: seed=5 sequence=12",
                     "model: train_gpt GPT-2: 2 layers, hidden 64, 4 heads, vocabulary 250, 64 positions",
                     "wte.weight                               F32  [250, 64]          2 pieces",
                     "h.0.attn.c_attn.weight                   F32  [64, 192]          6 pieces"]:
        if fragment not in out:
            fail(f"weft-ckpt inspect does not say {fragment!r}:\n{out}")
    run([weft_ckpt, "export", "ckpt", "exported.safetensors"], tmp)
    exported_meta, exported = safetensors(os.path.join(tmp, "exported.safetensors"))
    saved_meta, saved_file = safetensors(os.path.join(tmp, "model.safetensors"))
    if sorted(exported) != sorted(saved_file) or len(saved_file) != 28:
        fail(f"the export holds {sorted(exported)}, --save's file {sorted(saved_file)}")
    for name, value in saved_file.items():
        if exported.get(name) != value:
            fail(f"tensor {name}: the export of ckpt/6 differs from --save's file of the same step")
    for key in ("n_layer", "n_embd", "n_positions", "vocab_size"):
        if exported_meta.get(key) != saved_meta.get(key):
            fail(f"metadata {key}: export {exported_meta.get(key)!r}, --save {saved_meta.get(key)!r}")
    print(f"weft-ckpt: verify, inspect and export read train_gpt's checkpoint; the export's {len(exported)} tensors "
          "are --save's, byte for byte")


def piece_offset(directory, tensor):
    """The file of `tensor`'s first piece, and where that piece's bytes start in it."""
    with open(os.path.join(directory, "index.json")) as f:
        piece = json.load(f)["tensors"][tensor]["pieces"][0]
    path = os.path.join(directory, piece["file"])
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return piece["file"], 8 + n + header[piece["key"]]["data_offsets"][0]


def zero3(train_gpt, weft_ckpt, launch, tmp):
    def train(ranks, layout, *flags):
        return launch + ["-n", str(ranks), train_gpt] + MODEL + layout + list(flags)

    saved = ["--dp", "2", "--sharding", "zero3"]
    run(train(2, saved, "--steps", "6", "--save-every", "3", "--save-dir", "ckpt", "--log-json", "whole.json"), tmp)
    whole = losses(os.path.join(tmp, "whole.json"))
    for layout, what, exact in [(saved, "the same", True), (["--tp", "2"], "tp2", False)]:
        log = what.replace(" ", "_") + ".json"
        run(train(2, layout, "--steps", "6", "--resume", "ckpt/3", "--log-json", log), tmp)
        compare_curve(f"dp2 + ZeRO-3 -> {what}", whole, losses(os.path.join(tmp, log)), exact=exact)

    # A corrupted piece: one byte of c_attn's first piece flipped.
    shutil.copytree(os.path.join(tmp, "ckpt", "3"), os.path.join(tmp, "corrupt"))
    tensor = "h.1.attn.c_attn.weight"
    file, at = piece_offset(os.path.join(tmp, "corrupt"), tensor)
    with open(os.path.join(tmp, "corrupt", file), "r+b") as f:
        f.seek(at + 5)
        byte = f.read(1)
        f.seek(at + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    where = [f"file '{file}'", f"tensor '{tensor}'"]
    refused("a corrupted piece", train(2, ["--tp", "2"], "--steps", "6", "--resume", "corrupt"), tmp,
            where + ["checksum mismatch"])
    r = subprocess.run([weft_ckpt, "verify", "corrupt"], capture_output=True, text=True, timeout=60, cwd=tmp)
    print(f"weft-ckpt verify of the corrupted copy: exit {r.returncode}")
    if r.returncode != 1 or not any(all(f in line for f in where) for line in (r.stdout + r.stderr).splitlines()):
        fail(f"weft-ckpt verify of a corrupted piece: exit {r.returncode}, expected 1 naming {where}:\n{r.stdout}{r.stderr}")

    shutil.copytree(os.path.join(tmp, "ckpt", "3"), os.path.join(tmp, "missing"))
    os.remove(os.path.join(tmp, "missing", "rank-00001.safetensors"))
    refused("a missing rank file", train(2, ["--tp", "2"], "--steps", "6", "--resume", "missing"), tmp,
            ["file 'rank-00001.safetensors' of rank 1", "cannot be opened"])
    refused("another model's checkpoint", train(2, [], "--hidden", "32", "--steps", "6", "--resume", "ckpt"), tmp,
            ["checkpoint 'ckpt/6'", "tensor 'wte.weight' is F32 [250, 64] but this model needs F32 [250, 32]"])


def moe(train_gpt, weft_ckpt, launch, tmp):
    experts, hidden, vocab, positions, layers = 4, 64, 250, 64, 2

    def train(ranks, layout, *flags):
        return launch + ["-n", str(ranks), train_gpt] + MODEL + ["--moe-experts", str(experts), "--moe-top-k", "2"] + \
            layout + list(flags)

    def expected_parameters(ep):  # every block is an MoE block (--moe-every 1); tp 1, pp 1
        c = hidden
        expert = c * 4 * c + 4 * c + 4 * c * c + c
        block = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + experts * c + experts // ep * expert
        held_vocab = -(-vocab // 128) * 128  # wte's rows as held: Megatron's padding to a multiple of 128 (tp 1)
        return held_vocab * c + positions * c + layers * block + 2 * c

    def check_parameters(what, log, ep):
        with open(os.path.join(tmp, log)) as f:
            counts = {json.loads(line)["max_rank_parameters"] for line in f if line.strip()}
        print(f"{what}: max_rank_parameters {sorted(counts)}, expected {expected_parameters(ep)}")
        if counts != {expected_parameters(ep)}:
            fail(f"{what}: max_rank_parameters {sorted(counts)}, expected {expected_parameters(ep)} "
                 f"(the dense part and {experts // ep} experts per MoE block)")

    saved = ["--ep", "2", "--zero1"]
    run(train(4, saved, "--steps", "7", "--save-every", "3", "--save-dir", "ckpt", "--save", "model.safetensors",
              "--log-json", "whole.json"), tmp)
    whole = losses(os.path.join(tmp, "whole.json"))
    check_parameters("dp4 x ep2 + ZeRO-1", "whole.json", 2)
    for ranks, layout, ep, what in [(1, ["--save", "one.safetensors"], 1, "1 rank"), (4, ["--ep", "4"], 4, "ep4")]:
        log = what.replace(" ", "_") + ".json"
        out = run(train(ranks, layout, "--steps", "6", "--resume", "ckpt/3", "--log-json", log), tmp).stdout
        if "resumed from ckpt/3 at step 3" not in out:
            fail(f"{what} did not say it resumed ckpt/3: {out[-500:]}")
        compare_curve(f"dp4 x ep2 + ZeRO-1 -> {what}", whole, losses(os.path.join(tmp, log)), exact=False)
        check_parameters(what, log, ep)
    # The one rank's whole file (every expert), resumed by the two ep ranks that split them.
    run(train(2, ["--ep", "2"], "--steps", "7", "--resume", "one.safetensors", "--log-json", "from_one.json"), tmp)
    compare_curve("1 rank (--save) -> ep2", whole, losses(os.path.join(tmp, "from_one.json")), exact=False, steps=(7,))

    # Each expert once in the directory, from its ep rank (ep coordinate = world rank % 2 here:
    # the expert grid is expert-tp x ep x expert-dp, tp first).
    with open(os.path.join(tmp, "ckpt", "7", "index.json")) as f:
        tensors = json.load(f)["tensors"]
    for e in range(experts):
        for prefix in ("", "exp_avg.", "exp_avg_sq."):
            name = f"{prefix}h.1.mlp.experts.{e}.c_fc.weight"
            files = sorted({p["file"] for p in tensors[name]["pieces"]})
            owners = [f"rank-{r:05d}.safetensors" for r in range(4) if r % 2 == e // (experts // 2)]
            if len(files) < 1 or any(f not in owners for f in files):
                fail(f"{name} is written by {files}, expected by its ep rank's ranks {owners}")
            covered = sum(1 for p in tensors[name]["pieces"])
            if prefix == "" and covered != 1:
                fail(f"{name} has {covered} pieces in the directory, expected one copy")
    run([weft_ckpt, "export", "ckpt", "exported.safetensors"], tmp)
    _, exported = safetensors(os.path.join(tmp, "exported.safetensors"))
    _, saved_file = safetensors(os.path.join(tmp, "model.safetensors"))
    names = [f"h.{i}.mlp.experts.{e}.{w}" for i in range(layers) for e in range(experts)
             for w in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")]
    missing = [n for n in names if n not in saved_file]
    if missing:
        fail(f"--save's file (gathered from the ep ranks) lacks {missing}")
    if sorted(exported) != sorted(saved_file):
        fail(f"the export holds {sorted(exported)}, --save's file {sorted(saved_file)}")
    for name, value in saved_file.items():
        if exported.get(name) != value:
            fail(f"tensor {name}: the export of ckpt/6 differs from --save's file of the same step")
    print(f"moe: --save's file holds all {len(names)} expert tensors, equal to the directory's export")


def unequal_caps(train_gpt, weft_ckpt, launch, tmp):
    model = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "32", "--vocab", "1000", "--lr", "3e-3",
             "--seed", "5", "--global-batch", "4", "--quiet"]
    # The gradients a tp rank reduces are about 2 MB. Group (0, 2): each reduce-scatter of 512 KiB
    # or more returns 2 ms late, so 256 KiB is the fastest per byte and the buckets are 6; group
    # (1, 3): every one returns 0.3 ms late, so the whole is, and the buckets are 2 (the first
    # bucket's 1 MiB and the rest). wpe's moments are then cut at other places on the two.
    slowed = launch[:1] + ["-x", "LD_PRELOAD=" + os.environ["WEFT_TEST_PRELOAD"],
                           "-x", "WEFT_TEST_LATE_RSB=0:524288:2000,1:0:300"] + launch[1:]
    run(slowed + ["-n", "4", train_gpt] + model + ["--dp", "2", "--tp", "2", "--zero1", "--steps", "3",
                                                    "--save-every", "2", "--save-dir", "ckpt", "--log-json", "whole.json"],
        tmp)
    out = run([weft_ckpt, "verify", "ckpt/2"], tmp).stdout
    if not out.startswith("ok: ckpt/2"):
        fail(f"weft-ckpt verify ckpt/2: {out}")
    run(launch + ["-n", "1", train_gpt] + model + ["--steps", "3", "--resume", "ckpt/2", "--log-json", "one.json"], tmp)
    compare_curve("dp2 x tp2 + ZeRO-1, unequal caps -> 1 rank", losses(os.path.join(tmp, "whole.json")),
                  losses(os.path.join(tmp, "one.json")), exact=False, steps=(3,))


def main():
    case, train_gpt, weft_ckpt, launch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    with tempfile.TemporaryDirectory() as tmp:  # also the runs' working directory
        {"matrix": matrix, "zero3": zero3, "moe": moe, "unequal_caps": unequal_caps}[case](train_gpt, weft_ckpt, launch, tmp)
    if failures:
        print(f"distributed_checkpoint_check {case}: FAILED:\n" + "\n".join(failures))
        return 1
    print(f"distributed_checkpoint_check {case}: every case passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
