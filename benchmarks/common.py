"""What the benchmark scripts share: finding the venv's tools, the page cache, the machine."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time

__all__ = ["PageCache", "machine_info", "venv_tool"]


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
