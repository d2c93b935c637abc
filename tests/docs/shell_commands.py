#!/usr/bin/env python3
"""Every shell command printed in README.md, docs/train_gpt.md and docs/tuning.md runs as printed.

  shell_commands.py --repo ROOT --build BUILD [--list] [--match TEXT]

Reads the fenced `sh` blocks of those files, joins continued lines, and runs each command with
bash, one at a time (variables a block assigns are kept for its later commands), from a scratch
folder in the build tree that looks like the repository root: `scripts` and `tests` link to the
repository's, `build/run` (where scripts/run.sh builds) links to BUILD, and the tools
(`weft-plan`, `weft-layout`, `weft-schedule`, `weft-trace-diff`, `train_gpt`) are on PATH.
A command must exit with 0, or with the status the docs give it (EXPECTED_STATUS below).

Documented shortenings (docs/testing.md): training runs stop after 2 steps (`--steps N` becomes
`--steps 2`, `--steps 4` in a command that resumes; scripts/run.sh runs with STEPS=2 and BUILD_DIR=BUILD), and a `MODEL` placeholder runs
once for each model its comment lists. Commands that cannot run on CPU ranks here are listed in
NOT_RUN with the reason; a listed command that the docs no longer print fails the test, as does a
command that fails. `scripts/private_slurm.py` exits 77 where Slurm cannot start (not root, not
installed): that command is then reported as skipped, and the others still run.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

DOCS = ["README.md", "docs/train_gpt.md", "docs/tuning.md"]

# Commands left out, by the text they start with (after continued lines are joined): why each
# cannot run here.
NOT_RUN = {
    "scripts/test.sh": "the whole test suite, which runs this test",
    "#!/bin/bash #SBATCH": "a batch script for a Slurm cluster of 2 nodes (sbatch); the private Slurm has one node",
}

# Exit statuses the docs give (the command after shortenings, by a fragment of it).
EXPECTED_STATUS = [
    ("--model llama3-70b --cluster small", 3, "docs/tuning.md: 70B does not fit on the small cluster"),
    ("--model gpt3-175b --cluster small", 3, "docs/tuning.md: 175B does not fit on the small cluster"),
    ("--model gpt3-175b --cluster large --gpus 128 --global-batch 512 --pp 1 --recompute none --max-sharding optimizer",
     3, "docs/tuning.md: GPT-3 175B without a pipeline does not fit"),
]

TOOLS = {
    "weft-plan": "examples/weft_plan/weft-plan",
    "weft-layout": "examples/weft_layout/weft-layout",
    "weft-schedule": "examples/weft_schedule/weft-schedule",
    "weft-trace-diff": "examples/weft_trace_diff/weft-trace-diff",
    "train_gpt": "examples/train_gpt/train_gpt",
}

TIMEOUT_S = 600


def fenced_blocks(path):
    """(first line number, text) of each ```sh block."""
    blocks, current, start = [], None, 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            stripped = line.strip()
            if current is None and re.fullmatch(r"```(sh|bash|shell)", stripped):
                current, start = [], number + 1
            elif current is not None and stripped == "```":
                blocks.append((start, "".join(current)))
                current = None
            elif current is not None:
                current.append(line)
    return blocks


def commands_of(block):
    """The block's commands as (comment lines before it, command), continued lines joined. A block
    that is a batch script (#SBATCH lines) is one command: its first lines joined."""
    lines = block.splitlines()
    if any(line.startswith("#SBATCH") for line in lines):
        return [([], " ".join(line for line in lines if line.startswith("#")))]
    out, comments, pending = [], [], ""
    for line in lines:
        if pending:
            pending += " " + line.strip()
        elif line.strip().startswith("#") or not line.strip():
            comments.append(line.strip())
            continue
        else:
            pending = line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out.append((comments, re.sub(r"\s+", " ", pending)))
        comments, pending = [], ""
    return out


def expand_models(comments, command):
    """A command with the MODEL placeholder, once per model a comment above it in its block lists
    ("each of $G1, "--model llama2-7b", ... on these two")."""
    if not re.search(r"\bMODEL\b", command):
        return [command]
    for comment in comments:
        m = re.search(r"each of (.*) on these", comment)
        if m:
            models = [item.strip().strip('"') for item in m.group(1).split(",")]
            return [re.sub(r"\bMODEL\b", model, command) for model in models]
    raise SystemExit(f"shell_commands: '{command}' has MODEL but no comment says which models")


