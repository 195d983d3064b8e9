"""Worlds: what the emulator and the search-efficiency benchmark treat as the truth.

A world is a data file, separate from the model the search fits, so the two can differ on
purpose: a profile plus effects that the search's performance model cannot express (cost
cliffs, MoE dispatch that grows faster than the model's form, acceptance of odd shapes,
per-config launch bias, launches that now and then run slow), a prior with wrong facts, or
a replayed table of measurements.
The search never reads a world: it sees what a server shows (throughput, accept length)
and, as its prior, only the world's `facts`.

    name: cliffs                      # a world file (YAML)
    description: ...
    profile: qwen3-coder-next-h200    # the truth's base profile (name or file)
    facts: {hardware: {bandwidth_tb_s: 3.35}}   # optional: what a prior is told instead
    effects:
      verify_cliffs: {buckets: [8, 16, 32, 64, 128, 256], jump: 0.12}
      moe_dispatch: {per_token_us: 0.05, exponent: 1.5, saturation_ms: 8}
      expert_parallel: {ranks: 4}     # experts split whole over 4 GPUs (--ep-size 4)
      attention_dp: {groups: 4}       # --enable-dp-attention --dp-size 4, the prior not told
      launch_bias: {spread: 0.03, seed: 7}
      slow_launches: {rate: 0.1, speed: 0.88}
      acceptance:
        mt-bench: {top1_by_position: [0.8, 0.8, 0.8, 0.3], rank_shares: [0.6, 0.05]}
    replay: {file: grid.csv, fill: nearest}     # instead of effects: measured cells

A profile file is a world too: the search's own model, with no effect.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binom

from treetune.config import ServerConfig, TreeConfig
from treetune.errors import ConfigFileError, TreetuneError
from treetune.perfmodel import PerfModel, Profile, load_profile, resolve_profile_path
from treetune.perfmodel.acceptance import Acceptance
from treetune.perfmodel.cost import RoundTime, distinct_experts, independent_tokens
from treetune.perfmodel.profile import with_attention_dp
from treetune.results import config_key
from treetune.yamlio import build, closest, load_yaml


@dataclass(frozen=True)
class VerifyCliffs:
    """The verify pass slows by `jump` (a share of its time) for every kernel-tile or
    CUDA-graph bucket its token count (batch x draft tokens) exceeds: a staircase, where
    the model's cost is smooth."""

    buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    jump: float = 0.12

    def __post_init__(self) -> None:
        if self.jump < 0 or any(b < 1 for b in self.buckets):
            raise ValueError("verify_cliffs needs jump >= 0 and buckets >= 1")

    def factor(self, tokens: float) -> float:
        return 1.0 + self.jump * sum(1 for b in self.buckets if tokens > b)


@dataclass(frozen=True)
class MoEDispatch:
    """Expert dispatch (all-to-all, token permutation) that grows as tokens^exponent, up
    to a saturation: at large batch x draft tokens a wide tree pays more than the model's
    distinct-expert count says (why the published wide tree regresses at batch 32)."""

    per_token_us: float = 0.05
    exponent: float = 1.5
    saturation_ms: float = 8.0

    def __post_init__(self) -> None:
        if self.per_token_us < 0 or self.exponent < 1 or self.saturation_ms < 0:
            raise ValueError("moe_dispatch needs per_token_us >= 0, exponent >= 1, "
                             "saturation_ms >= 0")

    def seconds(self, tokens: float) -> float:
        return min(self.per_token_us * 1e-6 * tokens ** self.exponent,
                   self.saturation_ms * 1e-3)


@dataclass(frozen=True)
class ExpertParallel:
    """Experts split whole over `ranks` GPUs (SGLang's --ep-size), where the model prices
    them as tensor parallelism does, a share of every expert on each GPU: a pass then
    waits for the GPU whose tokens route to the most of its own experts. The model's
    routed-token count is kept; each rank's distinct experts are binomial (each of its
    experts touched with the model's chance, ranks taken as independent), and the pass
    reads the expected largest of them on every rank. That is about 1.7x the mean at one
    token of 512 experts, top-10, over 4 GPUs, and tends to 1 as every expert is touched.
    An estimate from uniform routing, not a measurement: real routing is skewed, and
    SGLang can balance it (EPLB). The excess is added to the target's passes as weight
    reads (the shipped world's passes are bound by them throughout); draft passes are left
    as the model prices them. `ranks`: None is the server's tensor-parallel size, which a
    given `ranks` must divide."""

    ranks: int | None = None

    def __post_init__(self) -> None:
        if self.ranks is not None and self.ranks < 2:
            raise ValueError("expert_parallel.ranks must be >= 2 (one GPU splits nothing)")

    @staticmethod
    def busiest(routed: float, experts: int, per_token: int, ranks: int) -> float:
        """Expected distinct experts touched on the busiest of `ranks` GPUs by `routed`
        uniformly routed tokens."""
        if routed <= 0:
            return 0.0
        own = experts // ranks
        touched = distinct_experts(routed, experts, per_token) / experts  # each expert's odds
        below = binom.cdf(np.arange(own), own, touched)  # P(a rank touches <= j)
        return float(np.sum(1.0 - below ** ranks))


