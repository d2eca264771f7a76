"""Shared fixtures; the helpers themselves live in ``helpers.py``."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import helpers


@pytest.fixture
def run_stage():
    """``run_stage(*args, env=None, check=None)``: the real CLI in a subprocess."""
    return helpers.run_stage


@pytest.fixture
def make_tree():
    """``make_tree(root, seed=0)``: build the standard small source tree under ``root``."""
    return helpers.make_tree


@pytest.fixture(scope="module")
def no_stale_mpich_shm():
    """Aborted MPICH jobs leave /dev/shm segments; remove the ones a module's tests created."""
    before = set(glob.glob("/dev/shm/mpich*"))
    yield
    for path in set(glob.glob("/dev/shm/mpich*")) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)
