"""Resource limits: open files stay bounded by the streams, not by the size of the tree."""

from __future__ import annotations

import resource
import subprocess
import sys

from helpers import tree_bytes


def test_many_files_under_a_small_open_file_limit(tmp_path):
    src = tmp_path / "src"
    for d in range(10):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(40):
            (src / f"d{d}" / f"f{i}").write_bytes(bytes([d, i]) * 100)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "datastore",
            "stage",
            str(src),
            "--to",
            str(tmp_path / "dest"),
            "--streams",
            "8",
        ],
        capture_output=True,
        text=True,
        preexec_fn=low_limit,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert tree_bytes(tmp_path / "dest" / "src") == tree_bytes(src)