@dataclass(frozen=True)
class AttentionDP:
    """Servers that run their attention in `groups` data-parallel groups (SGLang's
    --enable-dp-attention --dp-size G) where the prior is told tensor parallelism: the
    truth is the profile's model with `server.attention_dp: groups` (each group's copy of
    the attention, a pass waiting for the busiest group, the draft head within a group;
    see CostModel), the search's facts the profile as it is. The profile must say its
    attention weights (`target.attention_params_b`)."""

    groups: int

    def __post_init__(self) -> None:
        if self.groups < 2:
            raise ValueError("attention_dp.groups must be >= 2 (one group is tensor "
                             "parallelism)")


@dataclass(frozen=True)
class LaunchBias:
    """A deterministic speed factor per config, uniform within +-`spread` (allocator and
    graph-capture luck; the baseline has its own): every launch of a config shares it, so
    re-launching cannot average it away."""

    spread: float = 0.03
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.spread < 1:
            raise ValueError("launch_bias.spread must be in [0, 1)")

    def factor(self, config: ServerConfig) -> float:
        digest = hashlib.sha256(f"{self.seed}:{config_key(config)}".encode()).digest()
        unit = int.from_bytes(digest[:8], "little") / 2 ** 64  # uniform in [0, 1)
        return 1.0 + self.spread * (2 * unit - 1)


@dataclass(frozen=True)
class SlowLaunches:
    """Now and then a launch runs slow for its whole life: a throttled GPU, a noisy
    neighbour on the node, a degraded link. With probability `rate`, independently per
    launch, the launch runs at `speed` of its normal pace (on top of the usual launch
    noise). The noise is then not log-normal but heavy on the slow side, which the study's
    learned noise and intervals do not assume."""

    rate: float = 0.1
    speed: float = 0.88

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1 or not 0 < self.speed <= 1:
            raise ValueError("slow_launches needs rate in [0, 1] and speed in (0, 1]")

    def draw(self, rng: np.random.Generator) -> float:
        return self.speed if rng.random() < self.rate else 1.0


@dataclass(frozen=True)
class AcceptanceShape:
    """A dataset's acceptance in a shape the model's decay form cannot take."""

    top1_by_position: tuple[float, ...] | None = None
    rank_shares: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Effects:
    verify_cliffs: VerifyCliffs | None = None
    moe_dispatch: MoEDispatch | None = None
    expert_parallel: ExpertParallel | None = None
    attention_dp: AttentionDP | None = None
    launch_bias: LaunchBias | None = None
    slow_launches: SlowLaunches | None = None
    acceptance: dict[str, AcceptanceShape] = field(default_factory=dict)


# The effects WorldModel applies to the model's costs, which a replay table replaces.
COST_EFFECTS = ("verify_cliffs", "moe_dispatch", "expert_parallel", "launch_bias",
                "slow_launches")


@dataclass(frozen=True)
class Replay:
    file: str  # CSV or YAML of measured cells, relative to the world file
    fill: str = "nearest"  # how unmeasured configs are filled (see replay.py)

    def __post_init__(self) -> None:
        if self.fill not in ("nearest",):
            raise ValueError(f"replay.fill must be 'nearest', got '{self.fill}'")


@dataclass(frozen=True)
class _WorldFile:
    name: str
    profile: str
    description: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    effects: Effects = field(default_factory=Effects)
    replay: Replay | None = None


