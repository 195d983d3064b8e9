"""Fault tests provoke real faults: emulator fault switches, signals, killed processes.

Each test gets its own short Ray temp dir (Ray's socket paths break past ~100 characters)
and must leave no process behind; `no_leftovers` checks that after every test."""

from __future__ import annotations

import tempfile

import pytest
from studykit import processes_with, wait_until


@pytest.fixture(autouse=True)
def ray_tmpdir(monkeypatch):
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    monkeypatch.setenv("TREETUNE_RAY_TMPDIR", path)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield path
    # Whatever the test did, nothing it started may outlive it.
    assert wait_until(lambda: not processes_with(path), 30), (
        f"processes outlived the test: {processes_with(path)}")
