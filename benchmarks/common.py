"""What the benchmark scripts share: finding the venv's tools, the page cache, the machine."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = [
    "TAG",
    "PageCache",
    "cpu_seconds",
    "machine_info",
    "read_tagged",
    "say",
    "timed_epochs",
    "venv_tool",
]

TAG = "@@ "  # a benchmark child's protocol lines on stdout start with this


def venv_tool(name: str) -> str:
    """The executable ``name`` next to this interpreter (the venv's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    exe = here if os.access(here, os.X_OK) else shutil.which(name)
    if not exe:
        sys.exit(f"{name} not found: run with the project venv's python (make bench)")
    return exe


class PageCache:
    """Drops the page cache before cold runs (root only), or remembers and says that it cannot."""

    def __init__(self, warm: bool) -> None:
        self.can_drop = not warm
        self.note = "never dropped (--warm)" if warm else "dropped before every cold run"

    def drop(self) -> None:
        os.sync()
        if not self.can_drop:
            return
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as exc:
            self.can_drop = False
            self.note = f"NOT dropped (not permitted: {exc.strerror}); 'cold' figures are warm"
            print(f"NOTE: cannot drop the page cache ({exc}); cold runs are warm", flush=True)


def machine_info(*extra: str) -> str:
    """One line: cores, CPU model, kernel, Python, anything in ``extra``, and the date."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    parts = [
        f"nproc {os.cpu_count()}",
        f"CPU {cpu}",
        f"kernel {platform.release()}",
        f"Python {platform.python_version()}",
        *extra,
    ]
    return ", ".join(parts) + time.strftime(", date %Y-%m-%d %H:%M:%S %Z")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def say(line: str) -> None:
    """A protocol line to the parent benchmark."""
    print(TAG + line, flush=True)


def read_tagged(proc: subprocess.Popen) -> str:
    """The next protocol line of a child (other output passes through)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(TAG):
            return line[len(TAG) :].rstrip("\n")
        sys.stdout.write(line)
    raise SystemExit(f"a benchmark child (pid {proc.pid}) exited with {proc.wait()}")


def timed_epochs(epoch: Callable[[], tuple[int, int]], epochs: int) -> None:
    """A benchmark client's protocol: one warm-up ``epoch()`` (``-> (batches, bytes)``), then
    ``ready``; on the parent's go (a line on stdin) ``epochs`` timed epochs, reported as one
    JSON line (start, end, batches, bytes, CPU seconds of this process)."""
    epoch()
    say("ready")
    sys.stdin.readline()
    batches = nbytes = 0
    cpu, t0 = time.process_time(), time.monotonic()
    for _ in range(epochs):
        nb, n = epoch()
        batches, nbytes = batches + nb, nbytes + n
    t1, cpu = time.monotonic(), time.process_time() - cpu
    say(json.dumps({"t0": t0, "t1": t1, "batches": batches, "bytes": nbytes, "cpu": cpu}))
