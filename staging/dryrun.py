"""``datastore stage --dry-run``: what would be copied or removed, how many bytes, and how
long."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence

from staging.config import StageConfig
from staging.exitcodes import Exit
from staging.manifest import Manifest
from staging.plan import Item, Plan, assign, build_plan
from staging.probe import existing_ancestor, measure
from staging.progress import MIB, human_bytes
from staging.stage import (
    planned_names,
    space_shortfall,
    stale_files,
    trees_to_clean,
    up_to_date,
    whole_archives,
)

__all__ = ["dry_run", "node_refusal"]


def _node_plan(
    cfg: StageConfig, node: int, nodes: int
) -> tuple[str, Plan, list[Item], int, list, str | None]:
    """``(dest, plan, items to copy, items skipped, files removed, the run's refusal of
    DEST)`` of ``node``."""
    dest = cfg.dest_for(node)
    manifest, refused = _manifest(dest)
    plan = build_plan(
        list(cfg.sources), cfg.unpack, whole_archives(manifest), cfg.io, cfg.confine, dest
    )
    groups = assign(plan, nodes)[node] if cfg.mode == "shard" else plan.groups
    trees, limit = trees_to_clean(plan, cfg.mode), planned_names(plan, cfg.mode)
    removed = stale_files(manifest, trees, groups, limit)
    copy, skipped = [], 0
    for item in (i for g in groups for i in g.items if i.kind != "dir"):
        if up_to_date(item, manifest.entries.get(item.dest), dest):
            skipped += 1
        else:
            copy.append(item)
    return dest, plan, copy, skipped, removed, refused


def _manifest(dest: str) -> tuple[Manifest, str | None]:
    """DEST's manifest, or an empty one and the error the run stops at before its plan (a
    corrupt manifest, a link where ``.datastore`` belongs, dangling too: it was an internal
    error here)."""
    try:
        return Manifest.load(dest), None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        return Manifest(), f"{dest}: cannot prepare destination ({why})"


def _shortfall(dest: str, copy: list[Item]) -> str | None:
    usage = shutil.disk_usage(existing_ancestor(dest))
    return space_shortfall(dest, sum(i.size for i in copy), usage.free, usage.total)


def node_refusal(cfg: StageConfig, node: int, nodes: int) -> tuple[str, int] | None:
    """What the run would refuse on ``node``, and its exit code (``None``: nothing): its DEST's
    ``.datastore``, else its share's space; the check an MPI dry run makes on every node but
    node 0, whose plan it prints (it checked the space only: a corrupt manifest there was
    'would stage', exit 0)."""
    dest, _, copy, _, _, refused = _node_plan(cfg, node, nodes)
    if refused:
        return refused, Exit.FAILED
    short = _shortfall(dest, copy)
    return (short, Exit.NO_SPACE) if short else None


def dry_run(
    cfg: StageConfig, node: int = 0, nodes: int = 1, others: Sequence[tuple[str, int]] = ()
) -> int:
    """Print the plan of ``node`` (of ``nodes``) against its DEST; writes nothing there.
    ``others``: the other nodes' :func:`node_refusal`, reported with this node's."""
    dest, plan, copy, skipped, removed, refused = _node_plan(cfg, node, nodes)
    nbytes = sum(i.size for i in copy)
    sources = [i.path for i in copy if i.kind == "file" and i.path]
    largest = max(sources, key=os.path.getsize, default=None)
    probe = measure(largest, dest)
    short = _shortfall(dest, copy)  # as the run would refuse
    errors = [e for e in (refused, *plan.errors, short, *(e for e, _ in others)) if e]
    seconds = probe.estimate(nbytes, len(copy), cfg.streams)
    if cfg.json:
        print(
            json.dumps(
                {
                    "dest": dest,
                    "files": len(copy),
                    "bytes": nbytes,
                    "skipped": skipped,
                    "estimate_s": round(seconds, 2),
                    "read_mib_per_s": _mib(probe.read_bps),
                    "write_mib_per_s": _mib(probe.write_bps),
                    "items": [{"dest": i.dest, "source": i.source, "bytes": i.size} for i in copy],
                    "removed": removed,
                    "errors": errors,
                }
            )
        )
    else:
        where = f"{dest} (node {node} of {nodes})" if nodes > 1 else dest
        for i in copy:
            print(f"copy {human_bytes(i.size):>10}  {i.dest}  <-  {i.source}")
        for key in removed:
            print(f"remove      {key}  (no longer in the source or this node's share)")
        print(
            f"would stage {len(copy)} files, {human_bytes(nbytes)} ({nbytes} bytes) into {where}; "
            f"{skipped} unchanged would be skipped; {len(removed)} would be removed"
        )
        print(
            f"estimated time: {seconds:.1f} s (probed read {_rate(probe.read_bps)}, "
            f"write {_rate(probe.write_bps)}, {probe.per_file_s * 1e3:.2f} ms per file)"
        )
        for e in errors:
            print(f"datastore stage: error: {e}", file=sys.stderr)
    if refused or Exit.FAILED in (c for _, c in others):  # (the run stops before the space)
        return Exit.FAILED
    return Exit.NO_SPACE if short or others else Exit.BAD_INPUT if plan.errors else Exit.OK


def _mib(bps: float | None) -> float | None:
    """A probed rate in MiB/s for ``--json``; ``None`` (null) where none was measured."""
    return None if bps is None else round(bps / MIB, 1)


def _rate(bps: float | None) -> str:
    return "not measured" if bps is None else f"{bps / MIB:.0f} MiB/s"
