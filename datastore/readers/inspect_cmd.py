"""The ``datastore inspect`` command: what a dataset holds, for people or (``--json``) scripts."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from staging.console import path_arg
from staging.exitcodes import Exit
from staging.progress import human_bytes

if TYPE_CHECKING:
    from datastore.readers.base import Reader

__all__ = ["EPILOG", "add_arguments", "describe", "format_text", "run"]


EPILOG = """\
exit codes:
  0  described
  2  bad input: a missing, unreadable or malformed dataset, or a spec that does not match it
     (one line on stderr naming the file and the field)

examples:
  datastore inspect /l/ssd/cosmo/train.h5
  datastore inspect '/l/ssd/cosmo/val/*.npy' --json
  datastore inspect /l/ssd/parts --layout shards   # equal-size shards, 16 samples each
  datastore inspect cosmo-spec.toml
  datastore inspect lmdb-spec.toml    # an LMDB of raw, .npy, msgpack or pickled records

spec files (.toml or .json; every key, with an example for each format: docs/loader.md):
  format = "lmdb"
  paths = "train.lmdb"
  [lmdb]
  value = "npy"
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``datastore inspect`` (``datastore.cli`` makes its parser)."""
    what = "a dataset file, directory or glob, or a spec file"
    p.add_argument("path", type=path_arg, metavar="PATH", help=what)
    p.add_argument(
        "--layout",
        choices=("shards", "per-sample"),
        help="how a set of HDF5 files holds its samples: shards with a leading sample axis, or "
        "one sample per file (default: decided from the files; files of identical shapes "
        "whose datasets share a leading length are refused without it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def describe(reader: Reader, path: str) -> dict[str, Any]:
    """The summary ``inspect`` prints, as plain data."""
    return {
        "path": path,
        "format": reader.format,
        "files": len(reader.files),
        "num_samples": len(reader),
        "fields": {
            name: {
                "dtype": reader.stored_dtype(name).str,  # as stored: byte order too
                "shape": list(f.shape),
                "spatial_axes": list(f.spatial_axes),
                "chunks": None if f.chunks is None else list(f.chunks),
                "nbytes_per_sample": f.nbytes,
            }
            for name, f in reader.fields.items()
        },
        "label": reader.label,
        "nbytes": reader.nbytes,
    }


def _tuple(values: list[int] | None) -> str:
    """``[4]`` -> ``"(4,)"``; ``None`` and ``[]`` -> ``"-"``."""
    return str(tuple(values)) if values else "-"


def format_text(summary: dict[str, Any]) -> str:
    """``describe``'s summary as a short table."""
    s = summary
    lines = [
        f"{s['path']}: {s['format']}, {s['num_samples']} samples in {s['files']} "
        f"file(s), {human_bytes(s['nbytes'])} ({s['nbytes']} bytes)"
    ]
    header = ("field", "dtype", "shape (per sample)", "spatial axes", "chunks", "per sample")
    rows = [header]
    for name, f in s["fields"].items():
        rows.append(
            (
                name,
                _dtype_name(f["dtype"]),
                str(tuple(f["shape"])),
                _tuple(f["spatial_axes"]),
                _tuple(f["chunks"]),
                human_bytes(f["nbytes_per_sample"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if s["label"] is not None:
        lines.append(f"label: {s['label']}")
    return "\n".join(lines)


def _dtype_name(dtype_str: str) -> str:
    """``"<f4"`` -> ``"float32"``; a non-native byte order is spelled out: ``"float32 (>f4)"``;
    a dtype numpy cannot parse back from its string (zarr's ``StringDType()``) as it is."""
    import numpy as np

    try:
        dt = np.dtype(dtype_str)
    except TypeError:
        return dtype_str
    return dt.name if dt.isnative else f"{dt.name} ({dtype_str})"


def run(args: argparse.Namespace) -> int:
    from datastore.readers.base import DatasetError
    from datastore.readers.spec import open_dataset

    try:
        with open_dataset(args.path, layout=args.layout) as reader:
            reader.check_files()  # detection and opening may look at some files only
            summary = describe(reader, args.path)
    except DatasetError as exc:
        print(f"datastore inspect: error: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    print(json.dumps(summary) if args.json else format_text(summary))
    return Exit.OK
