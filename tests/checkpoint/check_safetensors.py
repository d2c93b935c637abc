#!/usr/bin/env python3
"""Checks weft's safetensors files against a second, independent implementation.

  check_safetensors.py stdlib  --tool checkpoint_sample --dir DIR
      standard library only (struct + json): the file weft writes must equal, byte for byte, the
      one this script writes from the same sample set; this script's own reader must find every
      value in weft's file; and weft must read a file laid out as published GPT-2 checkpoints are
      (header keys sorted by name, data sorted by element size, escaped non-ASCII, no padding).
  check_safetensors.py library --tool checkpoint_sample --dir DIR
      the Hugging Face `safetensors` package (with torch, or numpy without BF16): it must open
      weft's file and see every value, and weft must read the file it writes. Exits 77 (skipped)
      when the package is not installed.

The sample set is written out here again from tests/checkpoint/sample_set.hpp's formulas.
"""
import argparse
import json
import os
import struct
import subprocess
import sys

SAMPLE = [
    ("wte.weight", "F32", [8, 6]),
    ("h.0.ln_1.bias", "F16", [6]),
    ("h.0.attn.c_attn.weight", "BF16", [6, 18]),
    ("scalar/loss_scale", "F64", []),
    ("empty.f32", "F32", [0]),
    ("empty.i64", "I64", [3, 0, 2]),
    ("step", "I64", []),
    ("positions", "I32", [4, 5]),
    ("mask", "U8", [13]),
    ("na\u00efve.\u540d\u524d.\"q\"\\t\n\x01", "F32", [2]),
    ("h.0.mlp.c_fc.weight", "F64", [3, 4]),
]
METADATA = {"format": "pt", "step": "1200", "note": "\u00e9 \"quoted\"\ttab\x01 back\\slash /"}
ITEM_SIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}
STRUCT_CODE = {"F32": "f", "F64": "d", "F16": "e", "I32": "i", "I64": "q", "U8": "B"}


def element_count(shape):
    count = 1
    for dimension in shape:
        count *= dimension
    return count


def sample_values(k, dtype, count):
    if dtype in ("F32", "F64", "F16", "BF16"):
        return [((i * 37 + k * 11) % 101 - 50) / 8.0 for i in range(count)]
    if dtype == "I32":
        return [(i * 2654435761 + k * 97) % 2**31 - 2**30 for i in range(count)]
    if dtype == "I64":
        values = [(i * 0x9E3779B97F4A7C15 + k) % 2**64 for i in range(count)]
        return [v - 2**64 if v >= 2**63 else v for v in values]
    if dtype == "U8":
        return [(i * 7 + k * 3) % 256 for i in range(count)]
    raise ValueError(dtype)


def encode(dtype, values):
    if dtype == "BF16":  # the top half of a float32 (every sample value is exact in bfloat16)
        return b"".join(struct.pack("<H", struct.unpack("<I", struct.pack("<f", v))[0] >> 16) for v in values)
    return struct.pack("<%d%s" % (len(values), STRUCT_CODE[dtype]), *values)


def decode(dtype, raw):
    count = len(raw) // ITEM_SIZE[dtype]
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % count, raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    return list(struct.unpack("<%d%s" % (count, STRUCT_CODE[dtype]), raw))


def sample_data():
    return [(name, dtype, shape, encode(dtype, sample_values(k, dtype, element_count(shape))))
            for k, (name, dtype, shape) in enumerate(SAMPLE)]


def no_duplicates(pairs):
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate keys in %r" % keys)
    return dict(pairs)


