"""Resource limits: open files stay bounded by the streams, not by the size of the tree."""

from __future__ import annotations

import subprocess
import sys

from helpers import tree_bytes


def test_many_files_under_a_small_open_file_limit(tmp_path):
    src = tmp_path / "src"
    for d in range(10):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(40):
            (src / f"d{d}" / f"f{i}").write_bytes(bytes([d, i]) * 100)

    proc = subprocess.run(  # (util-linux's prlimit: a preexec_fn would fork the test process)
        ["prlimit", "--nofile=48", sys.executable, "-m", "datastore", "stage", str(src),
         "--to", str(tmp_path / "dest"), "--streams", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert tree_bytes(tmp_path / "dest" / "src") == tree_bytes(src)
