#!/usr/bin/env python3
"""train_gpt --trace: a Chrome-trace timeline per rank that Perfetto can open.

  trace_check.py TRAIN_GPT LAUNCH...

Runs 2 steps on 2 pipeline stages with 4 micro-batches and checks each rank's file: valid JSON in
the trace-event format, complete events with non-negative times on named tracks, a forward and a
backward for every micro-batch of every step, forwards before their backwards, and the pipeline
(waits) and dp-reduction tracks present.
"""
import json
import os
import subprocess
import sys
import tempfile


def main():
    train_gpt, launch = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        command = launch + ["-n", "2", train_gpt, "--pp", "2", "--layers", "2", "--hidden", "64", "--heads", "4",
                            "--seq", "32", "--positions", "64", "--steps", "2", "--global-batch", "4", "--quiet",
                            "--trace", path]
        r = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            sys.exit(f"trace_check: '{' '.join(command)}' exited with {r.returncode}\n{r.stderr[-3000:]}")
        for rank in (0, 1):
            file = os.path.join(tmp, f"trace.rank{rank}.json")
            if not os.path.exists(file):
                sys.exit(f"trace_check: no timeline for rank {rank} ({file})")
            with open(file) as f:
                doc = json.load(f)
            events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
            tracks = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
            for e in events:
                if e["pid"] != rank or e["ts"] < 0 or e["dur"] < 0:
                    sys.exit(f"trace_check: rank {rank}: malformed event {e}")
            forwards = [e for e in events if e["name"].startswith("forward mb ")]
            backwards = [e for e in events if e["name"].startswith("backward mb ")]
            if len(forwards) != 8 or len(backwards) != 8:
                sys.exit(f"trace_check: rank {rank}: {len(forwards)} forwards and {len(backwards)} backwards, "
                         "expected 8 each (4 micro-batches x 2 steps)")
            for mb in range(4):
                f0 = min(e["ts"] for e in forwards if e["name"].startswith(f"forward mb {mb} "))
                b0 = min(e["ts"] for e in backwards if e["name"].startswith(f"backward mb {mb} "))
                if not f0 < b0:
                    sys.exit(f"trace_check: rank {rank}: micro-batch {mb}'s backward starts before its forward")
            for track in ("compute", "dp reduction", "pipeline"):
                if track not in tracks:
                    sys.exit(f"trace_check: rank {rank}: no '{track}' track (tracks: {sorted(tracks)})")
            print(f"trace_check: rank {rank}: {len(events)} events on tracks {sorted(tracks)}")
    print("trace_check: every rank's timeline is a well-formed Chrome trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())
