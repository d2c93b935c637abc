#!/usr/bin/python3
"""PyTorch DDP reducing GPT-2 small's 148 gradients in one backward, for comparison with
weft_bench_grad_sync: gloo backend, DDP's default 25 MB buckets, the same parameter set
(124,439,808 float32 values; --model mlp: the bench's model of few large tensors, 16 layers of a
2048-wide MLP, 67,141,632 values). Runs its own ranks on this machine over loopback.

    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 ddp_reference.py [--ranks 2] [--iterations 10] [--json FILE]
                                                            [--timeout SECONDS] [--model gpt2|mlp]

Times one backward with DDP's gradient reduction ("ddp_s") and, alternating with it, the same
backward under no_sync() ("ddp_backward_only_s": what the backward costs without communication).
Each time is the slowest rank's; the JSON holds medians.

Never waits without a bound: collectives and the rendezvous time out, and the whole run has a
deadline (--timeout). On any failure the last line on stderr starts with "ddp_reference.py: FAILED:"
and names the rank and what it was doing; the exit status is then nonzero.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from torch_ranks import finish_together, join_gloo_group, run_ranks  # noqa: E402

# What a rank is doing, as it tells the parent through shared memory (for failure messages).
PHASES = ["starting", "importing torch", "joining the process group (file store rendezvous)",
          "building the model and DDP", "timing backward passes", "checking gradients and writing the result",
          "waiting for the other ranks to finish"]


def gpt2_small_shapes():
    vocab, context, d = 50257, 1024, 768
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (context, d))]
    for layer in range(12):
        h = f"h.{layer}."
        shapes += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def wide_mlp_shapes(layers=16, width=2048):
    shapes = []
    for layer in range(layers):
        shapes += [(f"fc.{layer}.weight", (width, width)), (f"fc.{layer}.bias", (width,))]
    return shapes


MODELS = {"gpt2": (gpt2_small_shapes, 124_439_808), "mlp": (wide_mlp_shapes, 67_141_632)}


def measure(rank, ranks, store_path, phase, iterations, warmup, result_path, model_name="gpt2"):
    phase("importing torch")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank, like the MPI ranks
    phase("joining the process group (file store rendezvous)")
    store = join_gloo_group(rank, ranks, store_path)

    phase("building the model and DDP")

    class Gpt2Parameters(torch.nn.Module):
        """The model's parameters (GPT-2 small's by default), registered in forward order; the loss
        touches each once."""

        def __init__(self):
            super().__init__()
            self.names = []
            for name, dims in MODELS[model_name][0]():
                attr = name.replace(".", "_")
                self.register_parameter(attr, torch.nn.Parameter(torch.zeros(dims)))
                self.names.append(attr)

        def forward(self, scale):
            total = None
            for attr in self.names:
                term = getattr(self, attr).sum() * scale
                total = term if total is None else total + term
            return total

    model = Gpt2Parameters()
    count = sum(p.numel() for p in model.parameters())
    assert count == MODELS[model_name][1], count
    ddp = DistributedDataParallel(model)  # defaults: bucket_cap_mb=25, first bucket 1 MB
    scale = torch.ones(())
    with_sync, without_sync = [], []

    def timed(sync):
        ddp.zero_grad()
        # Under no_sync() the forward must run inside the context too: DDP arms its reducer there.
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = ddp(scale)
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
        elapsed = torch.tensor([end - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for it in range(warmup + iterations):
        phase("timing backward passes", it)
        # Alternate which goes first, so drifting load falls on both alike.
        order = [True, False] if it % 2 == 0 else [False, True]
        for sync in order:
            t = timed(sync)
            if it >= warmup:
                (with_sync if sync else without_sync).append(t)

    phase("checking gradients and writing the result")
    # Every rank contributed ones (scale 1, d(sum)/dp = 1): DDP averages, so gradients are 1.
    grad = getattr(model, model.names[0]).grad
    correct = bool(torch.all(grad[:4] == 1.0))
    if rank == 0:
        result = {
            "ddp_s": statistics.median(with_sync),
            "ddp_backward_only_s": statistics.median(without_sync),
            "ddp_times": with_sync,
            "ddp_backward_only_times": without_sync,
            "ranks": ranks,
            "iterations": iterations,
            "torch": torch.__version__,
            "bucket_cap_mb": 25,
            "correct": correct,
        }
        with open(result_path, "w") as out:
            json.dump(result, out)
    phase("waiting for the other ranks to finish")
    finish_together(store, ranks)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="ddp_result.json")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline for the whole run in seconds [120 + 10 per iteration]")
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = 120 + 10 * (args.warmup + args.iterations)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("ddp_reference.py: FAILED: this python has no torch; run it with Debian's /usr/bin/python3",
              file=sys.stderr)
        return 2
    with contextlib.suppress(FileNotFoundError):
        os.remove(args.json)  # a failed run must not leave an earlier run's result behind
    failure = run_ranks(measure, args.ranks, args.timeout, PHASES, (args.iterations, args.warmup, args.json, args.model))
    if failure is None and not os.path.exists(args.json):
        failure = "every rank finished but rank 0 wrote no result"
    if failure is not None:
        print("ddp_reference.py: FAILED: " + failure, file=sys.stderr)
        return 3
    with open(args.json) as f:
        result = json.load(f)
    print(f"torch DDP (gloo, 25 MB buckets, {args.ranks} ranks): backward with reduction "
          f"{result['ddp_s'] * 1e3:.1f} ms, without {result['ddp_backward_only_s'] * 1e3:.1f} ms "
          f"(medians of {args.iterations}); gradients {'correct' if result['correct'] else 'WRONG'}")
    if not result["correct"]:
        print("ddp_reference.py: FAILED: DDP's gradients are wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
