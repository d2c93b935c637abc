#!/usr/bin/python3
"""weft across several hosts of one machine: each test makes a private cluster of 2 hosts
(scripts/private_cluster.py: a network and UTS namespace per host, a Slurm across them), runs weft
programs on it with `srun -N 2 -n 4` (and `mpirun` through the cluster's rsh agent) and checks what
only a multi-host run shows.

  multinode_tests.py launch  --report LAUNCHER_REPORT
  multinode_tests.py layout  --report LAUNCHER_REPORT --weft-layout WEFT_LAYOUT
  multinode_tests.py hsdp    --train-gpt TRAIN_GPT
  multinode_tests.py health  --health-check HEALTH_CHECK
  multinode_tests.py stop    --program FAULT_PROGRAM [--trace-diff WEFT_TRACE_DIFF] [--deadline 2]
  multinode_tests.py link    --program FAULT_PROGRAM --trace-diff WEFT_TRACE_DIFF [--deadline 2]
  multinode_tests.py cleanup --program FAULT_PROGRAM
  multinode_tests.py doctor  --doctor WEFT_DOCTOR --hosts 2|3

Exit status: 0 passed; 1 failed, with the reason; 77 (CTest's skip) when the cluster cannot be
made on this machine (not root, no `ip`, no Slurm), having said why in one line.
"""
import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "scripts"))
import private_cluster  # noqa: E402
sys.path.insert(0, os.path.join(here, "..", "trace"))
from fault_job import alive  # noqa: E402

HOSTS = ["n1", "n2"]
RANKS = 4  # 2 hosts x 2 ranks: srun's block distribution puts ranks 0, 1 on n1 and 2, 3 on n2
SRUN = ["srun", "--mpi=pmix", "-N", "2", "-n", str(RANKS)]


def fail(message, output=""):
    if output:
        sys.stderr.write(output[-8000:] + "\n")
    sys.stderr.write(f"multinode_tests: FAILED: {message}\n")
    sys.exit(1)


def shared_memory_report():
    """Open MPI's shared-memory segments in /dev/shm (name, size, age) and the processes that map
    them: what to read when a job dies in its shared-memory set-up (a rank attaching to a peer's
    segment found no file: once in a series of full runs, multinode_doctor_3hosts)."""
    lines = []
    for path in sorted(glob.glob(os.path.join(private_cluster.SHM_DIR, "vader_segment.*"))):
        try:
            st = os.stat(path)
            lines.append(f"  {path} {st.st_size} bytes, modified {time.time() - st.st_mtime:.1f} s ago")
        except OSError as e:
            lines.append(f"  {path}: {e.strerror}")
    users = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    if "vader_segment" in line:
                        users.setdefault(line.split(None, 5)[5].strip(), set()).add(int(entry))
        except OSError:
            continue
    lines += [f"  {path} mapped by {sorted(pids)}" for path, pids in sorted(users.items())]
    return "shared-memory segments now:\n" + ("\n".join(lines) if lines else "  none")


def run(cluster, command, limit=120, env=None):
    """COMMAND on n1 of the cluster; its output; fails on a non-zero exit or past `limit` seconds."""
    try:
        done = cluster.run(command, capture_output=True, text=True, timeout=limit, env=env or cluster.env)
    except subprocess.TimeoutExpired:
        fail(f"'{' '.join(command)}' did not finish within {limit} s")
    if done.returncode != 0:
        fail(f"'{' '.join(command)}' exited with {done.returncode}", done.stdout + done.stderr)
    return done.stdout


def reports(output, what):
    """launcher_report's lines, by rank."""
    found = {}
    for line in output.splitlines():
        if line.startswith("launcher="):
            fields = dict(field.split("=", 1) for field in line.split())
            found[int(fields["rank"])] = fields
    if sorted(found) != list(range(RANKS)):
        fail(f"{what}: expected reports of ranks 0-{RANKS - 1}, got {sorted(found)}", output)
    return found


