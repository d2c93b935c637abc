#!/usr/bin/python3
"""Several hosts on this machine: a private multi-node Slurm, one network and UTS namespace per host.

Hosts n1...nN each get a network namespace (loopback up, one interface `weft0` with the address
10.77.0.<i>/24) and a UTS namespace (hostname n<i>); the weft0 interfaces are veth pairs whose
other ends are joined by a bridge in a namespace of its own, so nothing is added to this machine's
own network. slurmctld runs on n1 and one slurmd on every host (NodeName=n<i>, NodeAddr=10.77.0.<i>),
sharing this machine's munge (scripts/private_slurm.py, whose pieces this reuses). COMMAND runs on
n1 with:
  SLURM_CONF                              the cluster's Slurm: `srun -N 2 -n 4 --mpi=pmix PROGRAM`
  OMPI_MCA_plm_rsh_agent                  an agent that enters a host's namespaces, so that
  OMPI_MCA_orte_default_hostfile          `mpirun -n 4 --map-by node PROGRAM` starts its daemons there
  OMPI_MCA_{oob,btl}_tcp_if_include=weft0, NCCL_SOCKET_IFNAME=weft0: traffic between hosts on the
                                          private addresses, never on lo
  WEFT_CLUSTER_HOSTS="n1 n2 ..."          the hosts; WEFT_CLUSTER_DIR its folder
  WEFT_CLUSTER_ENTER                      a program: `$WEFT_CLUSTER_ENTER n2 CMD...` runs CMD on n2,
                                          e.g. `$WEFT_CLUSTER_ENTER n2 ip link set weft0 down`
Everything (processes in the namespaces, the namespaces, their links, mounts and the folders) is
removed when COMMAND ends, fails, or this script gets SIGINT, SIGTERM or SIGHUP, and so are the
shared-memory segments of killed ranks (/dev/shm/vader_segment.n<i>.*) that no process maps; what
a script killed by SIGKILL left is removed by the next one.

As a program:  private_cluster.py [--hosts N] [--cpus C] -- COMMAND...
  exits with COMMAND's status; 77 when the cluster cannot be made here (not root, no `ip`, no
  Slurm...), having said why in one line.
As a module:   with private_cluster.cluster(hosts, cpus) as c: c.run([...]) / c.popen([...])
  raises private_slurm.Unavailable (with the reason) when the cluster cannot be made here.
"""
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import private_slurm  # noqa: E402  (munge, Slurm's configuration and its checks, shared)
from private_slurm import SKIP, Unavailable  # noqa: E402,F401

SUBNET = "10.77.0"
INTERFACE = "weft0"
NETNS_DIR = "/run/netns"
SHM_DIR = "/dev/shm"


def host_names(count):
    return [f"n{i}" for i in range(1, count + 1)]


def run_ip(*args):
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise Unavailable(f"'ip {' '.join(args)}' failed: {result.stderr.strip()}")


def check_namespaces_possible():
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    missing = [n for n in ("ip", "nsenter", "unshare") if not shutil.which(n)]
    if missing:
        raise Unavailable("missing " + ", ".join(missing) + " (Debian: iproute2, util-linux)")


