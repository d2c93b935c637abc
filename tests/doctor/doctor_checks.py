#!/usr/bin/python3
"""weft-doctor's checks, against fake sysfs/procfs trees (trees/) and on this machine.

  doctor_checks.py WEFT_DOCTOR trees [--fake-nvml DIR]  the faults of the fake trees (and NVML), one rank
  doctor_checks.py WEFT_DOCTOR flags                    the bad-flag sweep
  doctor_checks.py WEFT_DOCTOR mpi --mpiexec M --ranks N   N ranks under mpiexec on this machine
  doctor_checks.py WEFT_DOCTOR nodes --mpiexec M        4 ranks as 2 nodes (WEFT_DOCTOR_NODE), drivers differing
  doctor_checks.py WEFT_DOCTOR slurm --ranks N          N ranks under the private Slurm (77: no Slurm here)

Every run is checked for a report whose statuses and exit code agree: 1 exactly when a check
failed, 0 otherwise; 2 for a command line that cannot run.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = os.path.join(HERE, "trees")
SKIP = 77
# Tiny measurements: the checks' logic is under test, not this machine's speed.
SMALL = ["--quick", "--bytes", "256K", "--rounds", "2", "--gemm-size", "64", "--storage-bytes", "1M",
         "--storage-seconds", "1"]


def fail(message):
    print("doctor_checks: FAILED: " + message, file=sys.stderr)
    sys.exit(1)


def run(command, env=None, timeout=120):
    merged = dict(os.environ)
    merged.setdefault("OPENBLAS_NUM_THREADS", "1")
    merged.update(env or {})
    try:
        return subprocess.run(command, env=merged, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"'{' '.join(command)}' did not finish within {timeout} s")


def report(command, env=None, timeout=120, want_exit=None):
    """Runs weft-doctor with --json, checks the JSON against the exit code; returns {name@node: check}."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "doctor.json")
        # mpiexec ends the ranks still finalizing once one exits with 1; weft then dumps their
        # flight recorders, here rather than in the current folder.
        done = run(command + ["--json", path], dict(env or {}, WEFT_TRACE_DIR=work), timeout)
        if not os.path.exists(path):
            fail(f"'{' '.join(command)}' wrote no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
        with open(path) as f:
            checks = json.load(f)["checks"]
    for c in checks:
        if sorted(c) != ["expected", "fix", "name", "node", "status", "value"]:
            fail(f"check with fields {sorted(c)}")
        if c["status"] not in ("PASS", "WARN", "FAIL", "SKIP"):
            fail(f"status {c['status']!r}")
        if c["status"] in ("FAIL", "WARN") and not c["fix"]:
            fail(f"{c['name']} is {c['status']} without a fix")
        if c["status"] == "FAIL" and c["name"] + " " not in done.stdout.replace(c["name"], c["name"] + " "):
            fail(f"{c['name']} failed in the JSON but not in the printed report")
    failed = any(c["status"] == "FAIL" for c in checks)
    if done.returncode != (1 if failed else 0):
        fail(f"exit {done.returncode} with {'a' if failed else 'no'} failed check:\n{done.stdout}\n{done.stderr}")
    if want_exit is not None and done.returncode != want_exit:
        fail(f"'{' '.join(command)}' exited {done.returncode}, expected {want_exit}:\n{done.stdout}")
    by_name = {}
    for c in checks:
        by_name.setdefault(c["name"], []).append(c)
    return by_name, done


def expect(checks, name, status, *words):
    if name not in checks:
        fail(f"no check {name} (checks: {sorted(checks)})")
    for c in checks[name]:
        if c["status"] != status:
            fail(f"{name} on {c['node']} is {c['status']}, expected {status}: {c['value']} / {c['fix']}")
        text = c["value"] + " " + c["fix"]
        for w in words:
            if w not in text:
                fail(f"{name}: '{w}' not in '{text}'")


def tree_args(name):
    return ["--sysfs-root", os.path.join(TREES, name, "sys"), "--proc-root", os.path.join(TREES, name, "proc")]


def trees(doctor, fake_nvml):
    healthy_env = {"NCCL_SOCKET_IFNAME": "ib", "NCCL_IB_HCA": "mlx5"}
    checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), healthy_env, want_exit=0)
    for port in ("network.rdma.mlx5_0:1", "network.rdma.mlx5_1:1"):
        expect(checks, port, "PASS", "400 Gb/sec")
    expect(checks, "gpu.count", "PASS", "2 x")
    expect(checks, "gpu.topology", "PASS", "GPU 0 0000:17:00.0: NUMA 0, NIC mlx5_0", "GPU 1 0000:b3:00.0: NUMA 1, NIC mlx5_1")
    expect(checks, "network.gpudirect_rdma", "PASS", "nvidia_peermem")
    expect(checks, "nccl.socket_ifname", "PASS")
    expect(checks, "nccl.ib_hca", "PASS")
    expect(checks, "limits.memlock", "PASS", "unlimited")
    expect(checks, "cpu_affinity.rank0", "PASS", "NUMA node 0")
    expect(checks, "same.driver", "PASS", "550.54.15")
    print("doctor_checks: healthy InfiniBand node: every node check passes, exit 0")

    checks, _ = report([doctor] + SMALL + tree_args("port_down"), {"NCCL_IB_HCA": "mlx5_1"}, want_exit=1)
    expect(checks, "network.rdma.mlx5_0:1", "PASS")
    expect(checks, "network.rdma.mlx5_1:1", "FAIL", "1: DOWN", "is down", "ibstat mlx5_1")
    expect(checks, "nccl.ib_hca", "FAIL", "mlx5_1 has no ACTIVE port", "mlx5_0")
    print("doctor_checks: port down: the port and NCCL_IB_HCA naming it fail, exit 1")

    checks, _ = report([doctor] + SMALL + tree_args("link_200"), want_exit=1)
    expect(checks, "network.rdma.mlx5_0:1", "FAIL", "200 Gb/sec", "trained at 200 Gb/s, not 400", "firmware")
    expect(checks, "network.rdma.mlx5_1:1", "PASS")
    checks, _ = report([doctor] + SMALL + tree_args("link_200") + ["--expect-link-gbps", "200"], want_exit=0)
    expect(checks, "network.rdma.mlx5_0:1", "PASS")
    print("doctor_checks: 200 Gb/s link: fails against 400, passes with --expect-link-gbps 200")

    checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), {"NCCL_SOCKET_IFNAME": "ib9,eth"}, want_exit=1)
    expect(checks, "nccl.socket_ifname", "FAIL", "no interface ib9", "NCCL_SOCKET_IFNAME", "eth0, ib0, ib1, lo")
    checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), {"NCCL_SOCKET_IFNAME": "^lo,docker"}, want_exit=0)
    expect(checks, "nccl.socket_ifname", "PASS")
    print("doctor_checks: NCCL_SOCKET_IFNAME naming a missing interface fails with the node's interfaces, exit 1")

    if fake_nvml:
        nvml = {"LD_LIBRARY_PATH": fake_nvml}
        checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), nvml, want_exit=0)
        expect(checks, "gpu.count", "PASS", "2 x NVIDIA H100 80GB HBM3 (from NVML)", "driver 550.54.15, CUDA 12.4")
        expect(checks, "gpu.health", "PASS", "no uncorrected ECC errors")
        expect(checks, "gpu.topology", "PASS", "NUMA 0, NIC mlx5_0", "0 active NVLinks", "0-1:SYS")
        expect(checks, "same.cuda_driver", "PASS", "12.4")
        checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), dict(nvml, FAKE_NVML_FAULT="ecc,remap"),
                           want_exit=1)
        expect(checks, "gpu.health", "FAIL", "GPU 0: a row remap is pending", "GPU 1: 3 uncorrected ECC errors",
               "drain the node", "nvidia-smi -r")
        checks, _ = report([doctor] + SMALL + tree_args("healthy_ib"), dict(nvml, FAKE_NVML_FAULT="throttle"), want_exit=0)
        expect(checks, "gpu.health", "WARN", "GPU 0: clocks throttled (reasons 0x40: hardware thermal); GPU 1", "cooling")
        print("doctor_checks: NVML (a stand-in, through dlopen): GPUs, driver and CUDA read; ECC errors and a pending "
              "remap fail, throttling warns")

    # This machine's own trees: no GPU (and here no InfiniBand): SKIP with the reason, never a crash.
    checks, _ = report([doctor] + SMALL)
    if not os.path.exists("/dev/nvidiactl"):
        expect(checks, "gpu.count", "SKIP", "no NVIDIA GPU")
        expect(checks, "cpu_affinity.rank0", "SKIP", "no GPU")
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        expect(checks, "network.rdma", "SKIP", "no InfiniBand")
    print("doctor_checks: this machine's GPU and InfiniBand checks skip with the reason")


