#!/usr/bin/env python3
"""train_gpt's first step against PyTorch on the same weights and tokens.

  torch_reference.py [--layout "RANKS FLAGS"]... LAUNCH... -- [train_gpt flags]

Writes random GPT-2 weights (safetensors, written here with the standard library), runs
`LAUNCH TRAIN_GPT --init-from weights --steps 1 --dump-grads dump [flags]`, then computes the
loss and every gradient of the dumped tokens with PyTorch's own GPT-2 (written below from the
architecture's definition, in float64) and compares. Exits non-zero, naming the worst tensor, when
the loss differs by more than 1e-5 (relative) or a gradient by more than 1e-3 of its largest
element.

A mixture of experts (--moe-experts E --moe-top-k K --moe-every N: the weights' shape, written in
their metadata) is checked against the MoE GPT-2 written below from issue 23's definition: the loss,
its parts (ce_loss, aux_loss, z_loss) and every gradient, the router's included. With --starve, the
router of block 0 never picks experts 0 .. E/2 - 1 (with K = 1), so that the first ep rank of two
receives no token there. --moe-capacity-factor is checked on one rank, whose micro-batches each drop
the same assignments as the reference.

Each --layout runs LAUNCH with `-n RANKS` before its last word (the program) and FLAGS added, all
against the same weights and tokens; without --layout, LAUNCH runs once as given. A layout with
--plan must also run the layout its printed plan puts first (tp, cp, ep, pp, dp).
"""
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile

import safetensors_file

try:
    import torch
except ImportError:
    print("torch_reference: SKIP: PyTorch is not installed for this interpreter (Debian: python3-torch)")
    sys.exit(77)

DTYPES = {"F32": (torch.float32, 4), "I64": (torch.int64, 8), "F64": (torch.float64, 8), "I32": (torch.int32, 4)}


def read_safetensors(path):
    meta, tensors = safetensors_file.read(path)
    out = {}
    for name, (dtype_name, shape, data) in tensors.items():
        dtype, _ = DTYPES[dtype_name]
        t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.zeros(0, dtype=dtype)
        out[name] = t.reshape(shape)
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