class WorldModel(PerfModel):
    """The truth of a world with effects: the model's cost and acceptance, then the
    effects the model cannot express."""

    def __init__(self, profile: Profile, effects: Effects, tp: int | None = None,
                 method: str | None = None) -> None:
        super().__init__(profile, tp, method)
        self.effects = effects
        ep = effects.expert_parallel
        if ep is not None and ep.ranks is not None and self.cost.tp % ep.ranks:
            raise TreetuneError(f"expert_parallel over {ep.ranks} GPUs needs a tensor-parallel "
                                f"size that is a multiple of it, and this server's is "
                                f"{self.cost.tp}")

    def for_method(self, method: str) -> WorldModel:
        return WorldModel(self.profile, self.effects, self.cost.tp, method)

    def _target_extra(self, batch: float, per_request: int, dataset: str,
                      verify_s: float) -> float:
        e, moe = self.effects, self.profile.target.moe
        tokens = batch * per_request
        out = verify_s * (e.verify_cliffs.factor(tokens) - 1.0) if e.verify_cliffs else 0.0
        if e.moe_dispatch and moe is not None:
            out += e.moe_dispatch.seconds(tokens)
        if e.expert_parallel and moe is not None:
            out += self._busiest_rank_s(batch, per_request, dataset, e.expert_parallel)
        return out

    def _busiest_rank_s(self, batch: float, per_request: int, dataset: str,
                        ep: ExpertParallel) -> float:
        """The expert weights the busiest GPU reads beyond its tensor-parallel share."""
        t, c = self.profile.target, self.profile.calibration
        assert t.moe is not None
        ranks = ep.ranks or self.cost.tp
        routed = independent_tokens(batch, per_request, self.profile.dataset(dataset)
                                    .routing_diversity, c.tree_routing_diversity)
        mean = distinct_experts(routed, t.moe.experts, t.moe.experts_per_token)
        busiest = ep.busiest(routed, t.moe.experts, t.moe.experts_per_token, ranks)
        extra = max(ranks * busiest - mean, 0.0) * t.expert_params * t.weight_bytes
        return extra / (self.cost.bandwidth * c.weight_bandwidth_eff)

    def round_time(self, config: ServerConfig, batch: float, dataset: str) -> RoundTime:
        base = super().round_time(config, batch, dataset)
        per_request = config.draft_tokens if isinstance(config, TreeConfig) else 1
        verify = base.verify_s + self._target_extra(batch, per_request, dataset,
                                                    base.verify_s)
        bias = self.effects.launch_bias.factor(config) if self.effects.launch_bias else 1.0
        return RoundTime(base.draft_s / bias, verify / bias, base.overhead_s / bias)

    def launch_speed(self, rng: np.random.Generator) -> float:
        slow = self.effects.slow_launches
        return slow.draw(rng) if slow else 1.0


@dataclass(frozen=True)
class World:
    name: str
    description: str
    profile: Profile  # the truth's profile (the acceptance effects applied)
    facts: Profile  # what a prior may know: hardware and model facts (maybe wrong)
    effects: Effects = field(default_factory=Effects)
    replay_path: Path | None = None
    own_model: bool = False  # a plain profile: the search's own model is the truth

    def model(self, tp: int | None = None, method: str | None = None) -> PerfModel:
        """The truth, for one tensor-parallel size and draft method (default: the
        profile's own draft head)."""
        if self.replay_path is not None:
            from treetune.worlds.replay import ReplayModel

            return ReplayModel(self.profile, self.replay_path, tp, method)
        return WorldModel(self.profile, self.effects, tp, method)


def shipped_worlds() -> list[str]:
    folder = resources.files("treetune") / "worlds" / "shipped"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _path(name_or_path: str | Path) -> Path | None:
    text = str(name_or_path)
    candidate = Path(text)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists() or "/" in text:
        return candidate
    shipped = resources.files("treetune") / "worlds" / "shipped" / f"{text}.yaml"
    return Path(str(shipped)) if shipped.is_file() else None


def resolve_world_path(name_or_path: str | Path) -> Path:
    """The file of a world: a path as given, a shipped world's, or a shipped profile's
    (the world of the search's own model)."""
    path = _path(name_or_path)
    if path is not None:
        return path
    from treetune.perfmodel import shipped_profiles

    try:
        return resolve_profile_path(name_or_path)
    except TreetuneError:
        names = shipped_worlds() + shipped_profiles()
        raise TreetuneError(
            f"unknown world '{name_or_path}'{closest(str(name_or_path), names)}: give a "
            f"world or profile file, or one of: {', '.join(names)}") from None


