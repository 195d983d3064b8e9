"""Positional acceptance model and SGLang's dynamic draft tree.

Sequoia's positional model: below an accepted node at depth j, the draft's child of rank
r (1 = top guess) is the target's token with probability p_j(r). Draft confidence is
calibrated (EAGLE-2), so the draft's cumulative scores rank nodes by these path
probabilities, which makes SGLang's tree deterministic in expectation and its expected
accept length exact: 1 (bonus token) + the sum of the verified nodes' path probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from treetune.config import TreeConfig


@dataclass(frozen=True)
class Acceptance:
    """Per-dataset acceptance of a draft head.

    top1: p_0(1), the chance the draft's first guess is right.
    top1_decay: top-1 falls with depth as top1 * (j+1)^-decay (fits published profiles).
    top1_by_position: measured top-1 per depth; overrides top1/top1_decay where given.
    rank_mass: share of the top-1 miss probability (1 - p_j(1)) that the draft's lower
        ranks capture, summed over all ranks; 0 makes trees no better than chains.
    rank_ratio: each lower rank holds this fraction of the one above it.
    rank_shares: the lower ranks' shares of the top-1 miss probability, rank 2 first;
        overrides rank_mass/rank_ratio where given (ranks past the list get nothing).
    """

    top1: float
    top1_decay: float = 0.0
    rank_mass: float = 0.5
    rank_ratio: float = 0.5
    top1_by_position: tuple[float, ...] | None = None
    rank_shares: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        checks = {
            "top1": self.top1,
            "rank_mass": self.rank_mass,
            "rank_ratio": self.rank_ratio,
            **{f"top1_by_position[{i}]": p for i, p in enumerate(self.top1_by_position or ())},
        }
        checks |= {f"rank_shares[{i}]": p for i, p in enumerate(self.rank_shares or ())}
        for name, value in checks.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        if self.rank_shares and sum(self.rank_shares) > 1.0 + 1e-9:
            raise ValueError(f"rank_shares must sum to at most 1, got {sum(self.rank_shares)}")
        if self.top1_decay < 0:
            raise ValueError(f"top1_decay must be >= 0, got {self.top1_decay}")

    def top1_at(self, depth: int) -> float:
        if self.top1_by_position and depth < len(self.top1_by_position):
            return self.top1_by_position[depth]
        if self.top1_by_position:
            # Past the measured positions, repeat the deepest measured value.
            return self.top1_by_position[-1]
        return self.top1 * (depth + 1) ** -self.top1_decay

    def matrix(self, depths: int, ranks: int) -> np.ndarray:
        """p[j, r-1] for depths 0..depths-1 and ranks 1..ranks; each row sums to <= 1."""
        p = np.zeros((depths, ranks))
        if self.rank_shares is not None:
            lower = np.zeros(max(ranks - 1, 0))
            given = np.array(self.rank_shares[:len(lower)], dtype=float)
            lower[:len(given)] = given
            scale = 1.0  # the shares already say how much of the miss the lower ranks hold
        else:
            lower = (1.0 - self.rank_ratio) * self.rank_ratio ** np.arange(max(ranks - 1, 0))
            scale = self.rank_mass
        for j in range(depths):
            a = self.top1_at(j)
            p[j, 0] = a
            p[j, 1:] = (1.0 - a) * scale * lower
        return p


@dataclass(frozen=True)
class DraftTree:
    """The verify set SGLang builds for one config, with each node's path probability.

    Nodes are numbered 0..N-2 (the root is implicit); parent -1 means the root.
    """

    config: TreeConfig
    parent: np.ndarray  # int, shape (N-1,)
    rank: np.ndarray  # int, 1-based rank among its siblings
    depth: np.ndarray  # int, 1-based
    score: np.ndarray  # float, path probability

    @property
    def expected_accepted(self) -> float:
        return float(self.score.sum())

    @property
    def expected_accept_length(self) -> float:
        return 1.0 + self.expected_accepted

    def child_table(self) -> np.ndarray:
        """child[node + 1, rank - 1] = index of that child in the tree, or -1."""
        k = self.config.topk
        table = np.full((len(self.parent) + 1, k), -1, dtype=np.int64)
        for i, (par, r) in enumerate(zip(self.parent, self.rank, strict=True)):
            table[par + 1, r - 1] = i
        return table


def _pool(steps: int, topk: int, p: np.ndarray) -> tuple[np.ndarray, ...]:
    """SGLang's candidate pool: K children of the root, then per step the K best nodes of
    the previous layer expanded into K children each, of which the K best are kept."""
    parents: list[int] = []
    ranks: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    frontier = [(-1, 1.0)]  # (node index, score) of the nodes expanded at this step
    for step in range(steps):
        layer: list[tuple[float, int]] = []
        for parent, parent_score in frontier:
            for r in range(1, topk + 1):
                idx = len(scores)
                parents.append(parent)
                ranks.append(r)
                depths.append(step + 1)
                scores.append(parent_score * p[step, r - 1])
                layer.append((scores[-1], idx))
        # Stable: on equal scores the earlier node wins, as parents precede children.
        layer.sort(key=lambda item: (-item[0], item[1]))
        frontier = [(idx, s) for s, idx in layer[:topk]]
    return (np.array(parents), np.array(ranks), np.array(depths), np.array(scores))


@lru_cache(maxsize=4096)
def _sorted_pool(steps: int, topk: int, acceptance: Acceptance) -> tuple[np.ndarray, ...]:
    p = acceptance.matrix(steps, topk)
    parents, ranks, depths, scores = _pool(steps, topk, p)
    # Highest cumulative score first; ties keep pool order so a parent precedes its child.
    order = np.lexsort((np.arange(len(scores)), -scores))
    return parents, ranks, depths, scores, order


def build_tree(config: TreeConfig, acceptance: Acceptance) -> DraftTree:
    """The verify set: the root plus the N-1 pool nodes with the highest scores."""
    parents, ranks, depths, scores, order = _sorted_pool(config.steps, config.topk, acceptance)
    chosen = np.sort(order[: config.draft_tokens - 1])
    remap = {int(old): new for new, old in enumerate(chosen)}
    remap[-1] = -1
    return DraftTree(
        config=config,
        parent=np.array([remap[int(parents[i])] for i in chosen], dtype=np.int64),
        rank=ranks[chosen].astype(np.int64),
        depth=depths[chosen].astype(np.int64),
        score=scores[chosen].astype(float),
    )


def expected_accept_length(config: TreeConfig, acceptance: Acceptance) -> float:
    """Mean tokens emitted per verify round (accepted drafts + the bonus token)."""
    *_, scores, order = _sorted_pool(config.steps, config.topk, acceptance)
    return 1.0 + float(scores[order[: config.draft_tokens - 1]].sum())


def accepted_distribution(tree: DraftTree) -> np.ndarray:
    """P(accepted drafts = d) for d = 0..steps in one verify round: the distribution
    `sample_accepted` draws from. The target's walk reaches a verified node with its path
    probability, and the nodes of one depth are disjoint outcomes, so it gets at least d
    drafts with the summed score of the depth-d nodes."""
    reach = np.ones(tree.config.steps + 2)
    reach[-1] = 0.0
    for d in range(1, tree.config.steps + 1):
        reach[d] = float(tree.score[tree.depth == d].sum())
    return reach[:-1] - reach[1:]


def sample_accepted(
    tree: DraftTree, acceptance: Acceptance, rng: np.random.Generator, count: int
) -> np.ndarray:
    """Draw accepted draft counts (bonus excluded) for `count` independent verify rounds.

    Walks the tree as the target would: at each depth the target's token is the draft's
    rank-r guess with probability p_j(r); the walk stops when that child was not verified.
    """
    steps, topk = tree.config.steps, tree.config.topk
    p = acceptance.matrix(steps, topk)
    miss = np.clip(1.0 - p.sum(axis=1, keepdims=True), 0.0, None)
    cdf = np.cumsum(np.hstack([p, miss]), axis=1)
    cdf /= cdf[:, -1:]
    children = tree.child_table()
    node = np.full(count, -1, dtype=np.int64)  # -1 = the root
    accepted = np.zeros(count, dtype=np.int64)
    alive = np.ones(count, dtype=bool)
    for depth in range(steps):
        if not alive.any():
            break
        draws = rng.random(count)
        rank = (draws[:, None] > cdf[depth][None, :]).sum(axis=1)  # 0-based; topk = miss
        hit = alive & (rank < topk)
        nxt = np.full(count, -1, dtype=np.int64)
        nxt[hit] = children[node[hit] + 1, rank[hit]]
        alive = hit & (nxt >= 0)
        node = np.where(alive, nxt, node)
        accepted += alive
    return accepted