def moe_weights(w, L, C, moe, gen, starve):
    """Replaces the MLP of every moe["every"]-th block by a router and E experts (GPT-2 MLPs)."""
    E = moe["experts"]
    for i in range(0, L, moe["every"]):
        h = f"h.{i}.mlp."
        for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
            del w[h + name]
        # Logits of a few units, so that the routing is far from uniform and far from ties.
        w[h + "router.weight"] = torch.randn(E, C, generator=gen) * 0.15
        if starve and i == 0:  # experts 0 .. E/2-1 get logit 0, the others +-v (one of which is > 0)
            v = torch.randn(C, generator=gen) * 0.5
            w[h + "router.weight"] = torch.stack([torch.zeros(C)] * (E // 2) + [v if e % 2 == 0 else -v for e in range(E - E // 2)])
        for e in range(E):
            x = f"{h}experts.{e}."
            w[x + "c_fc.weight"] = torch.randn(C, 4 * C, generator=gen) * 0.02
            w[x + "c_fc.bias"] = torch.randn(4 * C, generator=gen) * 0.02
            w[x + "c_proj.weight"] = torch.randn(4 * C, C, generator=gen) * 0.02
            w[x + "c_proj.bias"] = torch.randn(C, generator=gen) * 0.02


def moe_mlp(w, h, a, moe):
    """One MoE MLP on a [B, T, C] (ln_2's output): y, and each sequence's aux and z ([B] each).

    logits = a W_r^T; p = softmax; the top-k of p (ties to the lower index), w = p_topk / sum;
    y = sum_j w_j expert_j(a). aux = E sum_e f_e P_e, f_e the share of the sequence's T K
    assignments to e (no gradient), P_e the mean of p_e; z = mean_t logsumexp(logits_t)^2. With a
    capacity, each group of `group` sequences (a rank's micro-batch) keeps per expert the first
    ceil(f T K / E) assignments in token order, then slot order; the others add nothing to y.
    """
    B, T, C = a.shape
    E, K = moe["experts"], moe["top_k"]
    logits = a @ w[h + "router.weight"].T
    p = logits.softmax(-1)
    top_p, top_e = p.topk(K, dim=-1)  # slot 0 the largest
    if moe["starve"] and h == "h.0.mlp.":
        assert int((top_e < E // 2).sum()) == 0, "--starve: block 0 routed tokens to the first half of the experts"
    weight = top_p / top_p.sum(-1, keepdim=True)
    kept = torch.ones(B, T, K, dtype=torch.float64)
    if moe["capacity"] > 0:
        group = moe["group"]
        cap = math.ceil(moe["capacity"] * group * T * K / E)
        for g in range(0, B, group):
            count = [0] * E
            for b in range(g, g + group):
                for t in range(T):
                    for j in range(K):
                        e = int(top_e[b, t, j])
                        if count[e] < cap:
                            count[e] += 1
                        else:
                            kept[b, t, j] = 0
    y = torch.zeros_like(a)
    for e in range(E):
        x = f"{h}experts.{e}."
        out = torch.nn.functional.gelu(a @ w[x + "c_fc.weight"] + w[x + "c_fc.bias"], approximate="tanh")
        out = out @ w[x + "c_proj.weight"] + w[x + "c_proj.bias"]
        share = (weight * kept * (top_e == e)).sum(-1)  # [B, T]: token t's weight on expert e, 0 if not routed
        y = y + share.unsqueeze(-1) * out
    f = torch.stack([(top_e == e).sum((1, 2)).to(torch.float64) for e in range(E)], -1) / (T * K)  # [B, E]
    aux = E * (f * p.mean(1)).sum(-1)
    z = (torch.logsumexp(logits, -1) ** 2).mean(1)
    return y, aux, z


def gpt2_loss(w, ids, labels, L, H, moe=None):
    """GPT-2 as its paper and Hugging Face's implementation define it (pre-LN, tanh GELU, tied head).

    With `moe`: (total, ce, aux, z), the loss being ce + α mean_s Σ_layers aux + β mean_s Σ_layers z."""
    B, T = ids.shape
    C = w["wte.weight"].shape[1]
    x = w["wte.weight"][ids] + w["wpe.weight"][torch.arange(T)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    aux_sum = torch.zeros(B, dtype=torch.float64)
    z_sum = torch.zeros(B, dtype=torch.float64)
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
        if moe is not None and i % moe["every"] == 0:
            y, aux, z = moe_mlp(w, h + "mlp.", a, moe)
            x = x + y
            aux_sum, z_sum = aux_sum + aux, z_sum + z
            continue
        f = torch.nn.functional.gelu(a @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + f @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    x = torch.nn.functional.layer_norm(x, (C,), w["ln_f.weight"], w["ln_f.bias"], eps=1e-5)
    logits = x @ w["wte.weight"].T
    ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
    if moe is None:
        return ce
    aux, z = aux_sum.mean(), z_sum.mean()
    return ce + moe["aux_coef"] * aux + moe["z_coef"] * z, ce, aux, z


def take(flags, flag, default=None, cast=int, keep=False):
    """The value of `flag` in `flags` (removed unless `keep`), else `default`."""
    if flag not in flags:
        return default
    at = flags.index(flag)
    value = cast(flags[at + 1])
    if not keep:
        del flags[at:at + 2]
    return value


def main():
    args = sys.argv[1:]
    layouts = []
    while args and args[0] == "--layout":
        ranks, _, extra = args[1].partition(" ")
        layouts.append((ranks, extra.split()))
        args = args[2:]
    split = args.index("--")
    launch, flags = args[:split], args[split + 1:]
    L, C, H, V, P = 2, 64, 4, 256, 64
    L = take(flags, "--layers", L)  # the weights' depth (the run takes its shape from them)
    V = take(flags, "--vocab", V)  # the weights' vocabulary (one that tp's padding must extend, such as 250)
    moe = None
    if "--moe-experts" in flags:  # the weights' experts, top-k and MoE block frequency (their metadata)
        moe = {"experts": take(flags, "--moe-experts"), "top_k": take(flags, "--moe-top-k", 2),
               "every": take(flags, "--moe-every", 1),
               "aux_coef": take(flags, "--moe-aux-loss-coef", 0.01, float, keep=True),
               "z_coef": take(flags, "--moe-z-loss-coef", 0.001, float, keep=True), "starve": "--starve" in flags}
    starve = "--starve" in flags
    if starve:
        flags.remove("--starve")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        weights_path = os.path.join(tmp, "weights.safetensors")
        gen = torch.Generator().manual_seed(7)
        weights = gpt2_weights(L, C, V, P, gen)
        meta = {"format": "pt", "n_layer": str(L), "n_head": str(H), "n_embd": str(C), "n_positions": str(P),
                "vocab_size": str(V)}
        if moe is not None:
            moe_weights(weights, L, C, moe, gen, starve)
            meta.update({"num_local_experts": str(moe["experts"]), "num_experts_per_tok": str(moe["top_k"]),
                         "moe_every": str(moe["every"])})
        write_safetensors(weights_path, weights, meta)
        for ranks, extra in layouts or [(None, [])]:
            command = launch if ranks is None else launch[:-1] + ["-n", ranks, launch[-1]]
            failures += check_run(command, flags + extra, weights, weights_path, tmp, gen, L, H, V, moe)
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print("train_gpt equals PyTorch on the first step")
    return 0


def check_run(launch, flags, weights, weights_path, tmp, gen, L, H, V, moe):
    """Runs one layout and compares its dump with PyTorch's; returns the failures."""
    flags = list(flags)
    dump_path = os.path.join(tmp, "grads.safetensors")
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
    run = subprocess.run(cmd, check=True, timeout=240, stdout=subprocess.PIPE, text=True)
    print(run.stdout, end="", flush=True)
    if "--plan" in flags:
        planned = re.search(r"Best: tp=(\d+) cp=(\d+) ep=(\d+) pp=(\d+) dp=(\d+)", run.stdout)
        ran = re.search(r"ranks: tp (\d+) pp (\d+) dp (\d+) cp (\d+)", run.stdout)
        experts = re.search(r"mixture of experts: .* ep (\d+)", run.stdout)
        if not planned or not ran or (moe is not None and not experts):
            return ["--plan: the output lacks the plan's 'Best:' line or the layout it ran"]
        tp, cp, ep, pp, dp = planned.groups()
        used = {"tp": ran[1], "pp": ran[2], "dp": ran[3], "cp": ran[4], "ep": experts[1] if experts else "1"}
        if used != {"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": dp}:
            return [f"--plan ran {used}, not the plan it printed first (tp {tp} cp {cp} ep {ep} pp {pp} dp {dp})"]
        print(f"--plan ran the tuner's first layout: tp {tp} cp {cp} ep {ep} pp {pp} dp {dp}")
    meta, dump = read_safetensors(dump_path)
    os.remove(dump_path)

    ids, labels = dump["input_ids"], dump["labels"]
    if shard is not None:  # sequence k of the first step: the shard's tokens [k T, k T + T], in order
        B, T = ids.shape
        want = torch.tensor([shard[k * T:k * T + T + 1] for k in range(B)])
        if not torch.equal(ids, want[:, :T]) or not torch.equal(labels, want[:, 1:]):
            return ["the dumped input_ids and labels are not the shard's first windows in order"]
        print(f"input_ids and labels: the shard's first {B} windows of {T} tokens and their next tokens")
    w = {k: v.to(torch.float64).requires_grad_(True) for k, v in weights.items()}
    failures = []
    if moe is None:
        loss = gpt2_loss(w, ids, labels, L, H)
        parts = {}
    else:
        # Capacity drops happen per micro-batch of a rank: the reference's groups are one rank's micro-batches.
        capacity = take(flags, "--moe-capacity-factor", 0.0, float)
        moe = dict(moe, capacity=capacity, group=take(flags, "--micro-batch", 1))
        loss, ce, aux, z = gpt2_loss(w, ids, labels, L, H, moe)
        parts = {"ce_loss": ce, "aux_loss": aux, "z_loss": z}
    loss.backward()
    for name, ref in [("loss", loss)] + list(parts.items()):
        ours = float(dump[name])
        rel = abs(ours - ref.item()) / abs(ref.item())
        print(f"{name}: train_gpt {ours:.8f}  torch {ref.item():.8f}  relative difference {rel:.2e}")
        if rel > 1e-5:
            failures.append(f"{name} differs by {rel:.2e} (relative)")
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
    return [f"{' '.join(launch[-3:])} {' '.join(flags)}: {f}" for f in failures]


if __name__ == "__main__":
    sys.exit(main())