def shorten(command):
    """The documented shortenings."""
    # A resumed run continues from a checkpoint of the shortened run (step 2): 2 steps more.
    command = re.sub(r"--steps \d+", "--steps 4" if "--resume" in command else "--steps 2", command)
    if command.startswith("scripts/run.sh"):
        command = "STEPS=2 " + command
    return command


def scratch_root(repo, build):
    """A folder in the build tree that looks like the repository root to the docs' commands."""
    root = os.path.join(build, "tests", "docs", "shell_commands_root")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "build"))
    os.makedirs(os.path.join(root, "bin"))
    for name in ("scripts", "tests"):
        os.symlink(os.path.join(repo, name), os.path.join(root, name))
    os.symlink(os.path.abspath(build), os.path.join(root, "build", "run"))
    for tool, relative in TOOLS.items():
        target = os.path.join(build, relative)
        if os.path.exists(target):
            os.symlink(os.path.abspath(target), os.path.join(root, "bin", tool))
    return root


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--build", required=True)
    parser.add_argument("--list", action="store_true", help="print the commands and what would be run, run nothing")
    parser.add_argument("--match", help="run only commands containing this text")
    args = parser.parse_args()
    repo, build = os.path.abspath(args.repo), os.path.abspath(args.build)

    plan = []  # (where, command as printed, command to run or None, why not)
    used_skips = set()
    for doc in DOCS:
        for line, block in fenced_blocks(os.path.join(repo, doc)):
            assignments, block_comments = [], []
            for comments, command in commands_of(block):
                block_comments += comments
                where = f"{doc}:{line}"
                if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S.*", command) and " " not in command.split("=", 1)[0]:
                    assignments.append(command)  # a variable for the block's later commands
                    continue
                skip = next((key for key in NOT_RUN if command.startswith(key)), None)
                if skip is not None:
                    used_skips.add(skip)
                    plan.append((where, command, None, NOT_RUN[skip]))
                    continue
                for expanded in expand_models(block_comments, command):
                    plan.append((where, command, "\n".join(assignments + [shorten(expanded)]), None))
    stale = [key for key in NOT_RUN if key not in used_skips]
    if stale:
        print("shell_commands: FAILED: the docs no longer print these commands that NOT_RUN lists: " + ", ".join(stale))
        return 1

    if args.list:
        for where, printed, run, why in plan:
            print(f"{where}: {printed}\n    {'runs: ' + run if run else 'not run: ' + why}")
        return 0

    root = scratch_root(repo, build)
    env = dict(os.environ)
    env["PATH"] = os.path.join(root, "bin") + os.pathsep + env.get("PATH", "")
    env["BUILD_DIR"] = build  # scripts/run.sh: the build tree under test (configured already, so only built)
    # As a newcomer's shell has it: Open MPI starts no more ranks than cores unless the command
    # says --oversubscribe (the tests' environment allows it everywhere, which would hide that).
    env.pop("OMPI_MCA_rmaps_base_oversubscribe", None)
    failures, ran, skipped = [], 0, 0
    done = {}  # a command printed in two docs runs once: its text without the trailing comment -> where it ran
    for where, printed, run, why in plan:
        if run is None:
            print(f"-- {where}: not run ({why}): {printed}")
            skipped += 1
            continue
        if args.match and args.match not in run:
            continue
        key = re.sub(r"\s+#[^\n]*$", "", run)
        if key in done:
            print(f"-- {where}: as at {done[key]}: {run.splitlines()[-1]}")
            continue
        done[key] = where
        expected = next((status for fragment, status, _ in EXPECTED_STATUS if fragment in run), 0)
        print(f"-- {where}: {run.splitlines()[-1]}", flush=True)
        start = time.monotonic()
        try:
            r = subprocess.run(["bash", "-c", run], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            failures.append(f"{where}: '{run}' did not finish within {TIMEOUT_S} s")
            continue
        seconds = time.monotonic() - start
        output = r.stdout + r.stderr
        if r.returncode == 77 and run.startswith("scripts/private_slurm.py"):
            print(f"   skipped: no private Slurm here ({output.strip().splitlines()[-1] if output.strip() else 'exit 77'})")
            skipped += 1
            continue
        print(f"   exit {r.returncode} (expected {expected}) in {seconds:.1f} s")
        ran += 1
        if r.returncode != expected:
            failures.append(f"{where}: '{run}' exited with {r.returncode}, expected {expected}:\n{output[-3000:]}")
    if failures:
        print("shell_commands: FAILED:\n" + "\n\n".join(failures))
        return 1
    print(f"shell_commands: {ran} commands ran as the docs print them (shortened as documented), {skipped} not run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
