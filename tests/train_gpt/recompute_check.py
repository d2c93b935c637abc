#!/usr/bin/env python3
"""Activation recomputation changes no bit of the gradients.

  recompute_check.py --ranks N TRAIN_GPT LAUNCH... -- [layout flags]

Runs the first step of a small model on the layout with --recompute none, selective and full,
each with --dump-grads, and fails, naming the tensor, unless every dumped tensor (every gradient,
the loss, the tokens) is the same bytes in all three: recomputation reruns the same code on the
same inputs, so nothing may differ, not even in the last bit.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import safetensors_file

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--seed", "5",
         "--global-batch", "4", "--steps", "1", "--quiet"]


def tensors(path):
    """name -> raw bytes of each tensor of a safetensors file."""
    return {name: data for name, (_, _, data) in safetensors_file.read(path)[1].items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("train_gpt")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    split = args.rest.index("--")
    launch, layout = args.rest[:split], args.rest[split + 1:]
    dumps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "selective", "full"):
            path = os.path.join(tmp, mode + ".safetensors")
            cmd = launch + ["-n", str(args.ranks), args.train_gpt] + MODEL + layout + [
                "--recompute", mode, "--dump-grads", path]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            if run.returncode != 0:
                sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
                sys.exit(f"recompute_check: '{' '.join(cmd)}' exited with {run.returncode}")
            dumps[mode] = tensors(path)
    reference = dumps["none"]
    for mode in ("selective", "full"):
        if sorted(dumps[mode]) != sorted(reference):
            sys.exit(f"recompute_check: --recompute {mode} dumped other tensors than none")
        for name, raw in reference.items():
            if dumps[mode][name] != raw:
                sys.exit(f"recompute_check: --recompute {mode}: '{name}' differs from --recompute none "
                         f"on {' '.join(layout)}")
    print(f"recompute_check: selective and full equal none bit for bit ({len(reference)} tensors) "
          f"on {' '.join(layout)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
