#!/usr/bin/python3
"""Checks weft-ckpt on distributed checkpoints written here, by an independent Python writer of the
format docs/checkpoint.md describes (standard library only): inspect, verify and export of a tiny
GPT-2 saved by 4 ranks (tp slices, row shards, replicated tensors written once, optimizer moments),
the exported file against the tensors this script made, then bad input: the command line (exit 2
with the usage) and missing, corrupt and unsuitable checkpoints (exit 1, one message naming the
file and tensor).

usage: ckpt_cli_checks.py PATH/TO/weft-ckpt WORK_DIR
"""

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_safetensors import python_file, read_file  # noqa: E402

LAYERS, C, VOCAB, POSITIONS = 2, 8, 16, 8


def gpt2_tensors():
    """(name, shape) in GPT-2's order."""
    out = [("wte.weight", [VOCAB, C]), ("wpe.weight", [POSITIONS, C])]
    for layer in range(LAYERS):
        h = "h.%d." % layer
        out += [(h + "ln_1.weight", [C]), (h + "ln_1.bias", [C]), (h + "attn.c_attn.weight", [C, 3 * C]),
                (h + "attn.c_attn.bias", [3 * C]), (h + "attn.c_proj.weight", [C, C]), (h + "attn.c_proj.bias", [C]),
                (h + "ln_2.weight", [C]), (h + "ln_2.bias", [C]), (h + "mlp.c_fc.weight", [C, 4 * C]),
                (h + "mlp.c_fc.bias", [4 * C]), (h + "mlp.c_proj.weight", [4 * C, C]), (h + "mlp.c_proj.bias", [C])]
    out += [("ln_f.weight", [C]), ("ln_f.bias", [C])]
    return out


def count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def region_bytes(values, shape, offset, extent):
    """The float32 bytes of a box of a row-major tensor."""
    out = []
    strides = [count(shape[d + 1:]) for d in range(len(shape))]

    def walk(d, base):
        if d == len(shape):
            out.append(values[base])
            return
        for i in range(offset[d], offset[d] + extent[d]):
            walk(d + 1, base + i * strides[d])

    walk(0, 0)
    return struct.pack("<%df" % len(out), *out)


