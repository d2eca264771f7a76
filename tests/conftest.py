"""Fixtures for the ``datastore stage`` tests; the helpers themselves live in ``helpers.py``."""

from __future__ import annotations

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
