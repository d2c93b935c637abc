#!/usr/bin/python3
"""PyTorch DDP reducing GPT-2 small's 148 gradients in one backward, for comparison with
weft_bench_grad_sync: gloo backend, DDP's default 25 MB buckets, the same parameter set
(124,439,808 float32 values). Runs its own ranks on this machine over loopback.

    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 ddp_reference.py [--ranks 2] [--iterations 10] [--json FILE]

Times one backward with DDP's gradient reduction ("ddp_s") and, alternating with it, the same
backward under no_sync() ("ddp_backward_only_s": what the backward costs without communication).
Each time is the slowest rank's; the JSON holds medians.
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time


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


def worker(rank, ranks, store_path, iterations, warmup, result_path):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank, like the MPI ranks
    # Rendezvous through a file, not a TCP store on a port picked in advance: another process
    # can take that port between the pick and the bind, and a rank then fails at start-up.
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))

    class Gpt2Parameters(torch.nn.Module):
        """GPT-2 small's parameters, registered in forward order; the loss touches each once."""

        def __init__(self):
            super().__init__()
            self.names = []
            for name, dims in gpt2_small_shapes():
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
    assert count == 124_439_808, count
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
        # Alternate which goes first, so drifting load falls on both alike.
        order = [True, False] if it % 2 == 0 else [False, True]
        for sync in order:
            t = timed(sync)
            if it >= warmup:
                (with_sync if sync else without_sync).append(t)

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
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="ddp_result.json")
    args = parser.parse_args()
    try:
        import torch.multiprocessing as mp
    except ImportError:
        print("ddp_reference.py: this python has no torch; run it with Debian's /usr/bin/python3", file=sys.stderr)
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="weft_ddp_") as folder:
        store = os.path.join(folder, "store")
        mp.spawn(worker, args=(args.ranks, store, args.iterations, args.warmup, args.json), nprocs=args.ranks)
    with open(args.json) as f:
        result = json.load(f)
    print(f"torch DDP (gloo, 25 MB buckets, {args.ranks} ranks): backward with reduction "
          f"{result['ddp_s'] * 1e3:.1f} ms, without {result['ddp_backward_only_s'] * 1e3:.1f} ms "
          f"(medians of {args.iterations}); gradients {'correct' if result['correct'] else 'WRONG'}")
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