def flags(doctor):
    # Each case starts MPI (a singleton, about half a second): one per kind of mistake.
    cases = [
        (["--expect-link-gbsp", "400"], "did you mean '--expect-link-gbps'?"),
        (["--expect-link-gbps"], "'--expect-link-gbps' needs a value"),
        (["--expect-link-gbps", "0"], "--expect-link-gbps expects a number from"),
        (["--storage-bytes", "12Q"], "unknown size suffix"),
        (["--data-dir", "/nonexistent/weft-doctor"], "--data-dir: '/nonexistent/weft-doctor' is not a directory"),
    ]
    for args, words in cases:
        done = run([doctor] + args, timeout=60)
        if done.returncode != 2:
            fail(f"weft-doctor {' '.join(args)}: exit {done.returncode}, expected 2:\n{done.stdout}\n{done.stderr}")
        if words not in done.stderr or done.stderr.count("weft-doctor:") != 1:
            fail(f"weft-doctor {' '.join(args)}: expected one message with '{words}', got:\n{done.stderr}")
    # An unwritable --json: the run cannot report, so it cannot run (2), and says why.
    done = run([doctor] + SMALL + ["--json", "/nonexistent/weft-doctor/out.json"], timeout=60)
    if done.returncode != 2 or "cannot open '/nonexistent/weft-doctor/out.json'" not in done.stderr:
        fail(f"--json into a missing folder: exit {done.returncode}:\n{done.stderr}")
    done = run([doctor, "--help"], timeout=60)
    if done.returncode != 0 or "--expect-link-gbps" not in done.stdout:
        fail("--help")
    print(f"doctor_checks: {len(cases) + 1} bad command lines each exit 2 with one message")


