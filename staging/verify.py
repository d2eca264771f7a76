"""``datastore stage --verify``: re-hash DEST against its manifest."""

from __future__ import annotations

import json
import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from staging.checksum import combine, leaf_ranges
from staging.copy import hash_range
from staging.manifest import Manifest, open_meta

__all__ = ["verify_dest"]


def _check(dest: str, rel: str, entry: dict[str, Any], leaf: int) -> str | None:
    """A problem with one entry, or ``None`` when it matches the manifest."""
    path = os.path.join(dest, rel)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # (or a file where a directory of it was)
        return f"missing: {rel}"
    if entry["kind"] == "symlink":
        if not stat.S_ISLNK(st.st_mode) or os.readlink(path) != entry["link"]:
            return f"changed symlink: {rel}"
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file: {rel}"
    if st.st_size != entry["size"]:
        return f"size mismatch: {rel} ({st.st_size} bytes, manifest says {entry['size']})"
    if entry["hash"] is None:
        return None  # staged with --checksum none: size is all there is to check
    algo = entry["hash"].split(":", 1)[0]
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            digests = [hash_range(fd, off, n, algo) for off, n in leaf_ranges(st.st_size, leaf)]
        finally:
            os.close(fd)
    except OSError as exc:  # one file's (an I/O error): the others are still checked
        return f"unreadable: {rel} ({exc.strerror})"
    if combine(algo, digests) != entry["hash"]:
        return f"checksum mismatch: {rel}"
    return None


REPAIR = (
    "datastore stage: verify: a stage run again skips a file whose size and modification time "
    "still match its record (as a checksum mismatch's may): remove those files from DEST, then "
    "stage again"
)


def verify_dest(dest: str, streams: int) -> tuple[int, list[str]]:
    """``(entries checked, problems)`` for the manifest of ``dest``, read from its
    ``.datastore`` opened never through a link (one there is refused, named);
    ``FileNotFoundError`` where it has none."""
    meta = open_meta(dest, "read")
    try:
        os.stat("manifest.json", dir_fd=meta, follow_symlinks=False)
        manifest = Manifest.load(dest, meta)
    finally:
        os.close(meta)
    entries = sorted(manifest.entries.items())
    with ThreadPoolExecutor(streams) as pool:
        found = pool.map(lambda kv: _check(dest, kv[0], kv[1], manifest.leaf_bytes), entries)
        problems = [p for p in found if p]
    return len(entries), problems


def verify_command(cfg: Any, comm: Any) -> int:
    """Verify every node's DEST (its leader does it); print problems; exit 4 on any."""
    from staging.cluster import layout
    from staging.exitcodes import Agreed, Exit

    lay, _ = layout(comm, cfg.ranks_per_node)
    checked, problems, err = 0, [], None
    if lay.is_leader:
        dest = cfg.dest_for(lay.node)
        try:
            checked, problems = verify_dest(dest, cfg.streams)
        except (FileNotFoundError, NotADirectoryError):
            err = f"{dest}: no manifest (nothing was staged here with datastore stage)"
        except (OSError, ValueError) as exc:  # a manifest that cannot be read, a link
            err = f"{dest}: {getattr(exc, 'strerror', None) or exc}"
        problems = [f"{dest}: {p}" for p in problems]
    results = comm.gather((checked, problems, err), root=0)
    code = Exit.OK
    if lay.rank == 0:
        total = sum(c for c, _, _ in results)
        bad = [p for _, ps, _ in results for p in ps]
        errs = [e for _, _, e in results if e]
        for line in errs + bad:
            print(f"datastore stage: verify: {line}", file=sys.stderr)
        if any(": checksum mismatch: " in p for p in bad):
            print(REPAIR, file=sys.stderr)
        if cfg.json:
            print(json.dumps({"verified": total, "problems": bad, "errors": errs}))
        elif not cfg.quiet:
            failed = f"; {len(errs)} error(s)" if errs else ""  # (a DEST not verified)
            print(f"verified {total} entries: {len(bad)} problem(s){failed}")
        code = Exit.FAILED if errs else (Exit.MISMATCH if bad else Exit.OK)
    return Agreed(comm.bcast(code, root=0))