def load_world(name_or_path: str | Path) -> World:
    """A shipped world's name, a world file, or a profile (name or file): the profile is
    the world of the search's own model."""
    path = _path(name_or_path)
    if path is None:
        profile = load_profile(resolve_world_path(name_or_path))
        return World(profile.name, profile.description, profile, profile, own_model=True)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigFileError(path, "a world must be a mapping with name, profile, ...")
    if "hardware" in data and "target" in data:  # a profile file
        profile = load_profile(path)
        return World(profile.name, profile.description, profile, profile, own_model=True)
    raw = build(_WorldFile, data, path)
    base_ref = Path(raw.profile)
    if not base_ref.is_absolute() and (path.parent / base_ref).is_file():
        base_ref = path.parent / base_ref
    try:
        base = load_profile(base_ref if base_ref.exists() else raw.profile)
    except TreetuneError as exc:  # said with the world's file and key
        raise ConfigFileError(path, str(exc), "profile") from None
    for key in ("moe_dispatch", "expert_parallel"):
        if getattr(raw.effects, key) is not None and base.target.moe is None:
            raise ConfigFileError(path, f"{key} is an MoE model's cost, and profile "
                                  f"'{base.name}' is of a dense model", f"effects.{key}")
    dp = raw.effects.attention_dp
    if dp is not None and base.tp % dp.groups:
        raise ConfigFileError(path, f"{dp.groups} attention groups do not split the "
                              f"profile's {base.tp} GPUs evenly", "effects.attention_dp")
    if dp is not None and not base.target.attention_params_b:
        raise ConfigFileError(path, f"profile '{base.name}' does not say its attention "
                              "weights (target.attention_params_b), which each attention "
                              "group holds a copy of", "effects.attention_dp")
    ep = raw.effects.expert_parallel
    if ep is not None and base.target.moe is not None and (
            base.target.moe.experts % (ep.ranks or base.tp)):
        raise ConfigFileError(path, f"{base.target.moe.experts} experts do not split evenly "
                              f"over {ep.ranks or base.tp} GPUs", "effects.expert_parallel")
    truth = _with_acceptance(base, raw.effects.acceptance, path)
    if dp is not None:
        truth = with_attention_dp(truth, dp.groups)
    facts = _with_facts(base, raw.facts, path)
    replay = None
    if raw.replay is not None:
        # The table is the truth of the costs: these would be dropped without a word (the
        # acceptance shape and attention groups act on the profile, which the table keeps
        # for accept lengths it lacks, memory and prefill).
        if dropped := [name for name in COST_EFFECTS if getattr(raw.effects, name)]:
            raise ConfigFileError(path, f"a replay world's table is its truth of speed: "
                                  f"effects.{dropped[0]} would not act on it; remove it, or "
                                  "the replay", f"effects.{dropped[0]}")
        replay = (path.parent / raw.replay.file).resolve()
        if not replay.is_file():
            raise ConfigFileError(path, f"replay file {replay} not found", "replay.file")
    world = World(raw.name, raw.description.strip(), truth, facts, raw.effects, replay)
    if replay is not None:
        world.model()  # the table read now: its faults said before any launch
    return world


def _with_acceptance(profile: Profile, shapes: dict[str, AcceptanceShape],
                     path: Path) -> Profile:
    datasets = dict(profile.datasets)
    for name, shape in shapes.items():
        if name not in datasets:
            raise ConfigFileError(path, f"profile '{profile.name}' has no dataset '{name}'"
                                  f"{closest(name, datasets)}", f"effects.acceptance.{name}")
        data = datasets[name]
        changes = {k: v for k, v in dataclasses.asdict(shape).items() if v is not None}
        try:
            acceptance = Acceptance(**{**dataclasses.asdict(data.acceptance), **changes})
        except ValueError as exc:
            raise ConfigFileError(path, str(exc), f"effects.acceptance.{name}") from None
        datasets[name] = dataclasses.replace(data, acceptance=acceptance)
    return profile.replace(datasets=datasets)


def _with_facts(profile: Profile, changes: dict[str, Any], path: Path) -> Profile:
    """The facts a prior is told: the profile with the world's (wrong) facts over it."""
    if not changes:
        return profile
    data = profile.to_dict()
    for section, values in changes.items():
        if section not in ("hardware", "target", "draft") or not isinstance(values, dict):
            raise ConfigFileError(path, "facts may change hardware, target or draft, as a "
                                  "mapping of their fields", f"facts.{section}")
        if section not in data:  # a profile of other draft methods only
            raise ConfigFileError(path, f"the world's profile has no {section} section (its "
                                  f"methods: {', '.join(profile.method_names)})",
                                  f"facts.{section}")
        data[section] = {**data[section], **values}
    return build(Profile, data, path, "facts")