class Cluster:
    """The hosts of a running private cluster, and ways to run commands on them."""

    def __init__(self, hosts, cpus):
        self.hosts = host_names(hosts)
        self.cpus = cpus
        self.tag = f"weft{os.getpid()}"  # names this cluster's namespaces: weft<pid>-n1, weft<pid>-sw
        self.folder = tempfile.mkdtemp(prefix=f"weft_cluster_{os.getpid()}_")
        self.namespaces = []   # network namespaces made (names under /run/netns)
        self.uts_files = []    # persistent UTS namespaces (bind mounts in self.folder)
        self.env = private_slurm.slurm_environment()
        self.started_munge = False

    def netns(self, host):
        return f"{self.tag}-{host}"

    def address(self, host):
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def enter(self, host):
        """The command prefix that runs a command on `host` (in its network and UTS namespaces)."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.netns(host)}", f"--uts={self.folder}/uts/{host}", "--"]

    def run(self, command, host="n1", **kwargs):
        kwargs.setdefault("env", self.env)
        return subprocess.run(self.enter(host) + list(command), **kwargs)

    def popen(self, command, host="n1", **kwargs):
        kwargs.setdefault("env", self.env)
        return subprocess.Popen(self.enter(host) + list(command), **kwargs)

    # -- making it
    def make_network(self):
        switch = f"{self.tag}-sw"
        for name in [switch] + [self.netns(h) for h in self.hosts]:
            run_ip("netns", "add", name)
            self.namespaces.append(name)
        run_ip("-n", switch, "link", "add", "br0", "type", "bridge")
        run_ip("-n", switch, "link", "set", "br0", "up")
        os.makedirs(os.path.join(self.folder, "uts"))
        for host in self.hosts:
            ns, port = self.netns(host), f"p{host}"
            # Made inside the namespaces directly: this machine's own link list never changes.
            run_ip("link", "add", "name", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", switch)
            run_ip("-n", switch, "link", "set", port, "master", "br0")
            run_ip("-n", switch, "link", "set", port, "up")
            run_ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
            run_ip("-n", ns, "link", "set", "lo", "up")
            run_ip("-n", ns, "link", "set", INTERFACE, "up")
            uts = os.path.join(self.folder, "uts", host)
            open(uts, "w").close()
            made = subprocess.run(["unshare", f"--uts={uts}", "hostname", host], capture_output=True, text=True)
            if made.returncode != 0:
                raise Unavailable(f"could not make a UTS namespace: {made.stderr.strip()}")
            self.uts_files.append(uts)

    def write_host_script(self, name, usage, run):
        """folder/name: a script whose first argument names a host, and which runs the rest there
        (`run`: how the rest is run once in the host's namespaces)."""
        path = os.path.join(self.folder, name)
        cases = "".join(f"  {h}) exec {' '.join(self.enter(h))} {run} ;;\n" for h in self.hosts)
        with open(path, "w") as out:
            out.write(f"""#!/bin/sh
# {usage}
host="$1"; shift
case "$host" in
{cases}  *) echo "{name}: no host '$host' in the private cluster ({' '.join(self.hosts)})" >&2; exit 255 ;;
esac
""")
        os.chmod(path, 0o755)
        return path

    def write_helpers(self):
        """mpirun's rsh agent and hostfile, and the `enter` program."""
        # As ssh does, the agent joins the command's words into one line for a shell on the host.
        agent = self.write_host_script("rsh-agent", "mpirun's rsh agent: rsh-agent HOST COMMAND... runs COMMAND on HOST",
                                       '/bin/sh -c "$*"')
        enter = self.write_host_script("enter", "enter HOST COMMAND...: runs COMMAND on HOST", '"$@"')
        hostfile = os.path.join(self.folder, "hostfile")
        with open(hostfile, "w") as out:
            out.write("".join(f"{h} slots={self.cpus}\n" for h in self.hosts))
        self.env.update({
            "OMPI_MCA_plm_rsh_agent": agent,
            "OMPI_MCA_orte_default_hostfile": hostfile,
            "OMPI_MCA_oob_tcp_if_include": INTERFACE,
            "OMPI_MCA_btl_tcp_if_include": INTERFACE,
            "NCCL_SOCKET_IFNAME": INTERFACE,
            "WEFT_CLUSTER_HOSTS": " ".join(self.hosts),
            "WEFT_CLUSTER_DIR": self.folder,
            "WEFT_CLUSTER_ENTER": enter,
        })

    def start_slurm(self):
        private_slurm.check_installed()
        try:
            self.started_munge = private_slurm.start_munge()
            nodes = [(h, self.address(h)) for h in self.hosts]
            self.env["SLURM_CONF"] = private_slurm.write_config(self.folder, nodes[0], nodes, self.cpus)
            self.run(["slurmctld", "-f", self.env["SLURM_CONF"]], check=True, timeout=30)
            for host in self.hosts:
                self.run(["slurmd", "-f", self.env["SLURM_CONF"]], host=host, check=True, timeout=30)
        except (subprocess.SubprocessError, OSError) as e:
            private_slurm.show_logs(self.folder)
            raise Unavailable(f"could not start the private cluster's Slurm: {e}") from e
        private_slurm.wait_until_idle(self.env, self.folder, self.hosts, run=self.run)

    # -- removing it
    def teardown(self):
        # The work first (the command, the steps and their tasks: continued if stopped, then
        # SIGTERM, then SIGKILL), so that the daemons have nothing left to wait for; then the
        # daemons; then whatever is still in a host's namespace.
        self.signal_until_gone(lambda: [p for p in self.processes() if not daemon(p)],
                               ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)))
        private_slurm.kill_from_pidfile(os.path.join(self.folder, "slurmctld.pid"))
        for host in self.hosts:
            private_slurm.kill_from_pidfile(os.path.join(self.folder, f"slurmd-{host}.pid"))
        # A slurmd whose step was killed can take seconds over SIGTERM; its state goes with the folder.
        self.signal_until_gone(self.processes, ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)))
        if self.started_munge:
            private_slurm.kill_from_pidfile("/run/munge/munged.pid")
        for uts in self.uts_files:
            subprocess.run(["umount", uts], capture_output=True)
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        remove_dead_segments(self.hosts)

    @staticmethod
    def signal_until_gone(find, steps):
        """For each (signal, seconds) of `steps`: sends it to what `find` lists until none is left."""
        for sig, seconds in steps:
            end = time.time() + seconds
            sent = set()
            while True:
                left = find()
                if not left:
                    return
                if time.time() > end:
                    break
                for pid in left:
                    if pid not in sent:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGCONT)
                            os.kill(pid, sig)
                        sent.add(pid)
                time.sleep(0.05)

    def processes(self):
        """Every live process in one of this cluster's network namespaces."""
        pids = set()
        for name in self.namespaces:
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            pids.update(int(p) for p in out.split())
        pids.discard(os.getpid())
        return sorted(p for p in pids if not zombie(p))


