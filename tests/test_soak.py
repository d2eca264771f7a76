"""A short soak (45 s): a real ``datastore serve``, clients killed at random and resumed from
their saved ``state_dict``, the service stopped and restarted, stages killed mid-copy and run
into a 'full disk'; every sample's bytes checked against the source. Two faults are injected
(``--inject-faults``): one client crashes once, another once sees a wrong byte. The run must
fail on exactly those two, and every other check of ``benchmarks/soak.py`` must hold (epochs
whole, resumed epochs whole, destinations verified, nothing left behind, RSS and descriptors
back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staging.cluster import LAUNCH_ENV

ROOT = Path(__file__).parent.parent
CAUGHT = ("no client exited unexpectedly", "every sample's bytes equal the source's")


@pytest.mark.slow
def test_a_short_soak_loses_nothing_leaves_nothing_and_catches_every_fault(short_tmp):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seconds", "45",
           "--clients", "2", "--inject-faults", "--dir", str(short_tmp), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    report = json.loads(proc.stdout.splitlines()[-1])
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert sorted(failed) == sorted(CAUGHT), (failed, report)
    assert proc.returncode == 1, proc.stderr  # the injected faults fail the soak

    exits = sorted((e["client"], e["exit"]) for e in report["unexpected_exits"])
    assert exits == [(0, 1), (1, 3)], report["unexpected_exits"]  # exactly the two injected
    crash, wrong = sorted(report["unexpected_exits"], key=lambda e: e["client"])
    assert "RuntimeError: a fault injected by --inject-faults" in crash["stderr"]
    assert "bytes differ from the source" in wrong["stderr"]

    assert report["kills"] >= 3 and report["stage_rounds"]  # each after a save: fewer under load
    assert report["epochs"] > 0 and report["bad_epochs"] == 0
    assert report["samples_checked"] == 64 * report["epochs"]  # every sample of every epoch
    assert report["resumed_epochs"] > 0  # a kill mid-epoch, then exactly the rest of it
    assert report["restart_stop"]["exit"] == 0  # the mid-run SIGTERM