def storage_args(work):
    data, checkpoint = os.path.join(work, "data"), os.path.join(work, "checkpoint")
    os.makedirs(data)
    os.makedirs(checkpoint)
    # Training needs far below any disk's speed: the measurement runs, the verdict is PASS.
    return ["--data-dir", data, "--checkpoint-dir", checkpoint, "--tokens-per-s", "1000", "--checkpoint-size", "1M"]


def this_machine(checks, ranks, nodes):
    """What weft-doctor must say of this machine, on `ranks` ranks over `nodes` node names."""
    if not os.path.exists("/dev/nvidiactl"):  # no GPU here: skipped with the reason, on every node
        expect(checks, "gpu.count", "SKIP", "no NVIDIA GPU")
        if len(checks["gpu.count"]) != nodes:
            fail(f"gpu.count reported for {len(checks['gpu.count'])} nodes, expected {nodes}")
    expect(checks, "storage.data.read", "PASS", "MB/s", "1 MB in")
    expect(checks, "storage.checkpoint.write", "PASS", "MB/s")
    if len(checks["storage.data.read"]) != nodes:
        fail(f"storage measured on {len(checks['storage.data.read'])} nodes, expected {nodes}")
    gemm = [name for name in checks if name.startswith("gemm.rank")]
    if sorted(gemm) != sorted(f"gemm.rank{r}" for r in range(ranks)):
        fail(f"GEMM checks {gemm}")
    for name in gemm:
        if checks[name][0]["status"] == "FAIL" or "GFLOP/s" not in checks[name][0]["value"]:
            fail(f"{name}: {checks[name][0]}")
    if ranks // nodes > 1:
        expect(checks, "collectives.all_reduce.node", "PASS", f"over {ranks // nodes} ranks", "GB/s")


def mpi(doctor, mpiexec, ranks):
    with tempfile.TemporaryDirectory() as work:
        command = [mpiexec, "-n", str(ranks), "--oversubscribe", "--bind-to", "none", doctor] + SMALL + storage_args(work)
        checks, done = report(command, timeout=180, want_exit=0)
        if os.listdir(os.path.join(work, "data")) or os.listdir(os.path.join(work, "checkpoint")):
            fail("weft-doctor left files in the storage it timed")
    this_machine(checks, ranks, 1)
    expect(checks, "collectives.all_reduce.nodes", "SKIP", "one node")
    expect(checks, "collectives.p2p", "SKIP", "one node")
    if "weft-doctor: %d ranks on 1 node" % ranks not in done.stdout:
        fail("the report does not say how many ranks and nodes it checked:\n" + done.stdout)
    print(f"doctor_checks: {ranks} ranks on this machine: GPU checks skipped, storage and collectives measured, exit 0")


