#!/usr/bin/python3
"""Starts a private single-node Slurm on this machine (munge, slurmctld, slurmd on free local
ports, state in a temporary folder), launches a weft program with `srun --mpi=pmix`, and checks
what every rank resolved from Slurm's variables (through launcher_report, which also checks them
against MPI). Then stops everything it started.

    slurm_launch.py LAUNCHER_REPORT [--ranks 3]

Exit status: 0 when every rank reported what srun was asked for and contradictory variables were
refused; 1 when weft got it wrong (a mismatch, a failed or hung launch); 77 (CTest's skip) when
Slurm is not installed, this is not root (slurmd needs root), or the daemons cannot start here.
"""
import argparse
import contextlib
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import private_slurm  # noqa: E402  (the project's private single-node Slurm)

SKIP = private_slurm.SKIP


def fail(message):
    print("slurm_launch: " + message, file=sys.stderr)
    sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program")
    parser.add_argument("--ranks", type=int, default=3)
    args = parser.parse_args()

    stack = contextlib.ExitStack()
    try:
        # The machine's part: a Slurm that cannot start here (no munge, a sandbox that forbids
        # daemons) says nothing about weft, so it is a skip with the reason, not a failure.
        try:
            env = stack.enter_context(private_slurm.cluster(args.ranks))
        except private_slurm.Unavailable as e:
            print(f"slurm_launch: SKIP: {e}")
            return SKIP
        command = ["srun", "--mpi=pmix", "-N", "1", "-n", str(args.ranks), args.program]
        try:
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            fail(f"'{' '.join(command)}' did not finish within 120 s")
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            fail(f"'{' '.join(command)}' exited with {run.returncode}")

        reports = []
        for line in run.stdout.splitlines():
            if line.startswith("launcher="):
                reports.append(dict(field.split("=", 1) for field in line.split()))
        if len(reports) != args.ranks:
            fail(f"expected {args.ranks} rank reports, got {len(reports)}")
        n = str(args.ranks)
        for r in reports:
            want = {"launcher": "slurm", "world": n, "local_world": n, "node": "0", "nodes": "1",
                    "local_rank": r["rank"], "rank_sum": str(args.ranks * (args.ranks - 1) // 2)}
            wrong = {k: (r.get(k), v) for k, v in want.items() if r.get(k) != v}
            if wrong:
                fail(f"rank {r.get('rank')} resolved {wrong} (got, wanted)")
        ranks = sorted(int(r["rank"]) for r in reports)
        if ranks != list(range(args.ranks)):
            fail(f"ranks reported: {ranks}")
        print(f"slurm_launch: srun --mpi=pmix -n {args.ranks}: every rank resolved its Slurm layout, agreed with MPI")

        # A step whose variables contradict each other (as a wrapper script that edits them would
        # leave): every rank must stop with a message naming the variables, not hang or guess.
        command = ["srun", "--mpi=pmix", "-N", "1", "-n", str(args.ranks), "env",
                   f"SLURM_STEP_NUM_TASKS={args.ranks + 1}", args.program]
        try:
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            fail(f"'{' '.join(command)}' hung instead of failing")
        if run.returncode == 0 or "SLURM_STEP_NUM_TASKS" not in run.stderr or "contradictory" not in run.stderr:
            sys.stderr.write(run.stderr)
            fail(f"'{' '.join(command)}' should fail naming SLURM_STEP_NUM_TASKS (exit {run.returncode})")
        first = next(line for line in run.stderr.splitlines() if "SLURM_STEP_NUM_TASKS" in line)
        print("slurm_launch: contradictory step variables are refused: " + first.strip())
        return 0
    finally:
        stack.close()

if __name__ == "__main__":
    sys.exit(main())
