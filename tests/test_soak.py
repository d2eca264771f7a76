"""A short soak (45 s): a real ``datastore serve``, clients killed at random, the service
stopped and restarted, stages killed mid-copy and run into a 'full disk'; every check of
``benchmarks/soak.py`` must hold (epochs whole, destinations verified, nothing left behind,
RSS and descriptors back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staging.cluster import LAUNCH_ENV

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_leaves_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seconds", "45",
           "--clients", "2", "--dir", str(tmp_path), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    report = json.loads(proc.stdout.splitlines()[-1])
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, (failed, report)
    assert proc.returncode == 0, proc.stderr
    assert report["kills"] >= 5 and report["epochs"] > 0 and report["stage_rounds"]
    assert report["restart_stop"]["exit"] == 0  # the mid-run SIGTERM
