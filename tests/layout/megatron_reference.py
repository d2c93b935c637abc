#!/usr/bin/python3
"""Compares `weft-layout --json` with an independent model of Megatron-Core's rank layout.

The model follows Megatron-Core's documented scheme (megatron/core/parallel_state.py):
  * a rank generator lays the world out on a grid whose axes are the dimensions in the order
    string, the first axis varying fastest; dimensions missing from the order must have size 1;
  * the groups for a set of dimensions (a mask) are the sets of ranks that agree on every
    coordinate outside the mask; groups are numbered by those outside coordinates and ranks inside
    a group by the inside coordinates, first axis of the order fastest in both;
  * dense layers use a generator with (tp, cp, dp, pp) and ep = 1; expert layers use one with
    (expert-tp, ep, expert-dp, pp) and cp = 1, on the same order;
  * dp = world / (tp cp pp), expert-dp = world / (expert-tp ep pp), both must divide exactly;
  * unless pp is last in the order, dp must equal expert-dp; the pipeline groups of both
    generators must be equal;
  * the embedding group of a pipeline group is its first and last rank (its only rank when
    pp = 1), the position-embedding group its first rank.

It is written from that description with the standard library only, and enumerates coordinates
directly (itertools.product) rather than decoding numbers, so it shares no code path with weft.

usage: megatron_reference.py PATH/TO/weft-layout [--count N] [--seed S]
"""

import itertools
import json
import random
import subprocess
import sys

DIMS = ("tp", "cp", "ep", "dp", "pp")


class InvalidLayout(Exception):
    pass


def prod(values):
    result = 1
    for v in values:
        result *= v
    return result


def full_order(order, sizes):
    """The order's names plus the missing ones; raises if a missing one has size > 1."""
    names = order.split("-") if order else []
    for name in names:
        if name not in sizes:
            raise InvalidLayout(f"unknown dimension {name}")
    if len(set(names)) != len(names):
        raise InvalidLayout("repeated dimension")
    for name in DIMS:
        if name not in names:
            if sizes[name] != 1:
                raise InvalidLayout(f"{name} has size {sizes[name]} but is not in the order")
            names.append(name)
    return names


def grid_groups(order, sizes, token):
    """Groups of one generator for the mask named by token ('tp-dp', ...)."""
    names = full_order(order, sizes)
    masked = set(token.split("-"))
    stride = {}
    s = 1
    for name in names:
        stride[name] = s
        s *= sizes[name]
    inside = [n for n in names if n in masked]
    outside = [n for n in names if n not in masked]

    def first_fastest(axes):
        # itertools.product varies its last argument fastest, so feed the axes reversed.
        for combo in itertools.product(*[range(sizes[a]) for a in reversed(axes)]):
            yield dict(zip(reversed(axes), combo))

    groups = []
    for fixed in first_fastest(outside):
        base = sum(fixed[a] * stride[a] for a in outside)
        groups.append([base + sum(c[a] * stride[a] for a in inside) for c in first_fastest(inside)])
    return groups