def python_file(entries, metadata, sort_keys=False, ensure_ascii=False, compact=True, pad=True):
    """The bytes of a safetensors file holding `entries` (name, dtype, shape, data) in this order."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(header, separators=separators, ensure_ascii=ensure_ascii, sort_keys=sort_keys).encode("utf-8")
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data for _, _, _, data in entries)


def read_file(path):
    """An independent reader: (metadata, {name: (dtype, shape, raw bytes)}, header length)."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + length].decode("utf-8"), object_pairs_hook=no_duplicates)
    buffer = data[8 + length:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    end = 0
    for name, info in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, stop = info["data_offsets"]
        if begin != end:
            raise ValueError("tensor %r starts at %d, the previous one ends at %d" % (name, begin, end))
        if stop - begin != element_count(info["shape"]) * ITEM_SIZE[info["dtype"]]:
            raise ValueError("tensor %r: shape %r and offsets [%d, %d] disagree" % (name, info["shape"], begin, stop))
        tensors[name] = (info["dtype"], info["shape"], buffer[begin:stop])
        end = stop
    if end != len(buffer):
        raise ValueError("tensors end at %d, the buffer has %d bytes" % (end, len(buffer)))
    return metadata, tensors, length


def run_tool(tool, *arguments):
    result = subprocess.run([tool, *arguments], capture_output=True, text=True, errors="replace")
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_values(label, metadata, found, skip_dtypes=()):
    """found: {name: (dtype, shape, values)}; returns the number of problems."""
    wrong = 0
    if metadata != METADATA:
        print("%s: metadata %r, expected %r" % (label, metadata, METADATA))
        wrong += 1
    expected_names = set()
    for k, (name, dtype, shape) in enumerate(SAMPLE):
        if dtype in skip_dtypes:
            continue
        expected_names.add(name)
        if name not in found:
            print("%s: tensor %r missing" % (label, name))
            wrong += 1
            continue
        got_dtype, got_shape, got_values = found[name]
        expected = sample_values(k, dtype, element_count(shape))
        if got_dtype != dtype or list(got_shape) != shape:
            print("%s: tensor %r is %s %r, expected %s %r" % (label, name, got_dtype, got_shape, dtype, shape))
            wrong += 1
        elif list(got_values) != expected:
            bad = [i for i, (g, e) in enumerate(zip(got_values, expected)) if g != e]
            print("%s: tensor %r: %d wrong values (first at %s), %d values" % (label, name, len(bad), bad[:1], len(got_values)))
            wrong += 1
    extra = set(found) - expected_names
    if extra:
        print("%s: unexpected tensors %r" % (label, sorted(extra)))
        wrong += 1
    print("%s: %d tensors checked, %d wrong" % (label, len(expected_names), wrong))
    return wrong


def stdlib_checks(tool, directory):
    wrong = 0
    weft_path = os.path.join(directory, "weft.safetensors")
    if run_tool(tool, "write", weft_path) != 0:
        print("FAILED: checkpoint_sample write failed")
        return 1
    with open(weft_path, "rb") as f:
        weft_bytes = f.read()
    expected = python_file(sample_data(), METADATA)
    with open(os.path.join(directory, "python.safetensors"), "wb") as f:
        f.write(expected)
    if weft_bytes != expected:
        at = first_difference(weft_bytes, expected)
        print("weft's file differs from the Python writer's at byte %d (sizes %d and %d)" % (at, len(weft_bytes), len(expected)))
        print("  weft:   %r" % weft_bytes[max(0, at - 40):at + 40])
        print("  python: %r" % expected[max(0, at - 40):at + 40])
        wrong += 1
    else:
        print("weft's file equals the Python writer's byte for byte (%d bytes)" % len(weft_bytes))

    metadata, tensors, length = read_file(weft_path)
    if length % 8 != 0:
        print("weft's header is %d bytes, not a multiple of 8" % length)
        wrong += 1
    found = {name: (dtype, shape, decode(dtype, raw)) for name, (dtype, shape, raw) in tensors.items()}
    wrong += check_values("Python reader on weft's file", metadata, found)

    # As published GPT-2 checkpoints are laid out: header keys sorted by name, data by element size
    # then name, non-ASCII escaped as \uXXXX, spaces after separators, header not padded.
    entries = sorted(sample_data(), key=lambda e: (-ITEM_SIZE[e[1]], e[0]))
    gpt2_style = os.path.join(directory, "gpt2_style.safetensors")
    with open(gpt2_style, "wb") as f:
        f.write(python_file(entries, METADATA, sort_keys=True, ensure_ascii=True, compact=False, pad=False))
    if run_tool(tool, "check", gpt2_style) != 0:
        print("FAILED: weft did not read the GPT-2-style file correctly")
        wrong += 1
    return wrong


def library_checks(tool, directory):
    try:
        import safetensors
    except ImportError:
        print("SKIPPED: the safetensors package is not installed for %s (pip install safetensors)" % sys.executable)
        return 77
    try:
        import torch
        from safetensors.torch import save_file
        framework = "pt"
        torch_dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
                        "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}
        names_of = {value: key for key, value in torch_dtypes.items()}
        skip = ()
    except ImportError:
        import numpy as np
        from safetensors.numpy import save_file
        framework = "numpy"
        numpy_dtypes = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I64": np.int64, "U8": np.uint8}
        names_of = {np.dtype(value): key for key, value in numpy_dtypes.items()}
        skip = ("BF16",)
        print("torch is not installed: BF16 is left out of the library checks")
    print("safetensors %s, framework %s" % (safetensors.__version__, framework))

    wrong = 0
    weft_path = os.path.join(directory, "weft_for_library.safetensors")
    if run_tool(tool, "write", weft_path) != 0:
        print("FAILED: checkpoint_sample write failed")
        return 1
    found = {}
    with safetensors.safe_open(weft_path, framework=framework) as f:
        metadata = f.metadata() or {}
        for name in f.keys():
            if f.get_slice(name).get_dtype() in skip:
                continue
            tensor = f.get_tensor(name)
            if framework == "pt":
                values = (tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor).flatten().tolist()
                found[name] = (names_of[tensor.dtype], list(tensor.shape), values)
            else:
                found[name] = (names_of[tensor.dtype], list(tensor.shape), [v.item() for v in tensor.flatten()])
    wrong += check_values("safetensors library on weft's file", metadata, found, skip)

    tensors = {}
    for k, (name, dtype, shape) in enumerate(SAMPLE):
        if dtype in skip:
            continue
        values = sample_values(k, dtype, element_count(shape))
        if framework == "pt":
            tensors[name] = torch.tensor(values, dtype=torch_dtypes[dtype]).reshape(shape)
        else:
            tensors[name] = np.array(values, dtype=numpy_dtypes[dtype]).reshape(shape)
    library_path = os.path.join(directory, "library.safetensors")
    save_file(tensors, library_path, metadata=METADATA)
    arguments = ["check", library_path] + (["--skip-dtype", "BF16"] if skip else [])
    if run_tool(tool, *arguments) != 0:
        print("FAILED: weft did not read the file the safetensors library wrote")
        wrong += 1
    return wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["stdlib", "library"])
    parser.add_argument("--tool", required=True, help="the checkpoint_sample program")
    parser.add_argument("--dir", required=True, help="where to write the files")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    result = stdlib_checks(args.tool, args.dir) if args.mode == "stdlib" else library_checks(args.tool, args.dir)
    if result == 77:
        return 77
    print("OK" if result == 0 else "FAILED: %d problems" % result)
    return 0 if result == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
