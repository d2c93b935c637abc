#!/usr/bin/env python3
"""PyTorch's GPT-2 small on the same GPU, for bench/gpu_train's comparison: tokens/s and MFU.

  torch_gpt2.py [--steps N] [--micro-batch B] [--seq T] [--precision bf16|fp32] [--peak-tflops X]
                [--device cuda|cpu] [--layers L --hidden C --heads H --vocab V]

The model is train_gpt's (GPT-2: learned positions, pre-norm blocks, tanh GELU, the output layer
tied to the token embedding, biases everywhere), trained as train_gpt trains it: AdamW on fp32
weights (fused on CUDA), bf16 through autocast (the products and attention in bf16 with fp32
accumulation, the norms and the loss in fp32), attention through F.scaled_dot_product_attention
(causal: flash attention where PyTorch has it). Eager mode, no torch.compile: what a user's plain
training loop gets. Random tokens (the timing does not depend on them). Steps are timed with the
device synchronized around each; the first two warm up and are left out; the median is reported,
with the FLOP convention of gpu_train.py (6 N per token plus 12 L T C). Prints one line starting
with `pytorch:`; exits 2 when PyTorch or its CUDA is missing (the caller reports it as not run),
1 with one line on stderr for a bad argument.
"""
import argparse
import math
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as missing:  # the caller says PyTorch was not there
    print(f"pytorch: not run: {missing}")
    sys.exit(2)


def causal_attention(q, k, v):
    """F.scaled_dot_product_attention (PyTorch 2: flash attention on CUDA), or before it the
    softmax written out."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    hidden = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn, self.attn_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.c_fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        a = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, vocab, positions):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # the output layer tied to the embedding
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments end in one line on stderr and exit 1: argparse's own exit 2 (after the usage)
    is this script's "not run", which the caller reports as PyTorch missing."""

    def error(self, message):
        sys.exit(f"torch_gpt2.py: {message}")


def main():
    parser = OneLineParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (two warm up)")
    for flag in ("micro_batch", "seq", "layers", "hidden", "heads", "vocab"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.hidden % args.heads != 0:
        parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if not args.peak_tflops > 0:
        parser.error(f"--peak-tflops must be positive, not {args.peak_tflops}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"pytorch: not run: PyTorch {torch.__version__} sees no CUDA device")
        return 2
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(args.layers, args.hidden, args.heads, args.vocab, args.seq).to(device)
    params = sum(p.numel() for p in model.parameters())
    settings = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    try:  # fused AdamW where PyTorch has it (2.0 on), else its default
        optimizer = torch.optim.AdamW(model.parameters(), **settings, fused=args.device == "cuda")
    except TypeError:
        optimizer = torch.optim.AdamW(model.parameters(), **settings)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times, loss = [], float("nan")
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        with autocast:
            loss_t = model(inputs, labels)
        loss_t.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        loss = loss_t.item()
    step_s = statistics.median(times[2:])
    tokens_per_s = args.micro_batch * args.seq / step_s
    flop_per_token = 6 * params + 12 * args.layers * args.seq * args.hidden
    tflops = tokens_per_s * flop_per_token / 1e12
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    attention = "scaled_dot_product_attention" if hasattr(F, "scaled_dot_product_attention") else "softmax written out"
    print(f"pytorch: {name}, PyTorch {torch.__version__} (attention: {attention}), {params / 1e6:.1f} M parameters, "
          f"seq {args.seq}, "
          f"{args.micro_batch} sequences a step, {args.precision}: median step {1e3 * step_s:.1f} ms, "
          f"{tokens_per_s:.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {100 * tflops / args.peak_tflops:.1f} % "
          f"of {args.peak_tflops:.0f} TFLOP/s (last loss {loss:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