def write_checkpoint(root, step, tensors, ranks=4, model="gpt2-tiny"):
    """A checkpoint as docs/checkpoint.md describes it: 2-D tensors split in column halves (as tp)
    and those halves in row halves (as dp shards), 1-D tensors written whole by one rank."""
    directory = os.path.join(root, str(step))
    os.makedirs(directory, exist_ok=True)
    files = {r: [] for r in range(ranks)}
    index_tensors = {}
    turn = 0
    for name, shape, values in tensors:
        pieces = []
        if len(shape) == 2:
            boxes = [([r0, c0], [shape[0] // 2, shape[1] // 2]) for r0 in (0, shape[0] // 2) for c0 in (0, shape[1] // 2)]
        else:
            boxes = [([0] * len(shape), list(shape))]
        for offset, extent in boxes:
            rank = turn % ranks
            turn += 1
            key = name + "@" + ",".join(str(o) for o in offset)
            data = region_bytes(values, shape, offset, extent)
            files[rank].append((key, "F32", extent, data))
            pieces.append({"file": "rank-%05d.safetensors" % rank, "key": key, "offset": offset, "extent": extent,
                           "crc32": zlib.crc32(data)})
        index_tensors[name] = {"dtype": "F32", "shape": shape, "pieces": pieces}
    index_files = []
    for rank in range(ranks):
        name = "rank-%05d.safetensors" % rank
        content = python_file(files[rank], {"format": "weft.distributed_checkpoint", "step": str(step), "rank": str(rank)})
        with open(os.path.join(directory, name), "wb") as f:
            f.write(content)
        index_files.append({"rank": rank, "file": name, "bytes": len(content)})
    index = {"format": "weft.distributed_checkpoint", "version": 1, "model": model, "step": step,
             "data_position": {"sample": step * 8}, "layout": {"dp": 2, "tp": 2, "world_size": ranks},
             "files": index_files, "tensors": index_tensors}
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump(index, f)
    return directory


def run(binary, *args):
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def main():
    binary, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    failures = []

    def expect(condition, what):
        if not condition:
            failures.append(what)

    rng = random.Random(5)
    model = [(name, shape, [rng.uniform(-1, 1) for _ in range(count(shape))]) for name, shape in gpt2_tensors()]
    # Optimizer moments: saved, not exported.
    moments = [("exp_avg." + name, shape, [rng.uniform(-1, 1) for _ in range(count(shape))]) for name, shape, _ in model[:3]]
    root = os.path.join(work, "run")
    write_checkpoint(root, 5, model + moments)
    good = write_checkpoint(root, 7, model + moments)

    # inspect: the newest complete step of the root, its layout, data position and tensors.
    code, out, err = run(binary, "inspect", root)
    expect(code == 0, "inspect exit %d: %s" % (code, err))
    for text in ["step: 7", "model: gpt2-tiny", "layout: dp=2 tp=2 world_size=4", "data position: sample=56",
                 "files: 4 rank files", "rank 3  rank-00003.safetensors", "h.1.mlp.c_fc.weight", "[8, 32]", "4 pieces",
                 "exp_avg.wte.weight", "tensors: %d," % (len(model) + len(moments))]:
        expect(text in out, "inspect output lacks %r:\n%s" % (text, out))

    # verify: all well.
    code, out, err = run(binary, "verify", good)
    expect(code == 0 and out.startswith("ok: ") and "%d tensors" % (len(model) + len(moments)) in out,
           "verify of a good checkpoint: exit %d, %r %r" % (code, out, err))

    # export: GPT-2's tensors, in its names and order, the values this script made.
    exported = os.path.join(work, "model.safetensors")
    code, out, err = run(binary, "export", root, exported)
    expect(code == 0 and "wrote" in out, "export exit %d: %s" % (code, err))
    metadata, tensors, _ = read_file(exported)
    expect(list(tensors) == [name for name, _, _ in model], "exported names or order differ: %s" % list(tensors)[:5])
    for name, shape, values in model:
        dtype, got_shape, raw = tensors[name]
        expect(dtype == "F32" and got_shape == shape, "%s: %s %s" % (name, dtype, got_shape))
        expect(raw == struct.pack("<%df" % len(values), *values), "%s: exported values differ" % name)
    expect(metadata.get("n_layer") == str(LAYERS) and metadata.get("n_embd") == str(C) and
           metadata.get("vocab_size") == str(VOCAB) and metadata.get("n_positions") == str(POSITIONS),
           "export metadata: %s" % metadata)

    def one_line(err):
        return err.count("\n") == 1 and err.startswith("weft-ckpt: ")

    # A bad command line: exit 2 with the usage.
    for args, message in [
        ([], "name a subcommand"),
        (["inspcet", root], "unknown subcommand 'inspcet'; give inspect, verify or export; did you mean 'inspect'?"),
        (["inspect"], "inspect takes one directory, given 0 arguments"),
        (["verify", root, root], "verify takes one directory, given 2 arguments"),
        (["export", root], "export takes a directory and the file to write, given 1 argument"),
        (["verify", "--fast", root], "unknown option '--fast'"),
    ]:
        code, out, err = run(binary, *args)
        expect(code == 2 and message in err and "usage: weft-ckpt" in err, "%s: exit %d, %r" % (args, code, err))
    code, out, err = run(binary, "--help")
    expect(code == 0 and "usage: weft-ckpt" in out, "--help")

    # Missing, corrupt and unsuitable checkpoints: exit 1, one message.
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    for command in ["inspect", "verify"]:
        for path, message in [(os.path.join(work, "nowhere"), "does not exist"), (empty, "holds no complete checkpoint"),
                              (exported, "is not a directory")]:
            code, out, err = run(binary, command, path)
            expect(code == 1 and message in err and one_line(err), "%s %s: exit %d, %r" % (command, path, code, err))

    def fresh(name, step=3):
        return write_checkpoint(os.path.join(work, name), step, model + moments)

    # A corrupt piece: verify names the file, tensor and piece; export writes nothing.
    corrupt = fresh("corrupt")
    with open(os.path.join(corrupt, "index.json")) as f:
        piece = json.load(f)["tensors"]["h.0.attn.c_attn.weight"]["pieces"][1]
    path = os.path.join(corrupt, piece["file"])
    _, stored, length = read_file(path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    layout = json.loads(data[8:8 + length].decode())
    at = 8 + length + layout[piece["key"]]["data_offsets"][0] + 3
    data[at] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)
    code, out, err = run(binary, "verify", corrupt)
    expect(code == 1 and "failed verification: 1 problem" in err and
           "file '%s', tensor 'h.0.attn.c_attn.weight', piece '%s': checksum mismatch" % (piece["file"], piece["key"]) in err,
           "verify of a corrupt piece: exit %d, %r" % (code, err))
    target = os.path.join(work, "corrupt.safetensors")
    code, out, err = run(binary, "export", corrupt, target)
    expect(code == 1 and "nothing was exported" in err and not os.path.exists(target), "export of a corrupt checkpoint: %d %r" % (code, err))

    # A missing rank file and a truncated one: named by inspect and verify.
    missing = fresh("missing")
    os.remove(os.path.join(missing, "rank-00002.safetensors"))
    for command in ["inspect", "verify"]:
        code, out, err = run(binary, command, missing)
        expect(code == 1 and "file 'rank-00002.safetensors' of rank 2 is missing" in err, "%s, missing file: %d %r" % (command, code, err))
    truncated = fresh("truncated")
    with open(os.path.join(truncated, "rank-00001.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, "rank-00001.safetensors")) - 4)
    code, out, err = run(binary, "verify", truncated)
    expect(code == 1 and "file 'rank-00001.safetensors' of rank 1 has" in err and "truncated" in err, "verify, truncated: %d %r" % (code, err))

    # A broken index, and an index of another format.
    broken = fresh("broken")
    with open(os.path.join(broken, "index.json"), "w") as f:
        f.write('{"format": "weft.distributed_checkpoint", "version": 1, "model": ')
    for command in ["inspect", "verify"]:
        code, out, err = run(binary, command, broken)
        expect(code == 1 and "index.json" in err and "not valid JSON" in err and one_line(err), "%s, broken index: %d %r" % (command, code, err))
    other = fresh("other")
    with open(os.path.join(other, "index.json"), "w") as f:
        json.dump({"format": "something.else"}, f)
    code, out, err = run(binary, "inspect", other)
    expect(code == 1 and "its format is 'something.else'" in err and one_line(err), "inspect, other format: %d %r" % (code, err))

    # Another model: export refuses it by name; inspect and verify accept it.
    another = write_checkpoint(os.path.join(work, "another"), 1, [("encoder.weight", [4, 6], [0.5] * 24)], model="resnet")
    code, out, err = run(binary, "export", another, os.path.join(work, "another.safetensors"))
    expect(code == 1 and "(model 'resnet') is not a GPT-2 model" in err and one_line(err), "export, another model: %d %r" % (code, err))
    code, out, err = run(binary, "verify", another)
    expect(code == 0, "verify, another model: %d %r" % (code, err))
    # An export to a directory that does not exist.
    code, out, err = run(binary, "export", good, os.path.join(work, "no", "such", "dir", "m.safetensors"))
    expect(code == 1 and "cannot write checkpoint" in err and one_line(err), "export to a missing directory: %d %r" % (code, err))

    for failure in failures:
        print("FAIL:", failure)
    print("%d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
