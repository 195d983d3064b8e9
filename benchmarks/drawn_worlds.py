"""Draw world files no one has tuned the search on: held-out worlds for the benchmarks.

The twelve shipped worlds and profiles have been the search's yardstick for many changes,
so a rule can win there by fitting them. Drawn worlds are a check against that: each is
one of the three shipped profiles whose targets are provable at 3% noise (the 8B, the
30B-A3B and Coder-Next; the 397B's best batch-32 tree clears the floor by 2.5%, which no
strategy proves in 30 launches, stop 24's oracle) with effects drawn at random, each
present with probability one half (at least one in every world), at magnitudes drawn
over the ranges below. The ranges are the issue's examples and the shipped worlds'
settings, widened; they were fixed before any drawn world was searched.

    .venv/bin/python benchmarks/drawn_worlds.py [--count 24] [--seed 2026] --output DIR
    .venv/bin/python benchmarks/search_efficiency.py --worlds DIR/*.yaml --seeds 2 ...

Each file is an ordinary world file (`treetune/worlds/_world.py`), its description saying
what was drawn; the same count and seed draw the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from treetune.perfmodel import Profile, load_profile
from treetune.yamlio import dump_yaml

PROFILES = ("qwen3-8b-h100", "qwen3-30b-a3b-h100", "qwen3-coder-next-h200")
# Token counts per verify pass where kernels change tile or CUDA graphs change bucket:
# powers of two (the shipped cliffs world's), a ladder of graph-capture-like sizes (steps
# of 8, then 16, then 32 and 64), coarse tiles of 64, and an irregular ladder none of the
# shipped worlds has.
BUCKETS = ((8, 16, 32, 64, 128, 256), (16, 24, 32, 48, 64, 96, 128, 192, 256),
           (64, 128, 192, 256, 384, 512), (12, 24, 40, 80, 160, 320))
POSITIONS = 8  # top-1 acceptance drawn per depth up to here (deeper repeats the last)


def draw(index: int, seed: int = 2026) -> dict[str, Any]:
    """World `index` of the draw `seed`, as a world file's mapping."""
    rng = np.random.default_rng([seed, index])
    name = f"drawn-{seed}-{index:02d}"
    profile = load_profile(PROFILES[int(rng.integers(len(PROFILES)))])
    moe = profile.target.moe is not None
    effects: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    said: list[str] = []
    while not effects and not facts:
        if rng.random() < 0.5:
            buckets = BUCKETS[int(rng.integers(len(BUCKETS)))]
            jump = round(float(rng.uniform(0.03, 0.15)), 3)
            effects["verify_cliffs"] = {"buckets": list(buckets), "jump": jump}
            said.append(f"verify cliffs of {jump:.1%} at {list(buckets)} tokens")
        if moe and rng.random() < 0.5:
            dispatch = {"per_token_us": round(float(np.exp(rng.uniform(np.log(0.1),
                                                                      np.log(1.5)))), 3),
                        "exponent": round(float(rng.uniform(1.2, 1.7)), 2),
                        "saturation_ms": round(float(rng.uniform(2.0, 8.0)), 1)}
            effects["moe_dispatch"] = dispatch
            said.append("MoE dispatch growing as tokens^{exponent} up to "
                        "{saturation_ms} ms".format(**dispatch))
        if rng.random() < 0.5:
            shapes = _acceptance(profile, rng)
            if shapes:
                effects["acceptance"] = shapes
                said.append(f"acceptance plateau-then-drop on {', '.join(shapes)}")
        if rng.random() < 0.5:
            spread = round(float(rng.uniform(0.005, 0.03)), 4)
            effects["launch_bias"] = {"spread": spread, "seed": int(rng.integers(1000))}
            said.append(f"per-config launch bias within {spread:.1%}")
        if rng.random() < 0.5:
            scale = float(rng.uniform(0.7, 1.3))
            facts = {"hardware": {"bandwidth_tb_s": round(
                profile.hardware.bandwidth_tb_s * scale, 3)}}
            said.append(f"a prior told {scale - 1:+.0%} HBM bandwidth")
        if rng.random() < 0.25:
            slow = {"rate": round(float(rng.uniform(0.03, 0.12)), 3),
                    "speed": round(float(rng.uniform(0.85, 0.95)), 3)}
            effects["slow_launches"] = slow
            said.append("{rate:.0%} of launches at {speed:.0%} speed".format(**slow))
    out: dict[str, Any] = {
        "name": name,
        "description": f"Drawn (seed {seed}, world {index}): {profile.name} with "
                       + "; ".join(said) + ".",
        "profile": profile.name}
    if facts:
        out["facts"] = facts
    if effects:
        out["effects"] = effects
    return out


def _acceptance(profile: Profile, rng: np.random.Generator) -> dict[str, dict[str, list[float]]]:
    """Per dataset (each with probability one half): the profile's top-1 acceptance held on
    a plateau for 1-4 positions, then dropped by 20-50%, and a rank-2 share of the miss of
    15-65% with almost nothing below it (the model's ranks decay geometrically)."""
    shapes = {}
    for name, data in profile.datasets.items():
        if rng.random() >= 0.5:
            continue
        plateau = int(rng.integers(1, 5))
        drop = float(rng.uniform(0.5, 0.8))
        first = data.acceptance.top1_at(0)
        top1 = [first * (1 - 0.01 * j) if j < plateau else data.acceptance.top1_at(j) * drop
                for j in range(POSITIONS)]
        shares = [float(rng.uniform(0.15, 0.65)), float(rng.uniform(0.0, 0.06))]
        shapes[name] = {"top1_by_position": [round(p, 3) for p in top1],
                        "rank_shares": [round(s, 3) for s in shares]}
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=24, help="worlds to draw")
    parser.add_argument("--seed", type=int, default=2026, help="the draw's seed")
    parser.add_argument("--output", type=Path, required=True,
                        help="the folder the world files are written to")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be >= 1")
    args.output.mkdir(parents=True, exist_ok=True)
    for index in range(args.count):
        world = draw(index, args.seed)
        path = args.output / f"{world['name']}.yaml"
        dump_yaml(world, path)
        print(path)


if __name__ == "__main__":
    main()
