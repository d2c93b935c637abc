#!/usr/bin/env python3
"""Checkpoints of train_gpt: resume is bit-exact, and the files are GPT-2 safetensors.

  resume_check.py --ranks N [--resume-ranks M --resume-layout "FLAGS"] TRAIN_GPT LAUNCH... -- [layout flags]

1. an uninterrupted run of 6 steps (--log-json);
2. a run of 3 steps that saves (--save), then a run that resumes from it to step 6;
3. steps 4-6 of the resumed run must print exactly the losses of the uninterrupted run (the JSON
   writes every digit of the double), and the model file must hold GPT-2's names, shapes and config
   metadata (read here with the standard library; also with the safetensors package when installed).

With --resume-ranks, the resumed run goes on with M ranks and the layout flags given there (the
checkpoint holds whole tensors, whatever the layout): the sums are then ordered differently, so its
losses must match within 1e-6 (relative) instead of to the last bit.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import safetensors_file

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--lr", "3e-3",
         "--seed", "5", "--global-batch", "4", "--quiet"]


def run(command):
    r = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        sys.exit(f"resume_check: '{' '.join(command)}' exited with {r.returncode}")
    return r.stdout


def losses(path):
    with open(path) as f:
        return {json.loads(line)["step"]: line.split('"loss": ')[1].split(",")[0] for line in f if line.strip()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--resume-ranks", type=int)
    parser.add_argument("--resume-layout", default="")
    parser.add_argument("train_gpt")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    split = args.rest.index("--")
    launch = args.rest[:split] + ["-n", str(args.ranks), args.train_gpt] + MODEL + args.rest[split + 1:]
    relaunch = launch
    if args.resume_ranks:
        relaunch = args.rest[:split] + ["-n", str(args.resume_ranks), args.train_gpt] + MODEL + args.resume_layout.split()
    with tempfile.TemporaryDirectory() as tmp:
        whole, first, second = (os.path.join(tmp, n) for n in ("whole.json", "first.json", "second.json"))
        ckpt = os.path.join(tmp, "model.safetensors")
        run(launch + ["--steps", "6", "--log-json", whole])
        run(launch + ["--steps", "3", "--log-json", first, "--save", ckpt])
        out = run(relaunch + ["--steps", "6", "--log-json", second, "--resume", ckpt])
        if "resumed from" not in out:
            sys.exit("resume_check: the resumed run did not say it resumed")
        h = safetensors_file.header(ckpt)
        meta = h.pop("__metadata__")
        want_meta = {"n_layer": "2", "n_head": "4", "n_embd": "64", "n_positions": "64", "vocab_size": "256"}
        for k, v in want_meta.items():
            if meta.get(k) != v:
                sys.exit(f"resume_check: metadata {k} = {meta.get(k)!r}, expected {v!r}")
        shapes = {"wte.weight": [256, 64], "wpe.weight": [64, 64], "h.1.attn.c_attn.weight": [64, 192],
                  "h.1.attn.c_attn.bias": [192], "h.0.attn.c_proj.weight": [64, 64], "h.0.mlp.c_fc.weight": [64, 256],
                  "h.0.mlp.c_proj.weight": [256, 64], "ln_f.weight": [64], "h.1.ln_2.bias": [64]}
        for name, shape in shapes.items():
            if name not in h or h[name]["shape"] != shape or h[name]["dtype"] != "F32":
                sys.exit(f"resume_check: tensor {name}: {h.get(name)}, expected F32 {shape}")
        if len(h) != 2 + 2 * 12 + 2:
            sys.exit(f"resume_check: the model file holds {len(h)} tensors, expected 28 (GPT-2, 2 layers)")
        try:
            from safetensors.numpy import load_file  # optional: the reference reader, when installed
            tensors = load_file(ckpt)
            print(f"resume_check: the safetensors package reads the model file ({len(tensors)} tensors)")
        except ImportError:
            print("resume_check: (the safetensors package is not installed; the file was read with the standard library)")
        a, b = losses(whole), losses(second)
    if sorted(b) != [4, 5, 6]:
        sys.exit(f"resume_check: the resumed run logged steps {sorted(b)}, expected 4, 5, 6")
    for step in (4, 5, 6):
        print(f"step {step}: uninterrupted {a[step]}  resumed {b[step]}")
        if args.resume_ranks:
            rel = abs(float(a[step]) - float(b[step])) / abs(float(a[step]))
            if rel > 1e-6:
                sys.exit(f"resume_check: step {step}: the loss resumed on {args.resume_ranks} ranks "
                         f"({args.resume_layout}) differs from the uninterrupted one by {rel:.2e} (tolerance 1e-6)")
        elif a[step] != b[step]:
            sys.exit(f"resume_check: step {step}: the resumed loss {b[step]} is not the uninterrupted {a[step]}")
    if args.resume_ranks:
        print(f"resume_check: resumed on {args.resume_ranks} ranks ({args.resume_layout}), the run follows the curve")
    else:
        print("resume_check: the resumed run continues the loss curve bit-exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
