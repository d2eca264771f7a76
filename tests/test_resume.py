"""Kill -9 at any point of a large copy, then re-run: complete, exact, and no debris."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from staging.checksum import LEAF_BYTES

LEAVES = 6


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "big.bin"
    path.write_bytes(os.urandom(LEAVES * LEAF_BYTES - 12345))
    return path


def stage_cmd(src, dest, *more):
    return [
        sys.executable,
        "-m",
        "datastore",
        "stage",
        str(src),
        *map(str, more),
        "--to",
        str(dest),
        "--json",
        "--streams",
        "1",
        "--checksum",
        "blake2b",
    ]


def leaves_done(dest) -> int:
    tmp = dest / ".datastore" / "tmp"
    logs = list(tmp.glob("*/*.leaves")) if tmp.exists() else []
    return max((len(p.read_text().splitlines()) - 1 for p in logs), default=0)


def finish(src, dest, *more) -> dict:
    proc = subprocess.run(stage_cmd(src, dest, *more), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_clean_copy(src, dest):
    assert (dest / src.name).read_bytes() == src.read_bytes()
    assert sorted(os.listdir(dest / ".datastore")) == ["lock", "manifest.json"]


def test_kill_mid_copy_resumes_finished_leaves(big, tmp_path):
    dest = tmp_path / "dest"
    job = subprocess.Popen(stage_cmd(big, dest), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while leaves_done(dest) < 2:
        assert job.poll() is None and time.monotonic() < deadline, "copy ended before the kill"
        time.sleep(0.002)
    job.send_signal(signal.SIGKILL)
    job.wait()
    kept = leaves_done(dest)
    assert 2 <= kept < LEAVES
    assert not (dest / big.name).exists(), "a partial file appeared under its final name"
    s = finish(big, dest)
    assert s["resumed_bytes"] >= 2 * LEAF_BYTES
    assert s["resumed_bytes"] % LEAF_BYTES == 0
    assert_clean_copy(big, dest)


def test_corrupted_partial_leaf_is_recopied(big, tmp_path):
    dest = tmp_path / "dest"
    job = subprocess.Popen(stage_cmd(big, dest), stdout=subprocess.DEVNULL)
    while leaves_done(dest) < 1:
        assert job.poll() is None, "copy ended before the kill"
        time.sleep(0.002)
    job.send_signal(signal.SIGKILL)
    job.wait()
    part = next((dest / ".datastore" / "tmp").glob("*/*.part"))
    with open(part, "r+b") as f:  # as if the data of a journaled leaf never reached the disk
        f.write(b"\0" * 4096)
    finish(big, dest)
    assert_clean_copy(big, dest)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3, 0.6])
def test_kill_at_any_point_then_rerun_is_exact(big, tmp_path, delay):
    dest = tmp_path / "dest"
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"small{i}").write_bytes(os.urandom(1000 * i))
    job = subprocess.Popen(stage_cmd(big, dest, src), stdout=subprocess.DEVNULL)
    time.sleep(delay)
    job.send_signal(signal.SIGKILL)
    job.wait()
    s = finish(big, dest, src)
    assert s["errors"] == []
    assert finish(big, dest, src)["files"] == 0
    assert_clean_copy(big, dest)
    for i in range(30):
        assert (dest / "src" / f"small{i}").read_bytes() == (src / f"small{i}").read_bytes()
