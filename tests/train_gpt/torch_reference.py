#!/usr/bin/env python3
"""train_gpt's first step against PyTorch on the same weights and tokens.

  torch_reference.py TRAIN_GPT LAUNCH... -- [train_gpt flags]

Writes random GPT-2 weights (safetensors, written here with the standard library), runs
`LAUNCH TRAIN_GPT --init-from weights --steps 1 --dump-grads dump [flags]`, then computes the
loss and every gradient of the dumped tokens with PyTorch's own GPT-2 (written below from the
architecture's definition, in float64) and compares. Exits non-zero, naming the worst tensor, when
the loss differs by more than 1e-5 (relative) or a gradient by more than 1e-3 of its largest
element.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("torch_reference: SKIP: PyTorch is not installed for this interpreter (Debian: python3-torch)")
    sys.exit(77)

DTYPES = {"F32": (torch.float32, 4), "I64": (torch.int64, 8), "F64": (torch.float64, 8), "I32": (torch.int32, 4)}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        dtype, size = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if end > begin else torch.zeros(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return meta, out


def write_safetensors(path, tensors, meta):
    header, blobs, offset = {"__metadata__": meta}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def gpt2_weights(L, C, V, P, gen):
    w = {"wte.weight": torch.randn(V, C, generator=gen) * 0.02, "wpe.weight": torch.randn(P, C, generator=gen) * 0.01}
    for i in range(L):
        h = f"h.{i}."
        # Non-trivial norms and biases, so that their gradients are checked too.
        w[h + "ln_1.weight"] = 1 + 0.1 * torch.randn(C, generator=gen)
        w[h + "ln_1.bias"] = 0.1 * torch.randn(C, generator=gen)
        w[h + "attn.c_attn.weight"] = torch.randn(C, 3 * C, generator=gen) * 0.02
        w[h + "attn.c_attn.bias"] = torch.randn(3 * C, generator=gen) * 0.02
        w[h + "attn.c_proj.weight"] = torch.randn(C, C, generator=gen) * 0.02
        w[h + "attn.c_proj.bias"] = torch.randn(C, generator=gen) * 0.02
        w[h + "ln_2.weight"] = 1 + 0.1 * torch.randn(C, generator=gen)
        w[h + "ln_2.bias"] = 0.1 * torch.randn(C, generator=gen)
        w[h + "mlp.c_fc.weight"] = torch.randn(C, 4 * C, generator=gen) * 0.02
        w[h + "mlp.c_fc.bias"] = torch.randn(4 * C, generator=gen) * 0.02
        w[h + "mlp.c_proj.weight"] = torch.randn(4 * C, C, generator=gen) * 0.02
        w[h + "mlp.c_proj.bias"] = torch.randn(C, generator=gen) * 0.02
    w["ln_f.weight"] = 1 + 0.1 * torch.randn(C, generator=gen)
    w["ln_f.bias"] = 0.1 * torch.randn(C, generator=gen)
    return w


def gpt2_loss(w, ids, labels, L, H):
    """GPT-2 as its paper and Hugging Face's implementation define it (pre-LN, tanh GELU, tied head)."""
    B, T = ids.shape
    C = w["wte.weight"].shape[1]
    x = w["wte.weight"][ids] + w["wpe.weight"][torch.arange(T)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        h = f"h.{i}."
        a = torch.nn.functional.layer_norm(x, (C,), w[h + "ln_1.weight"], w[h + "ln_1.bias"], eps=1e-5)
        qkv = a @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(C // H)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        a = torch.nn.functional.layer_norm(x, (C,), w[h + "ln_2.weight"], w[h + "ln_2.bias"], eps=1e-5)
        f = torch.nn.functional.gelu(a @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + f @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    x = torch.nn.functional.layer_norm(x, (C,), w["ln_f.weight"], w["ln_f.bias"], eps=1e-5)
    logits = x @ w["wte.weight"].T
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    args = sys.argv[1:]
    split = args.index("--")
    launch, flags = args[:split], args[split + 1:]
    L, C, H, V, P = 2, 64, 4, 256, 64
    if "--layers" in flags:  # the weights' depth (the run takes its shape from them)
        at = flags.index("--layers")
        L = int(flags[at + 1])
        del flags[at:at + 2]
    if "--vocab" in flags:  # the weights' vocabulary (one that tp's padding must extend, such as 250)
        at = flags.index("--vocab")
        V = int(flags[at + 1])
        del flags[at:at + 2]
    with tempfile.TemporaryDirectory() as tmp:
        weights_path = os.path.join(tmp, "weights.safetensors")
        dump_path = os.path.join(tmp, "grads.safetensors")
        gen = torch.Generator().manual_seed(7)
        weights = gpt2_weights(L, C, V, P, gen)
        write_safetensors(weights_path, weights, {"format": "pt", "n_layer": str(L), "n_head": str(H),
                                                  "n_embd": str(C), "n_positions": str(P), "vocab_size": str(V)})
        shard = None
        if "--token-shard" in flags:  # the tokens from an llm.c shard of random tokens, written here
            flags.remove("--token-shard")
            shard = [int(t) for t in torch.randint(0, V, (1000,), generator=gen)]
            shard_path = os.path.join(tmp, "tokens_000000.bin")
            with open(shard_path, "wb") as f:
                f.write(struct.pack("<256i", 20240520, 1, len(shard), *([0] * 253)))
                f.write(struct.pack(f"<{len(shard)}H", *shard))
            flags += ["--data", shard_path]
        cmd = launch + ["--init-from", weights_path, "--steps", "1", "--dump-grads", dump_path, "--quiet"] + flags
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=240)
        meta, dump = read_safetensors(dump_path)

    ids, labels = dump["input_ids"], dump["labels"]
    if shard is not None:  # sequence k of the first step: the shard's tokens [k T, k T + T], in order
        B, T = ids.shape
        want = torch.tensor([shard[k * T:k * T + T + 1] for k in range(B)])
        if not torch.equal(ids, want[:, :T]) or not torch.equal(labels, want[:, 1:]):
            print("MISMATCH: the dumped input_ids and labels are not the shard's first windows in order")
            return 1
        print(f"input_ids and labels: the shard's first {B} windows of {T} tokens and their next tokens")
    w = {k: v.to(torch.float64).requires_grad_(True) for k, v in weights.items()}
    loss = gpt2_loss(w, ids, labels, L, H)
    loss.backward()
    failures = []
    ours = float(dump["loss"])
    rel = abs(ours - loss.item()) / abs(loss.item())
    print(f"loss: train_gpt {ours:.8f}  torch {loss.item():.8f}  relative difference {rel:.2e}")
    if rel > 1e-5:
        failures.append(f"loss differs by {rel:.2e} (relative)")
    worst = (0.0, "")
    for name, ref in w.items():
        if name not in dump:
            failures.append(f"the dump has no gradient '{name}'")
            continue
        got = dump[name].to(torch.float64)
        if list(got.shape) != list(ref.grad.shape):
            failures.append(f"'{name}': shape {list(got.shape)}, torch {list(ref.grad.shape)}")
            continue
        scale = ref.grad.abs().max().item()
        err = (got - ref.grad).abs().max().item() / (scale if scale > 0 else 1.0)
        worst = max(worst, (err, name))
        if err > 1e-3:
            failures.append(f"'{name}': largest difference {err:.2e} of its largest element ({scale:.3e})")
    print(f"gradients: {len(w)} tensors, worst relative difference {worst[0]:.2e} ('{worst[1]}')")
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print("train_gpt equals PyTorch on the first step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
