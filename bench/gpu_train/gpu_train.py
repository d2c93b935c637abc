#!/usr/bin/env python3
"""train_gpt on one GPU at GPT-2 small's size: tokens/s and MFU.

  gpu_train.py --train-gpt PATH [--steps N] [--micro-batch B] [--precision bf16|fp32] [--peak-tflops X]

Runs `train_gpt --device cuda --precision bf16 --model gpt2 --seq 1024` (124.4 M parameters, 12
layers, hidden 768, vocabulary 50257) for N steps of B sequences and reads its summary line (the
median step).

FLOP convention (PaLM's, as llm.c reports MFU): per token, 6 N for the products with the weights
(N = every parameter, 124.4 M; the tied embedding counted once, as the output layer's product: its
lookup costs nothing) plus 12 L T C for attention (the scores and their weighted sum, forward and
backward, the causal mask's skipped half counted), L = 12 layers, T = 1024, C = 768. MFU = tokens/s
x FLOP per token / the GPU's dense peak (--peak-tflops; default 989, an H200's or H100 SXM's dense
bf16 tensor-core peak, the peak the 45 % target is stated against).

Anchor: llm.c's GPT-2 124M run, about 300 ms per 524,288-token step on 8 x A100, is 218 k tokens/s
per A100, about 52 % MFU by 6 N against the A100's 312 TFLOP/s. The issue's target on an H200 is
45 % of 989 TFLOP/s.

What to expect in bf16 (before a GPU has run it): a step of 8 x 1024 tokens is 7.0 TFLOP by this
convention. The bf16 products (cuBLASLt, fp32 accumulation) are 6.1 TFLOP of it, about 10 ms at
600 TFLOP/s; the memory-bound kernels (layer norm, GELU, residual adds, the conversions around
attention and the loss, the loss over 8 x 1024 x 50304 fp32 logits, AdamW) move a few tens of GB,
about 10 ms at 4 TB/s. Attention is about 0.55 TFLOP of causal work forward and backward: on
train_gpt's fp32 flash-style kernel (CUDA cores, one thread a query row), at the 5-15 TFLOP/s such
a kernel reaches, 40-110 ms, so in bf16 it runs on the tensor cores instead
(attention_bf16.cu, WMMA): at 100-200 TFLOP/s, 3-6 ms, a step of about 25 ms, 25-30 % MFU. The 45 %
target (15.7 ms a step) needs the memory-bound kernels fused as well. These are estimates until a
GPU has run it.

PyTorch on the same GPU (torch_gpt2.py: the same model, batch and precision, eager, scaled dot
product attention) runs after it where this Python has PyTorch with CUDA, and the ratio of the two
tokens/s is printed; otherwise a line says why it did not run (--no-pytorch leaves it out).
"""
import argparse
import os
import re
import subprocess
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-gpt", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--no-pytorch", action="store_true", help="leave PyTorch's run out")
    args = parser.parse_args()
    layers, hidden, seq, vocab, positions = 12, 768, 1024, 50257, 1024
    params = vocab * hidden + positions * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden
    flop_per_token = 6 * params + 12 * layers * seq * hidden
    command = [args.train_gpt, "--device", "cuda", "--precision", args.precision, "--model", "gpt2", "--seq", str(seq),
               "--micro-batch", str(args.micro_batch), "--global-batch", str(args.micro_batch), "--steps",
               str(args.steps), "--quiet"]
    print("gpu train: " + " ".join(command), flush=True)
    r = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.stdout.write(r.stderr[-3000:])
        print(f"gpu train: FAILED: train_gpt exited with {r.returncode}")
        return 1
    done = re.search(r"^done: .* median step ([0-9.]+) ms, ([0-9.]+) tokens/s", r.stdout, re.M)
    precision = re.search(r"GPU\(s\) in (\w+)", r.stdout)
    if not done:
        print("gpu train: FAILED: no summary line ('done: ... median step X ms, Y tokens/s') in train_gpt's output")
        return 1
    step_ms, tokens_per_s = float(done.group(1)), float(done.group(2))
    tflops = tokens_per_s * flop_per_token / 1e12
    print(f"gpu train: GPT-2 small ({params / 1e6:.1f} M parameters), seq {seq}, {args.micro_batch} sequences a step, "
          f"{precision.group(1) if precision else '?'}: median step {step_ms:.1f} ms, {tokens_per_s:.0f} tokens/s, "
          f"{flop_per_token / 1e9:.3f} GFLOP a token, {tflops:.1f} TFLOP/s, MFU {100 * tflops / args.peak_tflops:.1f} % "
          f"of {args.peak_tflops:.0f} TFLOP/s (llm.c's GPT-2 124M: about 52 % on A100s; the target 45 %)")
    # PyTorch on the same GPU, the same model, batch and precision (torch_gpt2.py), where this
    # Python has PyTorch with CUDA; said as not run otherwise.
    if not args.no_pytorch:
        torch_command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_gpt2.py"),
                         "--steps", str(args.steps), "--micro-batch", str(args.micro_batch), "--seq", str(seq),
                         "--precision", args.precision, "--peak-tflops", str(args.peak_tflops)]
        t = subprocess.run(torch_command, capture_output=True, text=True)
        line = next((l for l in t.stdout.splitlines() if l.startswith("pytorch:")), None)
        if t.returncode == 0 and line:
            print("gpu train: " + line)
            theirs = re.search(r" ([0-9.]+) tokens/s", line)
            if theirs:
                print(f"gpu train: train_gpt / PyTorch tokens/s: {tokens_per_s / float(theirs.group(1)):.2f}")
        elif t.returncode == 2 and line:
            print("gpu train: " + line)
        else:
            print(f"gpu train: pytorch: failed (exit {t.returncode}): " + (t.stdout + t.stderr)[-1500:])
    print("gpu train: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