def megatron_layout(world, tp=1, cp=1, ep=1, pp=1, expert_tp=None, order="tp-cp-ep-dp-pp"):
    """Every group kind by name, or InvalidLayout where Megatron-Core would refuse the layout."""
    if min(world, tp, cp, ep, pp) < 1:
        raise InvalidLayout("sizes must be positive")
    if world % (tp * cp * pp):
        raise InvalidLayout("world not divisible by tp*cp*pp")
    dp = world // (tp * cp * pp)
    if expert_tp is None:
        expert_tp = tp
    if world % (expert_tp * ep * pp):
        raise InvalidLayout("world not divisible by expert_tp*ep*pp")
    expert_dp = world // (expert_tp * ep * pp)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": expert_tp, "cp": 1, "ep": ep, "dp": expert_dp, "pp": pp}
    full_order(order, dense)
    full_order(order, expert)
    if not (order.endswith("pp") or pp == 1 or expert_dp == dp):
        raise InvalidLayout("pp not last and dp != expert_dp")
    pipelines = grid_groups(order, dense, "pp")
    if pipelines != grid_groups(order, expert, "pp"):
        raise InvalidLayout("pipeline groups differ between dense and expert layers")
    groups = {}
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp"):
        groups[token] = grid_groups(order, dense, token)
    groups["embedding"] = [[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in pipelines]
    groups["position-embedding"] = [[p[0]] for p in pipelines]
    for token, name in (("ep", "ep"), ("tp", "expert-tp"), ("dp", "expert-dp"), ("tp-ep", "expert-tp-ep"),
                        ("tp-ep-pp", "expert-tp-ep-pp")):
        groups[name] = grid_groups(order, expert, token)
    return {"dp": dp, "expert_dp": expert_dp, "groups": groups}


def run_weft(binary, world, tp, cp, ep, pp, expert_tp, order):
    args = [binary, "--world-size", str(world), "--tp", str(tp), "--cp", str(cp), "--ep", str(ep), "--pp", str(pp),
            "--order", order, "--json"]
    if expert_tp is not None:
        args += ["--expert-tp", str(expert_tp)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return done, " ".join(args[1:])


def random_layouts(rng, count):
    worlds = [1, 2, 3, 4, 6, 8, 12, 16, 18, 24, 32, 36, 48, 64, 96, 128, 256]
    for _ in range(count):
        world = rng.choice(worlds)
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        # Mostly valid layouts: draw degrees from what is left of the world.
        left = world
        degrees = {}
        for name in rng.sample(["tp", "cp", "pp"], 3):
            choice = rng.choice([d for d in divisors if left % d == 0]) if rng.random() < 0.9 else rng.choice([1, 2, 3, 4])
            degrees[name] = choice
            left = left // choice if left % choice == 0 else left
        ep = rng.choice([d for d in divisors if d <= 16]) if rng.random() < 0.5 else 1
        expert_tp = rng.choice([None, None, 1, 2, degrees["tp"]])
        if degrees["cp"] > 1 and ep > 1 and rng.random() < 0.5:
            ep = 1
        names = list(DIMS)
        rng.shuffle(names)
        if rng.random() < 0.2:
            names = [n for n in names if rng.random() < 0.8]
        if rng.random() < 0.4:
            names = ["tp", "cp", "ep", "dp", "pp"]
        yield world, degrees["tp"], degrees["cp"], ep, degrees["pp"], expert_tp, "-".join(names)


def fixed_layouts():
    # Every order of the five names, on layouts where most of them have size > 1. Megatron-Core
    # refuses many of these orders (pp not last with dp != expert-dp, or pipeline groups that differ
    # between the dense and expert grids): weft must refuse exactly the same ones.
    for names in itertools.permutations(DIMS):
        order = "-".join(names)
        yield 24, 2, 1, 1, 3, None, order
        yield 16, 2, 1, 2, 2, 1, order
        yield 32, 2, 2, 4, 2, 1, order
        yield 24, 2, 2, 1, 3, None, order
    yield 1, 1, 1, 1, 1, None, "tp-cp-ep-dp-pp"
    yield 1024, 8, 2, 8, 4, 1, "tp-cp-ep-dp-pp"
    yield 512, 4, 1, 8, 8, None, "tp-ep-dp-pp"
    yield 64, 2, 4, 1, 2, None, "tp-cp-dp-pp"


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    binary = sys.argv[1]
    count = 200
    seed = 20240611
    rest = sys.argv[2:]
    while rest:
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--count":
            count = int(value)
        elif flag == "--seed":
            seed = int(value)
    rng = random.Random(seed)
    failures = []
    compared = refused = 0
    for world, tp, cp, ep, pp, expert_tp, order in itertools.chain(fixed_layouts(), random_layouts(rng, count)):
        done, command = run_weft(binary, world, tp, cp, ep, pp, expert_tp, order)
        try:
            expected = megatron_layout(world, tp, cp, ep, pp, expert_tp, order)
        except InvalidLayout as why:
            refused += 1
            if done.returncode != 1 or "error" not in done.stderr:
                failures.append(f"{command}: Megatron-Core refuses it ({why}) but weft-layout exited "
                                f"{done.returncode}: {done.stderr.strip()[:300]}")
            continue
        if done.returncode != 0:
            failures.append(f"{command}: valid for Megatron-Core but weft-layout exited {done.returncode}: "
                            f"{done.stderr.strip()[:300]}")
            continue
        compared += 1
        got = json.loads(done.stdout)
        if got["world_size"] != world or got["degrees"]["dp"] != expected["dp"] or \
                got["degrees"]["expert_dp"] != expected["expert_dp"]:
            failures.append(f"{command}: world or derived sizes differ: {got['world_size']} {got['degrees']}")
        for name, groups in expected["groups"].items():
            mine = got["groups"].get(name)
            if mine is None:
                failures.append(f"{command}: no '{name}' groups in the JSON")
            elif sorted(mine) != sorted(groups):
                failures.append(f"{command}: '{name}' groups differ (sorted): weft {sorted(mine)[:4]}... "
                                f"Megatron-Core {sorted(groups)[:4]}...")
            elif mine != groups:
                failures.append(f"{command}: '{name}' groups are the same sets in a different order: weft "
                                f"{mine[:4]}... Megatron-Core {groups[:4]}...")
    for failure in failures[:40]:
        print("FAIL:", failure)
    print(f"{compared} layouts compared group by group, {refused} refused by both, {len(failures)} failures")
    return 1 if failures or compared < count // 3 else 0


if __name__ == "__main__":
    sys.exit(main())