def check_placement(found, launcher, what):
    """Ranks 0, 1 on n1 and 2, 3 on n2, each knowing its node and local rank."""
    for rank, r in found.items():
        want = {"launcher": launcher, "world": str(RANKS), "nodes": "2", "node": str(rank // 2),
                "local_rank": str(rank % 2), "local_world": "2", "host": HOSTS[rank // 2]}
        wrong = {k: (r.get(k), v) for k, v in want.items() if r.get(k) != v}
        if wrong:
            fail(f"{what}: rank {rank} resolved {wrong} (got, wanted)")


def test_launch(args, cluster):
    found = reports(run(cluster, SRUN + [args.report]), "srun -N 2 -n 4")
    check_placement(found, "slurm", "srun -N 2 -n 4")
    # Open MPI's own launcher: mpirun starts its daemon on n2 through the cluster's rsh agent.
    mpirun = ["mpirun", "-n", str(RANKS), "--map-by", "ppr:2:node", "--bind-to", "none", args.report]
    found = reports(run(cluster, mpirun), "mpirun")
    check_placement(found, "openmpi", "mpirun --map-by ppr:2:node")
    print("launch: srun -N 2 -n 4 --mpi=pmix and mpirun (rsh agent) put ranks 0, 1 on n1 and 2, 3 on n2; every rank "
          "resolved its node (0, 1), local rank (0, 1) and 2 nodes")


def test_layout(args, cluster):
    host_of = {rank: r["host"] for rank, r in reports(run(cluster, SRUN + [args.report]), "srun").items()}
    checked = 0
    # The default order (tp inside a node, dp across) and one whose tp groups cross the nodes.
    for flags in (["--tp", "2"], ["--tp", "2", "--order", "dp-tp-cp-ep-pp"]):
        command = [args.weft_layout, "--world-size", str(RANKS), "--gpus-per-node", "2", "--json"] + flags
        layout = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        for r in layout["ranks"]:
            if HOSTS[r["node"]] != host_of[r["rank"]]:
                fail(f"weft-layout {' '.join(flags)} places rank {r['rank']} on node {r['node']}, "
                     f"srun on {host_of[r['rank']]}")
        for kind, groups in layout["groups"].items():
            placed = layout["nodes"]["groups"][kind]
            crossing = sum(1 for g in groups if len({host_of[rank] for rank in g}) > 1)
            most = max(len({host_of[rank] for rank in g}) for g in groups)
            said = (placed["inside_nodes"], placed["crossing"], placed["max_nodes"])
            if said != (crossing == 0, crossing, most):
                fail(f"weft-layout {' '.join(flags)}: group kind {kind} {groups}: weft-layout says inside_nodes, "
                     f"crossing, max_nodes = {said}; on the hosts srun gave ({host_of}) it is "
                     f"{(crossing == 0, crossing, most)}")
            checked += 1
    print(f"layout: weft-layout's nodes and its {checked} group placements (2 layouts) match the hosts srun -N 2 "
          f"-n 4 ran the ranks on")


MODEL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--lr", "3e-3",
         "--seed", "11", "--steps", "8", "--global-batch", "8"]
HSDP_STEPS = 100


def test_hsdp(args, cluster):
    env = dict(cluster.env, OMPI_MCA_mpi_yield_when_idle="1", OPENBLAS_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="weft_hsdp_") as tmp:
        single_log = os.path.join(tmp, "single.json")
        run(cluster, ["srun", "--mpi=pmix", "-N", "1", "-n", "1", args.train_gpt] + MODEL + ["--log-json", single_log],
            limit=240, env=env)
        single = [json.loads(line)["loss"] for line in open(single_log) if line.strip()]
        if len(single) != 8 or not single[-1] < single[0]:
            fail(f"the single rank's 8 steps did not lower the loss, so the comparison would say nothing: {single}")
        # srun's block distribution (ranks 0, 1 on n1) and its cyclic one (ranks 0, 2 on n1): the
        # shard groups must be the hosts' ranks in both, whatever their numbers.
        for distribution, host_of_rank in (("block", lambda r: HOSTS[r // 2]), ("cyclic", lambda r: HOSTS[r % 2])):
            folder = os.path.join(tmp, distribution)
            os.mkdir(folder)
            hsdp_run(args, cluster, env, folder, distribution, {r: host_of_rank(r) for r in range(RANKS)}, single)


def hsdp_run(args, cluster, env, folder, distribution, placement, single):
    """srun -m DISTRIBUTION train_gpt --sharding hsdp on 2 hosts: its groups and its curve."""
    what = f"srun -N 2 -n 4 -m {distribution} train_gpt --sharding hsdp"
    hsdp_log, output_path = os.path.join(folder, "hsdp.json"), os.path.join(folder, "hsdp.txt")
    # The groups hsdp made, as the ranks' flight recorders list them: every rank dumps them on
    # SIGUSR1 (and carries on) once two steps are done. The run goes on for HSDP_STEPS steps, so
    # that the signal finds every rank training: 8 steps take a fraction of a second here, and a
    # rank signalled after its last one dumps a recorder whose groups are gone. The learning rate
    # is constant, so the first 8 steps are those of an 8-step run.
    env = dict(env, WEFT_TRACE_DIR=folder)
    command = SRUN + ["-m", distribution, args.train_gpt] + MODEL + [
        "--steps", str(HSDP_STEPS), "--dp", "4", "--sharding", "hsdp", "--micro-batch", "2", "--log-json", hsdp_log]
    with open(output_path, "w") as out:
        job = cluster.popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            dumps = dump_during_run(job, args.train_gpt, env["SLURM_CONF"], hsdp_log, folder, output_path)
            status = job.wait(timeout=240)
        except subprocess.TimeoutExpired:
            fail(f"{what} did not finish within 240 s")
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    output = open(output_path).read()
    if status != 0:
        fail(f"{what} exited with {status}", output)
    hsdp = [json.loads(line)["loss"] for line in open(hsdp_log) if line.strip()]
    host_of = {rank: d["host"] for rank, d in dumps.items()}
    if host_of != placement:
        fail(f"{what}: the ranks ran on {host_of}, not {placement}")
    shards, replicas = set(), set()
    for rank, dump in dumps.items():
        groups = {g["name"]: g["members"] for g in dump["groups"]}
        shard = next((m for n, m in groups.items() if n.endswith("-shard")), None)
        replicate = next((m for n, m in groups.items() if n.endswith("-replicate")), None)
        if shard is None or replicate is None:
            fail(f"{what}: rank {rank}'s dump has no shard and replicate groups: {sorted(groups)}")
        if {host_of[m] for m in shard} != {host_of[rank]} or len(shard) != 2:
            fail(f"{what}: rank {rank}'s shard group {shard} is not the ranks of its host {host_of[rank]} ({host_of})")
        if len({host_of[m] for m in replicate}) != len(HOSTS):
            fail(f"{what}: rank {rank}'s replicate group {replicate} does not span both hosts ({host_of})")
        shards.add(tuple(shard))
        replicas.add(tuple(replicate))
    if len(hsdp) != HSDP_STEPS:
        fail(f"{what}: expected {HSDP_STEPS} steps, got {len(hsdp)}", output)
    hsdp = hsdp[:8]
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, hsdp))
    for step, (a, b) in enumerate(zip(single, hsdp), 1):
        print(f"-m {distribution} step {step}: 1 rank {a:.7f}  hsdp on 2 hosts x 2 ranks {b:.7f}")
    if worst > 1e-6:
        fail(f"{what}: the loss differs from the single rank's by up to {worst:.2e} (tolerance 1e-06)")
    print(f"hsdp -m {distribution}: shard groups {sorted(shards)} are the hosts' ranks, replicate groups "
          f"{sorted(replicas)} span them; the curve follows the single rank's (worst relative difference "
          f"{worst:.1e} over 8 steps)")


def dump_during_run(job, program, slurm_conf, log, folder, job_output):
    """Once `log` has two steps, SIGUSR1 to every rank of `program` in this cluster; their dumps."""
    end = time.monotonic() + 120
    while not (os.path.exists(log) and len(open(log).read().splitlines()) >= 2):
        if time.monotonic() > end or job.poll() is not None:
            fail(f"train_gpt did not get through two steps (exit status {job.poll()})", open(job_output).read())
        time.sleep(0.05)
    pids = processes_of(program, slurm_conf)
    if len(pids) != RANKS:
        fail(f"found {len(pids)} ranks of train_gpt, not {RANKS}")
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    end = time.monotonic() + 30
    while len(glob.glob(os.path.join(folder, "weft-flight-*.json"))) < RANKS:
        if time.monotonic() > end:
            fail("the ranks did not all dump their flight recorders on SIGUSR1")
        time.sleep(0.05)
    time.sleep(0.2)  # the last file's writer has closed it
    dumps = {}
    for path in glob.glob(os.path.join(folder, "weft-flight-*.json")):
        with open(path) as f:
            dump = json.load(f)
        dumps[dump["rank"]] = dump
    return dumps


def processes_of(program, slurm_conf):
    """Pids of the processes running `program` under the cluster whose Slurm is `slurm_conf`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if os.path.basename(argv0) == os.path.basename(program) and env.get(b"SLURM_CONF") == slurm_conf.encode():
            found.append(int(entry))
    return found


def test_health(args, cluster):
    env = dict(cluster.env, OMPI_MCA_mpi_yield_when_idle="1")
    command = SRUN + [args.health_check, "--backend", "mpi", "--bytes", "1M", "--warmup", "1", "--rounds", "3",
                      "--host-rounds", "3", "--expect-ms", "10000", "--fail-ms", "60000"]
    output = run(cluster, command, env=env)
    if "over 4 ranks on 2 hosts" not in output:
        fail("the health check does not say it ran on 2 hosts", output)
    # Its table: per rank the host, and that host's own all-reduce bandwidth (measured only when
    # the ranks span several hosts), maybe with a mark ("<- slow local memory") after it.
    for rank in range(RANKS):
        row = re.search(rf"^\s+{rank}\s+(\S+)\s+(?:[\d.]+\s+){{4}}([\d.]+)(\s+<-.*)?$", output, re.M)
        if not row or row.group(1) != HOSTS[rank // 2] or not float(row.group(2)) > 0:
            fail(f"the health check's table does not give rank {rank} on {HOSTS[rank // 2]} with its host's "
                 f"all-reduce bandwidth", output)
    print("health: the health check ran on 2 hosts; its table puts ranks 0, 1 on n1 and 2, 3 on n2, each with its "
          "host's own all-reduce bandwidth")


def test_doctor(args, cluster):
    """weft-doctor's cross-node checks (all-reduce over the nodes, p2p between every pair of nodes)
    on the hosts of the cluster, 2 ranks each: measured, never skipped, every host named, and the
    exit status agreeing with the statuses."""
    hosts = [f"n{i + 1}" for i in range(args.hosts)]
    with tempfile.TemporaryDirectory(prefix="weft-doctor-") as folder:
        report = os.path.join(folder, "doctor.json")
        # The veth links are not InfiniBand: expect a rate they reach, so that the statuses test the
        # measurement rather than the hardware.
        command = ["srun", "--mpi=pmix", "-N", str(args.hosts), "-n", str(2 * args.hosts), args.doctor, "--quick",
                   "--bytes", "1M", "--rounds", "3", "--gemm-size", "64", "--expect-link-gbps", "0.001",
                   "--json", report]
        env = dict(cluster.env, OMPI_MCA_mpi_yield_when_idle="1")
        try:
            done = cluster.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=folder)
        except subprocess.TimeoutExpired:
            fail("weft-doctor did not finish within 120 s")
        output = done.stdout + done.stderr
        if done.returncode not in (0, 1) or not os.path.exists(report):
            fail(f"weft-doctor exited with {done.returncode} and wrote no report", output + "\n" + shared_memory_report())
        checks = json.load(open(report))["checks"]
    by_name = {}
    for c in checks:
        by_name.setdefault(c["name"], []).append(c)
    for name in ("collectives.all_reduce.nodes", "collectives.p2p"):
        if name not in by_name:
            fail(f"no {name} check in the report", output)
        for c in by_name[name]:
            if c["status"] == "SKIP" or not c["value"]:
                fail(f"{name} was not measured across {args.hosts} hosts: {c}", output)
    pairs = by_name["collectives.p2p"][0]["value"]
    measured = {tuple(sorted(pair)) for pair in re.findall(r"(n\d+)-(n\d+) [\d.]+ GB/s", pairs)}
    every_pair = {(a, b) for a in hosts for b in hosts if a < b}
    if measured != every_pair:
        fail(f"collectives.p2p measured the pairs {sorted(measured)}, not every pair of {hosts}: {pairs}", output)
    named = {c["node"] for c in checks if c.get("node")}
    if not set(hosts) <= named:
        fail(f"the report names nodes {sorted(named)}, not every host of {hosts}", output)
    node_checks = by_name.get("collectives.all_reduce.node", [])
    if sorted(c["node"] for c in node_checks) != hosts:
        fail(f"the all-reduce inside each node ran on {sorted(c['node'] for c in node_checks)}, not on {hosts}", output)
    failed = any(c["status"] == "FAIL" for c in checks)
    if done.returncode != (1 if failed else 0):
        fail(f"exit status {done.returncode} disagrees with the report's statuses (a FAIL: {failed})", output)
    print(f"doctor: on {args.hosts} hosts the all-reduce over the nodes and p2p between the "
          f"{args.hosts * (args.hosts - 1) // 2} pairs were measured ({pairs}); every host is named; exit "
          f"{done.returncode} agrees with the statuses (failed: "
          f"{', '.join(sorted({c['name'] for c in checks if c['status'] == 'FAIL'})) or 'none'})")


class srun_job:
    """srun -N 2 -n 4 fault_program DIR ARGS... on the cluster; each rank's output in DIR/out-<rank>
    (written on its own host by slurmstepd, so a host cut off still leaves it), its dumps in
    DIR/<host>/ (a host's own disk, as on a real cluster), its pid in DIR/pid-<rank>."""

    def __init__(self, cluster, program, program_args, deadline):
        self.dir = tempfile.mkdtemp(prefix="weft_multinode_")
        for host in HOSTS:
            os.mkdir(os.path.join(self.dir, host))
        env = dict(cluster.env, WEFT_COMM_TIMEOUT=str(deadline), WEFT_ABORT_GRACE="1")
        wrapper = ["/bin/sh", "-c", 'WEFT_TRACE_DIR="$0/$(hostname)" exec "$@"', self.dir]
        command = SRUN + ["--output", os.path.join(self.dir, "out-%t"), "--error", os.path.join(self.dir, "out-%t")]
        self.srun_output = open(os.path.join(self.dir, "srun.txt"), "w")
        self.process = cluster.popen(command + wrapper + [program, self.dir] + program_args, env=env,
                                     stdout=self.srun_output, stderr=subprocess.STDOUT)
        self.pids = {}

    def wait_for_pids(self, limit=60):
        end = time.monotonic() + limit
        while len(self.pids) < RANKS:
            for rank in range(RANKS):
                path = os.path.join(self.dir, f"pid-{rank}")
                if rank not in self.pids and os.path.exists(path) and open(path).read().strip():
                    self.pids[rank] = int(open(path).read())
            if time.monotonic() > end or self.process.poll() is not None:
                fail("the ranks did not all start", self.output())
            time.sleep(0.02)

    def wait_in_loop(self, calls=20, limit=60):
        """Until every rank has issued `calls` all-reduces of the loop (their flight recorders,
        dumped on SIGUSR1, say so); the dumps are then removed. Mid-loop, the ranks are inside
        all-reduces most of the time, and they time out together when one is cut off."""
        end = time.monotonic() + limit
        while True:
            for rank in range(RANKS):
                os.kill(self.pids[rank], signal.SIGUSR1)
            time.sleep(0.2)
            dumps = {**self.dumps("n1"), **self.dumps("n2")}
            issued = {r: max((g["issued"] for g in d["groups"] if g["name"] == "world"), default=0)
                      for r, d in dumps.items()}
            for path in glob.glob(os.path.join(self.dir, "n*", "weft-flight-*.json")):
                os.remove(path)
            if len(issued) == RANKS and min(issued.values()) >= calls:
                return
            if time.monotonic() > end or self.process.poll() is not None:
                fail(f"the ranks did not reach {calls} all-reduces of the loop (issued: {issued})", self.output())

    def wait_gone(self, since, limit):
        """Seconds from `since` until every rank's process is gone, or None past `limit`."""
        while time.monotonic() - since < limit:
            if not any(alive(pid) for pid in self.pids.values()):
                return time.monotonic() - since
            time.sleep(0.02)
        return None

    def rank_output(self, rank):
        path = os.path.join(self.dir, f"out-{rank}")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def output(self):
        self.srun_output.flush()
        text = open(os.path.join(self.dir, "srun.txt"), errors="replace").read()
        return text + "".join(f"--- rank {r}:\n{self.rank_output(r)}" for r in range(RANKS))

    def dumps(self, host):
        found = {}
        for path in glob.glob(os.path.join(self.dir, host, "weft-flight-*.json")):
            with open(path) as f:
                dump = json.load(f)
            found[dump["rank"]] = dump
        return found

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.srun_output.close()
        subprocess.run(["rm", "-rf", self.dir])


TIMEOUT_MESSAGE = r"weft: rank {rank} \(host {host}\): all_reduce #\d+ \(256 x float\) on group 'world' " \
                  r"\(rank {rank} of 4\) timed out: waited [\d.]+ s, deadline {deadline:.2f} s"


def check_messages(job, ranks, deadline, what):
    for rank in ranks:
        pattern = TIMEOUT_MESSAGE.format(rank=rank, host=HOSTS[rank // 2], deadline=deadline)
        if not re.search(pattern, job.rank_output(rank)):
            fail(f"{what}: rank {rank} on {HOSTS[rank // 2]} did not end with the timeout message", job.output())


def test_stop(args, cluster):
    deadline, victim = args.deadline, 3  # the second rank of n2
    what = f"rank {victim} on n2 stopped"
    job = srun_job(cluster, args.program, ["stop", "collective", str(victim)], deadline)
    try:
        job.wait_for_pids()
        end = time.monotonic() + 60
        while not stopped(job.pids[victim]):
            if time.monotonic() > end:
                fail(what + ": the rank never stopped", job.output())
            time.sleep(0.01)
        elapsed = job.wait_gone(time.monotonic(), 2 * deadline + 10)
        if elapsed is None or elapsed > 2 * deadline:
            fail(f"{what}: the ranks ended {elapsed} s after the stop, not within 2 x the {deadline} s deadline",
                 job.output())
        check_messages(job, [r for r in range(RANKS) if r != victim], deadline, what)
        print(f"stop: rank {victim} on n2 stopped; ranks 0, 1 (n1) and 2 (n2) timed out with the message and every "
              f"rank was gone {elapsed:.2f} s later (deadline {deadline} s)")
    finally:
        job.close()


def stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_link(args, cluster):
    deadline = args.deadline
    what = "n2's link down"
    job = srun_job(cluster, args.program, ["loop", "60"], deadline)
    try:
        job.wait_for_pids()
        job.wait_in_loop()
        cut = time.monotonic()
        cluster.run(["ip", "link", "set", private_cluster.INTERFACE, "down"], host="n2", check=True)
        elapsed = job.wait_gone(cut, 2 * deadline + 10)
        if elapsed is None or elapsed > 2 * deadline:
            fail(f"{what}: the ranks ended {elapsed} s after the link went down, not within 2 x the {deadline} s "
                 f"deadline", job.output())
        check_messages(job, range(RANKS), deadline, what)
        # What reaches the job's side (n1's disk) names the ranks of the host it lost; what n2 kept
        # on its own disk says they were on n2 and timed out in the same all-reduce.
        seen, kept = job.dumps("n1"), job.dumps("n2")
        if sorted(seen) != [0, 1] or {d["host"] for d in seen.values()} != {"n1"}:
            fail(f"{what}: n1's dumps are from ranks {sorted(seen)}, hosts {[d['host'] for d in seen.values()]}",
                 job.output())
        if sorted(kept) != [2, 3] or {d["host"] for d in kept.values()} != {"n2"}:
            fail(f"{what}: n2's dumps are from ranks {sorted(kept)}, hosts {[d['host'] for d in kept.values()]}",
                 job.output())
        diff = subprocess.run([args.trace_diff, os.path.join(job.dir, "n1")], capture_output=True, text=True)
        if diff.returncode != 1 or "no dump from world ranks 2, 3" not in diff.stdout:
            fail(f"{what}: weft-trace-diff on n1's dumps should name world ranks 2, 3 as missing "
                 f"(exit {diff.returncode})", diff.stdout + diff.stderr)
        for rank, dump in {**seen, **kept}.items():
            if dump["reason"] != "timeout" or f"(host {dump['host']})" not in dump["message"]:
                fail(f"{what}: rank {rank}'s dump says {dump['reason']}: {dump['message']}")
        print(f"link: n2's link down mid-all-reduce; all 4 ranks timed out with the message and were gone "
              f"{elapsed:.2f} s later (deadline {deadline} s); weft-trace-diff on n1's dumps names ranks 2, 3 "
              f"missing, whose dumps on n2 say host n2")
    finally:
        cluster.run(["ip", "link", "set", private_cluster.INTERFACE, "up"], host="n2")
        job.close()


def test_cleanup(args):
    """The script as users run it: after a run, a failure, SIGINT and SIGTERM, nothing of the
    cluster is left (namespaces, links, mounts, folder, processes); after SIGKILL, nothing once
    the next cluster has started."""
    script = os.path.join(here, "..", "..", "scripts", "private_cluster.py")
    # Busy: an MPI job on both hosts (its shared-memory segments must go too).
    busy = 'WEFT_TRACE_DIR="$WEFT_CLUSTER_DIR" ' + " ".join(SRUN) + f' {args.program} "$WEFT_CLUSTER_DIR" loop 60'
    program = os.path.basename(args.program)
    cases = [("a run", "srun -N 2 -n 4 hostname", None, 0),
             ("a failure", "srun -N 2 -n 4 false", None, 1),
             ("SIGINT (Ctrl-C)", busy, signal.SIGINT, 128 + signal.SIGINT),
             ("SIGTERM", busy, signal.SIGTERM, 128 + signal.SIGTERM),
             # No teardown can run: the next cluster removes what this one left.
             ("SIGKILL and the next run", busy, signal.SIGKILL, -signal.SIGKILL)]
    for what, shell, sig, want in cases:
        command = ["/usr/bin/python3", script, "--hosts", "2", "--", "sh", "-c", f'echo "$WEFT_CLUSTER_DIR"; {shell}']
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = []  # what the script says before the command's first line (a stale cluster removed)
        while not said or not (said[-1].startswith("/") or said[-1] == "\0"):
            said.append(process.stdout.readline().strip() or "\0")  # "\0": the end of its output
        folder = said[-1]
        if not folder.startswith("/"):
            process.terminate()
            out = "\n".join(said[:-1]) + process.communicate()[0]
            if process.returncode == private_cluster.SKIP:
                print(f"cleanup: SKIP: {out.strip()}")
                sys.exit(private_cluster.SKIP)
            fail(f"{what}: the cluster did not start", out)
        tag = f"weft{process.pid}"
        if sig is not None:
            # The job is running on both hosts when the signal comes.
            end = time.monotonic() + 30
            while not steps_running(folder, program):
                if time.monotonic() > end:
                    process.terminate()  # the script removes the cluster
                    fail(f"{what}: the job never started", process.communicate()[0])
                time.sleep(0.05)
            process.send_signal(sig)
        try:
            if sig == signal.SIGKILL:  # its daemons, still running, hold its output open
                process.wait(timeout=60)
                process.stdout.close()
                out = ""
            else:
                out = process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            process.terminate()
            fail(f"{what}: private_cluster.py did not end within 60 s", process.communicate()[0])
        if process.returncode != want:
            fail(f"{what}: private_cluster.py exited with {process.returncode}, not {want}", out)
        if sig == signal.SIGKILL:
            if not private_cluster.leftovers(tag, folder):
                fail(f"{what}: the killed script's cluster is gone already: the check would see nothing")
            following = subprocess.run(["/usr/bin/python3", script, "--", "true"], capture_output=True, text=True)
            out += following.stdout + following.stderr
            if following.returncode != 0 or f"pid {process.pid}" not in following.stderr:
                fail(f"{what}: the next run did not say it removed the cluster of pid {process.pid}", out)
        left = private_cluster.leftovers(tag, folder)
        if left:
            fail(f"{what}: left behind: " + "; ".join(left), out)
        print(f"cleanup: after {what} (exit {process.returncode}) nothing is left: no namespace {tag}-*, link, "
              f"mount, folder or process of the cluster")


def steps_running(folder, program):
    """Whether the cluster whose folder is `folder` runs `program` on both hosts."""
    hosts = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().split(b"\0")
                if os.path.basename(cmdline[0]) != program.encode():
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if env.get(b"SLURM_CONF", b"").startswith(folder.encode()):
                hosts.add(env.get(b"SLURMD_NODENAME"))
    return len(hosts) == 2


TESTS = {"launch": test_launch, "layout": test_layout, "hsdp": test_hsdp, "health": test_health,
         "stop": test_stop, "link": test_link, "doctor": test_doctor}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test", choices=sorted(TESTS) + ["cleanup"])
    parser.add_argument("--report")
    parser.add_argument("--weft-layout")
    parser.add_argument("--train-gpt")
    parser.add_argument("--health-check")
    parser.add_argument("--program")
    parser.add_argument("--trace-diff")
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--doctor")
    parser.add_argument("--hosts", type=int, default=len(HOSTS))
    args = parser.parse_args()
    if args.test == "cleanup":
        test_cleanup(args)
        return 0
    try:
        with private_cluster.cluster(hosts=args.hosts if args.test == "doctor" else len(HOSTS), cpus=2) as cluster:
            TESTS[args.test](args, cluster)
    except private_cluster.Unavailable as e:
        print(f"multinode_tests: SKIP: {e}")
        return private_cluster.SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main())
