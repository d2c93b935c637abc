"""What the fault tests share (fault_tests.py, dump_tests.py): a 4-rank job under mpiexec whose
ranks write their pids, and the ways to wait for it, harm it and read what it left. Standard
library only."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RANKS = 4


def fail(message, output=""):
    """Prints the end of `output` and the message, prefixed with the test script's name; exits 1."""
    if output:
        sys.stderr.write(output[-8000:] + "\n")
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    sys.stderr.write("%s: FAILED: %s\n" % (script, message))
    sys.exit(1)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        with open("/proc/%d/stat" % pid) as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class job:
    """mpiexec -n 4 --oversubscribe --bind-to none COMMAND..., run with `env` in a folder of its own
    (or `directory`), where each rank writes pid-<rank>; the output goes to a file there."""

    def __init__(self, mpiexec, command, env, directory=None, prefix="weft-fault-"):
        self.dir = directory or tempfile.mkdtemp(prefix=prefix)
        for stale_pid in glob.glob(os.path.join(self.dir, "pid-*")):
            os.remove(stale_pid)
        command = [mpiexec, "-n", str(RANKS), "--oversubscribe", "--bind-to", "none"] + command
        self.output_path = os.path.join(self.dir, "output-%d.txt" % time.monotonic_ns())
        self.output_file = open(self.output_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.output_file, stderr=subprocess.STDOUT)
        self.pids = {}

    def wait_for_pids(self, limit=60):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            for rank in range(RANKS):
                path = os.path.join(self.dir, "pid-%d" % rank)
                if rank not in self.pids and os.path.exists(path):
                    text = open(path).read().strip()
                    if text:
                        self.pids[rank] = int(text)
            if len(self.pids) == RANKS:
                return
            if self.process.poll() is not None:
                fail("the job ended before every rank started", self.output())
            time.sleep(0.05)
        self.kill_all()
        fail("the ranks did not start within %d s" % limit, self.output())

    def wait(self, limit):
        try:
            return self.process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None

    def output(self):
        self.output_file.flush()
        return open(self.output_path).read()

    def kill_all(self):
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.kill()
        self.process.wait()

    def survivors(self, grace=2.0):
        end = time.monotonic() + grace
        while time.monotonic() < end:
            left = [rank for rank, pid in self.pids.items() if alive(pid)]
            if not left:
                return []
            time.sleep(0.05)
        return [rank for rank, pid in self.pids.items() if alive(pid)]

    def dumps(self):
        return sorted(glob.glob(os.path.join(self.dir, "weft-flight-*.json")))

    def dump(self, rank):
        path = os.path.join(self.dir, "weft-flight-%d.json" % rank)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def cleanup(self):
        self.output_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)
