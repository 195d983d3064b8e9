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

With `--new-bases` the base is drawn too, so that no world rests on a shipped profile: a
target among the config.json fixtures (tests/fixtures/hf: Qwen3 dense, MoE and hybrid,
GLM-4.5-Air, Llama-4-Scout, DeepSeek-V3) with its EAGLE3 head (a one-layer head of the
target's width where no head is among the fixtures), on a GPU of treetune's table at the
least tensor parallelism whose weights take at most 60% of the GPUs' memory; its facts are
what the auto prior counts from those files, its calibration one of the three profiles'
with each value scaled by up to +-30%, its datasets' acceptance another's (or the same).
The base is written to DIR/bases/, which `--worlds DIR/*.yaml` does not pick up.

    .venv/bin/python benchmarks/drawn_worlds.py --new-bases --seed 2028 --output DIR
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from treetune.facts import auto_prior, gpu_facts, model_facts
from treetune.facts.gpus import GpuFacts
from treetune.facts.models import ModelFacts, facts_from_config, read_config
from treetune.perfmodel import Profile, load_profile
from treetune.perfmodel.profile import Calibration
from treetune.yamlio import dump_yaml

PROFILES = ("qwen3-8b-h100", "qwen3-30b-a3b-h100", "qwen3-coder-next-h200")
# Token counts per verify pass where kernels change tile or CUDA graphs change bucket:
# powers of two (the shipped cliffs world's), a ladder of graph-capture-like sizes (steps
# of 8, then 16, then 32 and 64), coarse tiles of 64, and an irregular ladder none of the
# shipped worlds has.
BUCKETS = ((8, 16, 32, 64, 128, 256), (16, 24, 32, 48, 64, 96, 128, 192, 256),
           (64, 128, 192, 256, 384, 512), (12, 24, 40, 80, 160, 320))
POSITIONS = 8  # top-1 acceptance drawn per depth up to here (deeper repeats the last)
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
# --new-bases: targets (with their EAGLE3 head's fixture, None: a one-layer head of the
# target's width) and GPUs to draw from.
TARGETS = (("Qwen/Qwen3-8B", "thoughtworks/Qwen3-8B-Eagle3"),
           ("Qwen/Qwen3-30B-A3B-FP8", "sgl-project/qwen3-30B-A3B-eagle3"),
           ("Qwen/Qwen3-Coder-Next-FP8", "thoughtworks/Qwen3-Coder-Next-Eagle3"),
           ("zai-org/GLM-4.5-Air", None),
           ("meta-llama/Llama-4-Scout-17B-16E-Instruct", None),
           ("deepseek-ai/DeepSeek-V3", None))
GPUS = ("A100-80GB-SXM", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "MI300X")
WEIGHT_SHARE = 0.6  # of the GPUs' memory the target's weights may take
CALIBRATION_SPREAD = 0.3  # each borrowed calibration value scaled by exp(+-this) at most


def draw(index: int, seed: int = 2026, base: Profile | None = None) -> dict[str, Any]:
    """World `index` of the draw `seed`, as a world file's mapping; on `base` (its
    "profile" then to be set to where the base is written) instead of a shipped profile."""
    rng = np.random.default_rng([seed, index])
    name = f"drawn-{seed}-{index:02d}"
    profile = load_profile(PROFILES[int(rng.integers(len(PROFILES)))])
    label = profile.name
    if base is not None:
        profile, label = base, base.description.split(":")[0]
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
        "description": f"Drawn (seed {seed}, world {index}): {label} with "
                       + "; ".join(said) + ".",
        "profile": profile.name}
    if facts:
        out["facts"] = facts
    if effects:
        out["effects"] = effects
    return out


