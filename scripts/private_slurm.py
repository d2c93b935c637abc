#!/usr/bin/python3
"""A private single-node Slurm on this machine: munge, slurmctld and slurmd on free local ports,
state in a temporary folder, stopped again afterwards. For the tests that launch with a real
`srun`, and for scripts/run.sh.

As a program:  private_slurm.py [--cpus N] -- COMMAND...
  starts Slurm, runs COMMAND with SLURM_CONF set (e.g. `srun --mpi=pmix -n 4 ./train_gpt`), stops
  Slurm, and exits with COMMAND's status; 77 when Slurm cannot run here (not installed, not root,
  the daemons do not start), having said why.
As a module:   with private_slurm.cluster(cpus) as env: subprocess.run([...], env=env)
  raises private_slurm.Unavailable (with the reason) when Slurm cannot run here.
"""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77


class Unavailable(Exception):
    """Slurm cannot run on this machine: says nothing about the program it was to launch."""


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
    raise Unavailable("munged started but does not answer (munge -n | unmunge)")


def write_config(folder, host, ctld_port, slurmd_port, cpus):
    config = os.path.join(folder, "slurm.conf")
    with open(config, "w") as out:
        out.write(f"""ClusterName=weft-local
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


@contextlib.contextmanager
def cluster(cpus):
    """Yields the environment (SLURM_CONF set, no outer job's SLURM_ variables) of a running
    private Slurm with one node of `cpus` CPUs; stops it on exit."""
    missing = [n for n in ("srun", "slurmctld", "slurmd", "munged", "munge") if not shutil.which(n)]
    if missing:
        raise Unavailable("Slurm or munge is not installed (missing " + ", ".join(missing) + "; Debian: slurm-wlm munge)")
    if os.geteuid() != 0:
        raise Unavailable("slurmd needs root")
    host = socket.gethostname().split(".")[0]
    folder = tempfile.mkdtemp(prefix="weft_slurm_")
    started_munge = False
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside another job
    try:
        try:
            started_munge = start_munge()
            ctld_port, slurmd_port = free_ports(2)
            env["SLURM_CONF"] = write_config(folder, host, ctld_port, slurmd_port, max(cpus, os.cpu_count() or 1))
            subprocess.run(["slurmctld", "-f", env["SLURM_CONF"]], env=env, check=True, timeout=30)
            subprocess.run(["slurmd", "-f", env["SLURM_CONF"]], env=env, check=True, timeout=30)
        except (subprocess.SubprocessError, OSError) as e:
            show_logs(folder)
            raise Unavailable(f"could not start a private Slurm here: {e}") from e
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
            raise Unavailable(f"the private Slurm did not come up within 30 s (node state '{state}')")
        yield env
    finally:
        kill_from_pidfile(os.path.join(folder, "slurmd.pid"))
        kill_from_pidfile(os.path.join(folder, "slurmctld.pid"))
        if started_munge:
            kill_from_pidfile("/run/munge/munged.pid")
        time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)


def main():
    args = sys.argv[1:]
    cpus = 4
    if args[:1] == ["--cpus"]:
        cpus, args = int(args[1]), args[2:]
    if args[:1] != ["--"] or len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with cluster(cpus) as env:
            return subprocess.run(args[1:], env=env).returncode
    except Unavailable as e:
        print(f"private_slurm: {e}", file=sys.stderr)
        return SKIP


if __name__ == "__main__":
    sys.exit(main())
