#!/usr/bin/env python3
"""train_gpt on GPUs: bf16 against fp32, bit-exact resume, ZeRO-1 against dp 2, tp and cp's whole state
and bf16 (needs a GPU: label gpu).

  device_runs_check.py bf16 TRAIN_GPT LAUNCH...
  device_runs_check.py resume TRAIN_GPT LAUNCH...
  device_runs_check.py sharding [--rank-wrapper SCRIPT] TRAIN_GPT LAUNCH...
  device_runs_check.py layouts [--rank-wrapper SCRIPT] TRAIN_GPT LAUNCH...

The model is device_check.py's (2 layers, hidden 64, 4 heads, seq 32, vocabulary 256, two
micro-batches of two sequences a step, lr 3e-3).

bf16: --precision bf16 against --precision fp32 on the GPU, from the same weights and tokens.
  The bands come from bf16's rounding (unit roundoff u = 2^-9, about 2e-3 relative) in this model,
  not from a run:
  1. the first step's loss within 2e-3 relative. At initialisation the logits are about
     0.02 x sqrt(64) = 0.16 (wte's N(0, 0.02) against a normalised h); h and wte rounded to bf16,
     and h carrying the roundings of the two layers before it (about ten, of u each; attention on
     the tensor cores adds its operands', q, k, v and the probabilities, among them), put each
     logit within about 10 u x 0.16 = 3e-3 of fp32's; a row's loss moves by at most twice its
     largest logit error (6e-3 of 5.5 nats, 1e-3 relative), and the mean over 128 rows averages
     those errors' signs: 2e-3 is twice the worst case;
  2. every gradient within 0.1 of the tensor's largest element: a gradient collects about twenty
     roundings on its way back from the loss (each product's bf16 output, the residual stream's
     bf16 gradient, and attention's bf16 operands: dout, the probabilities and their gradients),
     about 20 u = 4 % at worst; 0.1 leaves a margin, and a wrong term,
     index or missing conversion is off by the gradient's own size. The gradients must also differ
     from fp32's by more than 1e-5 of the largest (fp32 runs repeat to the bit: a bf16 run equal
     to fp32 would not be computing in bf16);
  3. 50 steps: every loss within 3e-2 relative of fp32's. AdamW's update is about lr x m / sqrt(v),
     which a gradient error of about 1 % moves by about 1 % where gradients are steady: after 50
     steps of lr 3e-3 the weights differ by about 50 x 3e-3 x 1e-2 = 1.5e-3 against a change of
     0.15 (1 %), moving the loss by about 1 % of its 3-nat fall plus bf16's own rounding of the
     loss (item 1); 3e-2 is three times that. bf16 must train: its last loss at least 1 nat below
     its first;
  4. two bf16 runs print the same 50 losses (every kernel, conversions included, is deterministic).

resume: for fp32 and for bf16, 2N steps (N = 4) with --save, against N steps with --save then
  --resume for the other N with --save: the losses of steps N+1..2N printed alike (to the last
  digit), and the two final checkpoints (weights, and AdamW's moments with the step and the data
  position) byte-equal.

sharding: dp 2 with --zero1 (AdamW on each rank's shard of the reduce-scattered gradients, then the
  shards gathered) in fp32 and in bf16, and with the sharded units of --sharding zero2, zero3 (and
  zero3 in bf16) and hsdp with --ranks-per-node 1 (shard groups of one rank, the gradients
  all-reduced across the two replicas), each against plain dp 2 for 10 steps: the same printed
  losses to the last digit, and --save files byte-equal to plain dp 2's (the shards and their
  moments gathered into whole tensors), and ZeRO-1's --dump-grads file (the first step's reduced
  gradient shards gathered) byte-equal to dp 2's; then ZeRO-1 and ZeRO-3 as dp 2 resumed as
  `resume` below does it (fp32). With two ranks a reduce-scatter and an all-reduce add the same two
  numbers, each rank runs one micro-batch a step (so the units reduce what the synchronizer
  reduces), and AdamW is elementwise, so the weights stay bit-equal; a shard left ungathered, a
  moment applied to the wrong run, a unit bound to another's parameters, the output layer's
  gradient left out of the root's, or a stale bf16 copy changes the losses from the first or second
  step. --rank-wrapper runs each rank through SCRIPT (tests/nccl/per_rank_hostid.sh, where the
  ranks share one GPU).

layouts: one step in fp32 on one GPU (its gradients dumped) against
  1. one step at lr 0 on one GPU, as tp 2 with sequence parallelism and as pp 2, each saved: the
     weights (gathered from the tp slices or the stages into whole tensors) equal to the bit, since lr 0 leaves the
     initial weights as they were; AdamW's moments, (1 - beta1) g and (1 - beta2) g^2, within
     2e-3 of each tensor's largest element (device_check.py's 1e-3 on the gradients, doubled for
     the square). A slice placed at the wrong rows or columns, or a replicated tensor summed over
     tp, is off by the tensor's own size;
  2. bf16 as tp 2 with sequence parallelism, and bf16 as cp 2: every gradient within bf16's band
     (0.1 of the largest element, as in bf16 above) of the fp32 one GPU's, and not equal to it.
"""
import filecmp
import os
import re
import sys
import tempfile