def nodes(doctor, mpiexec):
    # 4 ranks as 2 nodes of 2 (as on two hosts), named through WEFT_DOCTOR_NODE, with the driver
    # version of WEFT_DOCTOR_DRIVER_VERSION: the same on both nodes, then differing.
    def launch(driver):
        return [mpiexec, "-n", "4", "--oversubscribe", "--bind-to", "none", "sh", "-c",
                'WEFT_DOCTOR_NODE=node$((OMPI_COMM_WORLD_RANK / 2)) WEFT_DOCTOR_DRIVER_VERSION=%s exec "$0" "$@"' % driver,
                doctor] + SMALL
    with tempfile.TemporaryDirectory() as work:
        # Links expected at 0.001 Gb/s: this machine's loopback passes.
        command = launch("550.54.15") + ["--expect-link-gbps", "0.001"] + storage_args(work)
        checks, _ = report(command, timeout=180, want_exit=0)
    expect(checks, "same.driver", "PASS", "550.54.15 on all 2 nodes")
    this_machine(checks, 4, 2)  # the all-reduce inside each node of 2 ranks: exact on both
    expect(checks, "collectives.all_reduce.nodes", "PASS", "over 4 ranks on 2 nodes")
    expect(checks, "collectives.p2p", "PASS", "node0-node1", "GB/s")
    # Differing drivers, and the links of a cluster (400 Gb/s) against this machine's loopback.
    checks, _ = report(launch("55$((OMPI_COMM_WORLD_RANK / 2)).54"), timeout=180, want_exit=1)
    expect(checks, "same.driver", "FAIL", "550.54 on node0 (ranks 0,1)", "551.54 on node1 (ranks 2,3)",
           "same NVIDIA driver on every node")
    expect(checks, "collectives.all_reduce.nodes", "FAIL", "Gb/s over 4 ranks", "NET/IB")
    expect(checks, "collectives.p2p", "FAIL", "slow pairs: node0-node1")
    # 3 nodes of 1 rank: 3 pairs, measured in rounds of disjoint pairs (one node resting each round).
    command = [mpiexec, "-n", "3", "--oversubscribe", "--bind-to", "none", "sh", "-c",
               'WEFT_DOCTOR_NODE=node$OMPI_COMM_WORLD_RANK exec "$0" "$@"', doctor] + SMALL + ["--expect-link-gbps", "0.001"]
    # Pairs of ranks sharing this machine's cores differ by more than the 2x a cluster's pairs
    # may: the status is left to the statuses-agree-with-exit check.
    checks, _ = report(command, timeout=180)
    pairs = checks["collectives.p2p"][0]["value"].split("; ")
    if [p.split()[0] for p in pairs] != ["node0-node1", "node0-node2", "node1-node2"] or \
            any(float(p.split()[1]) <= 0 for p in pairs):
        fail(f"p2p over 3 nodes: {pairs}")
    print("doctor_checks: 4 ranks as 2 nodes: drivers compared (same: PASS, differing: FAIL naming each node), "
          "all-reduce inside and across nodes and p2p measured and judged against --expect-link-gbps; "
          "3 nodes: every pair measured")


def slurm(doctor, ranks):
    sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
    import private_slurm  # noqa: E402  (the project's private single-node Slurm)
    with tempfile.TemporaryDirectory() as work:
        command = ["srun", "--mpi=pmix", "-N", "1", "-n", str(ranks), doctor] + SMALL + storage_args(work)
        try:
            with private_slurm.cluster(ranks) as env:
                env["OMPI_MCA_mpi_yield_when_idle"] = "1"
                checks, done = report(command, env=env, timeout=180, want_exit=0)
        except private_slurm.Unavailable as e:
            print(f"doctor_checks: SKIP: {e}")
            return SKIP
    this_machine(checks, ranks, 1)
    expect(checks, "slurm.srun_pmix", "PASS", "srun --mpi=pmix available")
    expect(checks, "slurm.job", "PASS", f"{ranks} ranks on this node", "SLURM_CPUS_ON_NODE=")
    print(f"doctor_checks: srun -n {ranks}: Slurm's pmix and the job's CPUs seen, storage and collectives measured, exit 0")
    return 0


def main():
    doctor, mode = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:]
    option = lambda name, default=None: rest[rest.index(name) + 1] if name in rest else default  # noqa: E731
    if mode == "trees":
        trees(doctor, option("--fake-nvml"))
    elif mode == "flags":
        flags(doctor)
    elif mode == "mpi":
        mpi(doctor, option("--mpiexec"), int(option("--ranks")))
    elif mode == "nodes":
        nodes(doctor, option("--mpiexec"))
    elif mode == "slurm":
        return slurm(doctor, int(option("--ranks")))
    else:
        fail("unknown mode " + mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
