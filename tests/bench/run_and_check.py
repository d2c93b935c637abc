#!/usr/bin/python3
"""Runs one benchmark or the health check and checks what it printed and wrote.

    run_and_check.py KIND [--json FILE] [--expect-rc 0|nonzero|N] [--expect-text TEXT]...
                     [--expect-json KEY=VALUE]... [--expect-line REGEX]... [--reject-line REGEX]...
                     -- COMMAND...

KIND says how to read the results:
  perf      an nccl-tests-style table (allreduce_perf and siblings): every row has sizes and, per
            placement, time, algbw, busbw and #wrong; every checked #wrong must be 0; the JSON is a
            list of records that agrees with the table.
  overhead  allreduce_overhead: the JSON is a list of {"ranks", "bytes", "weft_s", "raw_s", "ratio"}.
  micro     Google Benchmark JSON (--benchmark_out) holding weft's micro-benchmarks.
  health    the health check: its JSON object, and the exit status it should give.
  grad_sync weft_bench_grad_sync: its JSON object, and DDP's status (ok, failed or not_run) in both
            the JSON and the table; a run without DDP must give the reason in both.
  train_vs_torch
            bench/train_vs_torch: a JSON list with, for every rank count, one train_gpt record and
            one PyTorch record (torch on 1 rank, torch_ddp on more), each either ok (positive
            tokens/s and step time that agree with the tokens per step, an OpenBLAS library, a
            GEMM rate) or failed with a reason that its table line gives; train_gpt's records
            carry their ratio to PyTorch's. Speed is never checked.
--expect-json KEY=VALUE: the JSON object's KEY holds VALUE (a string, or a number or null as JSON
writes it).
Standard library only.
"""
import json
import math
import re
import subprocess
import sys


def fail(message, output=""):
    if output:
        sys.stderr.write(output[-6000:] + "\n")
    sys.stderr.write("run_and_check: FAILED: " + message + "\n")
    sys.exit(1)


def finite_positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def load_json(path, output):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        fail("the JSON file %s is missing or malformed: %s" % (path, error), output)


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)\s+(.*)$")


def check_perf(output, json_path):
    rows = []
    for line in output.splitlines():
        if line.startswith("#"):
            continue
        match = ROW.match(line)
        if not match:
            continue
        fields = match.group(6).split()
        if len(fields) != 8:
            fail("row with %d result columns instead of 8: %r" % (len(fields), line), output)
        size, count = int(match.group(1)), int(match.group(2))
        for start in (0, 4):
            time, algbw, busbw, wrong = fields[start:start + 4]
            if time == "N/A":
                if start == 0:
                    fail("the out-of-place column was not measured: %r" % line, output)
                continue
            if float(time) <= 0 or float(algbw) < 0 or float(busbw) < 0:
                fail("impossible time or bandwidth: %r" % line, output)
            if wrong != "0":
                fail("#wrong is %s (must be 0, and -c 1 must check): %r" % (wrong, line), output)
        rows.append((size, count))
    if not rows:
        fail("no result rows in the output", output)
    if "wrong elements in total: 0 (OK)" not in output:
        fail("the summary does not report 0 wrong elements", output)
    records = load_json(json_path, output)
    if not isinstance(records, list) or not records:
        fail("the JSON is not a non-empty list of records", output)
    required = {"collective", "backend", "ranks", "bytes", "count", "type", "redop", "root", "in_place",
                "time_us", "algbw_gbps", "busbw_gbps", "wrong"}
    for record in records:
        if not isinstance(record, dict) or not required <= record.keys():
            fail("a JSON record lacks fields %s: %r" % (sorted(required - set(record)), record), output)
        if record["wrong"] != 0:
            fail("a JSON record has wrong = %r" % record["wrong"], output)
        if not finite_positive(record["time_us"]):
            fail("a JSON record has a bad time: %r" % record, output)
    out_of_place = [(r["bytes"], r["count"]) for r in records if not r["in_place"]]
    if out_of_place != rows:
        fail("the JSON records %s do not match the table rows %s" % (out_of_place, rows), output)


def check_overhead(output, json_path, ranks):
    records = load_json(json_path, output)
    if not isinstance(records, list) or not records:
        fail("the JSON is not a non-empty list", output)
    for record in records:
        for key in ("ranks", "bytes", "weft_s", "raw_s", "ratio"):
            if key not in record:
                fail("a record lacks %r: %r" % (key, record), output)
        if record["ranks"] != ranks:
            fail("a record says %r ranks, expected %d" % (record["ranks"], ranks), output)
        for key in ("weft_s", "raw_s", "ratio"):
            if not finite_positive(record[key]):
                fail("%s is not a positive number: %r" % (key, record), output)
        if record.get("correct") is not True:
            fail("weft or raw MPI computed a wrong sum: %r" % record, output)
    sizes = [r["bytes"] for r in records]
    if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
        fail("sizes are not increasing: %s" % sizes, output)