from device_check import MODEL, floats, run  # the same model, runner and reader as the first-step check


def losses(text):
    """(step, loss as printed) of each step line."""
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^step (\d+)/\d+ \| loss ([0-9.]+)", text, re.M)]


def check_bf16(one, tmp, failures):
    dumps = {}
    for precision in ("fp32", "bf16"):
        path = os.path.join(tmp, precision + ".safetensors")
        out = run(one + MODEL + ["--precision", precision, "--steps", "1", "--dump-grads", path, "--quiet"])
        if f"GPU(s) in {precision}" not in out:
            failures.append(f"--precision {precision} did not say it trains on the GPU in {precision}:\n" + out[-2000:])
        dumps[precision] = floats(path)
    fp32, bf16 = dumps["fp32"], dumps["bf16"]
    loss_error = abs(bf16["loss"][0] - fp32["loss"][0]) / abs(fp32["loss"][0])
    print(f"bf16 first-step loss: fp32 {fp32['loss'][0]:.7f} bf16 {bf16['loss'][0]:.7f} (relative {loss_error:.1e}, "
          "band 2e-3)")
    if loss_error > 2e-3:
        failures.append(f"bf16's first-step loss {bf16['loss'][0]} is {loss_error:.2e} from fp32's {fp32['loss'][0]}")
    if sorted(fp32) != sorted(bf16):
        failures.append(f"the dumps hold different tensors: {sorted(set(fp32) ^ set(bf16))}")
    worst, worst_name = 0.0, ""
    for name in sorted(fp32):
        if name == "loss" or name not in bf16:
            continue
        scale = max(abs(v) for v in fp32[name]) or 1.0
        error = max(abs(a - b) for a, b in zip(fp32[name], bf16[name])) / scale
        if error > worst:
            worst, worst_name = error, name
        if error > 0.1 or len(fp32[name]) != len(bf16[name]):
            failures.append(f"bf16 gradient {name}: off by {error:.2e} of fp32's largest element {scale:.3e} (band 0.1)")
    print(f"bf16 gradients: {len(fp32) - 1} tensors, worst {worst:.1e} of the tensor's largest element ({worst_name}; "
          "band 0.1)")
    if worst <= 1e-5:
        failures.append(f"bf16's gradients are fp32's to {worst:.1e}: --precision bf16 does not compute in bf16")

    curves = {}
    for precision, tag in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "bf16 again")):
        curves[tag] = losses(run(one + MODEL + ["--precision", precision, "--steps", "50"]))
    values = {tag: [float(loss) for _, loss in curve] for tag, curve in curves.items()}
    if len(values["fp32"]) != 50 or len(values["bf16"]) != 50:
        failures.append(f"50 steps printed {len(values['fp32'])} (fp32) and {len(values['bf16'])} (bf16) losses")
        return
    drift = max(abs(b - f) / f for f, b in zip(values["fp32"], values["bf16"]))
    print(f"bf16 50 steps: fp32 {values['fp32'][0]:.4f} -> {values['fp32'][-1]:.4f}, bf16 {values['bf16'][0]:.4f} -> "
          f"{values['bf16'][-1]:.4f}, largest relative difference {drift:.1e} (band 3e-2)")
    if drift > 3e-2:
        failures.append(f"the bf16 curve left fp32's by {drift:.2e} relative (band 3e-2)")
    if values["bf16"][0] - values["bf16"][-1] < 1.0:
        failures.append(f"bf16 did not train: loss {values['bf16'][0]} -> {values['bf16'][-1]} in 50 steps")
    if curves["bf16"] != curves["bf16 again"]:
        failures.append("two bf16 runs printed different losses: " +
                        str([(a, b) for a, b in zip(curves["bf16"], curves["bf16 again"]) if a != b][:3]))


