#!/usr/bin/python3
"""Checks weft-schedule's JSON against the pipeline papers' formulas, its timeline, and bad input.

usage: cli_checks.py PATH/TO/weft-schedule
"""

import json
import random
import subprocess
import sys
import time

FIELDS = ["schedule", "stages", "micro_batches", "virtual", "makespan", "bubble_fraction", "peak_in_flight",
          "deadlock_free", "actions"]


def run(binary, *args):
    done = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def expected(kind, p, m, v):
    """(makespan, bubble fraction, peak per stage) from the formulas, for the default costs F=1,
    B=2 (input 1 + weight W=1) per chunk; makespan and bubble None for zb-h1 with m < p."""
    if kind in ("gpipe", "1f1b"):
        makespan = (m + p - 1) * 3
    elif kind == "interleaved":
        makespan = (v * m + p - 1) * 3
    else:
        # ZB-H1, m >= p: m(F + B) + (p - 1)(F + B - 2W).
        makespan = 3 * m + (p - 1) if m >= p else None
    bubble = None if makespan is None else 1 - 3 * v * m / makespan
    if kind == "gpipe":
        peaks = [m] * p
    elif kind == "interleaved":
        peaks = [min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) for s in range(p)]
    elif kind == "zb-h1":
        peaks = [min(p, m)] * p
    else:
        peaks = [min(p - s, m) for s in range(p)]
    return makespan, bubble, peaks


