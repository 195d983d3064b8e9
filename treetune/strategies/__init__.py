"""Search strategies: what to launch next. One module per strategy, one name each, behind
the `Strategy` protocol; `make(name, context)` builds one for the planner."""

from treetune.strategies import gp, grid, model, random, tpe
from treetune.strategies._base import (
    AUTO,
    STRATEGIES,
    Estimate,
    Estimates,
    Proposal,
    SearchContext,
    Strategy,
    make,
    missing_requirement,
    names,
    register,
    resolve,
)
from treetune.strategies._trials import BatchStudies
from treetune.strategies.methods import MethodPart, MethodsStrategy

__all__ = ["AUTO", "STRATEGIES", "BatchStudies", "Estimate", "Estimates", "MethodPart",
           "MethodsStrategy", "Proposal", "SearchContext", "Strategy", "gp", "grid", "make",
           "missing_requirement", "model", "names", "random", "register", "resolve", "tpe"]
