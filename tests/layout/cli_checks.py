#!/usr/bin/python3
"""Checks weft-layout's exit codes, messages and JSON shape.

usage: cli_checks.py PATH/TO/weft-layout
"""

import json
import re
import subprocess
import sys
import time

REQUIRED_GROUPS = ["tp", "cp", "ep", "dp", "pp", "tp-pp", "tp-cp", "dp-cp", "tp-dp-cp", "embedding"]


def run(binary, *args):
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def main():
    binary = sys.argv[1]
    failures = []

    def expect(condition, what):
        if not condition:
            failures.append(what)

    # Valid layout, JSON: required keys, groups partition the world, node report present.
    code, out, err = run(binary, "--world-size", "32", "--tp", "4", "--cp", "2", "--pp", "2", "--json",
                         "--gpus-per-node", "8")
    expect(code == 0, f"valid layout exited {code}: {err}")
    data = json.loads(out)
    expect(data["world_size"] == 32, "world_size")
    expect(data["order"] == "tp-cp-ep-dp-pp", "order")
    expect(data["degrees"]["dp"] == 2, "dp derived as 32 / (4*2*2)")
    expect(data["fingerprint"].startswith("0x") and len(data["fingerprint"]) == 18, "fingerprint is 64-bit hex")
    for name in REQUIRED_GROUPS:
        expect(name in data["groups"], f"groups lacks {name}")
    for name in ["tp", "cp", "ep", "dp", "pp", "tp-pp", "tp-cp", "dp-cp", "tp-dp-cp"]:
        flat = sorted(r for g in data["groups"][name] for r in g)
        expect(flat == list(range(32)), f"{name} groups do not partition the world")
    expect(data["groups"]["tp"][0] == [0, 1, 2, 3], "first tp group")
    expect(data["groups"]["cp"][0] == [0, 4], "first cp group")
    expect(data["groups"]["embedding"][0] == [0, 16], "first embedding group")
    expect(len(data["ranks"]) == 32 and data["ranks"][5]["tp"] == 1 and data["ranks"][5]["cp"] == 1, "rank 5 coordinates")
    expect(data["ranks"][9]["node"] == 1, "rank 9 is on node 1")
    expect(data["nodes"]["groups"]["tp"]["inside_nodes"] is True, "tp inside nodes")
    expect(data["nodes"]["groups"]["pp"]["inside_nodes"] is False, "pp crosses nodes")
    expect(data["warnings"] == [], "no warnings for the default order")

    # Default order, no --order: same as explicit.
    code, out2, _ = run(binary, "--world-size", "32", "--tp", "4", "--cp", "2", "--pp", "2", "--json",
                        "--gpus-per-node", "8", "--order", "tp-cp-ep-dp-pp")
    expect(code == 0 and json.loads(out2)["groups"] == data["groups"], "explicit default order differs")

    # Node warnings: TP across nodes with DP inside.
    code, out, err = run(binary, "--world-size", "16", "--tp", "8", "--order", "dp-tp-pp", "--gpus-per-node", "8", "--json")
    warnings = json.loads(out)["warnings"]
    expect(code == 0 and len(warnings) == 2 and "TP groups span nodes" in warnings[0], f"tp warning: {warnings}")
    expect("warning: TP groups span nodes" in err, "warnings are repeated on stderr with --json")
    code, out, err = run(binary, "--world-size", "16", "--tp", "8", "--order", "dp-tp-pp", "--gpus-per-node", "8")
    expect(code == 0 and "warning: TP groups span nodes" in out, "table shows the warning")

    # The readable table.
    code, out, err = run(binary, "--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2")
    expect(code == 0, f"table exit {code}")
    for text in ["layout: world size 8, order tp-cp-ep-dp-pp", "dense layers:  tp=2 cp=1 dp=2 pp=2",
                 "expert layers: expert-tp=2 ep=2 expert-dp=1 pp=2", "  tp: 2 x 4", "[0 1] [2 3] [4 5] [6 7]",
                 "  ep: 2 x 4", "embedding: 2 x 4"]:
        expect(text in out, f"table lacks '{text}'")
    code, out, err = run(binary, "--world-size", "8", "--tp", "2", "--pp", "2", "--rank", "5")
    expect(code == 0 and "[4 5] (rank 5 at position 1)" in out and "(rank 5 is in none)" not in out.split("embedding")[0],
           "--rank view")
    code, out, err = run(binary, "--help")
    expect(code == 0 and "usage: weft-layout" in out, "--help")

    # Invalid layouts exit 1 with the reason on stderr (and a JSON error object with --json).
    for args, message in [
        (["--world-size", "16", "--tp", "3", "--pp", "4"], "does not divide the world size 16"),
        (["--world-size", "16", "--tp", "2", "--pp", "4", "--dp", "4"], "leave dp out to derive it (it would be 2)"),
        (["--world-size", "16", "--tp", "0"], "tp=0 is invalid"),
        (["--world-size", "16", "--dp", "0"], "leave --dp out to derive it"),
        (["--world-size", "16", "--order", "tp-xp-dp"], "unknown dimension 'xp'"),
        (["--world-size", "16", "--order", "tp-dp-tp"], "appears more than once"),
        (["--world-size", "16", "--pp", "4", "--order", "tp-dp"], "does not name pp"),
        (["--world-size", "16", "--ep", "4", "--pp", "4", "--expert-tp", "2"], "expert-dp"),
        (["--world-size", "16", "--cp", "2", "--ep", "2", "--pp", "2", "--order", "tp-cp-pp-ep-dp"], "put pp last"),
        (["--world-size", "16", "--tp", "4", "--heads", "6"], "6 attention heads do not divide over tp=4"),
        (["--world-size", "16", "--pp", "4", "--layers", "10"], "10 layers do not divide over pp=4"),
        (["--world-size", "16", "--pp", "2", "--layers", "12", "--virtual-stages", "4"], "= 8 model chunks"),
        (["--world-size", "16", "--ep", "4", "--experts", "6"], "6 experts do not divide over ep=4"),
        (["--world-size", "16", "--gpus-per-node", "0"], "gpus per node 0 is invalid"),
        (["--world-size", "16", "--rank", "16"], "--rank 16 is outside the world"),
        (["--world-size", "0"], "world size 0 is invalid"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 1, f"{' '.join(args)}: exit {code}, expected 1")
        expect(message in err, f"{' '.join(args)}: stderr lacks '{message}': {err.strip()}")
        code, out, err = run(binary, *args, "--json")
        expect(code == 1 and message in " ".join(json.loads(out)["errors"]), f"{' '.join(args)} --json: no error object")

    # A bad command line exits 2 with usage.
    for args, message in [
        (["--tp", "2"], "--world-size is required"),
        (["--world-size", "16", "--tp", "abc"], "--tp expects an integer from -2147483648 to 2147483647, not 'abc'"),
        (["--world-size", "16", "--tp"], "--tp needs a value"),
        (["--world-size", "16", "--frobnicate"], "unknown option '--frobnicate'"),
        (["--world-size", "99999999999"], "--world-size expects an integer from -2147483648 to 2147483647, not '99999999999'"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 2, f"{' '.join(args)}: exit {code}, expected 2")
        expect(message in err and "usage:" in err, f"{' '.join(args)}: stderr lacks '{message}': {err.strip()}")

    # A world too large to lay out ends in one line and exit 1, not std::bad_alloc (exit 134).
    start = time.monotonic()
    code, out, err = run(binary, "--world-size", "2147483647")
    expect(code == 1 and err.count("\n") == 1 and "world size 2147483647 is more than the 1048576 ranks" in err,
           f"--world-size 2147483647: exit {code}, stderr {err.strip()!r}")
    expect(time.monotonic() - start < 10, "--world-size 2147483647 takes over 10 s")
    # Sizes that would overflow pp x virtual stages are refused with the flag and the range.
    code, out, err = run(binary, "--world-size", "16", "--pp", "4", "--layers", "8", "--virtual-stages", "2147483647")
    expect(code == 1 and "--virtual-stages 2147483647 is out of range: give 1 to 1048576" in err,
           f"--virtual-stages 2147483647: exit {code}, {err.strip()!r}")

    # Misspelt options get the nearest spelling.
    for wrong, right in [("--word-size", "--world-size"), ("--virtual-stage", "--virtual-stages"), ("--jsn", "--json"),
                         ("--seq-len", "--seq-length")]:
        code, out, err = run(binary, wrong, "8")
        expect(code == 2 and f"unknown option '{wrong}'; did you mean '{right}'?" in err, f"{wrong}: {err.strip()!r}")
    code, out, err = run(binary, "--world-size", "8", "--frobnicate")
    expect("did you mean" not in err, f"--frobnicate gets a suggestion: {err.strip()!r}")

    # Every numeric flag, given 0, -1, a huge value or a non-number: an exit status (1 for a value
    # out of range, 2 for a non-number), never a signal or a hang, and a first line naming the flag.
    accepts_zero = {"--rank", "--heads", "--kv-heads", "--layers", "--experts", "--seq-length"}
    for flag in ["--world-size", "--tp", "--cp", "--ep", "--pp", "--dp", "--expert-tp", "--gpus-per-node", "--rank",
                 "--heads", "--kv-heads", "--layers", "--virtual-stages", "--experts", "--seq-length"]:
        too_large = "2000000000000" if flag == "--seq-length" else "2147483647"  # past 2^40, past int
        for value in ["0", "-1", "99999999999999999999", too_large, "1e300", "x"]:
            args = ["--world-size", "16", flag, value] if flag != "--world-size" else [flag, value]
            start = time.monotonic()
            code, out, err = run(binary, *args)
            name = " ".join(args)
            expect(time.monotonic() - start < 10, f"{name}: over 10 s")
            expect(code in (0, 1, 2), f"{name}: exit {code} (a signal?)")
            if value == "0" and flag in accepts_zero:
                expect(code == 0, f"{name}: exit {code}, 0 is valid")
                continue
            expect(code in (1, 2), f"{name}: accepted")
            first = err.splitlines()[0] if err else ""
            expect(first.startswith("weft-layout:") and re.search(flag.lstrip("-").replace("-", "[- ]"), first),
                   f"{name}: first line does not name the flag: {first!r}")
            if code == 1:
                expect(err.count("\n") == 1, f"{name}: more than one line: {err!r}")

    # --flag=value spelling.
    code, out, err = run(binary, "--world-size=8", "--tp=2", "--json")
    expect(code == 0 and json.loads(out)["degrees"]["dp"] == 4, "--flag=value")

    for failure in failures:
        print("FAIL:", failure)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