def main():
    binary = sys.argv[1]
    failures = []

    def expect(condition, what):
        if not condition:
            failures.append(what)

    rng = random.Random(4242)
    cases = [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 8, 1)]
    for _ in range(30):
        kind = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1"])
        p = rng.randint(2 if kind == "interleaved" else 1, 8)
        v = rng.randint(2, 4) if kind == "interleaved" else 1
        m = p * rng.randint(1, 4) if kind == "interleaved" else rng.randint(1, 24)
        cases.append((kind, p, m, v))
    for kind, p, m, v in cases:
        name = f"{kind} p={p} m={m} v={v}"
        args = ["--schedule", kind, "--stages", p, "--micro-batches", m, "--json"]
        if v > 1:
            args += ["--virtual", v]
        code, out, err = run(binary, *args)
        expect(code == 0, f"{name}: exit {code}: {err}")
        if code != 0:
            continue
        data = json.loads(out)
        for field in FIELDS:
            expect(field in data, f"{name}: no field {field}")
        expect((data["schedule"], data["stages"], data["micro_batches"], data["virtual"]) == (kind, p, m, v), f"{name}: echo")
        expect(data["deadlock_free"] is True, f"{name}: not deadlock-free")
        makespan, bubble, peaks = expected(kind, p, m, v)
        if makespan is not None:
            expect(abs(data["bubble_fraction"] - bubble) < 1e-9, f"{name}: bubble {data['bubble_fraction']} != {bubble}")
            expect(data["makespan"] == makespan, f"{name}: makespan {data['makespan']} != {makespan}")
        else:
            expect(data["makespan"] < (m + p - 1) * 3 or p == 1, f"{name}: makespan {data['makespan']}, not below 1f1b's")
        expect(data["peak_in_flight"] == peaks, f"{name}: peaks {data['peak_in_flight']} != {peaks}")
        # Idle time over stages x makespan, from the actions themselves.
        busy = sum(a["finish"] - a["start"] for rank in data["actions"] for a in rank)
        expect(abs(1 - busy / (p * data["makespan"]) - data["bubble_fraction"]) < 1e-9, f"{name}: bubble vs actions")
        kinds = {"forward": 0, "backward": 0, "weight": 0}
        for rank in data["actions"]:
            for a in rank:
                kinds[a["kind"]] += 1
        expect(kinds["forward"] == kinds["backward"] == p * m * v, f"{name}: action counts {kinds}")
        expect(kinds["weight"] == (p * m if kind == "zb-h1" else 0), f"{name}: weight actions {kinds}")
        # Every send has its receive.
        sends = sorted((r, a["send_to"], a["kind"], a["micro_batch"]) for r, rank in enumerate(data["actions"]) for a in rank
                       if a["send_to"] >= 0)
        recvs = sorted((a["recv_from"], r, a["kind"], a["micro_batch"]) for r, rank in enumerate(data["actions"]) for a in rank
                       if a["recv_from"] >= 0)
        expect(len(sends) == len(recvs) and [s[:2] + s[3:] for s in sends] == [s[:2] + s[3:] for s in recvs], f"{name}: pairing")

    # ZB-H1 beats 1F1B with a weight cost, no stage holding more than 1F1B's stage 0.
    _, out_zb, _ = run(binary, "--schedule", "zb-h1", "--stages", 4, "--micro-batches", 8, "--json")
    _, out_1f, _ = run(binary, "--schedule", "1f1b", "--stages", 4, "--micro-batches", 8, "--json")
    zb, one = json.loads(out_zb), json.loads(out_1f)
    expect(zb["bubble_fraction"] < one["bubble_fraction"] and max(zb["peak_in_flight"]) == max(one["peak_in_flight"]),
           "zb-h1 vs 1f1b")
    expect((zb["makespan"], one["makespan"]) == (27, 33), f"zb-h1 vs 1f1b makespans {zb['makespan']}, {one['makespan']}")

    # The timeline.
    code, out, err = run(binary, "--schedule", "1f1b", "--stages", 4, "--micro-batches", 8)
    expect(code == 0, f"timeline exit {code}")
    for text in ["stage 0  FFFF......BBFBBFBBFBBFBB.BB.BB.BB", "stage 3  ...FBBFBBFBBFBBFBBFBBFBBFBB......",
                 "makespan 33, bubble 27.27 %", "peak micro-batches in flight per stage: 4 3 2 1"]:
        expect(text in out, f"timeline lacks '{text}'")
    code, out, err = run(binary, "--schedule", "zb-h1", "--stages", 4, "--micro-batches", 8)
    expect(code == 0, f"zb-h1 timeline exit {code}")
    for text in ["stage 0  FFFF...BWFBWFBWFBWFBWBWBWBW", "stage 3  ...FBFBFBFBWFBWFBWFBWFBWWWW",
                 "makespan 27, bubble 11.11 %", "peak micro-batches in flight per stage: 4 4 4 4"]:
        expect(text in out, f"zb-h1 timeline lacks '{text}'")
    code, out, err = run(binary, "--help")
    expect(code == 0 and "usage: weft-schedule" in out, "--help")

    # Refused schedules exit 1 with the rule and a valid alternative.
    for args, message in [
        (["--schedule", "interleaved", "--stages", 4, "--micro-batches", 6, "--virtual", 2], "use micro-batches=4 or 8"),
        (["--schedule", "interleaved", "--stages", 4, "--micro-batches", 8], "use the 1f1b schedule"),
        (["--schedule", "1f1b", "--stages", 4, "--micro-batches", 8, "--virtual", 2], "use --schedule interleaved"),
        (["--schedule", "interleaved", "--stages", 4, "--micro-batches", 8, "--virtual", 3, "--layers", 32], "use layers=24 or 36"),
        (["--schedule", "zb-h1", "--stages", 4, "--micro-batches", 8, "--weight-cost", 2], "give 0..1"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 1, f"{args}: exit {code}, expected 1")
        expect(message in err, f"{args}: stderr lacks '{message}': {err.strip()}")
        code, out, err = run(binary, *args, "--json")
        expect(code == 1 and message in " ".join(json.loads(out)["errors"]), f"{args} --json: no error object")

    # A bad command line exits 2 with the usage.
    for args, message in [
        (["--stages", 4, "--micro-batches", 8], "--schedule is required"),
        (["--schedule", "pipedream", "--stages", 4, "--micro-batches", 8], "--schedule expects one of gpipe, 1f1b, interleaved, zb-h1"),
        (["--schedule", "1f1b", "--stages", 0, "--micro-batches", 8], "--stages expects an integer from 1"),
        (["--schedule", "1f1b", "--stages", 4, "--micro-batches", "x"], "--micro-batches expects an integer"),
        (["--schedule", "1f1b", "--stages", 4, "--micro-batches", 8, "--frobnicate"], "unknown option '--frobnicate'"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 2, f"{args}: exit {code}, expected 2")
        expect(message in err and "usage:" in err, f"{args}: stderr lacks '{message}': {err.strip()}")

    # A table too large to build is refused at once, naming the limit (it ran past 60 s, allocating).
    start = time.monotonic()
    code, out, err = run(binary, "--schedule", "interleaved", "--stages", 4096, "--micro-batches", 65536, "--virtual", 1024)
    expect(code == 2 and "= 549755813888 actions, more than the 2097152 weft-schedule builds" in err,
           f"huge interleaved schedule: exit {code}, {err.splitlines()[:1]}")
    expect(time.monotonic() - start < 5, "huge interleaved schedule not refused within 5 s")
    # The limit counts ZB-H1's weight passes: 64 x 10923 x 3 is just over it. (Just under it, the
    # schedule takes seconds, longer under the sanitizers: docs/parallelism.md has the times.)
    code, out, err = run(binary, "--schedule", "zb-h1", "--stages", 64, "--micro-batches", 10923)
    expect(code == 2 and "x 3 passes = 2097216 actions, more than the 2097152" in err,
           f"zb-h1 64 x 10923: exit {code}, {err.splitlines()[:1]}")

    # Misspelt options and schedule names get the nearest spelling.
    for args, message in [
        (["--schedule", "1F1B", "--stages", 4, "--micro-batches", 8], "did you mean '1f1b'?"),
        (["--schedule", "zbh1", "--stages", 4, "--micro-batches", 8], "did you mean 'zb-h1'?"),
        (["--schedule", "1f1b", "--stage", 4, "--micro-batches", 8], "unknown option '--stage'; did you mean '--stages'?"),
        (["--schedule", "1f1b", "--stages", 4, "--microbatches", 8], "did you mean '--micro-batches'?"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 2 and message in err, f"{args}: exit {code}, {err.splitlines()[:1]}")

    # Every numeric flag, given 0, -1, a huge value or a non-number: exit 2 with a first line that
    # names the flag and its range, never a signal or a hang.
    accepts_zero = {"--layers", "--weight-cost", "--comm-cost"}
    for flag in ["--stages", "--micro-batches", "--virtual", "--layers", "--forward-cost", "--backward-cost",
                 "--weight-cost", "--comm-cost"]:
        for value in ["0", "-1", "99999999999999999999", "1e300", "x"]:
            args = ["--schedule", "1f1b", "--stages", 4, "--micro-batches", 8, flag, value]
            start = time.monotonic()
            code, out, err = run(binary, *args)
            name = f"{flag} {value}"
            expect(time.monotonic() - start < 10, f"{name}: over 10 s")
            if value == "0" and flag in accepts_zero:
                expect(code == 0, f"{name}: exit {code}, 0 is valid")
                continue
            first = err.splitlines()[0] if err else ""
            expect(code == 2 and first.startswith(f"weft-schedule: {flag} expects an integer from"),
                   f"{name}: exit {code}, first line {first!r}")

    for failure in failures:
        print("FAIL:", failure)
    print(f"{len(cases)} schedules checked, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
