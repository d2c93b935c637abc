#!/usr/bin/env python3
"""A layout's loss curve against the single-rank curve.

  layout_curve.py --ranks N [--tolerance 2e-5] [--steps 8] TRAIN_GPT LAUNCH... -- [layout flags]

Runs train_gpt for a few steps on one rank and then on N ranks with the layout flags (same
model, seed, data and global batch), both with --log-json, and fails, naming the step, when a
loss differs from the single-rank one by more than the tolerance (relative). The runs differ
only in how sums are ordered (reductions over ranks, accumulation over micro-batches), so the
curves agree to float32 rounding amplified by a few AdamW steps.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--lr", "3e-3",
         "--seed", "11"]


def curve(command, path):
    run = subprocess.run(command + ["--log-json", path, "--quiet"], capture_output=True, text=True, timeout=240)
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        sys.exit(f"layout_curve: '{' '.join(command)}' exited with {run.returncode}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--tolerance", type=float, default=2e-5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("train_gpt")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    split = args.rest.index("--")
    launch, layout = args.rest[:split], args.rest[split + 1:]
    common = MODEL + ["--steps", str(args.steps), "--global-batch", str(args.global_batch)]
    with tempfile.TemporaryDirectory() as tmp:
        single = curve(launch + ["-n", "1", args.train_gpt] + common, os.path.join(tmp, "single.json"))
        ours = curve(launch + ["-n", str(args.ranks), args.train_gpt] + common + layout, os.path.join(tmp, "layout.json"))
    if len(single) != args.steps or len(ours) != args.steps:
        sys.exit(f"layout_curve: expected {args.steps} steps, got {len(single)} (1 rank) and {len(ours)} (layout)")
    worst = 0.0
    for a, b in zip(single, ours):
        rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, rel)
        print(f"step {a['step']}: 1 rank {a['loss']:.7f}  {' '.join(layout)} on {args.ranks} ranks {b['loss']:.7f}  "
              f"relative {rel:.1e}")
        if rel > args.tolerance:
            sys.exit(f"layout_curve: step {a['step']}: the layout's loss differs from the single-rank loss by "
                     f"{rel:.2e} (tolerance {args.tolerance:.0e})")
    if single[-1]["loss"] >= single[0]["loss"]:
        sys.exit("layout_curve: the loss did not fall over the run; the comparison would say nothing")
    print(f"layout_curve: {' '.join(layout)} on {args.ranks} ranks follows the single-rank curve "
          f"(worst relative difference {worst:.1e} over {args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
