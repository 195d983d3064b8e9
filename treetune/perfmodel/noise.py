"""Measurement noise: every launch runs at its own speed, and speed drifts while it runs.

Both are multiplicative on step time and log-normal. The per-launch factor is drawn once
when a server starts (clock boost, placement, allocator luck); the drift is an
Ornstein-Uhlenbeck process on log-speed whose stationary spread is `measurement_cv`, so a
measurement lasting about `correlation_s` sees roughly that much noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from treetune.perfmodel.profile import Noise


def lognormal_factor(cv: float, rng: np.random.Generator) -> float:
    """A factor with mean 1 and coefficient of variation `cv`."""
    if cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    return float(math.exp(rng.normal(-0.5 * sigma * sigma, sigma)))


@dataclass
class NoiseModel:
    launch_cv: float
    measurement_cv: float
    correlation_s: float = 5.0

    @classmethod
    def from_profile(cls, noise: Noise, enabled: bool = True) -> NoiseModel:
        if not enabled:
            return cls(0.0, 0.0)
        return cls(noise.launch_cv, noise.measurement_cv)

    def launch_factor(self, rng: np.random.Generator) -> float:
        return lognormal_factor(self.launch_cv, rng)

    def measurement_factor(self, rng: np.random.Generator) -> float:
        """One measurement's factor, for direct (in-process) evaluation."""
        return lognormal_factor(self.measurement_cv, rng)

    def drift(self, rng: np.random.Generator) -> Drift:
        return Drift(self.measurement_cv, self.correlation_s, rng)


class Drift:
    """Slow speed drift over emulated time (exact OU updates, any step length)."""

    def __init__(self, cv: float, correlation_s: float, rng: np.random.Generator) -> None:
        self.sigma = math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0
        self.tau = correlation_s
        self.rng = rng
        self.x = rng.normal(0.0, self.sigma) if self.sigma else 0.0

    def advance(self, dt: float) -> float:
        """Move `dt` emulated seconds forward and return the current step-time factor."""
        if not self.sigma:
            return 1.0
        decay = math.exp(-dt / self.tau)
        self.x = self.x * decay + self.sigma * math.sqrt(1 - decay * decay) * self.rng.normal()
        return math.exp(self.x - 0.5 * self.sigma * self.sigma)
