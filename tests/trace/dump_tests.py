#!/usr/bin/python3
"""Fault tests of the flight-recorder dumps: 4 ranks of dump_program under mpiexec.

    dump_tests.py every-rank   rank 0 times out waiting for rank 1, which is stopped; ranks 2 and 3
                               are outside any operation: they dump because rank 0 asked them to
                               (the marker in WEFT_TRACE_DIR), and weft-trace-diff names rank 1 as
                               missing
    dump_tests.py stale        dumps of an earlier run in the same WEFT_TRACE_DIR: weft-trace-diff
                               names the stale one as another run's and leaves it out, so the
                               stopped rank of the new run shows as missing
    dump_tests.py fifo         FIFOs where the ranks' dumps are written: the job still ends, with
                               status 124, within the deadline + WEFT_ABORT_GRACE
    dump_tests.py funneled     MPI initialised with MPI_THREAD_FUNNELED: the watchdog does not call
                               MPI_Abort from its thread; it says so and exits 124
    common: --mpiexec PATH --program PATH [--trace-diff PATH] [--deadline SECONDS]

Standard library only.
"""
import argparse
import os
import random
import re
import signal
import subprocess
import tempfile
import time

from fault_job import RANKS, fail
import fault_job

GRACE = 2.0  # WEFT_ABORT_GRACE of these jobs: a rank that timed out waits at most half for the others' dumps


def job(args, mode, deadline, directory=None, extra_env=None):
    """mpiexec -n 4 dump_program DIR MODE SECONDS, with the rank pids it wrote."""
    directory = directory or tempfile.mkdtemp(prefix="weft-dump-")
    env = dict(os.environ)
    env["WEFT_COMM_TIMEOUT"] = str(deadline)
    env["WEFT_TRACE_DIR"] = directory
    env["WEFT_ABORT_GRACE"] = str(GRACE)
    env.update(extra_env or {})
    return fault_job.job(args.mpiexec, [args.program, directory, mode, "60"], env, directory)


def stop_and_wait(run, victim, deadline, what):
    """SIGSTOPs `victim` mid-run; returns (status, seconds until mpiexec ended)."""
    run.wait_for_pids()
    time.sleep(0.5)
    stopped_at = time.monotonic()
    os.kill(run.pids[victim], signal.SIGSTOP)
    status = run.wait(deadline + GRACE + 20)
    elapsed = time.monotonic() - stopped_at
    if status is None:
        output = run.output()
        run.kill_all()
        fail("%s: the job still ran %.1f s after rank %d was stopped" % (what, elapsed, victim), output)
    return status, elapsed


def trace_diff(args, run):
    diff = subprocess.run([args.trace_diff, run.dir], capture_output=True, text=True)
    if diff.returncode == 2:
        fail("weft-trace-diff could not read the dumps", diff.stdout + diff.stderr)
    return diff


def test_every_rank(args):
    deadline = args.deadline
    victim = 1
    # No SIGTERM handler: when mpiexec ends the job, the stopped rank must not dump after the fact.
    run = job(args, "idle", deadline, extra_env={"WEFT_TRACE_SIGNALS": "0"})
    status, elapsed = stop_and_wait(run, victim, deadline, "every-rank")
    output = run.output()
    what = "every-rank (rank 1 stopped, rank 0 waiting for it, ranks 2 and 3 idle)"
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124" % (what, status), output)
    # Rank 0 times out at deadline + one poll, then waits at most GRACE / 2 for the others' dumps.
    if elapsed > deadline + GRACE + 1.5:
        fail("%s: the job took %.2f s to end, more than the deadline %g s + grace %g s" % (what, elapsed, deadline, GRACE),
             output)
    reasons = {}
    for rank in range(RANKS):
        d = run.dump(rank)
        if d is not None:
            reasons[rank] = d["reason"]
    if reasons.get(0) != "timeout":
        fail("%s: rank 0 did not dump for its timeout (%s)" % (what, reasons), output)
    for rank in (2, 3):
        if reasons.get(rank) != "peer-timeout":
            fail("%s: rank %d did not dump when rank 0 timed out (dumps: %s)" % (what, rank, reasons), output)
    if victim in reasons:
        fail("%s: the stopped rank left a dump (%s)" % (what, reasons), output)
    jobs = {run.dump(rank)["job"] for rank in reasons}
    if len(jobs) != 1 or "" in jobs:
        fail("%s: the dumps do not carry one job id: %s" % (what, jobs), output)
    if args.trace_diff:
        diff = trace_diff(args, run)
        if diff.returncode != 1 or not re.search(r"missing ranks \([^)]*\): 1\n", diff.stdout):
            fail("%s: weft-trace-diff does not name rank 1 alone as missing (status %d)" % (what, diff.returncode),
                 diff.stdout + diff.stderr)
        if not re.search(r"rank 0 \(world rank 0\): in recv #\d+ \(16 x float, peer 1\), started", diff.stdout):
            fail("%s: weft-trace-diff does not show rank 0 waiting for rank 1" % what, diff.stdout)
    print("every-rank: the job ended %.2f s after rank 1 was stopped (deadline %g s, grace %g s); dumps: %s"
          % (elapsed, deadline, GRACE, reasons))
    run.cleanup()


