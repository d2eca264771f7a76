"""The typed configuration of one ``datastore stage`` run."""

from __future__ import annotations

import os
from dataclasses import dataclass

from staging.checksum import ALGORITHMS
from staging.directio import IO_MODES

__all__ = ["MODES", "StageConfig", "default_streams"]

MODES = ("replicate", "shard")


def default_streams() -> int:
    """Parallel I/O streams per rank: 4 per core, at least 4, at most 32.

    Staging waits on storage far more than on the CPU, so more streams than cores keep the
    device queue full; ``DATASTORE_STREAMS`` overrides.
    """
    env = os.environ.get("DATASTORE_STREAMS")
    if env:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"DATASTORE_STREAMS must be a whole number >= 1, got {env!r}")
        return int(env)
    return max(4, min(32, 4 * (os.cpu_count() or 1)))


@dataclass(frozen=True)
class StageConfig:
    """What to stage where, and how. ``dest`` may hold ``{node}``, the node's index."""

    dest: str
    sources: tuple[str, ...] = ()
    streams: int = 0
    unpack: bool = True
    mode: str = "replicate"
    checksum: str = "xxh3"
    io: str = "auto"
    dry_run: bool = False
    verify: bool = False
    json: bool = False
    progress_json: bool = False
    quiet: bool = False
    ranks_per_node: int | None = None
    preserve_special_bits: bool = False
    confine: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.streams == 0:
            object.__setattr__(self, "streams", default_streams())
        if self.progress_json:  # progress lines, then the summary as the last JSON line
            object.__setattr__(self, "json", True)
        if self.streams < 1:
            raise ValueError(f"--streams must be >= 1, got {self.streams}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.checksum not in (*ALGORITHMS, "none"):
            raise ValueError(f"--checksum must be one of {', '.join((*ALGORITHMS, 'none'))}")
        if self.io not in IO_MODES:
            raise ValueError(f"--io must be one of {', '.join(IO_MODES)}, got {self.io!r}")
        if not self.dest:
            raise ValueError("--to DEST is required")
        if not self.sources and not self.verify:
            raise ValueError("give at least one SRC to stage (or --verify to check DEST)")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node must be >= 1, got {self.ranks_per_node}")

    def dest_for(self, node: int) -> str:
        """DEST of ``node``, with ``{node}`` filled in."""
        return os.path.abspath(self.dest.replace("{node}", str(node)))
