#!/usr/bin/python3
"""`srun -n 4 train_gpt` under a real Slurm (the project's private single-node one).

  srun_check.py TRAIN_GPT

Checks that the run resolved 4 ranks from Slurm, trained (the loss fell) and finished; exits 77
(CTest's skip) when Slurm cannot run on this machine.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import private_slurm  # noqa: E402


def main():
    train_gpt = sys.argv[1]
    command = ["srun", "--mpi=pmix", "-N", "1", "-n", "4", train_gpt, "--tp", "2", "--layers", "2", "--hidden", "64",
               "--heads", "4", "--seq", "32", "--positions", "64", "--steps", "6", "--lr", "3e-3", "--global-batch", "4"]
    try:
        with private_slurm.cluster(4) as env:
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # 4 ranks on fewer cores: waiting ranks yield
            try:
                run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            except subprocess.TimeoutExpired:
                sys.exit(f"srun_check: '{' '.join(command)}' did not finish within 180 s")
    except private_slurm.Unavailable as e:
        print(f"srun_check: SKIP: {e}")
        return private_slurm.SKIP
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr[-4000:])
    if run.returncode != 0:
        sys.exit(f"srun_check: '{' '.join(command)}' exited with {run.returncode}")
    if "on 4 ranks: tp 2 pp 1 dp 2 cp 1" not in run.stdout:
        sys.exit("srun_check: train_gpt did not report the 4-rank layout (tp 2, dp 2) srun gave it")
    losses = [float(m.group(1)) for m in re.finditer(r"\| loss ([0-9.]+) \|", run.stdout)]
    if len(losses) != 6 or not losses[-1] < losses[0]:
        sys.exit(f"srun_check: expected 6 steps with a falling loss, got {losses}")
    print(f"srun_check: srun -n 4 train_gpt trained 6 steps (loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
