#!/usr/bin/python3
"""train_gpt against PyTorch on the same model, batch and thread count, side by side in one run.

    /usr/bin/python3 bench/train_vs_torch/train_vs_torch.py --train-gpt BUILD/examples/train_gpt/train_gpt
        [--ranks 1,2,4] [--rounds 2] [--steps 5] [--warmup 2] [--threads T] [--json FILE]
        [--layers 4 --hidden 128 --heads 4 --vocab 256 --seq 128 --global-batch 8] [--data FILE]

For each rank count: PyTorch (eager on one process; DistributedDataParallel over gloo on more)
and train_gpt (data parallel, one micro-batch of global-batch / ranks sequences per rank), the
same GPT-2 shape, global batch and AdamW. Both get the same BLAS and threads: train_gpt's
OpenBLAS must be what torch's libblas.so.3 resolves to (when the system's alternative is another
BLAS, torch runs with OpenBLAS's libblas.so.3 preloaded), each side's library is printed with a
measured 1024^3 SGEMM rate, and OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / torch.set_num_threads
are T on one rank and 1 per rank on more. T defaults to 1: every process then has one core's
worth of threads, as the ranks of the multi-rank runs do (with 2 threads on a 2-core machine
shared with other work, torch's OpenMP and OpenBLAS threads spin against each other). Rounds alternate which
implementation goes first, so load that drifts falls on both; the first --warmup steps of each
run are dropped and the table shows medians over the rest of every round.

A run that fails (a DDP rank dies or times out, train_gpt exits non-zero) is reported as failed,
with the reason, in the table and the JSON; the exit status is then 1.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_GPT = os.path.join(HERE, "torch_gpt.py")
TORCH_PYTHON = "/usr/bin/python3"  # Debian's python3-torch
BLAS_ALTERNATIVE = "libblas.so.3-x86_64-linux-gnu"


def fail(message):
    print("train_vs_torch: " + message, file=sys.stderr)
    sys.exit(2)


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        match = re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE)
        return match.group(1).strip() if match else "unknown"
    except OSError:
        return "unknown"


def linked_blas(program):
    """The BLAS library `program` loads (resolved path), from ldd."""
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        match = re.match(r"\s*(\S*(?:openblas|blas|mkl)\S*)\s+=>\s+(\S+)", line)
        if match:
            return os.path.realpath(match.group(2))
    return None


def system_blas():
    """What libblas.so.3 (the library Debian's torch calls) resolves to now."""
    out = subprocess.run(["update-alternatives", "--query", BLAS_ALTERNATIVE], capture_output=True, text=True,
                         check=False).stdout
    match = re.search(r"^Value:\s*(\S+)", out, re.MULTILINE)
    return os.path.realpath(match.group(1)) if match else None


def is_openblas(path):
    """Whether a library is OpenBLAS's (its file, or Debian's libblas.so.3 in an openblas folder)."""
    return path is not None and "openblas" in os.path.realpath(path).lower()


GEMM_PROBE = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
n = 1024
a, b, c = ((ctypes.c_float * (n * n))() for _ in range(3))
for i in range(0, n * n, 7):
    a[i] = 1.0; b[i] = 0.5
f = ctypes.c_float
lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [f, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                 f, ctypes.c_void_p, ctypes.c_int]
def run():
    lib.cblas_sgemm(101, 111, 111, n, n, n, 1.0, a, n, b, n, 0.0, c, n)  # row-major, no transposes
run()
times = []
for _ in range(5):
    t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
print(2.0 * n ** 3 / sorted(times)[2] / 1e9)
"""


def gemm_rate(library, env):
    """1024^3 SGEMM rate (GFLOP/s) through `library`'s cblas_sgemm with the run's thread settings."""
    out = subprocess.run([sys.executable, "-c", GEMM_PROBE, library], capture_output=True, text=True, env=env,
                         check=False, timeout=120)
    try:
        return float(out.stdout.strip())
    except ValueError:
        return None


def run_train_gpt(args, ranks, env, folder):
    log = os.path.join(folder, f"train_gpt_{ranks}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    steps = args.warmup + args.steps
    cmd = [args.mpiexec, "-n", str(ranks), "--oversubscribe", "--bind-to", "none", args.train_gpt,
           "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--vocab", str(args.vocab), "--positions", str(args.seq), "--seq", str(args.seq),
           "--global-batch", str(args.global_batch), "--micro-batch", str(args.global_batch // ranks),
           "--dp", str(ranks), "--steps", str(steps), "--lr", "1e-3", "--weight-decay", "0.1",
           "--seed", str(args.seed), "--data", args.data, "--log-json", log, "--quiet", "--comm-timeout", "120"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"train_gpt killed after {args.timeout:.0f} s (--timeout)"
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return None, f"train_gpt exited with status {done.returncode}" + (f": {last[-1]}" if last else "")
    with open(log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if len(records) != steps:
        return None, f"train_gpt logged {len(records)} steps, expected {steps}"
    return {"step_times_s": [r["step_time_s"] for r in records[args.warmup:]],
            "losses": [r["loss"] for r in records]}, None


def run_torch(args, ranks, threads, env, folder):
    out = os.path.join(folder, f"torch_{ranks}.json")
    cmd = [TORCH_PYTHON, TORCH_GPT, "--ranks", str(ranks), "--threads", str(threads), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--vocab", str(args.vocab),
           "--positions", str(args.seq), "--seq", str(args.seq), "--global-batch", str(args.global_batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed), "--lr", "1e-3",
           "--weight-decay", "0.1", "--data", args.data, "--json", out, "--timeout", str(args.torch_timeout)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.torch_timeout + 60,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"torch_gpt.py killed after {args.torch_timeout + 60:.0f} s"
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        reasons = [line for line in done.stderr.splitlines() if line.startswith("torch_gpt.py: FAILED: ")]
        reason = reasons[-1][len("torch_gpt.py: FAILED: "):] if reasons else f"exited with status {done.returncode}"
        return None, ("DDP" if ranks > 1 else "torch") + " failed: " + reason
    with open(out) as f:
        result = json.load(f)
    if not any(is_openblas(path) for path in result["blas_libraries"]):
        return None, f"torch did not load OpenBLAS (it mapped {result['blas_libraries'] or 'no BLAS'})"
    return result, None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-gpt", required=True, help="the train_gpt program")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each run")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of the one-rank runs (more ranks: 1 thread per rank) [1]")
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("vocab", 256), ("seq", 128),
                          ("global-batch", 4), ("seed", 1234)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--data", help="training text [the corpus train_gpt was built with]")
    parser.add_argument("--json", help="write the results here (a list of objects)")
    parser.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    parser.add_argument("--timeout", type=float, default=300, help="deadline of each train_gpt run, seconds")
    parser.add_argument("--torch-timeout", type=float, default=300,
                        help="deadline of each PyTorch run (torch_gpt.py --timeout), seconds")
    args = parser.parse_args()
    args.rank_counts = [int(r) for r in args.ranks.split(",") if r]
    if not os.access(args.train_gpt, os.X_OK):
        fail(f"--train-gpt {args.train_gpt} is not an executable program (build the train_gpt target)")
    for r in args.rank_counts:
        if r < 1 or args.global_batch % r != 0:
            fail(f"--global-batch {args.global_batch} does not split over {r} ranks: pick a batch every rank count "
                 f"in --ranks {args.ranks} divides")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        fail("--steps and --rounds must be at least 1, --warmup at least 0")
    if args.data is None:
        args.data = os.path.join(os.path.dirname(os.path.realpath(args.train_gpt)), "corpus.txt")
    if not os.path.isfile(args.data):
        fail(f"no training text at {args.data}: give one with --data")
    return args


def main():
    args = parse_args()
    # Both sides on OpenBLAS: train_gpt's, and torch's libblas.so.3 resolved to it (preloaded
    # when the system's alternative points elsewhere, e.g. at the reference BLAS).
    gpt_blas = linked_blas(args.train_gpt)
    if not is_openblas(gpt_blas):
        fail(f"train_gpt is linked to {gpt_blas or 'no BLAS'}, not OpenBLAS: rebuild it with libopenblas-dev")
    # gloo over loopback unless told otherwise (GLOO_SOCKET_IFNAME in the environment).
    torch_env_extra = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    current = system_blas()
    blas_note = f"libblas.so.3 -> {current}"
    if not is_openblas(current):
        preload = os.path.join(os.path.dirname(gpt_blas), "libblas.so.3")
        if not os.path.exists(preload):
            fail(f"the system's libblas.so.3 is {current}, not OpenBLAS, and {preload} does not exist: "
                 "run `update-alternatives --set libblas.so.3-x86_64-linux-gnu <OpenBLAS's libblas.so.3>`")
        torch_env_extra["LD_PRELOAD"] = preload
        blas_note = f"libblas.so.3 -> {current} (not OpenBLAS): torch runs with LD_PRELOAD={preload}"
    torch_ok = subprocess.run([TORCH_PYTHON, "-c", "import torch"], capture_output=True, check=False).returncode == 0

    base_env = dict(os.environ)
    base_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo",
                     "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    tokens_per_step = args.global_batch * args.seq
    print(f"# train_vs_torch: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
          f"seq {args.seq}, global batch {args.global_batch} ({tokens_per_step} tokens/step), AdamW; "
          f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} measured steps)")
    print(f"# machine: {cpu_model()}, {os.cpu_count()} cores; BLAS: {blas_note}")

    results = {}  # (impl, ranks) -> dict
    gemm = {}
    with tempfile.TemporaryDirectory(prefix="weft_train_vs_torch_") as folder:
        for ranks in args.rank_counts:
            threads = args.threads if ranks == 1 else 1
            env = dict(base_env, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            gemm[("train_gpt", ranks)] = gemm_rate(gpt_blas, env)
            torch_impl = "torch" if ranks == 1 else "torch_ddp"
            for impl in ("train_gpt", torch_impl):
                results[(impl, ranks)] = {"impl": impl, "ranks": ranks, "threads_per_rank": threads, "times": [],
                                          "reason": None, "blas": gpt_blas if impl == "train_gpt" else None}
            if not torch_ok:
                results[(torch_impl, ranks)]["reason"] = f"{TORCH_PYTHON} has no torch (install python3-torch)"
        for round_index in range(args.rounds):
            for ranks in args.rank_counts:
                threads = args.threads if ranks == 1 else 1
                env = dict(base_env, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
                torch_impl = "torch" if ranks == 1 else "torch_ddp"
                order = ["train_gpt", torch_impl] if round_index % 2 == 0 else [torch_impl, "train_gpt"]
                for impl in order:
                    entry = results[(impl, ranks)]
                    if entry["reason"] is not None:
                        continue  # failed before: not retried, so the table says why
                    started = time.monotonic()
                    if impl == "train_gpt":
                        run, reason = run_train_gpt(args, ranks, env, folder)
                    else:
                        run, reason = run_torch(args, ranks, threads, dict(env, **torch_env_extra), folder)
                    if reason is not None:
                        entry["reason"] = reason
                        print(f"# round {round_index + 1}: {impl} on {ranks} ranks FAILED: {reason}", flush=True)
                        continue
                    entry["times"] += run["step_times_s"]
                    if impl != "train_gpt":
                        # The library doing the work (Debian's libblas.so.3 for OpenBLAS forwards to it).
                        entry["blas"] = sorted(run["blas_libraries"], key=lambda p: "libopenblas" not in p)[0]
                        gemm[(impl, ranks)] = run["gemm_1024_gflops"]
                        entry["torch"] = run["torch"]
                    print(f"# round {round_index + 1}: {impl:9} {ranks} ranks x {threads} threads: median step "
                          f"{statistics.median(run['step_times_s']) * 1e3:.1f} ms ({time.monotonic() - started:.1f} s)",
                          flush=True)

    records = []
    for (impl, ranks), entry in results.items():
        ok = entry["reason"] is None and entry["times"]
        step = statistics.median(entry["times"]) if ok else None
        records.append({
            "impl": impl, "ranks": ranks, "layout": f"dp{ranks}", "threads_per_rank": entry["threads_per_rank"],
            "status": "ok" if ok else "failed", "reason": entry["reason"],
            "tokens_per_s": tokens_per_step / step if ok else None, "step_time_s": step,
            "steps_measured": len(entry["times"]), "step_times_s": entry["times"],
            "tokens_per_step": tokens_per_step, "blas": entry["blas"], "gemm_1024_gflops": gemm.get((impl, ranks)),
            "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
                      "seq": args.seq}, "global_batch": args.global_batch,
        })
    for record in records:
        if record["impl"] == "train_gpt":
            peer = next(r for r in records if r["ranks"] == record["ranks"] and r["impl"] != "train_gpt")
            both = record["tokens_per_s"] is not None and peer["tokens_per_s"] is not None
            record["vs_torch"] = record["tokens_per_s"] / peer["tokens_per_s"] if both else None

    print(f"{'impl':<10} {'ranks':>5} {'thr/rank':>8} {'step ms':>9} {'tokens/s':>10} {'vs torch':>9}  blas (1024^3 sgemm)")
    for record in records:
        gflops = record["gemm_1024_gflops"]
        blas = f"{os.path.basename(record['blas'])} ({gflops:.1f} GFLOP/s)" if record["blas"] and gflops else "-"
        if record["status"] == "ok":
            ratio = f"{record['vs_torch']:.2f}x" if record.get("vs_torch") else ""
            print(f"{record['impl']:<10} {record['ranks']:>5} {record['threads_per_rank']:>8} "
                  f"{record['step_time_s'] * 1e3:>9.1f} {record['tokens_per_s']:>10.0f} {ratio:>9}  {blas}")
        else:
            print(f"{record['impl']:<10} {record['ranks']:>5} {record['threads_per_rank']:>8} "
                  f"  not run: {record['reason']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)
            out.write("\n")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
