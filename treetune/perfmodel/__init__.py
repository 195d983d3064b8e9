"""Performance model of EAGLE tree speculative decoding (pure numpy/scipy, no GPU)."""

from treetune.perfmodel.acceptance import (
    Acceptance,
    DraftTree,
    build_tree,
    expected_accept_length,
    sample_accepted,
)
from treetune.perfmodel.cost import CostModel, RoundTime, distinct_experts, independent_tokens
from treetune.perfmodel.memory import MemoryCheck, RunningCaps, check_memory
from treetune.perfmodel.noise import Drift, NoiseModel, lognormal_factor
from treetune.perfmodel.predict import PerfModel, Prediction, ServingPrediction
from treetune.perfmodel.profile import (
    DEFAULT_METHOD,
    DRAFTERS,
    MTP,
    Calibration,
    Dataset,
    Draft,
    Hardware,
    Method,
    MoE,
    Noise,
    Profile,
    Target,
    load_profile,
    resolve_profile_path,
    shipped_profiles,
)
from treetune.perfmodel.serving import Serving, Shape

__all__ = [
    "DEFAULT_METHOD",
    "DRAFTERS",
    "MTP",
    "Acceptance",
    "Calibration",
    "CostModel",
    "Dataset",
    "Draft",
    "DraftTree",
    "Drift",
    "Hardware",
    "MemoryCheck",
    "Method",
    "MoE",
    "Noise",
    "NoiseModel",
    "PerfModel",
    "Prediction",
    "Profile",
    "RoundTime",
    "RunningCaps",
    "Serving",
    "ServingPrediction",
    "Shape",
    "Target",
    "build_tree",
    "check_memory",
    "distinct_experts",
    "expected_accept_length",
    "independent_tokens",
    "load_profile",
    "lognormal_factor",
    "resolve_profile_path",
    "sample_accepted",
    "shipped_profiles",
]