def daemon(pid):
    """Whether `pid` is one of Slurm's daemons (slurmctld and its slurmscriptd, a slurmd)."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip() in ("slurmctld", "slurmscriptd", "slurmd")
    except OSError:
        return False


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def remove_stale():
    """Removes what clusters whose script is gone left behind: only a SIGKILL (a test harness's
    timeout, say) ends the script without its teardown, and its daemons outlive it."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = {}
    for name in names:
        m = re.fullmatch(r"weft(\d+)-(sw|n\d+)", name)
        if m and not process_alive(int(m.group(1))):
            stale.setdefault(int(m.group(1)), []).append(name)
    for pid, namespaces in stale.items():
        for name in namespaces:
            for victim in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(OSError):
                    os.kill(int(victim), signal.SIGKILL)
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"weft_cluster_{pid}_*")):
            for uts in glob.glob(os.path.join(folder, "uts", "*")):
                subprocess.run(["umount", uts], capture_output=True)
            shutil.rmtree(folder, ignore_errors=True)
        for name in namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        remove_dead_segments(host_names(250))
        print(f"private_cluster: removed the cluster a killed script (pid {pid}) left: {' '.join(sorted(namespaces))}",
              file=sys.stderr)


def dead_segments(hosts):
    """Open MPI's shared-memory segments (/dev/shm/vader_segment.<host>.*) of `hosts` that no process
    has open or maps. Their names carry the host and the job, not the cluster, so a live segment
    of another cluster with the same host names is told apart by its users: a rank opens its
    segment, maps it, then closes it, so a segment listed here was open or mapped all along while
    in use, and each process's files are read before its maps."""
    paths = {p for h in hosts for p in glob.glob(os.path.join(SHM_DIR, f"vader_segment.{h}.*"))}
    for entry in os.listdir("/proc"):
        if not paths:
            break
        if entry.isdigit():
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    with contextlib.suppress(OSError):
                        paths.discard(os.readlink(f"/proc/{entry}/fd/{fd}"))
                with open(f"/proc/{entry}/maps") as maps:
                    for line in maps:
                        if "vader_segment" in line:
                            paths.discard(line.split(None, 5)[5].strip())
    return sorted(paths)


