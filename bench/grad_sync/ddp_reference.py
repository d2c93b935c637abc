#!/usr/bin/python3
"""PyTorch DDP reducing GPT-2 small's 148 gradients in one backward, for comparison with
weft_bench_grad_sync: gloo backend, DDP's default 25 MB buckets, the same parameter set
(124,439,808 float32 values). Runs its own ranks on this machine over loopback.

    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 ddp_reference.py [--ranks 2] [--iterations 10] [--json FILE]
                                                            [--timeout SECONDS]

Times one backward with DDP's gradient reduction ("ddp_s") and, alternating with it, the same
backward under no_sync() ("ddp_backward_only_s": what the backward costs without communication).
Each time is the slowest rank's; the JSON holds medians.

Never waits without a bound: collectives and the rendezvous time out, and the whole run has a
deadline (--timeout). On any failure the last line on stderr starts with "ddp_reference.py: FAILED:"
and names the rank and what it was doing; the exit status is then nonzero.
"""
import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback

# What a rank is doing, as it tells the parent through shared memory (for failure messages).
PHASES = ["starting", "importing torch", "joining the process group (file store rendezvous)",
          "building the model and DDP", "timing backward passes", "checking gradients and writing the result",
          "waiting for the other ranks to finish", "finished"]
# A single collective on 498 MB takes 1-4 s here even under heavy load.
COLLECTIVE_TIMEOUT_S = 60


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


def worker(rank, ranks, store_path, iterations, warmup, result_path, progress):
    def phase(name, iteration=-1):
        progress[2 * rank] = PHASES.index(name)
        progress[2 * rank + 1] = iteration

    # The parent sends SIGUSR1 before killing a rank that overran the deadline: its stacks then
    # show where it stood.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        measure(rank, ranks, store_path, iterations, warmup, result_path, phase)
    except BaseException:  # noqa: B036 - report anything, including KeyboardInterrupt from the parent
        at = progress[2 * rank + 1]
        sys.stderr.write(f"ddp_reference.py: rank {rank} failed while {PHASES[progress[2 * rank]]}"
                         + (f" (iteration {at})" if at >= 0 else "") + ":\n" + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    phase("finished")
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running torch's destructors. In torch 1.13 (Debian's), destroying a gloo
    # process group (here: when the DDP object goes, or in destroy_process_group) takes the
    # group's work mutex while holding the GIL; a gloo worker thread still retiring the last
    # collective holds that mutex and waits for the GIL to free the Python tensor it reduced.
    # Both wait forever (seen in about 1 run in 7 on 2 loaded cores). There is nothing left to
    # release: every rank has finished its collectives (the store barrier before this) and the
    # parent removes the store's folder.
    os._exit(0)


def measure(rank, ranks, store_path, iterations, warmup, result_path, phase):
    phase("importing torch")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank, like the MPI ranks
    phase("joining the process group (file store rendezvous)")
    # Rendezvous through a file, not a TCP store on a port picked in advance: another process
    # can take that port between the pick and the bind, and a rank then fails at start-up. The
    # timeout bounds the rendezvous, every collective and every store wait.
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.FileStore(store_path, ranks)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)

    phase("building the model and DDP")

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
    # A barrier through the file store, not gloo: once every rank is past it, no rank has a
    # collective in flight, so each may leave at once.
    phase("waiting for the other ranks to finish")
    if store.add("weft/finished", 1) == ranks:
        store.set("weft/all_finished", "1")
    store.wait(["weft/all_finished"])


def describe(progress, rank):
    at = progress[2 * rank + 1]
    return PHASES[progress[2 * rank]] + (f" (iteration {at})" if at >= 0 else "")


def run(args, mp):
    ctx = mp.get_context("spawn")
    progress = ctx.Array("i", [0, -1] * args.ranks, lock=False)
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="weft_ddp_") as folder:
        store = os.path.join(folder, "store")  # a fresh file per run: never a stale store
        processes = mp.spawn(worker, args=(args.ranks, store, args.iterations, args.warmup, args.json, progress),
                             nprocs=args.ranks, join=False)
        try:
            while not processes.join(timeout=1):
                if time.monotonic() < deadline:
                    continue
                late = [r for r, p in enumerate(processes.processes) if p.is_alive()]
                for r in late:
                    os.kill(processes.processes[r].pid, signal.SIGUSR1)  # stacks to stderr
                time.sleep(2)
                for p in processes.processes:
                    if p.is_alive():
                        p.kill()
                    p.join()
                states = "; ".join(f"rank {r} was {describe(progress, r)}" for r in late)
                return f"timed out after {args.timeout:.0f} s (--timeout): {states}"
        except mp.ProcessExitedException as error:
            # The other ranks are killed by now; say what each was doing.
            r = error.error_index
            others = "; ".join(f"rank {o} was {describe(progress, o)}" for o in range(args.ranks) if o != r)
            how = f"signal {error.signal_name}" if error.signal_name else f"exit status {error.exit_code}"
            return f"rank {r} ended with {how} while {describe(progress, r)}" + (f"; {others}" if others else "")
        except mp.ProcessRaisedException as error:
            return f"rank {error.error_index} raised: {str(error).strip().splitlines()[-1]}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="ddp_result.json")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline for the whole run in seconds [120 + 10 per iteration]")
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = 120 + 10 * (args.warmup + args.iterations)
    try:
        import torch.multiprocessing as mp
    except ImportError:
        print("ddp_reference.py: FAILED: this python has no torch; run it with Debian's /usr/bin/python3",
              file=sys.stderr)
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with contextlib.suppress(FileNotFoundError):
        os.remove(args.json)  # a failed run must not leave an earlier run's result behind
    failure = run(args, mp)
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
