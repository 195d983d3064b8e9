"""Whole requests in the model search: what a study measures on fixed-length requests.

A study's cell on a dataset of fixed-length requests (a synthetic "512 in / 1024 out"
cell) measures whole requests: each one's prefill stalls the running batch, and requests
end and restart at their own times. Speculation speeds up decoding only, so such a cell's
speedup is the steady state's, diluted by a share that depends on the tree (its rounds,
its prefill stalls): 0.79 where the steady state says 0.91, for (3,4,8) on the 30B profile
at 1024/128 tokens and 128 concurrent requests. `predict` serves these cells with the
serving model (`treetune.perfmodel.serving`), and so does the search: the fit reads each
measured cell as the steady state it implies, and the predictions of the trees that
matter (measured ones, and those a draw ranks near the top) are served whole.

The serving model costs milliseconds per (tree, cell), too much for every tree of a space
on every posterior draw: the shift from steady state to whole requests is computed at the
current fit, once per tree and cell, and each draw ranks by its own steady state first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from treetune.config import BASELINE, ServerConfig
from treetune.perfmodel import PerfModel, Profile, RunningCaps
from treetune.perfmodel.serving import Shape


class WholeRequests:
    """The log shift from steady-state speedup to whole-request speedup, per (tree, batch
    size, dataset of fixed-length requests), at one profile (`at`)."""

    def __init__(self, shapes: Mapping[str, Shape], max_batch: int, tp: int | None,
                 caps: RunningCaps | None = None) -> None:
        """`caps`: how many requests each server runs at once (its KV pool's hold)."""
        self.shapes = dict(shapes)
        self.max_batch, self.tp, self.caps = max_batch, tp, caps
        self._model: PerfModel | None = None
        self._profile: Profile | None = None
        self._speed: dict[tuple[ServerConfig, int, str], float] = {}

    def __bool__(self) -> bool:
        return bool(self.shapes)

    def at(self, profile: Profile, again: bool = False) -> None:
        """Shifts from now on are of `profile` (those known of another are forgotten;
        `again`: of this one too, its servers' caps changed)."""
        if again or profile is not self._profile:
            self._profile, self._model, self._speed = profile, None, {}

    def _log_ratio(self, config: ServerConfig, batch: int, dataset: str) -> float:
        """log(whole-request throughput / steady-state throughput) of one server."""
        key = (config, batch, dataset)
        if key not in self._speed:
            assert self._profile is not None, "WholeRequests.at first"
            if self._model is None:
                self._model = PerfModel(self._profile, self.tp)
            running = max(self.max_batch, batch)
            if self.caps is not None:
                running = min(running, self.caps(config))
            served = self._model.closed_loop(config, dataset, self.shapes[dataset], batch,
                                             running).output_tok_s
            steady = self._model.throughput(config, min(batch, running), dataset)
            self._speed[key] = (math.log(served / steady) if served > 0 and steady > 0
                                else 0.0)
        return self._speed[key]

    def server_shift(self, config: ServerConfig, batch: int, dataset: str) -> float:
        """log(whole / steady) of one server's throughput (0 on other datasets)."""
        return self._log_ratio(config, batch, dataset) if dataset in self.shapes else 0.0

    def shift(self, config: ServerConfig, batch: int, dataset: str) -> float:
        """log(whole-request speedup / steady-state speedup) of `config` (0 on datasets
        of other requests)."""
        return (self.server_shift(config, batch, dataset)
                - self.server_shift(BASELINE, batch, dataset))

    def serve(self, table: dict, configs: list, batch: int, datasets: list[str]) -> None:
        """A table of steady-state speedups (config -> batch -> per dataset), with
        `configs`' cells at `batch` served as whole requests, in place."""
        if not any(d in self.shapes for d in datasets):
            return
        for config in configs:
            table[config][batch] = [v * math.exp(self.shift(config, batch, d))
                                    for v, d in zip(table[config][batch], datasets,
                                                    strict=True)]
