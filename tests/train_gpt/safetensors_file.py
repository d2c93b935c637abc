"""safetensors files read with the standard library alone, for train_gpt's Python checks.

read(path) -> (metadata, {name: (dtype, shape, bytes)}): the header's "__metadata__" (empty when
absent) and each tensor's dtype string ("F32", "I64", ...), shape and raw little-endian bytes.
"""
import json
import struct


def header(path):
    """The JSON header, "__metadata__" included, without reading the tensors' bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
        body = f.read()
    meta = head.pop("__metadata__", {})
    return meta, {name: (info["dtype"], info["shape"], body[info["data_offsets"][0]:info["data_offsets"][1]])
                  for name, info in head.items()}