def check_micro(output, json_path):
    report = load_json(json_path, output)
    names = [b.get("name", "") for b in report.get("benchmarks", [])]
    for wanted in ("float_to_16bit", "raw_allreduce", "weft_allreduce/", "weft_allreduce_async_wait"):
        if not any(wanted in name for name in names):
            fail("no benchmark named like %r in %s" % (wanted, names), output)
    for bench in report["benchmarks"]:
        if not finite_positive(bench.get("real_time")):
            fail("benchmark %r has no time" % bench.get("name"), output)


def check_health(output, json_path, ranks):
    report = load_json(json_path, output)
    for key in ("avg_ms", "algbw_GBps", "busbw_GBps", "algbw_Gbps", "busbw_Gbps", "wrong", "status", "per_rank"):
        if key not in report:
            fail("the health-check JSON lacks %r" % key, output)
    if report["wrong"] != 0:
        fail("the health check saw %r wrong elements" % report["wrong"], output)
    if len(report["per_rank"]) != ranks or sum(1 for r in report["per_rank"] if r["slowest"]) != 1:
        fail("per_rank must list %d ranks with exactly one slowest" % ranks, output)
    if abs(report["algbw_Gbps"] - 8 * report["algbw_GBps"]) > 1e-6 * max(1.0, report["algbw_Gbps"]):
        fail("Gb/s is not 8 x GB/s", output)
    if "slowest" not in output:
        fail("the slowest rank is not marked in the output", output)


def check_grad_sync(output, json_path):
    report = load_json(json_path, output)
    for key in ("weft_s", "weft_mean_s", "mpi_flat_s", "mpi_per_tensor_s"):
        if not finite_positive(report.get(key)):
            fail("%s is not a positive number: %r" % (key, report.get(key)), output)
    if "# results correct" not in output:
        fail("the benchmark does not report correct results", output)
    status, reason = report.get("ddp_status"), report.get("ddp_reason")
    ddp_line = [line for line in output.splitlines() if line.startswith("torch_ddp")]
    if len(ddp_line) != 1:
        fail("the table needs exactly one torch_ddp line, found %d" % len(ddp_line), output)
    if status == "ok":
        if not finite_positive(report.get("ddp_s")) or reason is not None:
            fail("DDP ran but ddp_s is %r and ddp_reason %r" % (report.get("ddp_s"), reason), output)
    elif status in ("failed", "not_run"):
        if report.get("ddp_s") is not None:
            fail("DDP did not run but ddp_s is %r" % report.get("ddp_s"), output)
        if not isinstance(reason, str) or not reason:
            fail("DDP did not run and ddp_reason does not say why: %r" % reason, output)
        if reason not in ddp_line[0] or "not run" not in ddp_line[0]:
            fail("the table's torch_ddp line does not give the reason %r: %r" % (reason, ddp_line[0]), output)
    else:
        fail("ddp_status is %r, not ok, failed or not_run" % status, output)


