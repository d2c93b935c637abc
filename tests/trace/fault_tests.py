#!/usr/bin/python3
"""Fault-injection tests: 4 ranks of fault_program under mpiexec, one rank harmed.

    fault_tests.py kill --trials 20     SIGKILL one rank mid-collective, 20 times
    fault_tests.py stop WHERE --victim R [--check-level L]
                                        rank R stops itself (SIGSTOP) where the others then wait
                                        in WHERE: collective, split, groups, pipeline, dup (see
                                        fault_program.cpp); the others time out, dump, exit 124
    fault_tests.py term                 SIGTERM one rank: every rank ends, dumping, without a hang
    fault_tests.py mismatch KIND        one rank calls a different collective (count, dtype, op,
                                        order) under WEFT_CHECK_LEVEL=fingerprint
    fault_tests.py drain --victim R     a communicator destroyed with queued work that waits for
                                        rank R, which never joins: still under the deadline
    fault_tests.py slow --victim R      rank R is late by half the deadline in one collective:
                                        nothing times out, exit 0
    fault_tests.py health PHASE --victim R --preload LIB --preload-script SH
                                        the health check (--program) with rank R stopped inside
                                        PHASE (see HEALTH_PHASES): exit 124, the message, in time
    fault_tests.py slowest --victim R --preload LIB --preload-script SH
                                        the health check with rank R 30 ms late out of each
                                        all-reduce: only R is marked `<- slowest`; R = -1: no
                                        rank is slowed and none is marked
    common: --mpiexec PATH --program PATH [--trace-diff PATH] [--deadline SECONDS]

What Open MPI does, and so what is asserted: when a rank dies by a signal (SIGKILL, SIGTERM),
mpiexec itself ends the job: it says which rank died and sends SIGTERM to the others, whose
watchdogs then write their flight recorders and say which operation they were in. A stopped rank
does not die, so the others' deadlines expire: they print the timeout message, dump, and MPI_Abort
with status 124. In every case every rank must be gone within 2 x the deadline of the harm.
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


def job(args, program_args, deadline, extra_env=None, command=None):
    """mpiexec -n 4 fault_program DIR ARGS..., with the rank pids it wrote; or, given `command`,
    mpiexec -n 4 COMMAND... (the deadline is then the command's business)."""
    directory = tempfile.mkdtemp(prefix="weft-fault-")
    env = dict(os.environ)
    if command is None:
        env["WEFT_COMM_TIMEOUT"] = str(deadline)
        command = [args.program, directory] + program_args
    env["WEFT_TRACE_DIR"] = directory
    env.update(extra_env or {})
    return fault_job.job(args.mpiexec, command, env, directory)


def harm_and_time(args, sig, victim, program_args, deadline, settle):
    run = job(args, program_args, deadline)
    run.wait_for_pids()
    time.sleep(settle)  # mid-loop: the ranks are inside collectives most of the time
    harmed_at = time.monotonic()
    os.kill(run.pids[victim], sig)
    status = run.wait(2 * deadline + 10)
    elapsed = time.monotonic() - harmed_at
    if status is None:
        output = run.output()
        run.kill_all()
        fail("the job still ran %.1f s after %s of rank %d" % (elapsed, signal.Signals(sig).name, victim), output)
    return run, status, elapsed


def check_gone(run, deadline, elapsed, what):
    if elapsed > 2 * deadline:
        fail("%s: the job took %.2f s to end, more than 2 x the %g s deadline" % (what, elapsed, deadline), run.output())
    left = run.survivors()
    if left:
        output = run.output()
        run.kill_all()
        fail("%s: ranks %s outlived mpiexec" % (what, left), output)


def test_kill(args):
    deadline = args.deadline
    worst = 0.0
    weft_messages = 0
    for trial in range(args.trials):
        victim = random.randrange(RANKS)
        run, status, elapsed = harm_and_time(args, signal.SIGKILL, victim, ["loop", "60"], deadline,
                                             random.uniform(0.2, 0.8))
        what = "trial %d (SIGKILL rank %d)" % (trial + 1, victim)
        check_gone(run, deadline, elapsed, what)
        output = run.output()
        if status == 0:
            fail(what + ": mpiexec exited with status 0", output)
        if not re.search(r"rank %d .*exited on signal 9" % victim, output):
            fail(what + ": no message names the killed rank", output)
        # The survivors say what they were doing when mpiexec ended them.
        said = len(re.findall(r"weft: rank \d+ \(host [^)]*\): terminated by SIGTERM; in flight: all_reduce #\d+", output))
        if said == 0:
            fail(what + ": no surviving rank said which operation it was in", output)
        weft_messages += said
        worst = max(worst, elapsed)
        run.cleanup()
    print("kill: %d trials, every job ended within %.2f s of the kill (deadline %g s); %d survivor messages"
          % (args.trials, worst, deadline, weft_messages))


def process_state(pid):
    try:
        with open("/proc/%d/stat" % pid) as stat:
            return stat.read().split(")")[-1].split()[0]
    except OSError:
        return None


# What the others wait in while the victim is stopped (fault_program.cpp, "stop WHERE"): the
# operation as the timeout message and weft-trace-diff name it, the group, and the victim's state
# in weft-trace-diff (None: no record in that group, so it is listed as missing).
STOP_PLACES = {
    "collective": (r"all_reduce #52 \(256 x float", "world",
                   r"idle; its last operation was all_reduce #51 \(256 x float, sum\), completed"),
    "split": (r"split #2 \(0 x uint8", "world", r"idle; its last operation was barrier #1 \(0 x uint8\), completed"),
    "groups": (r"all_gather #2 \(1 x int64", "world", r"idle; its last operation was barrier #1 \(0 x uint8\), completed"),
    "pipeline": (r"all_gather #2 \(\d+ x int64", "world",
                 r"idle; its last operation was barrier #1 \(0 x uint8\), completed"),
    "dup": (r"dup #1 \(0 x uint8", "MPI_COMM_WORLD", None),
}


def test_stop(args):
    deadline = args.deadline
    victim = args.victim
    operation, group, victim_state = STOP_PLACES[args.kind]
    extra_env = {"WEFT_CHECK_LEVEL": args.check_level} if args.check_level else {}
    what = "rank %d stopped before %s (check level %s)" % (victim, args.kind, args.check_level or "default")
    run = job(args, ["stop", args.kind, str(victim)], deadline, extra_env)
    run.wait_for_pids()
    # The victim stops itself at a known place: the clock starts when the kernel shows it stopped.
    end = time.monotonic() + 60
    while process_state(run.pids[victim]) != "T":
        if time.monotonic() > end or run.process.poll() is not None:
            output = run.output()
            run.kill_all()
            fail(what + ": the rank never stopped", output)
        time.sleep(0.01)
    stopped_at = time.monotonic()
    status = run.wait(2 * deadline + 10)
    elapsed = time.monotonic() - stopped_at
    if status is None:
        output = run.output()
        run.kill_all()
        fail("%s: the job still ran %.1f s after the stop" % (what, elapsed), output)
    # A stopped rank never fails; the others notice only at their deadline, plus one poll.
    check_gone(run, deadline, elapsed, what)
    output = run.output()
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124 (the watchdog's MPI_Abort)" % (what, status), output)
    if "went on past the stopped rank" in output:
        fail(what + ": a rank went on past the stopped one", output)
    pattern = (r"weft: rank (\d+) \(host [^)]+\): %s\) on group '%s' \(rank \d+ of 4\) timed out: "
               r"waited [\d.]+ s, deadline %.2f s" % (operation, group, deadline))
    timed_out = {int(m.group(1)) for m in re.finditer(pattern, output)}
    if not timed_out or victim in timed_out:
        fail("%s: the timeout message (%s on group '%s') came from ranks %s, not from the others"
             % (what, operation, group, sorted(timed_out)), output)
    dumps = run.dumps()
    if not dumps:
        fail(what + ": no flight-recorder dump was written", output)
    if args.trace_diff:
        diff = subprocess.run([args.trace_diff, run.dir], capture_output=True, text=True)
        report = diff.stdout + diff.stderr
        # The victim lags (or has no record): a problem, status 1.
        if diff.returncode != 1:
            fail("%s: weft-trace-diff exited with status %d, not 1" % (what, diff.returncode), report)
        start = diff.stdout.find("group '%s'" % group)
        if start < 0:
            fail("%s: weft-trace-diff does not show group '%s'" % (what, group), report)
        section = diff.stdout[start:].split("\ngroup '")[0]
        if victim_state is None:
            if not re.search(r"missing ranks \([^)]*\): [\d, ]*\b%d\b" % victim, section):
                fail("%s: weft-trace-diff does not list rank %d as missing from '%s'" % (what, victim, group), report)
        else:
            if not re.search(r"rank %d \(world rank %d\): %s\n" % (victim, victim, victim_state), section):
                fail("%s: weft-trace-diff does not show rank %d as '%s'" % (what, victim, victim_state), report)
            if not re.search(r"never arrived: ranks [\d, ]*\b%d\b" % victim, section):
                fail("%s: weft-trace-diff does not say rank %d never arrived" % (what, victim), report)
        # Under a check level the others wait in the collective's check, before its data moves.
        waiting = "issued" if args.check_level and args.kind == "collective" else "started"
        others = re.findall(r"rank (\d+) \(world rank \d+\): in %s[^)]*\), %s, for" % (operation, waiting), section)
        if not set(int(r) for r in others) & timed_out:
            fail("%s: weft-trace-diff does not show the ranks that timed out in %s, %s" % (what, operation, waiting),
                 report)
        stray = re.findall(r"rank (\d+) \(world rank \d+\): (in|idle).*", section)
        for rank, _ in stray:
            if int(rank) != victim and int(rank) not in {int(r) for r in others}:
                fail("%s: weft-trace-diff shows rank %s somewhere other than %s" % (what, rank, operation), report)
    print("stop %s: the job ended %.2f s after rank %d stopped (deadline %g s, check level %s); ranks %s timed out; "
          "%d dumps" % (args.kind, elapsed, victim, deadline, args.check_level or "default", sorted(timed_out),
                        len(dumps)))
    run.cleanup()


def test_drain(args):
    deadline = args.deadline
    victim = args.victim
    what = "queued work waiting for rank %d at destruction" % victim
    run = job(args, ["drain", str(victim), str(4 * deadline)], deadline)
    run.wait_for_pids()
    started = time.monotonic()
    status = run.wait(4 * deadline + 10)
    elapsed = time.monotonic() - started
    output = run.output()
    if status is None:
        run.kill_all()
        fail("%s: the job still ran %.1f s later (the destroyed communicator's work went unwatched)" % (what, elapsed),
             output)
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124" % (what, status), output)
    if "was destroyed before its queued work finished" in output:
        fail(what + ": a destructor returned before its queued work finished", output)
    pattern = (r"weft: rank (\d+) \(host [^)]+\): all_reduce #1 \(256 x float\) on group 'second' \(rank \d+ of 4\) "
               r"timed out")
    timed_out = {int(m.group(1)) for m in re.finditer(pattern, output)}
    if not timed_out or victim in timed_out:
        fail(what + ": no other rank timed out in the destroyed communicator's all_reduce", output)
    if elapsed > 2 * deadline + 5:  # + the start-up: the clock runs from the pids, before the dup
        fail("%s: the job took %.2f s to end" % (what, elapsed), output)
    print("drain: the job ended %.2f s after start (deadline %g s); ranks %s timed out in the destroyed communicator"
          % (elapsed, deadline, sorted(timed_out)))
    run.cleanup()


def test_slow(args):
    deadline = args.deadline
    victim = args.victim
    what = "rank %d late by %.2f s in one collective" % (victim, deadline / 2)
    run = job(args, ["slow", str(deadline / 2), str(victim)], deadline)
    status = run.wait(60)
    output = run.output()
    if status is None:
        run.kill_all()
        fail(what + ": the job hung", output)
    if "timed out" in output or status != 0:
        fail("%s: mpiexec exited with status %s (want 0, no timeout)" % (what, status), output)
    done = re.findall(r"rank (\d+): 51 all_reduces done", output)
    if sorted(int(r) for r in done) != list(range(RANKS)):
        fail("%s: not every rank finished its all_reduces (%s)" % (what, done), output)
    print("slow: rank %d late by %.2f s (deadline %g s): no timeout, every rank finished" % (victim, deadline / 2, deadline))
    run.cleanup()


def test_term(args):
    deadline = args.deadline
    victim = random.randrange(RANKS)
    run, status, elapsed = harm_and_time(args, signal.SIGTERM, victim, ["loop", "60"], deadline, 0.5)
    what = "SIGTERM rank %d" % victim
    check_gone(run, deadline, elapsed, what)
    output = run.output()
    # Between two collectives it has nothing in flight, and says so.
    if not re.search(r"weft: rank %d \(host [^)]+\): terminated by SIGTERM; (in flight: all_reduce #\d+|no operation in flight)"
                     % victim, output):
        fail(what + ": the terminated rank did not say which operation it was in", output)
    if not os.path.exists(os.path.join(run.dir, "weft-flight-%d.json" % victim)):
        fail(what + ": the terminated rank wrote no dump", output)
    if status == 0:
        fail(what + ": mpiexec exited with status 0", output)
    print("term: the job ended %.2f s after SIGTERM to rank %d, which dumped and said where it was" % (elapsed, victim))
    run.cleanup()


def test_mismatch(args):
    deadline = args.deadline
    expected = {
        "count": r"all_reduce #\d+ of 63 x float",
        "dtype": r"all_reduce #\d+ of 64 x double",
        "op": r"all_reduce #\d+ of 64 x float, op max",
        "order": r"broadcast #\d+ of 64 x float",
    }[args.kind]
    for trial in range(args.trials):
        run = job(args, ["mismatch", args.kind], deadline, {"WEFT_CHECK_LEVEL": "fingerprint"})
        status = run.wait(2 * deadline + 20)
        output = run.output()
        if status is None:
            run.kill_all()
            fail("mismatch %s: the job hung" % args.kind, output)
        if "went unnoticed" in output:
            fail("mismatch %s: a rank went on after the mismatched call" % args.kind, output)
        reports = re.findall(r"fault_program: rank (\d+): .*the ranks' collectives diverged at collective (\d+)", output)
        if {int(rank) for rank, _ in reports} != set(range(RANKS)):
            fail("mismatch %s: not every rank reported the divergence (%s)" % (args.kind, reports), output)
        if len({place for _, place in reports}) != 1 or reports[0][1] != "5":
            fail("mismatch %s: the ranks do not name collective 5 as the first divergent one" % args.kind, output)
        if not re.search(r"rank %d: %s" % (RANKS - 1, expected), output):
            fail("mismatch %s: the message does not name the odd rank's call" % args.kind, output)
        if status == 0:
            fail("mismatch %s: the job exited with status 0" % args.kind, output)
        run.cleanup()
    print("mismatch %s: detected in %d of %d runs, on every rank, naming collective 5" % (args.kind, args.trials, args.trials))


# The health check's phases with the arguments below (mpi backend, 4 ranks on one host): the MPI
# call, and its count, at which the preloaded library stops the victim, and the operation and group
# the others then time out in. A phase with a later call number is the same call issued later.
HEALTH_ARGS = ["--bytes", "64K", "--warmup", "2", "--rounds", "5", "--expect-ms", "100000", "--fail-ms", "200000"]
HEALTH_PHASES = {
    "start": ("MPI_Comm_dup:1", r"dup #1 \(0 x uint8\)", "MPI_COMM_WORLD"),  # the world communicator
    "backend": ("MPI_Allreduce:1", r"all_reduce #1 \(1 x int32\)", "world"),  # --backend auto's agreement
    "hosts": ("MPI_Allgather:1", r"all_gather #2 \(256 x uint8\)", "world"),  # the host names
    "warmup": ("MPI_Allreduce:2", r"all_reduce #3 \(16384 x float\)", "world"),
    "round-barrier": ("MPI_Barrier:1", r"barrier #5 \(0 x uint8\)", "world"),  # before the first timed round
    "round": ("MPI_Allreduce:4", r"all_reduce #6 \(16384 x float\)", "world"),
    "slowest": ("MPI_Allreduce:9", r"all_reduce #15 \(5 x double\)", "world"),  # the slowest rank per round
    "report": ("MPI_Allgather:2", r"all_gather #16 \(7 x double\)", "world"),  # the per-rank reports
    "status": ("MPI_Bcast:1", r"broadcast #17 \(1 x int32, root 0\)", "world"),
    "exit": ("MPI_Barrier:6", r"barrier #18 \(0 x uint8\)", "world"),  # the last barrier before MPI_Finalize
}


def preloaded_job(args, victim, deadline, extra_env):
    """The health check under mpiexec, with the preloaded library in rank `victim` only."""
    command = ["sh", args.preload_script, str(victim), args.preload, args.program] + HEALTH_ARGS + \
        ["--comm-timeout", str(deadline)]
    return job(args, [], deadline, extra_env, command)


def test_health(args):
    deadline = args.deadline
    victim = args.victim
    stop_at, operation, group = HEALTH_PHASES[args.kind]
    what = "health check, rank %d stopped in phase %s (%s)" % (victim, args.kind, stop_at)
    run = preloaded_job(args, victim, deadline, {"WEFT_TEST_STOP_AT": stop_at})
    marker = os.path.join(run.dir, "stopped")
    end = time.monotonic() + 60
    while True:
        text = open(marker).read().strip() if os.path.exists(marker) else ""
        if text and process_state(int(text)) == "T":
            break
        if time.monotonic() > end or run.process.poll() is not None:
            output = run.output()
            if run.process.poll() is None:
                run.process.kill()
            fail(what + ": the rank never stopped", output)
        time.sleep(0.01)
    run.pids = {victim: int(text)}
    stopped_at = time.monotonic()
    status = run.wait(2 * deadline + 10)
    elapsed = time.monotonic() - stopped_at
    output = run.output()
    if status is None:
        run.kill_all()
        fail("%s: the job still ran %.1f s after the stop" % (what, elapsed), output)
    check_gone(run, deadline, elapsed, what)
    if status != 124:
        fail("%s: mpiexec exited with status %s, not 124" % (what, status), output)
    pattern = (r"weft: rank (\d+) \(host [^)]+\): %s on group '%s' \(rank \d+ of 4\) timed out: waited [\d.]+ s, "
               r"deadline %.2f s" % (operation, group, deadline))
    timed_out = {int(m.group(1)) for m in re.finditer(pattern, output)}
    # The victim was stopped inside the call, after weft recorded it: when mpiexec ends the job it
    # sends SIGCONT first, and the victim's own watchdog may then report the same timeout.
    if not timed_out - {victim}:
        fail("%s: no other rank timed out in %s on group '%s'" % (what, operation, group), output)
    print("health %s: the job ended %.2f s after rank %d stopped (deadline %g s); ranks %s timed out"
          % (args.kind, elapsed, victim, deadline, sorted(timed_out)))
    run.cleanup()


def test_slowest(args):
    victim = args.victim
    what = "health check, rank %d late out of each all-reduce" % victim if victim >= 0 else "health check, no rank slowed"
    run = preloaded_job(args, max(victim, 0), 60, {"WEFT_TEST_LATE_MS": "30" if victim >= 0 else "0"})
    status = run.wait(60)
    output = run.output()
    if status is None:
        run.process.kill()
        fail(what + ": the health check hung", output)
    if status != 0:
        fail("%s: the health check exited with status %s" % (what, status), output)
    rows = re.findall(r"^ +(\d+) +\S+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+(.*)$", output, re.M)
    if len(rows) != RANKS:
        fail("%s: the per-rank table has %d rows, not %d" % (what, len(rows), RANKS), output)
    marked = [int(rank) for rank, notes in rows if "<- slowest" in notes]
    expected = [victim] if victim >= 0 else []
    if marked != expected:
        fail("%s: ranks %s are marked '<- slowest', expected %s" % (what, marked, expected), output)
    print("slowest: marked %s as expected" % (marked or "no rank"))
    run.cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("test", choices=["kill", "stop", "term", "mismatch", "drain", "slow", "health", "slowest"])
    parser.add_argument("kind", nargs="?")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--check-level", choices=["local", "communication", "fingerprint"])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--mpiexec", required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--trace-diff")
    parser.add_argument("--preload", help="the fault library preloaded into the victim (health, slowest)")
    parser.add_argument("--preload-script", help="slow_rank.sh, which preloads it into one rank")
    args = parser.parse_args()
    # The sanitizer runs check the same paths with fewer repetitions (scripts/sanitize.sh): the
    # repetitions look for timing, which the main build's run covers, and cost about 2.8 s each there.
    if os.environ.get("WEFT_FAULT_MAX_TRIALS"):
        args.trials = min(args.trials, int(os.environ["WEFT_FAULT_MAX_TRIALS"]))
    if args.kind is None:
        args.kind = {"stop": "collective", "mismatch": "count"}.get(args.test)
    if args.test == "stop" and args.kind not in STOP_PLACES:
        parser.error("stop: WHERE is one of " + ", ".join(STOP_PLACES))
    if args.test == "health" and args.kind not in HEALTH_PHASES:
        parser.error("health: PHASE is one of " + ", ".join(HEALTH_PHASES))
    {"kill": test_kill, "stop": test_stop, "term": test_term, "mismatch": test_mismatch, "drain": test_drain,
     "slow": test_slow, "health": test_health, "slowest": test_slowest}[args.test](args)


if __name__ == "__main__":
    main()
