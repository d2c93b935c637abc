#!/usr/bin/python3
"""PyTorch's side of bench/train_vs_torch: GPT-2 as a user would write it in eager PyTorch
(nn.Module, nn.LayerNorm, nn.Embedding, Conv1D-style addmm layers, causal softmax attention,
tanh GELU, the output tied to the token embedding), trained with torch.optim.AdamW on one
process, or with DistributedDataParallel over gloo on N local ranks.

    /usr/bin/python3 torch_gpt.py --ranks N --threads T --layers L --hidden C --heads H --vocab V
                                  --positions P --seq S --global-batch B --steps K --data FILE --json OUT

Each rank takes B / N sequences of S + 1 bytes of FILE per step (one micro-batch, as train_gpt
is run). A step is zero_grad, forward, backward (with DDP's gradient all-reduce), AdamW and the
global mean loss as a number; its time is the slowest rank's. The JSON holds every step's time
and loss, the BLAS library the process mapped and a 1024 x 1024 x 1024 GEMM's rate through
torch on T threads. On any failure the last line on stderr starts with "torch_gpt.py: FAILED:"
and the exit status is nonzero.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "common"))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "train_gpt"))
from torch_ranks import finish_together, join_gloo_group, run_ranks  # noqa: E402

PHASES = ["starting", "importing torch", "joining the process group (file store rendezvous)",
          "building the model", "training", "writing the result", "waiting for the other ranks to finish"]


def build_model(config):
    import torch
    from torch import nn

    class Conv1D(nn.Module):
        """GPT-2's linear layer: weight stored (in, out), y = b + x W in one addmm."""

        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_in, n_out))
            self.bias = nn.Parameter(torch.empty(n_out))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)

    class Attention(nn.Module):
        def __init__(self, c, heads, positions):
            super().__init__()
            self.heads = heads
            self.c_attn = Conv1D(c, 3 * c)
            self.c_proj = Conv1D(c, c)
            # A plain attribute, not a buffer: DDP would broadcast a buffer, and gloo has no bool type.
            self.mask = torch.ones(positions, positions, dtype=torch.bool).tril()

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=-1)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(c // self.heads))
            att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
            return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))

    class Mlp(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c_fc = Conv1D(c, 4 * c)
            self.c_proj = Conv1D(4 * c, c)

        def forward(self, x):
            return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, c, heads, positions):
            super().__init__()
            self.ln_1 = nn.LayerNorm(c, eps=1e-5)
            self.attn = Attention(c, heads, positions)
            self.ln_2 = nn.LayerNorm(c, eps=1e-5)
            self.mlp = Mlp(c)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt2(nn.Module):
        """State dict names are Hugging Face GPT-2's (wte.weight, h.0.attn.c_attn.weight, ...)."""

        def __init__(self, m):
            super().__init__()
            self.wte = nn.Embedding(m["vocab"], m["hidden"])
            self.wpe = nn.Embedding(m["positions"], m["hidden"])
            self.h = nn.ModuleList(Block(m["hidden"], m["heads"], m["positions"]) for _ in range(m["layers"]))
            self.ln_f = nn.LayerNorm(m["hidden"], eps=1e-5)

        def forward(self, ids, labels):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    return Gpt2(config)


def initial_weights(config, seed):
    """GPT-2 weights from the PyTorch comparison test's generator (same names and shapes)."""
    import torch
    from torch_reference import gpt2_weights

    gen = torch.Generator().manual_seed(seed)
    return gpt2_weights(config["layers"], config["hidden"], config["vocab"], config["positions"], gen)


def check_same_model(model, weights, config, ids, labels):
    """The module computes the test's reference GPT-2 (torch_reference.gpt2_loss) on the same
    weights and tokens: the bench trains that model, not a near one."""
    import torch
    from torch_reference import gpt2_loss

    with torch.no_grad():
        ours = model(ids, labels).item()
        reference = gpt2_loss(weights, ids, labels, config["layers"], config["heads"]).item()
    if abs(ours - reference) > 1e-5 * abs(reference):
        raise RuntimeError(f"the benchmark's module gives loss {ours!r}, the reference GPT-2 {reference!r}")


