#!/usr/bin/env python3
"""A layout_bench measurement predicted again by this build's tuner, and how well it ranks.

  evaluate.py --weft-plan PATH --hardware FILE --layouts FILE.json [--model-flags "..."]
              [--global-batch 8] [--exchange-latency SECONDS] [--markdown]

Reads the JSON that `layout_bench --json` wrote, predicts each layout's step time and memory per
rank again with `weft-plan --hardware FILE` in evaluate mode (the layout given whole: micro-batch 1,
no recomputation, the sharding it ran with, sequence parallelism with tp > 1, as train_gpt runs
it), and prints per layout the measured median, the old prediction (the one train_gpt logged) and
the new one, then: the Spearman correlation between the rounds' own rankings (how well the
measurement orders the layouts at all), predicted against measured Spearman, the measured step
of the layout the tuner would pick over the best measured one, and the range of predicted /
measured. --exchange-latency replaces the description's exchange_latency (e.g. one measured by a
later probe). --markdown prints the table as Markdown. The model flags are train_gpt's; those
weft-plan does not know (--positions) are dropped.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layout_bench import spearman  # noqa: E402  (the bench's own rank correlation)

PLAN_MODEL_FLAGS = ("--layers", "--hidden", "--heads", "--seq", "--vocab")


def plan_flags(model_flags):
    words = shlex.split(model_flags)
    out = []
    for i, w in enumerate(words):
        if w in PLAN_MODEL_FLAGS:
            out += [w, words[i + 1]]
    return out + ["--tied-embeddings"]  # train_gpt ties its embeddings


def predict(a, hardware, row):
    cmd = [a.weft_plan, "--hardware", hardware, *plan_flags(a.model_flags), "--global-batch", str(a.global_batch),
           "--tp", str(row["tp"]), "--pp", str(row["pp"]), "--dp", str(row["dp"]), "--cp", str(row["cp"]),
           "--vp", str(row.get("vp", 1)), "--micro-batch", "1", "--recompute", "none",
           "--sharding", {"none": "none", "zero1": "optimizer", "zero2": "gradients"}.get(row["sharding"], "full"),
           "--json"]
    if not row["sp"]:
        cmd.append("--no-sequence-parallel")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"evaluate: weft-plan failed ({' '.join(cmd)}): {r.stderr.strip()}")
    return json.loads(r.stdout)["plans"][0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weft-plan", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--layouts", required=True)
    p.add_argument("--model-flags", default="--layers 4 --hidden 128 --heads 4 --seq 128 --vocab 256")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--exchange-latency", type=float, default=None)
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    rows = [r for r in json.load(open(a.layouts)) if "error" not in r]
    if len(rows) < 3:
        sys.exit("evaluate: fewer than 3 measured layouts")
    hardware = a.hardware
    with tempfile.TemporaryDirectory() as tmp:
        if a.exchange_latency is not None:
            hw = json.load(open(a.hardware))
            hw["exchange_latency"] = a.exchange_latency
            hardware = os.path.join(tmp, "hardware.json")
            json.dump(hw, open(hardware, "w"))
        for r in rows:
            plan = predict(a, hardware, r)
            r["new_s"] = plan["step_time_s"]
            r["new_memory_bytes"] = plan["memory_per_gpu_bytes"]
            r["new_state_bytes"] = sum(plan["memory"][k] for k in ("weights", "gradients", "optimizer"))
            r["new_tp_s"], r["new_cp_s"] = plan["time_s"]["tp_comm"], plan["time_s"]["cp_comm"]
            r["new_pp_s"] = plan["time_s"]["pp_comm"] + plan["time_s"]["bubble"]
    rows.sort(key=lambda r: r["step_time_s"])
    name = lambda r: f"tp{r['tp']} pp{r['pp']} dp{r['dp']} cp{r['cp']}" + (f" {r['sharding']}" if r["sharding"] != "none" else "")
    md = a.markdown
    head = ["layout", "rounds (ms)", "median (ms)", "exposed comm (ms)", "old pred (ms)", "old p/m", "new pred (ms)",
            "new p/m", "new tp / cp / pp+bubble (ms)", "RSS MiB", "state MiB", "pred MiB", "pred state MiB"]
    print(("| " + " | ".join(head) + " |\n|" + "---|" * len(head)) if md else "  ".join(head))
    for r in rows:
        cells = [name(r), " / ".join(f"{x * 1e3:.0f}" for x in r["step_time_s_rounds"]), f"{r['step_time_s'] * 1e3:.1f}",
                 f"{r['exposed_comm_s'] * 1e3:.1f}", f"{r['predicted_step_time_s'] * 1e3:.1f}",
                 f"{r['predicted_step_time_s'] / r['step_time_s']:.2f}", f"{r['new_s'] * 1e3:.1f}",
                 f"{r['new_s'] / r['step_time_s']:.2f}",
                 f"{r['new_tp_s'] * 1e3:.0f} / {r['new_cp_s'] * 1e3:.0f} / {r['new_pp_s'] * 1e3:.0f}",
                 f"{r['max_rss_bytes'] / 2**20:.0f}", f"{r['training_state_bytes'] / 2**20:.1f}",
                 f"{r['new_memory_bytes'] / 2**20:.1f}", f"{r['new_state_bytes'] / 2**20:.1f}"]
        print(("| " + " | ".join(cells) + " |") if md else "  ".join(cells))
    measured = [r["step_time_s"] for r in rows]
    best = min(measured)
    n_rounds = min(len(r["step_time_s_rounds"]) for r in rows)
    agree = [spearman([r["step_time_s_rounds"][i] for r in rows], [r["step_time_s_rounds"][j] for r in rows])
             for i in range(n_rounds) for j in range(i + 1, n_rounds)]
    print()
    if agree:
        print(f"rounds' agreement (Spearman, each pair): {', '.join(f'{x:.2f}' for x in agree)}; "
              f"median {statistics.median(agree):.2f}")
    for label, key in (("old", "predicted_step_time_s"), ("new", "new_s")):
        pred = [r[key] for r in rows]
        pick = min(rows, key=lambda r: r[key])
        ratios = [p / m for p, m in zip(pred, measured)]
        print(f"{label}: Spearman {spearman(pred, measured):.2f}; pick {name(pick)} at {pick['step_time_s'] / best:.2f} x "
              f"the best measured; pred/meas {min(ratios):.2f}-{max(ratios):.2f}, mean |error| "
              f"{100 * statistics.mean(abs(x - 1) for x in ratios):.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
