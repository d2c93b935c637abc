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
Its pieces (the configuration for any list of nodes, munge, the checks, the wait for idle nodes)
also make the private multi-host cluster of scripts/private_cluster.py.
"""
import contextlib
import glob
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


def write_config(folder, controller, nodes, cpus, ctld_port=6817, slurmd_port=6818):
    """Writes folder/slurm.conf for a controller (name, address) and nodes [(name, address)], each
    of `cpus` CPUs, all in one partition; state, spool, pid and log files under `folder` (the
    per-node ones, spool and TmpFS among them, named after the node, %n).

    Job ids start at a number of this process's own: Open MPI names its shared-memory segments
    and session folders after the host and the job, so two private Slurms on one machine (same
    host names, both at job 1) would share them, and their ranks crashed in MPI_Init."""
    config = os.path.join(folder, "slurm.conf")
    node_lines = "".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN\n" for name, address in nodes)
    with open(config, "w") as out:
        out.write(f"""ClusterName=weft-local
FirstJobId={(os.getpid() % 65536) * 1000 + 1}
SlurmctldHost={controller[0]}({controller[1]})
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
TmpFS={folder}/tmp-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
{node_lines}PartitionName=weft Nodes={",".join(name for name, _ in nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    os.makedirs(os.path.join(folder, "state"))
    for name, _ in nodes:
        # The steps' PMIx folders go under TmpFS: one per node, as the hosts share this /tmp.
        os.makedirs(os.path.join(folder, f"spool-{name}"))
        os.makedirs(os.path.join(folder, f"tmp-{name}"))
    return config


def kill_from_pidfile(path):
    try:
        with open(path) as f:
            pid = int(f.read().strip())
        os.kill(pid, 15)
    except (OSError, ValueError):
        pass


def show_logs(folder):
    for path in sorted(glob.glob(os.path.join(folder, "slurm*.log"))):
        with open(path) as f:
            lines = f.readlines()[-15:]
        print(f"--- last lines of {os.path.basename(path)}:\n" + "".join(lines), file=sys.stderr)


def check_installed():
    missing = [n for n in ("srun", "slurmctld", "slurmd", "munged", "munge") if not shutil.which(n)]
    if missing:
        raise Unavailable("Slurm or munge is not installed (missing " + ", ".join(missing) + "; Debian: slurm-wlm munge)")
    if os.geteuid() != 0:
        raise Unavailable("slurmd needs root")


def wait_until_idle(env, folder, nodes, run=subprocess.run):
    """Waits up to 30 s for every node to be idle (`run` runs sinfo where the controller is)."""
    deadline = time.time() + 30
    states = ""
    while time.time() < deadline:
        states = run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=10).stdout
        idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
        if idle >= set(nodes):
            return
        time.sleep(0.2)
    show_logs(folder)
    raise Unavailable("the private Slurm did not come up within 30 s (node states: " +
                      ", ".join(states.split("\n")).strip(", ") + ")")


def slurm_environment():
    """This process's environment without an outer job's SLURM_ variables, with PMIx's hash store.

    PMIX_MCA_gds=hash (unless set already): with PMIx 4.2's shared-memory store (gds ds21, the
    default of Debian 12's libpmix2) under Slurm 22.05's mpi/pmix, a rank of Open MPI 4.1 now and
    then leaves MPI_Init while a rank on another node still waits in it for the first fence, and
    that rank dies of SIGSEGV in mca_btl_tcp when the first message reaches it (no handler is
    registered yet). Measured on 2 hosts x 2 ranks, srun of an MPI_Init + MPI_Allreduce program
    with both cores busy: 4-12 crashes in 300 runs with ds21, none in 900 with the hash store.
    docs/train_gpt.md ("On a Slurm cluster") tells users the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.setdefault("PMIX_MCA_gds", "hash")
    return env


@contextlib.contextmanager
def cluster(cpus):
    """Yields the environment (SLURM_CONF set, no outer job's SLURM_ variables) of a running
    private Slurm with one node of `cpus` CPUs; stops it on exit."""
    check_installed()
    host = socket.gethostname().split(".")[0]
    folder = tempfile.mkdtemp(prefix="weft_slurm_")
    started_munge = False
    env = slurm_environment()
    try:
        try:
            started_munge = start_munge()
            ctld_port, slurmd_port = free_ports(2)
            env["SLURM_CONF"] = write_config(folder, (host, "127.0.0.1"), [(host, "127.0.0.1")],
                                             max(cpus, os.cpu_count() or 1), ctld_port, slurmd_port)
            subprocess.run(["slurmctld", "-f", env["SLURM_CONF"]], env=env, check=True, timeout=30)
            subprocess.run(["slurmd", "-f", env["SLURM_CONF"]], env=env, check=True, timeout=30)
        except (subprocess.SubprocessError, OSError) as e:
            show_logs(folder)
            raise Unavailable(f"could not start a private Slurm here: {e}") from e
        wait_until_idle(env, folder, [host])
        yield env
    finally:
        for pidfile in glob.glob(os.path.join(folder, "slurmd-*.pid")):
            kill_from_pidfile(pidfile)
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