def mapped_blas():
    """The BLAS libraries this process has mapped (what torch's matmul calls)."""
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "blas" in os.path.basename(path) or "mkl" in os.path.basename(path):
                names.add(os.path.realpath(path))
    return sorted(names)


def gemm_gflops(n=1024, repeats=5):
    import torch

    a, b = torch.rand(n, n), torch.rand(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / sorted(times)[len(times) // 2] / 1e9


def batches(corpus, seq, sequences, steps, first, seed):
    """Per step, `sequences` rows of seq + 1 tokens from random offsets (a generator per rank
    slice, so ranks read different rows). Prepared before timing, as train_gpt's loader thread
    prepares its batches during the previous step."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000003 + first)
    starts = torch.randint(0, len(corpus) - seq - 1, (steps, sequences), generator=gen)
    offsets = torch.arange(seq + 1)
    rows = corpus[(starts[..., None] + offsets).reshape(-1)].view(steps, sequences, seq + 1).long()
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def train(rank, ranks, store_path, phase, args):
    phase("importing torch")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    store = None
    if ranks > 1:
        phase("joining the process group (file store rendezvous)")
        store = join_gloo_group(rank, ranks, store_path)

    phase("building the model")
    config = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "positions")}
    weights = initial_weights(config, args.seed)
    model = build_model(config)
    model.load_state_dict(weights)
    per_rank = args.global_batch // ranks
    with open(args.data, "rb") as f:
        corpus = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    steps = args.warmup + args.steps
    data = batches(corpus, args.seq, per_rank, steps, rank * per_rank, args.seed)
    if rank == 0:
        check_same_model(model, weights, config, *data[0])
    # GPT-2's usual grouping, as train_gpt does: decay matrices and embeddings, not biases and norms.
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    net = model
    if ranks > 1:
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model)  # defaults: 25 MB buckets, overlap with backward

    step_times, losses = [], []
    for step in range(steps):
        phase("training", step)
        ids, labels = data[step]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = net(ids, labels)
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if ranks > 1:
            dist.all_reduce(value)
            value /= ranks
        loss_value = value.item()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if ranks > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        step_times.append(float(elapsed))
        losses.append(loss_value)

    phase("writing the result")
    if rank == 0:
        result = {
            "impl": "torch_ddp" if ranks > 1 else "torch",
            "ranks": ranks,
            "threads_per_rank": args.threads,
            "torch": torch.__version__,
            "blas_libraries": mapped_blas(),
            "gemm_1024_gflops": gemm_gflops(),
            "tokens_per_step": args.global_batch * args.seq,
            "warmup_steps": args.warmup,
            "step_times_s": step_times[args.warmup:],
            "losses": losses,
        }
        with open(args.json, "w") as out:
            json.dump(result, out)
    if store is not None:
        phase("waiting for the other ranks to finish")
        finish_together(store, ranks)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank (torch and OpenBLAS)")
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("vocab", 256), ("positions", 256),
                          ("seq", 128), ("global-batch", 8), ("steps", 10), ("warmup", 2), ("seed", 1234)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--data", required=True, help="training text, one byte a token")
    parser.add_argument("--json", required=True)
    parser.add_argument("--timeout", type=float, default=300, help="deadline for the whole run in seconds")
    args = parser.parse_args()
    if args.global_batch % args.ranks != 0:
        print(f"torch_gpt.py: FAILED: --global-batch {args.global_batch} does not split over {args.ranks} ranks",
              file=sys.stderr)
        return 2
    with contextlib.suppress(FileNotFoundError):
        os.remove(args.json)  # a failed run must not leave an earlier run's result behind
    if args.ranks == 1:
        try:
            train(0, 1, None, lambda *_: None, args)
            failure = None
        except Exception as error:  # noqa: BLE001 - reported in one line, with the traceback above it
            import traceback
            traceback.print_exc()
            failure = f"{type(error).__name__}: {error}"
    else:
        failure = run_ranks(train, args.ranks, args.timeout, PHASES, (args,))
    if failure is None and not os.path.exists(args.json):
        failure = "every rank finished but rank 0 wrote no result"
    if failure is not None:
        print("torch_gpt.py: FAILED: " + failure, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
