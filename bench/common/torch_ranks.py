"""Runs a PyTorch function on N local ranks joined in a gloo process group, never waiting without
a bound, and says which rank failed doing what. Shared by the benchmarks that compare weft with
PyTorch DDP (bench/grad_sync/ddp_reference.py, bench/train_vs_torch/torch_gpt.py).

    failure = run_ranks(measure, ranks, timeout_s, phases, extra_args)   # None when every rank finished

`measure(rank, ranks, store_path, phase, *extra_args)` runs on each rank in a spawned process;
it calls `phase(name, iteration=-1)` (a name from `phases`) as it goes, so that a failure or a
timeout names what each rank was doing, and `join_gloo_group` to join the group. A rank leaves
with os._exit once every rank is past a barrier in the store (see `_worker` for why).
"""
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback

# Bounds every collective, store wait and the rendezvous: a single collective on GPT-2 small's
# 498 MB of gradients takes 1-4 s here even under heavy load.
COLLECTIVE_TIMEOUT_S = 60


def join_gloo_group(rank, ranks, store_path, timeout_s=COLLECTIVE_TIMEOUT_S):
    """Joins the gloo group through a file store and returns the store."""
    import torch.distributed as dist

    # Rendezvous through a file, not a TCP store on a port picked in advance: another process
    # can take that port between the pick and the bind, and a rank then fails at start-up. The
    # timeout bounds the rendezvous, every collective and every store wait.
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, ranks)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)
    return store


def finish_together(store, ranks):
    """A barrier through the file store, not gloo: once every rank is past it, no rank has a
    collective in flight, so each may leave at once."""
    if store.add("weft/finished", 1) == ranks:
        store.set("weft/all_finished", "1")
    store.wait(["weft/all_finished"])


def _worker(rank, ranks, store_path, progress, phases, measure, extra_args):
    def phase(name, iteration=-1):
        progress[2 * rank] = phases.index(name)
        progress[2 * rank + 1] = iteration

    # The parent sends SIGUSR1 before killing a rank that overran the deadline: its stacks then
    # show where it stood.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        measure(rank, ranks, store_path, phase, *extra_args)
    except BaseException:  # noqa: B036 - report anything, including KeyboardInterrupt from the parent
        sys.stderr.write(f"rank {rank} failed while {_describe(progress, phases, rank)}:\n" + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running torch's destructors. In torch 1.13 (Debian's), destroying a gloo
    # process group (here: when the DDP object goes, or in destroy_process_group) takes the
    # group's work mutex while holding the GIL; a gloo worker thread still retiring the last
    # collective holds that mutex and waits for the GIL to free the Python tensor it reduced.
    # Both wait forever (seen in about 1 run in 7 on 2 loaded cores). There is nothing left to
    # release: every rank has finished its collectives (measure ends with finish_together) and
    # the parent removes the store's folder.
    os._exit(0)


def _describe(progress, phases, rank):
    at = progress[2 * rank + 1]
    return phases[progress[2 * rank]] + (f" (iteration {at})" if at >= 0 else "")


def run_ranks(measure, ranks, timeout_s, phases, extra_args=()):
    """Spawns `ranks` processes running `measure`; returns None when all finished, else what went
    wrong (which rank, doing what; on a timeout, what every late rank was doing)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    progress = ctx.Array("i", [0, -1] * ranks, lock=False)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="weft_ddp_") as folder:
        store = os.path.join(folder, "store")  # a fresh file per run: never a stale store
        processes = mp.spawn(_worker, args=(ranks, store, progress, list(phases), measure, tuple(extra_args)),
                             nprocs=ranks, join=False)
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
                states = "; ".join(f"rank {r} was {_describe(progress, phases, r)}" for r in late)
                return f"timed out after {timeout_s:.0f} s: {states}"
        except mp.ProcessExitedException as error:
            # The other ranks are killed by now; say what each was doing.
            r = error.error_index
            others = "; ".join(f"rank {o} was {_describe(progress, phases, o)}" for o in range(ranks) if o != r)
            how = f"signal {error.signal_name}" if error.signal_name else f"exit status {error.exit_code}"
            return f"rank {r} ended with {how} while {_describe(progress, phases, r)}" + (f"; {others}" if others else "")
        except mp.ProcessRaisedException as error:
            return f"rank {error.error_index} raised: {str(error).strip().splitlines()[-1]}"
    return None
