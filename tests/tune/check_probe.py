"""Runs weft-plan --probe on 2 ranks, then plans with the description it wrote (--hardware).

Usage: check_probe.py MPIEXEC path/to/weft-plan WORK_DIR
"""
import json
import math
import os
import subprocess
import sys

MPIEXEC, PLAN, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(WORK, exist_ok=True)
HW = os.path.join(WORK, "hardware.json")
MODEL = ["--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "1024"]
failures = []


def check(condition, message):
    if not condition:
        failures.append(message)


if os.path.exists(HW):
    os.remove(HW)
r = subprocess.run([MPIEXEC, "-n", "2", "--oversubscribe", "--bind-to", "none", PLAN, "--probe", HW, *MODEL],
                   capture_output=True, text=True, timeout=240)
if r.returncode != 0 or not os.path.exists(HW):
    print(f"FAILED: probe exit {r.returncode}, no {HW}: {r.stderr}")
    sys.exit(1)
hw = json.load(open(HW))
check(hw["format"] == "weft.hardware.v1" and hw["ranks_per_node"] * hw["nodes"] == 2, f"description: {hw}")
for key in ("memory_bytes", "memory_bandwidth", "gemm_peak_flops"):
    check(hw[key] > 0, f"{key} measured")
for key in ("all_reduce", "all_gather", "reduce_scatter", "latency"):
    check(hw["intra_node"][key] > 0, f"intra_node.{key} measured")
check(hw["p2p"]["bandwidth"] > 0 and hw["p2p"]["latency"] > 0, "p2p measured")
# The all-reduce curve the synchronizer's bucket rule reads: sizes of 256 KiB x 2^k (up to the
# probe's largest, 128 MiB), in increasing order, each timed. Which of them: the search times the
# size around 8 MiB first and the small ones last (weft/grad/bucket_cap.hpp, probe_search), so on
# a loaded machine the 1 s budget can end before 256 KiB, or after the first size alone.
curve = hw["intra_node"].get("all_reduce_curve", [])
unit = 256 * 1024
check(len(curve) >= 1 and all(b % unit == 0 and (b // unit) & (b // unit - 1) == 0 and b <= 128 << 20 for b, _ in curve)
      and all(b > a for (a, _), (b, _) in zip(curve, curve[1:])) and all(t > 0 for _, t in curve),
      f"intra_node.all_reduce_curve {curve}")
# The exchange between busy ranks and the spread of the GEMM timings: written, finite, not negative
# (an exchange can cost nothing beyond the idle latency; a spread of 0 is a perfectly steady machine).
# No upper bound: on a loaded machine one descheduled repetition spreads the timings by 100 x.
for key in ("exchange_latency", "timing_spread"):
    value = hw.get(key)
    check(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, f"{key} {value}")
# Each GEMM sample is a throughput a CPU core can reach: between 1 MFLOP/s and 1 TFLOP/s.
check(all(1e6 < flops < 1e12 for _, flops in hw["gemm_samples"]), f"GEMM samples {hw['gemm_samples']}")

# The description replaces --gpu: a search over its 2 ranks, and one layout evaluated.
r = subprocess.run([PLAN, *MODEL, "--hardware", HW, "--global-batch", "8", "--json"], capture_output=True, text=True,
                   timeout=60)
check(r.returncode == 0, f"--hardware search exit {r.returncode}: {r.stderr}")
plans = json.loads(r.stdout)["plans"]
check(all(p["tp"] * p["cp"] * p["pp"] * p["dp"] == 2 for p in plans), "plans use the description's 2 ranks")
r = subprocess.run([PLAN, *MODEL, "--hardware", HW, "--gpu", "H100", "--global-batch", "8"], capture_output=True,
                   text=True, timeout=60)
check(r.returncode == 2 and "replaces --gpu" in r.stderr, f"--hardware with --gpu: {r.stderr!r}")
bad = os.path.join(WORK, "bad.json")
with open(bad, "w") as f:
    json.dump({k: v for k, v in hw.items() if k != "p2p"}, f)
r = subprocess.run([PLAN, *MODEL, "--hardware", bad, "--global-batch", "8"], capture_output=True, text=True, timeout=60)
check(r.returncode == 2 and "no 'p2p'" in r.stderr, f"description without p2p: {r.stderr!r}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("weft-plan --probe / --hardware: all checks passed")