def check_train_vs_torch(output, json_path):
    records = load_json(json_path, output)
    if not isinstance(records, list) or not records:
        fail("the JSON is not a non-empty list of records", output)
    required = {"impl", "ranks", "threads_per_rank", "status", "reason", "tokens_per_s", "step_time_s",
                "steps_measured", "tokens_per_step", "blas", "gemm_1024_gflops"}
    by_ranks = {}
    for record in records:
        if not isinstance(record, dict) or not required <= record.keys():
            fail("a record lacks %s: %r" % (sorted(required - set(record)), record), output)
        by_ranks.setdefault(record["ranks"], []).append(record)
    table = [line for line in output.splitlines() if re.match(r"^(train_gpt|torch|torch_ddp) +\d+ ", line)]
    if len(table) != len(records):
        fail("the table has %d rows for %d JSON records" % (len(table), len(records)), output)
    for ranks, group in by_ranks.items():
        impls = sorted(r["impl"] for r in group)
        peer = "torch" if ranks == 1 else "torch_ddp"
        if impls != sorted(["train_gpt", peer]):
            fail("%d ranks: records for %s, expected train_gpt and %s" % (ranks, impls, peer), output)
        if any(r["threads_per_rank"] != 1 for r in group) and ranks > 1:
            fail("%d ranks: more than 1 thread per rank" % ranks, output)
        if len({r["threads_per_rank"] for r in group}) != 1:
            fail("%d ranks: the implementations ran with different thread counts" % ranks, output)
    for record in records:
        row = [line for line in table if re.match(r"^%s +%d " % (record["impl"], record["ranks"]), line)]
        if len(row) != 1:
            fail("no single table row for %s on %d ranks" % (record["impl"], record["ranks"]), output)
        if record["status"] == "ok":
            for key in ("tokens_per_s", "step_time_s", "gemm_1024_gflops"):
                if not finite_positive(record[key]):
                    fail("%s is not a positive number: %r" % (key, record), output)
            if abs(record["tokens_per_s"] * record["step_time_s"] - record["tokens_per_step"]) > 1e-6 * record["tokens_per_step"]:
                fail("tokens/s x step time is not the tokens per step: %r" % record, output)
            if record["reason"] is not None or record["steps_measured"] < 1:
                fail("an ok record with a reason or no measured step: %r" % record, output)
            if not isinstance(record["blas"], str) or "openblas" not in record["blas"].lower():
                fail("%s on %d ranks did not run on OpenBLAS: %r" % (record["impl"], record["ranks"], record["blas"]),
                     output)
            if record["blas"].rsplit("/", 1)[-1] not in row[0]:
                fail("the table row does not name the BLAS library: %r" % row[0], output)
        elif record["status"] == "failed":
            if record["tokens_per_s"] is not None or record["step_time_s"] is not None:
                fail("a failed record has a speed: %r" % record, output)
            if not isinstance(record["reason"], str) or not record["reason"]:
                fail("a failed record does not say why: %r" % record, output)
            if "not run: " + record["reason"] not in row[0]:
                fail("the table row does not give the reason %r: %r" % (record["reason"], row[0]), output)
        else:
            fail("status %r is neither ok nor failed" % record["status"], output)
    for record in records:
        if record["impl"] != "train_gpt":
            continue
        peer = next(r for r in by_ranks[record["ranks"]] if r["impl"] != "train_gpt")
        if record["status"] == "ok" and peer["status"] == "ok":
            expected = record["tokens_per_s"] / peer["tokens_per_s"]
            if not finite_positive(record.get("vs_torch")) or abs(record["vs_torch"] - expected) > 1e-9 * expected:
                fail("train_gpt's vs_torch is %r, its tokens/s over PyTorch's is %r" % (record.get("vs_torch"), expected),
                     output)
        elif record.get("vs_torch") is not None:
            fail("vs_torch %r without two measured implementations" % record["vs_torch"], output)


def check_json_values(output, json_path, expected):
    report = load_json(json_path, output)
    for key, value in expected:
        if key not in report:
            fail("the JSON lacks %r" % key, output)
        actual = report[key]
        shown = actual if isinstance(actual, str) else json.dumps(actual)
        if shown != value:
            fail("the JSON's %r is %r, expected %r" % (key, actual, value), output)


def main(argv):
    if "--" not in argv:
        fail("usage: run_and_check.py KIND [options] -- COMMAND...")
    split = argv.index("--")
    options, command = argv[1:split], argv[split + 1:]
    kind = options[0]
    json_path, expect_rc, texts, ranks, json_values, lines, rejected = None, "0", [], 2, [], [], []
    i = 1
    while i < len(options):
        if options[i] == "--json":
            json_path = options[i + 1]
        elif options[i] == "--expect-rc":
            expect_rc = options[i + 1]
        elif options[i] == "--expect-text":
            texts.append(options[i + 1])
        elif options[i] == "--ranks":
            ranks = int(options[i + 1])
        elif options[i] == "--expect-line":
            lines.append(options[i + 1])
        elif options[i] == "--reject-line":
            rejected.append(options[i + 1])
        elif options[i] == "--expect-json":
            key, _, value = options[i + 1].partition("=")
            json_values.append((key, value))
        else:
            fail("unknown option %r" % options[i])
        i += 2
    completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    output = completed.stdout
    sys.stdout.write(output)
    if expect_rc == "nonzero":
        if completed.returncode == 0:
            fail("the command succeeded but should have failed", output)
    elif completed.returncode != int(expect_rc):
        fail("exit status %d, expected %s" % (completed.returncode, expect_rc), output)
    for text in texts:
        if text not in output:
            fail("the output lacks %r" % text, output)
    for pattern in lines:
        if not re.search(pattern, output, re.MULTILINE):
            fail("no line of the output matches %r" % pattern, output)
    for pattern in rejected:
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            fail("a line of the output matches %r, which it must not: %r" % (pattern, match.group(0)), output)
    if kind == "perf":
        check_perf(output, json_path)
    elif kind == "overhead":
        check_overhead(output, json_path, ranks)
    elif kind == "micro":
        check_micro(output, json_path)
    elif kind == "health":
        if json_path:
            check_health(output, json_path, ranks)
    elif kind == "grad_sync":
        check_grad_sync(output, json_path)
    elif kind == "train_vs_torch":
        check_train_vs_torch(output, json_path)
    elif kind != "plain":
        fail("unknown kind %r" % kind)
    if json_values:
        check_json_values(output, json_path, json_values)
    print("run_and_check: OK")


if __name__ == "__main__":
    main(sys.argv)