def test_stale(args):
    deadline = args.deadline
    # An earlier run: every rank dumps on SIGUSR1, then the run is killed.
    first = job(args, "loop", deadline)
    first.wait_for_pids()
    time.sleep(0.3)
    for pid in first.pids.values():
        os.kill(pid, signal.SIGUSR1)
    end = time.monotonic() + 20
    while time.monotonic() < end and not all(first.dump(rank) for rank in range(RANKS)):
        time.sleep(0.05)
    if not all(first.dump(rank) for rank in range(RANKS)):
        output = first.output()
        first.kill_all()
        fail("stale: the first run did not dump on SIGUSR1", output)
    first.kill_all()
    old_job = first.dump(2)["job"]
    first.output_file.close()

    # The new run, in the same folder: rank 2 is stopped and never dumps there. When mpiexec ends
    # the job it resumes the stopped rank before it terminates it, and the resumed rank could
    # still answer a dump request left in the folder: its dumps go to a folder of its own.
    victim = 2
    elsewhere = os.path.join(first.dir, "victim")
    os.mkdir(elsewhere)
    run = job(args, "loop", deadline, directory=first.dir,
              extra_env={"WEFT_TRACE_SIGNALS": "0", "DUMP_PROGRAM_OWN_TRACE_DIR": "%d:%s" % (victim, elsewhere)})
    status, elapsed = stop_and_wait(run, victim, deadline, "stale")
    output = run.output()
    if status != 124:
        fail("stale: the second run exited with status %s, not 124" % status, output)
    # The new run's job: that of its newest dump. A live rank that the abort ended before it
    # dumped (a loaded machine) still holds the first run's file: then it is left out too.
    newest = max((run.dump(rank) for rank in range(RANKS) if rank != victim), key=lambda d: d["unix_time_ns"])
    new_job = newest["job"]
    if not new_job or new_job == old_job:
        fail("stale: the two runs do not carry different job ids (%s, %s)" % (old_job, new_job), output)
    compared = sum(1 for rank in range(RANKS) if run.dump(rank)["job"] == new_job)
    if run.dump(victim)["job"] != old_job:
        fail("stale: the stopped rank's file is not the first run's", output)
    if args.trace_diff:
        diff = trace_diff(args, run)
        stale_path = os.path.join(run.dir, "weft-flight-%d.json" % victim)
        if not re.search(r"left out: %s belongs to another run \(job %s, written " % (re.escape(stale_path), re.escape(old_job)),
                         diff.stdout):
            fail("stale: weft-trace-diff does not name the stale dump as another run's", diff.stdout)
        if diff.returncode != 1 or not re.search(r"missing ranks \([^)]*\): [\d, -]*\b2\b", diff.stdout):
            fail("stale: weft-trace-diff does not name rank 2 as missing (status %d)" % diff.returncode, diff.stdout)
        if "job %s: %d dumps compared" % (new_job, compared) not in diff.stdout:
            fail("stale: weft-trace-diff does not compare the new run's %d dumps" % compared, diff.stdout)
    print("stale: the first run's dump of rank 2 (job %s) was named and left out; rank 2 of job %s is missing (%d dumps "
          "of the new run)" % (old_job, new_job, compared))
    run.cleanup()


def test_fifo(args):
    deadline = args.deadline
    victim = random.randrange(1, RANKS)
    run = job(args, "loop", deadline)
    run.wait_for_pids()
    for rank in range(RANKS):
        os.mkfifo(os.path.join(run.dir, "weft-flight-%d.json.partial" % rank))
    status, elapsed = stop_and_wait(run, victim, deadline, "fifo")
    output = run.output()
    what = "fifo (rank %d stopped, FIFOs at the dumps' temporary names)" % victim
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124" % (what, status), output)
    if elapsed > deadline + GRACE + 1.5:
        fail("%s: the job took %.2f s to end, more than the deadline %g s + grace %g s" % (what, elapsed, deadline, GRACE),
             output)
    written = [rank for rank in range(RANKS) if run.dump(rank)]
    if not [rank for rank in written if rank != victim]:
        fail("%s: no live rank wrote its dump past the FIFO" % what, output)
    print("fifo: the job ended %.2f s after rank %d was stopped (deadline %g s, grace %g s); dumps from %s"
          % (elapsed, victim, deadline, GRACE, written))
    run.cleanup()


def test_funneled(args):
    deadline = args.deadline
    victim = random.randrange(1, RANKS)
    run = job(args, "loop", deadline, extra_env={"DUMP_PROGRAM_THREAD_LEVEL": "funneled"})
    status, elapsed = stop_and_wait(run, victim, deadline, "funneled")
    output = run.output()
    what = "funneled (rank %d stopped, MPI_THREAD_FUNNELED)" % victim
    if "initialised below MPI_THREAD_MULTIPLE, so MPI_Abort cannot be called from the watchdog's thread" not in output:
        fail("%s: no rank said it ends without MPI_Abort" % what, output)
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124" % (what, status), output)
    if elapsed > deadline + GRACE + 1.5:
        fail("%s: the job took %.2f s to end" % (what, elapsed), output)
    print("funneled: the job ended %.2f s after rank %d was stopped, status 124, without MPI_Abort" % (elapsed, victim))
    run.cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("test", choices=["every-rank", "stale", "fifo", "funneled"])
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--mpiexec", required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--trace-diff")
    args = parser.parse_args()
    {"every-rank": test_every_rank, "stale": test_stale, "fifo": test_fifo, "funneled": test_funneled}[args.test](args)


if __name__ == "__main__":
    main()
