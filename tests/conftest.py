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


def mapped_files() -> set[str]:
    """Every file some live process has mapped (``/proc/*/maps``)."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as fh:
            mapped.update(line.split(None, 5)[-1].strip() for line in fh if "/dev/shm/" in line)
    return mapped


@pytest.fixture(scope="module")
def no_stale_mpich_shm():
    """Aborted MPICH jobs leave /dev/shm segments; remove the ones a module's tests created
    that no live process still maps (another job running beside the tests keeps its own)."""
    before = set(glob.glob("/dev/shm/mpich*"))
    yield
    in_use = mapped_files()
    for path in set(glob.glob("/dev/shm/mpich*")) - before - in_use:
        with contextlib.suppress(OSError):
            os.unlink(path)