def remove_dead_segments(hosts):
    for path in dead_segments(hosts):
        with contextlib.suppress(OSError):
            os.remove(path)


def process_alive(pid):
    """Whether `pid` is a live process (not a thread of another), as the script that made a cluster is."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return fields["Tgid"].strip() == str(pid) and not fields["State"].strip().startswith("Z")
    except (OSError, KeyError):
        return False


def leftovers(tag, folder):
    """What a cluster named `tag` with `folder` left on this machine (empty when nothing)."""
    found = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found += [f"namespace {n.split()[0]}" for n in names if n.startswith(tag + "-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if INTERFACE in line or tag in line]
    with open("/proc/self/mountinfo") as mounts:
        found += [f"mount {line.split()[4]}" for line in mounts if folder in line or f"/{tag}-" in line]
    pid = tag[len("weft"):]
    for path in [folder] + glob.glob(os.path.join(tempfile.gettempdir(), f"weft_cluster_{pid}_*")):
        if os.path.exists(path) and f"folder {path}" not in found:
            found.append(f"folder {path}")
    # Open MPI's shared-memory segments of the cluster's hosts that no process maps (ranks killed
    # mid-job leave them), and the session folders of its hosts (a killed mpirun leaves one).
    found += [f"file {path}" for path in dead_segments(host_names(250))]
    found += [f"file {path}" for path in glob.glob(os.path.join(tempfile.gettempdir(), "ompi.n[0-9]*"))]
    # Every process of the cluster (daemons, steps, the command, what it started) has the folder
    # in its command line or its environment (WEFT_CLUSTER_DIR, SLURM_CONF).
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read().decode(errors="replace")
                if (folder in cmdline or folder in environ) and not zombie(int(entry)):
                    found.append(f"process {entry}: {cmdline.strip()[:120]}")
    return found


@contextlib.contextmanager
def cluster(hosts=2, cpus=2):
    """A running private cluster of `hosts` hosts with `cpus` CPUs each (a Cluster); removed on exit."""
    if hosts < 1 or hosts > 250:
        raise ValueError(f"--hosts must be 1 to 250, got {hosts}")
    check_namespaces_possible()
    private_slurm.check_installed()
    remove_stale()
    c = Cluster(hosts, cpus)
    try:
        c.make_network()
        c.write_helpers()
        c.start_slurm()
        yield c
    finally:
        c.teardown()


class Stop(Exception):
    pass


def raise_stop(signum, _frame):
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # one signal is enough: the teardown runs to its end
    raise Stop(signum)


def main():
    args = sys.argv[1:]
    hosts, cpus = 2, 2
    while args[:1] in (["--hosts"], ["--cpus"]) and len(args) > 1:
        try:
            value = int(args[1])
        except ValueError:
            print(f"private_cluster: {args[0]} wants a number, got '{args[1]}'", file=sys.stderr)
            return 2
        if args[0] == "--hosts":
            hosts = value
        else:
            cpus = value
        args = args[2:]
    if args[:1] != ["--"] or len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    if not 1 <= hosts <= 250 or cpus < 1:
        print(f"private_cluster: --hosts must be 1 to 250 and --cpus at least 1 (got {hosts}, {cpus})", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_stop)
    command = None
    try:
        with cluster(hosts, cpus) as c:
            # Its own session: a signal to this script reaches the command through the teardown,
            # after which nothing of it is left in the namespaces.
            command = c.popen(args[1:], start_new_session=True)
            return command.wait()
    except Unavailable as e:
        print(f"private_cluster: {e}", file=sys.stderr)
        return SKIP
    except Stop as e:
        signum = e.args[0]
        print(f"private_cluster: {signal.Signals(signum).name}: cluster removed", file=sys.stderr)
        return 128 + signum
    finally:
        if command is not None and command.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(command.pid, signal.SIGKILL)
            command.wait()


if __name__ == "__main__":
    sys.exit(main())
