"""Fault tests provoke real faults: emulator fault switches, signals, killed processes.

Each test gets its own short Ray temp dir and must leave no process behind (the
`ray_tmpdir` fixture of tests/conftest.py checks that after every test)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_ray_dir(ray_tmpdir):
    return ray_tmpdir