def draw_base(index: int, seed: int) -> Profile:
    """World `index`'s base for `--new-bases`: a target and head of the fixtures on a
    drawn GPU, its facts counted as the auto prior counts them, its calibration and
    acceptance borrowed from the shipped profiles (see the module's doc)."""
    rng = np.random.default_rng([seed, index, 1])  # apart from the effects' stream
    target_name, head_name = TARGETS[int(rng.integers(len(TARGETS)))]
    target = model_facts(str(FIXTURES / target_name))
    draft = (model_facts(str(FIXTURES / head_name)) if head_name
             else _eagle3_head(target_name))
    weights = target.total_params * target.weight_bytes

    def least_tp(gpu: GpuFacts) -> int | None:
        return next((n for n in (1, 2, 4, 8)
                     if weights <= WEIGHT_SHARE * n * gpu.memory_gb * 1e9), None)

    if not any(least_tp(gpu_facts(name)) for name in GPUS):
        raise ValueError(f"{target_name} fits none of {', '.join(GPUS)} at 8 GPUs")
    while (tp := least_tp(gpu := gpu_facts(GPUS[int(rng.integers(len(GPUS)))]))) is None:
        pass  # drawn again: the target does not fit this GPU
    costs = load_profile(PROFILES[int(rng.integers(len(PROFILES)))])
    texts = load_profile(PROFILES[int(rng.integers(len(PROFILES)))])
    scaled = {key: value * float(np.exp(rng.uniform(-CALIBRATION_SPREAD,
                                                    CALIBRATION_SPREAD)))
              for key, value in dataclasses.asdict(costs.calibration).items()}
    calibration = Calibration(**{key: round(min(value, 0.95) if key.endswith(
        ("_eff", "_diversity")) else value, 6) for key, value in scaled.items()})
    counted = auto_prior(target, draft, gpu, tp, list(texts.datasets),
                         name=f"base-{seed}-{index:02d}")
    return counted.replace(
        description=(f"{target_name} with {head_name or 'a one-layer EAGLE3 head'} on {tp} x "
                     f"{gpu.name}: facts as the auto prior counts them, calibration "
                     f"{costs.name}'s scaled by up to +-{CALIBRATION_SPREAD:.0%}, "
                     f"acceptance {texts.name}'s."),
        calibration=calibration, datasets=dict(texts.datasets))


def _eagle3_head(target_name: str) -> ModelFacts:
    """The facts of a one-layer EAGLE3 head for the fixture `target_name`: the target's
    width, heads and vocabulary, a 32k draft vocabulary (as the fixtures' heads have)."""
    config = read_config(FIXTURES / target_name / "config.json")
    text = config.get("text_config", config)
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": text["intermediate_size"],
            "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": text.get("num_key_value_heads") or heads,
            "head_dim": text.get("head_dim") or hidden // heads,
            "vocab_size": text["vocab_size"], "draft_vocab_size": 32000,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    return facts_from_config(head, f"{target_name} EAGLE3 head (drawn)",
                             Path("(drawn)") / target_name)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--count", type=int, default=24, help="worlds to draw")
    parser.add_argument("--seed", type=int, default=2026, help="the draw's seed")
    parser.add_argument("--output", type=Path, required=True,
                        help="the folder the world files are written to")
    parser.add_argument("--new-bases", action="store_true",
                        help="draw each world's base too (a target of the fixtures on a "
                        "drawn GPU, written to OUTPUT/bases/) instead of a shipped profile")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be >= 1")
    args.output.mkdir(parents=True, exist_ok=True)
    for index in range(args.count):
        print(write_world(index, args.seed, args.new_bases, args.output))


def write_world(index: int, seed: int, new_base: bool, output: Path) -> Path:
    """Draw world `index` of `seed` (with a base of its own if `new_base`, written to
    OUTPUT/bases/) into the folder `output`; returns the world file's path."""
    base = draw_base(index, seed) if new_base else None
    world = draw(index, seed, base)
    if base is not None:
        (output / "bases").mkdir(exist_ok=True)
        base.save(output / "bases" / f"{base.name}.yaml")
        world["profile"] = f"bases/{base.name}.yaml"
    path = output / f"{world['name']}.yaml"
    dump_yaml(world, path)
    return path


if __name__ == "__main__":
    main()
