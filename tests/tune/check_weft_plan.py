"""Runs weft-plan and checks its --json output and its exit codes for bad input.

Usage: check_weft_plan.py path/to/weft-plan
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PLAN = sys.argv[1]
failures = []


def run(*args):
    return subprocess.run([PLAN, *args], capture_output=True, text=True, timeout=60)


def check(condition, message):
    if not condition:
        failures.append(message)


LLAMA7 = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096", "--vocab", "32000",
          "--ffn", "11008", "--swiglu"]

# Search: a JSON object with plans, best first, with the documented fields and sane values.
r = run(*LLAMA7, "--gpu", "H100", "--gpus", "64", "--global-batch", "512", "--tokens", "1T",
        "--price", "2", "--top", "4", "--json")
check(r.returncode == 0, f"search exit {r.returncode}: {r.stderr}")
out = json.loads(r.stdout)
plans = out["plans"]
check(len(plans) == 4, "--top 4 gives 4 plans")
for p in plans:
    for key in ("tp", "pp", "dp", "cp", "vp", "micro_batch", "recompute", "mfu", "tokens_per_s",
                "memory_per_gpu_bytes", "step_time_s"):
        check(key in p, f"plan lacks {key}")
    check(p["tp"] * p["pp"] * p["dp"] * p["cp"] == 64, "degrees multiply to the GPU count")
    check(0 < p["mfu"] < 1, "mfu is a fraction")
    check(p["memory_per_gpu_bytes"] < 80 * 2**30, "plans fit in 80 GB")
    check(abs(p["tokens_per_s"] * p["step_time_s"] - 512 * 4096) < 1e-3 * 512 * 4096,
          "tokens/s x step time = tokens per step")
    check(abs(p["days"] - 1e12 / p["tokens_per_s"] / 86400) < 1e-3 * p["days"], "days from throughput")
check(all(a["tokens_per_s"] >= b["tokens_per_s"] for a, b in zip(plans, plans[1:])), "plans are best first")
check(plans[0]["tp"] == 1 and plans[0]["pp"] == 1, "a 7B model on 64 H100s trains data parallel")

# The answer first: the first line names the best layout (the JSON's first plan), its days and
# cost for --tokens, and why (its closest alternative and what that one loses).
check(out.get("headline", "").startswith("Best: tp=%d cp=%d pp=%d dp=%d" % (plans[0]["tp"], plans[0]["cp"],
                                                                          plans[0]["pp"], plans[0]["dp"])),
      f"headline names the best plan: {out.get('headline')!r}")
r = run(*LLAMA7, "--gpu", "H100", "--gpus", "64", "--global-batch", "512", "--tokens", "1T", "--price", "2")
first = r.stdout.splitlines()[0] if r.stdout else ""
days = "%.3g days" % plans[0]["days"]
check(first.startswith("Best: tp=%d " % plans[0]["tp"]) and days in first and "cost" in first and "slower" in first,
      f"first line is the answer with days ({days}), cost and the reason: {first!r}")

# Evaluate one layout: the answer keeps it.
r = run(*LLAMA7, "--gpu", "A100-80GB", "--gpus", "16", "--global-batch", "256", "--tp", "2", "--pp", "2",
        "--dp", "4", "--micro-batch", "1", "--recompute", "full", "--json")
check(r.returncode == 0, f"evaluate exit {r.returncode}: {r.stderr}")
p = json.loads(r.stdout)["plans"][0]
check((p["tp"], p["pp"], p["dp"], p["micro_batch"], p["recompute"]) == (2, 2, 4, 1, "full"), "evaluate keeps the layout")

# The explanation names the usual alternatives with the model's numbers.
r = run("--model", "llama2-7b", "--gpu", "H100", "--gpus", "64", "--global-batch", "512", "--explain")
check(r.returncode == 0 and "8-way TP" in r.stdout and "TP collectives take" in r.stdout, "explanation of 8-way TP")

# The blog's claim: 8 x A100 in 120 days needs more than 100 % MFU.
r = run("--model", "llama2-7b", "--gpu", "A100-80GB", "--gpus", "8", "--global-batch", "1024", "--tokens", "1T",
        "--claim-days", "120", "--json")
claim = json.loads(r.stdout)["claim"]
check(claim["implied_mfu"] > 1 and claim["possible"] is False, "8 x A100 120-day claim is impossible")
check(claim["predicted_days"] > 120, "the model needs more than 120 days")

# Bad input: non-zero exit with the reason and, where possible, the nearest valid alternative.
bad = [
    (("--gpus", "16", "--tp", "4", "--pp", "2", "--dp", "4"), "but there are 16 GPUs", "--dp 2"),
    (("--gpus", "16", "--tp", "3", "--pp", "1", "--dp", "2"), "do not divide by tp = 3", "nearest valid tp: 2 or 4"),
    (("--gpus", "12", "--gpus-per-node", "4", "--tp", "2", "--pp", "3", "--dp", "2"), "layers do not divide",
     "valid"),
    (("--gpus", "16", "--recompute", "sometimes"), "--recompute must be", ""),
]
for extra, reason, hint in bad:
    r = run(*LLAMA7, "--gpu", "H100", "--global-batch", "192", *extra)
    check(r.returncode == 2, f"{extra}: exit {r.returncode}, want 2")
    check(reason in r.stderr and hint in r.stderr, f"{extra}: message {r.stderr!r}")
r = run("--model", "llama3-405b", "--gpu", "A100-40GB", "--gpus", "8", "--global-batch", "64")
check(r.returncode == 3 and "no layout fits" in r.stderr and "GB per GPU" in r.stderr, f"nothing fits: {r.stderr!r}")
r = run(*LLAMA7, "--gpu", "V100", "--gpus", "8", "--global-batch", "64")
check(r.returncode == 2 and "unknown GPU" in r.stderr and "H100" in r.stderr, "unknown GPU")
r = run(*LLAMA7, "--gpu", "H100", "--gpus", "12", "--global-batch", "64")
check(r.returncode == 2 and "whole number of nodes" in r.stderr, "partial nodes")
r = run("--layers", "32", "--gpu", "H100", "--gpus", "8", "--global-batch", "64")
check(r.returncode == 2 and "hidden" in r.stderr, "missing model fields")


# Nothing fits although the closest layout already shards fully: sharding is not advised.
r = run("--model", "llama3-405b", "--gpu", "A100-40GB", "--gpus", "16", "--global-batch", "64")
check(r.returncode == 3 and "allow sharding" not in r.stderr and "sharding=full" in r.stderr,
      f"fully sharded closest layout, yet sharding advised: {r.stderr!r}")
# Sharding kept below full by --max-sharding: then it is advised, with the flag.
r = run("--model", "llama3-405b", "--gpu", "A100-40GB", "--gpus", "8", "--global-batch", "64", "--max-sharding", "none")
check(r.returncode == 3 and "or allow sharding (--max-sharding full)" in r.stderr, f"--max-sharding none: {r.stderr!r}")

# Misspelt options and names get the nearest spelling.
for args, message in [
    (("--model", "llama2-7b", "--explian"), "unknown option '--explian'; did you mean '--explain'?"),
    (("--model", "llama2-7b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64", "--globalbatch", "8"),
     "did you mean '--global-batch'?"),
    (("--model", "Llama2-7B", "--gpu", "H100"), "did you mean 'llama2-7b'?"),
    (("--model", "llama2-7b", "--gpu", "A100-80G", "--gpus", "8"), "unknown GPU 'A100-80G'; did you mean 'A100-80GB'?"),
    (("--model", "llama2-7b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64", "--recompute", "selctive"),
     "did you mean 'selective'?"),
]:
    r = run(*args)
    check(r.returncode == 2 and message in r.stderr, f"{args}: {r.stderr!r}")

# A hardware file whose counts are not whole numbers, or do not fit an int, is refused by name
# (0.5 ranks per node truncated to 0, and weft-plan died of SIGFPE dividing by it).
with tempfile.TemporaryDirectory() as folder:
    valid = {"format": "weft.hardware.v1", "name": "test", "ranks_per_node": 2, "nodes": 1, "memory_bytes": 8e9,
             "memory_bandwidth": 1e10, "gemm_peak_flops": 5e10, "gemm_half_size": 64,
             "gemm_samples": [[64, 2.5e10], [1024, 5e10]],
             "intra_node": {"all_reduce": 3e9, "all_gather": 3e9, "reduce_scatter": 3e9, "latency": 2e-6},
             "across_nodes": {"all_reduce": 3e9, "all_gather": 3e9, "reduce_scatter": 3e9, "latency": 2e-6},
             "p2p": {"bandwidth": 5e9, "latency": 1e-6}, "cpus_per_node": 2}
    for field, value, message in [
        ("ranks_per_node", 0.5, "'ranks_per_node' must be a whole number from 1 to 1048576, not 0.5"),
        ("ranks_per_node", 1e300, "'ranks_per_node' must be a whole number from 1 to 1048576, not 1e+300"),
        ("nodes", 1e300, "'nodes' must be a whole number from 1 to 1048576, not 1e+300"),
        ("nodes", 4096, "2 ranks per node x 4096 nodes is more than 1048576 ranks"),
        ("cpus_per_node", 2.5, "'cpus_per_node' must be a whole number from 0 to 1048576, not 2.5"),
    ]:
        description = dict(valid, **{field: value})
        if field == "nodes" and value == 4096:
            description["ranks_per_node"] = 1024
            message = "1024 ranks per node x 4096 nodes is more than 1048576 ranks"
        path = os.path.join(folder, "hw.json")
        with open(path, "w") as f:
            json.dump(description, f)
        r = run("--model", "llama2-7b", "--hardware", path, "--gpus", "8", "--global-batch", "64")
        check(r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1,
              f"hardware {field}={value}: exit {r.returncode}, {r.stderr!r}")
    path = os.path.join(folder, "hw.json")
    with open(path, "w") as f:
        json.dump(valid, f)
    r = run("--model", "llama2-7b", "--hardware", path, "--gpus", "8", "--global-batch", "64", "--json")
    check(r.returncode in (0, 3), f"valid hardware file: exit {r.returncode}, {r.stderr!r}")

# Every numeric flag, given 0, -1, huge values or a non-number: exit 2 with one line naming the
# flag and its range, never a signal or a hang.
accepts_zero = {"--params", "--tokens", "--price"}
base = {"--layers": "32", "--hidden": "4096", "--heads": "32", "--seq": "4096", "--vocab": "32000", "--gpu": "H100",
        "--gpus": "8", "--global-batch": "64"}
for flag in ["--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--seq", "--vocab", "--params", "--gpus",
             "--gpus-per-node", "--nvlink-gbytes", "--network-gbits", "--oversubscription", "--global-batch",
             "--global-batch-tokens", "--tokens", "--price", "--tp", "--pp", "--dp", "--cp", "--vp", "--micro-batch",
             "--top", "--claim-days"]:
    for value in ["0", "-1", "99999999999999999999", "1e300", "x"]:
        args = dict(base, **{flag: value})
        if flag == "--claim-days":
            args["--tokens"] = "1T"
        argv = [w for item in args.items() for w in item]
        start = time.monotonic()
        r = run(*argv)
        name = f"{flag} {value}"
        check(time.monotonic() - start < 20, f"{name}: over 20 s")
        if value == "0" and flag in accepts_zero:
            check(r.returncode == 0, f"{name}: exit {r.returncode}, 0 is valid: {r.stderr!r}")
            continue
        check(r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(f"weft-plan: {flag} "),
              f"{name}: exit {r.returncode}, {r.stderr!r}")

# Mixtures of experts: the flags, ep in the search and in --json, the all-to-all in --explain, and
# one line of exit status 2 for each bad input.
MOE = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "2048", "--vocab", "32000", "--ffn", "4096",
       "--swiglu", "--moe-experts", "8", "--moe-top-k", "2", "--moe-every", "1"]
r = run(*MOE, "--gpu", "H100", "--gpus", "16", "--global-batch", "64", "--ep", "8", "--tp", "1", "--pp", "1",
        "--json", "--explain")
check(r.returncode == 0, f"MoE evaluate exit {r.returncode}: {r.stderr}")
if r.returncode == 0:
    out = json.loads(r.stdout)
    p = out["plans"][0]
    check(p["ep"] == 8 and p["expert_tp"] == 1 and p["time_s"]["ep_comm"] > 0,
          f"the plan keeps ep 8 and charges the all-to-all: {p}")
r = run(*MOE, "--gpu", "H100", "--gpus", "16", "--global-batch", "64", "--ep", "8", "--tp", "1", "--pp", "1",
        "--explain")
check("EP all-to-all" in r.stdout, f"--explain shows the all-to-all term: {r.stdout!r}")
r = run("--model", "mixtral-8x7b", "--gpu", "H100", "--gpus", "64", "--global-batch", "256", "--json")
check(r.returncode == 0 and json.loads(r.stdout)["plans"][0]["ep"] > 1,
      f"Mixtral 8x7B on 64 H100 splits its experts: {r.stdout[:300]!r} {r.stderr!r}")
for args, message in [
    (["--moe-top-k", "9"], "weft-plan: weft: tune: top-k = 9 is more than the 8 experts: a token is routed to at most "
                           "every expert; give --moe-top-k from 1 to 8\n"),
    (["--ep", "3"], "weft-plan: invalid layout: 8 experts do not divide over ep = 3; choose ep dividing the experts\n"),
    (["--ep", "8", "--tp", "4", "--expert-tp", "4"],
     "weft-plan: invalid layout: ep x expert-tp = 32 does not divide the 16 GPUs (it must divide tp x cp x dp, "
     "the ranks of a pipeline stage)\n"),
]:
    r = run(*MOE, *args, "--gpu", "H100", "--gpus", "16", "--global-batch", "64")
    check(r.returncode == 2 and r.stderr == message, f"{args}: exit {r.returncode}, {r.stderr!r}")
r = run(*LLAMA7, "--gpu", "H100", "--gpus", "16", "--global-batch", "64", "--ep", "2")
check(r.returncode == 2 and r.stderr.count("\n") == 1 and "has none" in r.stderr,
      f"--ep on a dense model: exit {r.returncode}, {r.stderr!r}")

# --explain says what the model cannot know: a probed machine whose timings spread by more than
# the predicted differences names the alternatives it cannot order (text and --json "caveats"),
# and a description of ranks sharing cores without exchange_latency says it lacks it.
HW = {"format": "weft.hardware.v1", "name": "four ranks on two cores", "ranks_per_node": 4, "nodes": 1,
      "memory_bytes": 6e9, "memory_bandwidth": 4.5e9, "gemm_peak_flops": 1e10, "gemm_half_size": 6,
      "intra_node": {"all_reduce": 6e8, "all_gather": 7e8, "reduce_scatter": 2.4e8, "latency": 5e-6},
      "across_nodes": {"all_reduce": 6e8, "all_gather": 7e8, "reduce_scatter": 2.4e8, "latency": 5e-6},
      "p2p": {"bandwidth": 2.5e9, "latency": 5e-6}, "cpus_per_node": 2, "exchange_latency": 3e-4,
      "timing_spread": 0.5}
SMALL = ["--layers", "4", "--hidden", "128", "--heads", "4", "--seq", "128", "--vocab", "256", "--tied-embeddings",
         "--global-batch", "8", "--explain"]
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "hw.json")
    json.dump(HW, open(path, "w"))
    r = run(*SMALL, "--hardware", path)
    check(r.returncode == 0 and "What the model cannot know here:\n  - the probe's repeated timings on this machine "
          "spread by 50.0 %" in r.stdout, f"--explain with spread timings: {r.stdout!r} {r.stderr!r}")
    r = run(*SMALL, "--hardware", path, "--json")
    caveats = json.loads(r.stdout)["caveats"] if r.returncode == 0 else []
    check(len(caveats) == 1 and "spread by 50.0 %" in caveats[0], f"--json --explain caveats: {r.stdout!r}")
    del HW["exchange_latency"], HW["timing_spread"]
    json.dump(HW, open(path, "w"))
    r = run(*SMALL, "--hardware", path, "--json")
    caveats = json.loads(r.stdout)["caveats"] if r.returncode == 0 else []
    check(len(caveats) == 1 and "no exchange_latency" in caveats[0], f"an older description: {r.stdout!r}")
r = run(*LLAMA7, "--gpu", "H100", "--gpus", "64", "--global-batch", "512", "--explain", "--json")
check(r.returncode == 0 and json.loads(r.stdout)["caveats"] == [], f"no caveats on 64 H100: {r.stdout[-300:]!r}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("weft-plan: all checks passed")
