"""Serving backends: one module per engine behind one small protocol (`Backend`).

A study names its backend in `backend: {kind: NAME, ...}`; the other keys are that
backend's own fields. Adding an engine is one module with one registered class.
"""

from treetune.backends import emulator, sglang
from treetune.backends._base import (
    BACKENDS,
    AdaptiveState,
    Backend,
    BackendFacts,
    Deployment,
    LaunchContext,
    LaunchSpec,
    ServerApi,
    backend_class,
    gather_facts,
    register,
    server_facts,
    shell_line,
)

__all__ = ["BACKENDS", "AdaptiveState", "Backend", "BackendFacts", "Deployment",
           "LaunchContext", "LaunchSpec", "ServerApi", "backend_class", "emulator",
           "gather_facts", "register", "server_facts", "sglang", "shell_line"]
