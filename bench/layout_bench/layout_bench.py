#!/usr/bin/env python3
"""train_gpt in every layout that fits N ranks, measured beside the tuner's prediction.

  layout_bench.py --train-gpt PATH --weft-plan PATH [--ranks 4] [--model-flags "..."] [--steps 8]
                  [--global-batch 8] [--layouts "tp,pp,cp[,sp] ..."] [--sharding none,zero1,zero2,zero3,hsdp]
                  [--rounds 1] [--hardware FILE] [--json FILE]

For each layout (every tp x pp x cp that divides the ranks and the model, dp the rest; sequence
parallelism whenever tp > 1) it runs train_gpt for --steps steps with --log-json and --hardware, drops
the first two steps (warm-up), and reports the median step time, tokens/s, exposed communication,
pipeline bubble and peak memory per rank, beside the step time weft's tuner predicts for the same
layout on the measured description of these ranks (`weft-plan --probe`, run first unless
--hardware is given). Ends with the Spearman rank correlation between predicted and measured step
times. --sharding runs every layout under each level given (default: none; zero2, zero3 and hsdp only
without pipeline stages, as train_gpt runs them). --rounds R measures every layout R times, in
alternating order (first to last, then last to first, so a drift of the machine falls on every
layout alike), reports each layout's median over the rounds, and the Spearman correlation between
the rounds' own rankings: how far the measurement itself can be trusted to order layouts. --json writes a list of objects: tp, pp, dp, cp, vp,
sp, sharding, tokens_per_s, step_time_s,
predicted_step_time_s, exposed_comm_s, bubble_s, max_rss_bytes, training_state_bytes, step_time_s_rounds
(each round's step time; the others are medians over the rounds), and "error" for a layout that failed.
"""
import argparse
import itertools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_oob_tcp_if_include": "lo",
       "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def model_value(flags, name, default):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def layouts_that_fit(ranks, flags, global_batch):
    layers, heads, seq = model_value(flags, "--layers", 4), model_value(flags, "--heads", 4), model_value(flags, "--seq", 128)
    out = []
    for tp, pp, cp in itertools.product(range(1, ranks + 1), repeat=3):
        if ranks % (tp * pp * cp) or heads % tp or layers % pp or (cp > 1 and seq % (2 * cp)):
            continue
        dp = ranks // (tp * pp * cp)
        if global_batch % dp:
            continue
        out.append({"tp": tp, "pp": pp, "cp": cp, "dp": dp, "vp": 1, "sp": tp > 1})
    return out


