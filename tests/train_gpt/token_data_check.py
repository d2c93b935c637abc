#!/usr/bin/env python3
"""train_gpt on token shards written by scripts/prepare_tokens.py: layouts agree, validation and resume.

  token_data_check.py PREPARE_TOKENS TRAIN_GPT LAUNCH...

1. generates a text (deterministic, here) and writes it with prepare_tokens.py (byte-level) as a
   validation shard and several training shards, and once more as nanoGPT's headerless uint16;
   the shards' headers and tokens are checked against the text;
2. trains 4 steps on one rank, on pp 2 and on tp 2 with sequence parallelism, with --data GLOB,
   --val-data and --val-every 2: the training and validation losses of the layouts must agree
   within 1e-6 (relative), and the headerless files must give the single rank's losses exactly;
3. on pp 2, a run saved at step 2 and resumed to step 4 must print the uninterrupted run's losses
   and validation losses to the last digit (the data position survives the checkpoint).
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--positions", "64", "--lr", "3e-3",
         "--seed", "5", "--global-batch", "4", "--quiet"]


def run(command):
    r = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        sys.exit(f"token_data_check: '{' '.join(command)}' exited with {r.returncode}")
    return r.stdout


def log(path):
    """step -> (loss text, val_loss text or None): every digit the JSON holds."""
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                j = json.loads(line)
                val = line.split('"val_loss": ')[1].split(",")[0].rstrip("}\n ") if "val_loss" in j else None
                out[j["step"]] = (line.split('"loss": ')[1].split(",")[0], val)
    return out


def close(a, b):
    return abs(float(a) - float(b)) <= 1e-6 * abs(float(b))


def main():
    prepare, train_gpt, launch = sys.argv[1], sys.argv[2], sys.argv[3:]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(11)
        words = ["tensor", "pipeline", "stage", "rank", "gradient", "shard", "loss", "token", "layer", "weft"]
        text = " ".join(rng.choice(words) for _ in range(1500)).encode()
        source = os.path.join(tmp, "text.txt")
        with open(source, "wb") as f:
            f.write(text)
        subprocess.run([sys.executable, prepare, "--out", os.path.join(tmp, "tok"), "--val-tokens", "2000",
                        "--shard-tokens", "3000", source], check=True, capture_output=True, timeout=60)
        subprocess.run([sys.executable, prepare, "--format", "u16", "--out", os.path.join(tmp, "u16"), "--val-tokens",
                        "2000", "--shard-tokens", "100000", source], check=True, capture_output=True, timeout=60)
        shards = sorted(n for n in os.listdir(tmp) if n.startswith("tok_train_"))
        if len(shards) < 3:
            failures.append(f"prepare_tokens wrote {shards}, expected several training shards")
        stream = b""
        for name in ["tok_val_000000.bin"] + shards:
            with open(os.path.join(tmp, name), "rb") as f:
                data = f.read()
            magic, version, count = struct.unpack("<3i", data[:12])
            if (magic, version, len(data)) != (20240520, 1, 1024 + 2 * count) or any(data[12:1024]):
                failures.append(f"{name}: header {magic, version, count} for {len(data)} bytes")
            stream += bytes(struct.unpack(f"<{count}H", data[1024:]))
        if stream != text:
            failures.append("the shards' tokens are not the text's bytes")

        def train(name, ranks, layout, data_prefix="tok", extra=()):
            path = os.path.join(tmp, name + ".json")
            fmt = ["--data-format", "u16"] if data_prefix == "u16" else []
            run(launch + ["-n", str(ranks), train_gpt] + MODEL + layout + fmt +
                ["--data", os.path.join(tmp, data_prefix + "_train_*.bin"),
                 "--val-data", os.path.join(tmp, data_prefix + "_val_000000.bin"), "--val-every", "2",
                 "--val-steps", "2", "--log-json", path] + list(extra))
            return log(path)

        single = train("single", 1, [], extra=["--steps", "4"])
        if [s for s, (_, v) in single.items() if v is not None] != [2, 4]:
            failures.append(f"validation losses at steps {[s for s, (_, v) in single.items() if v]}, expected 2 and 4")
        print("single rank:", single)
        if train("u16", 1, [], "u16", ["--steps", "4"]) != single:
            failures.append("nanoGPT's headerless files did not give the shards' losses")
        runs = {}
        for name, layout in (("pp2", ["--pp", "2"]), ("tp2_sp", ["--tp", "2", "--sequence-parallel"])):
            got = runs[name] = train(name, 2, layout, extra=["--steps", "4"])
            for step, (loss, val) in single.items():
                g = got.get(step, ("nan", None))
                if not close(g[0], loss) or (val is None) != (g[1] is None) or (val is not None and not close(g[1], val)):
                    failures.append(f"{name} step {step}: loss {g[0]} val {g[1]}, single rank {loss} val {val}")
        whole = runs["pp2"]
        ckpt = os.path.join(tmp, "model.safetensors")
        train("first", 2, ["--pp", "2"], extra=["--steps", "2", "--save", ckpt])
        resumed = train("resumed", 2, ["--pp", "2"], extra=["--steps", "4", "--resume", ckpt])
        for step in (3, 4):
            if resumed.get(step) != whole[step]:
                failures.append(f"resumed step {step}: {resumed.get(step)}, uninterrupted {whole[step]}")
    if failures:
        print("token_data_check: FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("token_data_check: shards, layouts, validation and resume agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
