"""Worlds: the truth the emulator serves and the benchmark judges by, kept apart from the
model the search fits (see `_world.py` for the file format, `replay.py` for replays)."""

from treetune.worlds._world import (
    AcceptanceShape,
    Effects,
    LaunchBias,
    MoEDispatch,
    SlowLaunches,
    VerifyCliffs,
    World,
    WorldModel,
    load_world,
    resolve_world_path,
    shipped_worlds,
)

__all__ = ["AcceptanceShape", "Effects", "LaunchBias", "MoEDispatch", "SlowLaunches",
           "VerifyCliffs", "World", "WorldModel", "load_world", "resolve_world_path",
           "shipped_worlds"]