def check_resume(one, tmp, failures, precisions=("fp32", "bf16"), label=""):
    n = 4
    for precision in precisions:
        flags = MODEL + ["--precision", precision]
        whole = os.path.join(tmp, label + precision + "_whole.safetensors")
        split = os.path.join(tmp, label + precision + "_split.safetensors")
        straight = losses(run(one + flags + ["--steps", str(2 * n), "--save", whole]))
        first = losses(run(one + flags + ["--steps", str(n), "--save", split]))
        text = run(one + flags + ["--steps", str(2 * n), "--resume", split, "--save", split])
        second = losses(text)
        if f"resumed from {split} at step {n}" not in text:
            failures.append(f"{precision}: the resumed run did not say it resumed at step {n}:\n" + text[-2000:])
        if first != straight[:n] or second != straight[n:]:
            failures.append(f"{precision}: {2 * n} steps printed {straight}, {n} + resume + {n} printed {first + second}")
        same = [filecmp.cmp(a, b, shallow=False) for a, b in ((whole, split), (whole + ".optimizer", split + ".optimizer"))]
        print(f"resume ({label}{precision}): {n} + {n} steps against {2 * n}: losses {'equal' if second == straight[n:] else 'differ'}, "
              f"weights {'byte-equal' if same[0] else 'differ'}, optimizer state {'byte-equal' if same[1] else 'differs'}")
        if not all(same):
            a, b = floats(whole), floats(split)
            differing = sorted(k for k in a if a[k] != b.get(k))
            failures.append(f"{precision}: the final weights of {2 * n} steps and of {n} + resume + {n} differ: "
                            f"{differing[:5] or 'in their metadata'} (weights {same[0]}, optimizer state {same[1]})")


def check_sharding(two, tmp, failures):
    levels = {"fp32": (("zero1", ["--zero1"]), ("zero2", ["--sharding", "zero2"]), ("zero3", ["--sharding", "zero3"]),
                       ("hsdp", ["--sharding", "hsdp", "--ranks-per-node", "1"])),
              "bf16": (("zero1", ["--zero1"]), ("zero3", ["--sharding", "zero3"]))}
    for precision, runs in levels.items():
        flags = MODEL + ["--precision", precision, "--dp", "2", "--steps", "10"]
        plain = os.path.join(tmp, precision + "_dp2.safetensors")
        a = losses(run(two + flags + ["--save", plain]))
        for level, extra in runs:
            # Every level saves its shards gathered into whole tensors: dp2's files, byte for byte.
            saved = os.path.join(tmp, f"{precision}_{level}.safetensors")
            sharded = run(two + flags + extra + ["--save", saved])
            if f"+{level}," not in sharded:
                failures.append(f"{precision}: {' '.join(extra)} did not say +{level} in its header:\n" + sharded[-2000:])
            b = losses(sharded)
            same = [filecmp.cmp(plain + suffix, saved + suffix, shallow=False) for suffix in ("", ".optimizer")]
            print(f"{level} ({precision}): dp2 {a[-1:]} dp2 +{level} {b[-1:]}, {'equal' if a == b else 'different'} "
                  f"over {len(a)} steps; checkpoint {'byte-equal' if all(same) else 'differs'}")
            if len(a) != 10 or a != b:
                failures.append(f"{precision}: dp2 printed {a}, dp2 with {' '.join(extra)} {b}")
            if not all(same):
                failures.append(f"{precision}: the checkpoint of dp2 with {' '.join(extra)} is not dp2's "
                                f"(weights equal: {same[0]}, optimizer state equal: {same[1]})")
        # ZeRO-1's gradient dump: the first step's reduced gradient shards gathered into whole
        # tensors, dp2's file byte for byte (the units' dumps are device_check.py's).
        dumps = [os.path.join(tmp, f"{precision}_{name}.grads") for name in ("dp2", "zero1")]
        for extra, path in zip(([], ["--zero1"]), dumps):
            run(two + MODEL + ["--precision", precision, "--dp", "2", "--steps", "1", "--quiet", "--dump-grads", path] + extra)
        same_dump = filecmp.cmp(dumps[0], dumps[1], shallow=False)
        print(f"zero1 gradient dump ({precision}): {'byte-equal' if same_dump else 'differs from'} dp2's")
        if not same_dump:
            failures.append(f"{precision}: the gradient dump of dp2 with --zero1 is not dp2's")
    # ZeRO-1 and ZeRO-3 runs resumed from their own checkpoints continue bit for bit.
    check_resume(two + ["--dp", "2", "--zero1"], tmp, failures, precisions=("fp32",), label="zero1 dp2 ")
    check_resume(two + ["--dp", "2", "--sharding", "zero3"], tmp, failures, precisions=("fp32",), label="zero3 dp2 ")