def failure_reason(stderr, returncode):
    """The line of a failed run that says why: train_gpt's or weft's own message, not the launcher's
    banner of dashes and "Primary job terminated" that mpiexec prints after it."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and set(line.strip()) != {"-"}]
    own = [line for line in lines if line.startswith(("train_gpt", "weft"))]
    return (own or lines or ["exit %d" % returncode])[0]


def parse_layouts(text, ranks):
    out = []
    for item in text.split():
        parts = item.split(",")
        tp, pp, cp = (int(x) for x in parts[:3])
        out.append({"tp": tp, "pp": pp, "cp": cp, "dp": ranks // (tp * pp * cp), "vp": 1,
                    "sp": len(parts) > 3 and parts[3] == "sp"})
    return out


def spearman(xs, ys):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-gpt", required=True)
    p.add_argument("--weft-plan", required=True)
    p.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--model-flags", default="--layers 4 --hidden 256 --heads 4 --seq 128 --positions 128")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--layouts", default="")
    p.add_argument("--sharding", default="none")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--hardware", default="")
    p.add_argument("--threads", type=int, default=1, help="OpenBLAS threads per rank")
    p.add_argument("--json", default="")
    a = p.parse_args()
    flags = shlex.split(a.model_flags)
    env = dict(os.environ, **ENV, OPENBLAS_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    if a.ranks > (os.cpu_count() or 1):
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # more ranks than cores: waiting ranks yield
    launch = [a.mpiexec, "-n", str(a.ranks), "--oversubscribe", "--bind-to", "none", "-x", "OPENBLAS_NUM_THREADS",
              "-x", "OMP_NUM_THREADS"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        hardware = a.hardware or os.path.join(tmp, "hardware.json")
        if not a.hardware:
            model = [f"--{k}={model_value(flags, '--' + k, d)}" for k, d in
                     (("layers", 4), ("hidden", 128), ("heads", 4), ("seq", 128), ("vocab", 256))]
            probe = launch + [a.weft_plan, "--probe", hardware, "--tied-embeddings",
                              "--global-batch", str(a.global_batch)] + [x for f in model for x in f.split("=")]
            r = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                sys.exit(f"layout_bench: the probe failed ({' '.join(probe)}):\n{r.stderr[-3000:]}")
            print(f"layout_bench: measured these {a.ranks} ranks with weft-plan --probe")
        layouts = parse_layouts(a.layouts, a.ranks) if a.layouts else layouts_that_fit(a.ranks, flags, a.global_batch)
        levels = a.sharding.split(",")
        runs = [dict(lay, sharding=level) for lay in layouts for level in levels
                if level in ("none", "zero1") or lay["pp"] == 1]
        def measure(lay):
            log = os.path.join(tmp, "log.json")
            cmd = launch + [a.train_gpt, *flags, "--steps", str(a.steps), "--global-batch", str(a.global_batch),
                            "--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--cp", str(lay["cp"]), "--quiet",
                            "--log-json", log, "--hardware", hardware, "--sharding", lay["sharding"]]
            cmd += ["--sequence-parallel"] if lay["sp"] else []
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            row = dict(lay)
            if r.returncode != 0:
                row["error"] = failure_reason(r.stderr, r.returncode)
                return row
            with open(log) as f:
                steps = [json.loads(line) for line in f if line.strip()][2:]
            med = lambda k: statistics.median(s[k] for s in steps)
            row.update({"step_time_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
                        "exposed_comm_s": med("exposed_comm_s"), "bubble_s": med("bubble_s"),
                        "max_rss_bytes": max(s["max_rss_bytes"] for s in steps),
                        "training_state_bytes": max(s["training_state_bytes"] for s in steps),
                        "predicted_step_time_s": steps[0]["predicted_step_time_s"]})
            print(f"  tp {lay['tp']} pp {lay['pp']} dp {lay['dp']} cp {lay['cp']}{' sp' if lay['sp'] else ''} "
                  f"{lay['sharding']}: {row['step_time_s'] * 1e3:.1f} ms "
                  f"(predicted {row['predicted_step_time_s'] * 1e3:.1f})", flush=True)
            return row

        measured = [[] for _ in runs]  # per run, one row a round
        for rnd in range(a.rounds):
            order = range(len(runs)) if rnd % 2 == 0 else reversed(range(len(runs)))
            if a.rounds > 1:
                print(f"layout_bench: round {rnd + 1} of {a.rounds}", flush=True)
            for i in order:
                measured[i].append(measure(runs[i]))
        for rows in measured:
            failed = [r for r in rows if "error" in r]
            if failed:
                results.append(failed[0])
                continue
            row = dict(rows[0])
            for key in ("step_time_s", "tokens_per_s", "exposed_comm_s", "bubble_s"):
                row[key] = statistics.median(r[key] for r in rows)
            row["step_time_s_rounds"] = [r["step_time_s"] for r in rows]
            results.append(row)
    ok = [r for r in results if "error" not in r]
    print(f"\n{'tp':>3} {'pp':>3} {'dp':>3} {'cp':>3} {'sp':>3} {'shard':>6} {'tokens/s':>10} {'step ms':>9} {'exposed ms':>11} "
          f"{'bubble ms':>10} {'MiB/rank':>9} {'state MiB':>10} {'predicted ms':>13} {'pred/meas':>10}")
    for r in sorted(ok, key=lambda r: r["step_time_s"]):
        print(f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>3} {r['cp']:>3} {'y' if r['sp'] else '-':>3} {r['sharding']:>6} "
              f"{r['tokens_per_s']:>10.0f} "
              f"{r['step_time_s'] * 1e3:>9.1f} {r['exposed_comm_s'] * 1e3:>11.1f} {r['bubble_s'] * 1e3:>10.1f} "
              f"{r['max_rss_bytes'] / 2**20:>9.0f} {r['training_state_bytes'] / 2**20:>10.0f} "
              f"{r['predicted_step_time_s'] * 1e3:>13.1f} "
              f"{r['predicted_step_time_s'] / r['step_time_s']:>10.2f}")
    for r in results:
        if "error" in r:
            print(f"tp {r['tp']} pp {r['pp']} cp {r['cp']} {r['sharding']}: FAILED: {r['error']}")
    rho = spearman([r["predicted_step_time_s"] for r in ok], [r["step_time_s"] for r in ok]) if len(ok) > 2 else float("nan")
    print(f"\nSpearman rank correlation, predicted vs measured step time over {len(ok)} layouts: {rho:.2f}")
    if a.rounds > 1 and len(ok) > 2:
        pairs = [(i, j) for i in range(a.rounds) for j in range(i + 1, a.rounds)]
        agree = [spearman([r["step_time_s_rounds"][i] for r in ok], [r["step_time_s_rounds"][j] for r in ok])
                 for i, j in pairs]
        print("Spearman rank correlation between the rounds' own rankings: " +
              ", ".join(f"{i + 1}-{j + 1}: {x:.2f}" for (i, j), x in zip(pairs, agree)) +
              f" (median {statistics.median(agree):.2f}): how well the measurement orders these layouts at all")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
