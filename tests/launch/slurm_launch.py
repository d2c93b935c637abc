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
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77


def fail(message):
    print("slurm_launch: " + message, file=sys.stderr)
    sys.exit(1)


def free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def munge_works():
    try:
        token = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=True).stdout
        subprocess.run(["unmunge"], input=token, capture_output=True, timeout=10, check=True)
        return True
    except (subprocess.SubprocessError, OSError):
        return False


def start_munge():
    """Starts munged as user munge unless one already answers; returns whether this started it."""
    if munge_works():
        return False
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True, timeout=30)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
    for _ in range(50):
        if munge_works():
            return True
        time.sleep(0.1)
    fail("munged started but does not answer (munge -n | unmunge)")


def write_config(folder, host, ctld_port, slurmd_port, cpus):
    config = os.path.join(folder, "slurm.conf")
    with open(config, "w") as out:
        out.write(f"""ClusterName=weft-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=weft Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    os.makedirs(os.path.join(folder, "state"))
    os.makedirs(os.path.join(folder, "spool"))
    return config


def kill_from_pidfile(path):
    try:
        with open(path) as f:
            pid = int(f.read().strip())
        os.kill(pid, 15)
    except (OSError, ValueError):
        pass


def show_logs(folder):
    for name in ("slurmctld.log", "slurmd.log"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                lines = f.readlines()[-15:]
            print(f"--- last lines of {name}:\n" + "".join(lines), file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program")
    parser.add_argument("--ranks", type=int, default=3)
    args = parser.parse_args()

    daemons = [shutil.which(n) for n in ("srun", "slurmctld", "slurmd", "munged", "munge")]
    if not all(daemons):
        print("slurm_launch: SKIP: Slurm or munge is not installed (Debian: slurm-wlm munge)")
        return SKIP
    if os.geteuid() != 0:
        print("slurm_launch: SKIP: slurmd needs root")
        return SKIP

    host = socket.gethostname().split(".")[0]
    folder = tempfile.mkdtemp(prefix="weft_slurm_")
    started_munge = False
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside another job
    try:
        # The machine's part: a Slurm that cannot start here (no munge, a sandbox that forbids
        # daemons) says nothing about weft, so it is a skip with the reason, not a failure.
        try:
            started_munge = start_munge()
            ctld_port, slurmd_port = free_ports(2)
            config = write_config(folder, host, ctld_port, slurmd_port, max(args.ranks, os.cpu_count() or 1))
            env["SLURM_CONF"] = config
            subprocess.run(["slurmctld", "-f", config], env=env, check=True, timeout=30)
            subprocess.run(["slurmd", "-f", config], env=env, check=True, timeout=30)
        except (subprocess.SubprocessError, OSError, SystemExit) as e:
            show_logs(folder)
            print(f"slurm_launch: SKIP: could not start a private Slurm here: {e}")
            return SKIP
        deadline = time.time() + 30
        state = ""
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                                   timeout=10).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.2)
        else:
            show_logs(folder)
            print(f"slurm_launch: SKIP: the private Slurm did not come up within 30 s (node state '{state}')")
            return SKIP

        command = ["srun", "--mpi=pmix", "-N", "1", "-n", str(args.ranks), args.program]
        try:
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            show_logs(folder)
            fail(f"'{' '.join(command)}' did not finish within 120 s")
        sys.stdout.write(run.stdout)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            show_logs(folder)
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
        kill_from_pidfile(os.path.join(folder, "slurmd.pid"))
        kill_from_pidfile(os.path.join(folder, "slurmctld.pid"))
        if started_munge:
            kill_from_pidfile("/run/munge/munged.pid")
        time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