def relative_errors(reference, other):
    """name -> the largest |difference| over the tensor's largest |element| (the loss left out)."""
    out = {}
    for name, values in reference.items():
        if name == "loss" or name not in other or len(other[name]) != len(values):
            out[name] = float("inf")
            continue
        scale = max(abs(v) for v in values) or 1.0
        out[name] = max(abs(a - b) for a, b in zip(values, other[name])) / scale
    return out


def check_layouts(one, two, tmp, failures):
    path = lambda name: os.path.join(tmp, name)  # noqa: E731
    still = ["--steps", "1", "--lr", "0", "--quiet"]
    run(one + MODEL + ["--steps", "1", "--dump-grads", path("one.grads"), "--quiet"])
    run(one + MODEL + still + ["--save", path("one.model")])
    for layout, what in ((["--tp", "2", "--sequence-parallel"], "tp2 + sp"), (["--pp", "2"], "pp2")):
        saved = path(what.replace(" ", "").replace("+", "_") + ".model")
        run(two + MODEL + still + layout + ["--save", saved])
        for suffix, kind, bound in (("", "weights", 0.0), (".optimizer", "AdamW's moments", 2e-3)):
            errors = relative_errors(floats(path("one.model" + suffix)), floats(saved + suffix))
            worst = max(errors, key=errors.get)
            print(f"{what} at lr 0, saved {kind}: {len(errors)} tensors, worst {errors[worst]:.1e} of the largest "
                  f"element ({worst}; bound {bound})")
            if errors[worst] > bound:
                failures.append(f"{what}: the saved {kind} differ from one GPU's: {worst} by {errors[worst]:.2e} "
                                f"of its largest element (bound {bound})")
    reference = floats(path("one.grads"))
    for layout, what in ((["--tp", "2", "--sequence-parallel"], "tp2 + sp"), (["--cp", "2"], "cp2")):
        dump = path(what.replace(" ", "").replace("+", "_") + ".grads")
        out = run(two + MODEL + layout + ["--precision", "bf16", "--steps", "1", "--dump-grads", dump, "--quiet"])
        if "GPU(s) in bf16" not in out:
            failures.append(f"bf16 {what} did not say it trains on GPUs in bf16:\n" + out[-2000:])
        errors = relative_errors(reference, floats(dump))
        worst = max(errors, key=errors.get)
        print(f"bf16 {what} against fp32 on one GPU: {len(errors)} gradients, worst {errors[worst]:.1e} ({worst}; band 0.1)")
        if errors[worst] > 0.1:
            failures.append(f"bf16 {what}: gradient {worst} off by {errors[worst]:.2e} of fp32's largest element (band 0.1)")
        if errors[worst] <= 1e-5:
            failures.append(f"bf16 {what}: the gradients are fp32's to {errors[worst]:.1e}: it does not compute in bf16")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    wrapper = []
    if args[:1] == ["--rank-wrapper"]:
        wrapper, args = [args[1]], args[2:]
    train_gpt, launch = args[0], args[1:]
    one = launch + ["-n", "1", train_gpt, "--device", "cuda"]
    two = launch + ["-n", "2"] + wrapper + [train_gpt, "--device", "cuda"]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "bf16":
            check_bf16(one, tmp, failures)
        elif mode == "resume":
            check_resume(one, tmp, failures)
        elif mode == "sharding":
            check_sharding(two, tmp, failures)
        elif mode == "layouts":
            check_layouts(one, two, tmp, failures)
        else:
            sys.exit(f"device_runs_check: unknown mode '{mode}' (bf16, resume, sharding or layouts)")
    if failures:
        print("device_runs_check: FAILED:\n" + "\n".join(failures))
        return 1
    print(f"device_runs_check: {mode} passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
