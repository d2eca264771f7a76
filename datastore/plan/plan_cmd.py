"""The ``datastore plan`` command: how to stage, hold and shuffle a dataset on a machine.

A thin layer over :mod:`datastore.plan.plan_model`: it reads the dataset (a path, through the
readers ``datastore inspect`` uses, or ``--samples`` with ``--sample-bytes`` or
``--shape``/``--dtype``), merges the machine and job values (defaults, then a TOML file, then
flags: what was measured overrides the defaults), and prints the plan as tables or JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tomllib
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from staging.console import option_type, path_arg
from staging.exitcodes import Exit
from staging.progress import human_bytes

if TYPE_CHECKING:
    from datastore.plan.plan_model import DatasetSize, Plan

__all__ = ["DEFAULTS", "EPILOG", "add_arguments", "format_text", "plan_dict", "run"]


def _count(least: int) -> Callable[[Any, str], int]:
    def parse(value: Any, name: str) -> int:
        text = str(value).strip()
        if isinstance(value, bool) or not (isinstance(value, int) or text.lstrip("-").isdigit()):
            raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        if int(text) < least:
            raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        return int(text)

    return parse


def _number(value: Any, name: str, *, allow_zero: bool = False) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return v


def _size(value: Any, name: str) -> int:
    from datastore.store.memory import parse_size

    return parse_size(value, name)


def _room(value: Any, name: str) -> int:
    """A size of 1 byte or more (``datastore serve --memory-budget`` refuses 0)."""
    from datastore.store.memory import parse_size

    return parse_size(value, name, least=1)


def _rate(value: Any, name: str) -> float:
    """Bytes per second: ``"25G"``, ``"25GiB/s"`` (powers of 1024, as sizes) or a number. Bits
    (``"25Gb/s"``, ``"100Gbps"``: how links are sold) are refused, not read as bytes."""
    if isinstance(value, str):
        text = value.strip().removesuffix("/s")
        if text.endswith("b") or text.lower().endswith(("bps", "bit")):
            raise ValueError(
                f"{name} takes bytes per second, got {value!r}: bits (a link of 25Gb/s moves "
                "3.125e9 bytes/s, about 2.9G)"
            )
        try:  # a plain number of bytes per second, fractions too (a measured rate)
            value = float(text)
        except ValueError:
            value = _size(text, name)
    return _number(value, name)


def _seconds(value: Any, name: str) -> float:
    """``0.25``, ``"0.25s"`` or ``"250ms"``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text.endswith("ms"):
            return _number(text[:-2], name) / 1e3
        return _number(text.removesuffix("s"), name)
    return _number(value, name)


def _ints(value: Any, name: str) -> tuple[int, ...]:
    """``"2,1,1"``, ``"2x1x1"``, ``[2, 1, 1]`` or one int."""
    items = value if isinstance(value, list) else str(value).replace("x", ",").split(",")
    if isinstance(value, int) and not isinstance(value, bool):
        items = [value]
    out = [_count(0)(v, name) for v in items if str(v).strip()]
    if not out or len(out) != len(items):  # "4,,8" is not (4, 8)
        raise ValueError(f"{name} needs whole numbers, got {value!r}")
    return tuple(out)


def _shape(value: Any, name: str) -> tuple[int, ...]:
    """``"4,128,128,128"``: sizes of 1 or more."""
    shape = _ints(value, name)
    if min(shape) < 1:
        raise ValueError(f"{name} needs sizes >= 1, got {value!r}")
    return shape


def _splits(value: Any, name: str) -> tuple[tuple[int, ...], ...]:
    """One split or several: a file gives ``[2, 1, 1]`` or ``[[2, 1, 1], [2, 2, 1]]`` (the
    flag repeats, each an ``_ints``)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return tuple(_ints(v, name) for v in value)
    return (_ints(value, name),)


def _text(value: Any, name: str) -> str:
    return str(value)


def _positive(value: Any, name: str) -> float:
    return _number(value, name)


def _non_negative(value: Any, name: str) -> float:
    return _number(value, name, allow_zero=True)


# key: (parser, default, help); None: no default, a value must be given
DEFAULTS: dict[str, tuple[Callable[[Any, str], Any], Any, str]] = {
    "nodes": (_count(1), None, "nodes of the job"),
    "gpus_per_node": (_count(0), 4, "GPUs per node (0: none)"),
    "ranks_per_node": (_count(1), None, "ranks per node (default: one per GPU)"),
    "memory_per_node": (_room, "256G", "memory a node gives the data (serve's --memory-budget)"),
    "gpu_memory": (_size, "80G", "memory of one GPU"),
    "nvme_per_node": (_size, "3T", "node-local disk free for staging"),
    "pfs_read_bw": (_rate, "100G", "parallel filesystem read bandwidth, shared by the nodes"),
    "nvme_write_bw": (_rate, "2G", "one node's NVMe write bandwidth"),
    "network_bw": (_rate, "25G", "one node's network link bandwidth"),
    "exchange_bw": (
        _rate,
        None,
        "how fast a node's store exchanges samples end to end: "
        "cutting, packing, the link, unpacking (measured: benchmarks/plan_check.py; "
        "default: the link)",
    ),
    "global_batch": (_count(1), None, "samples per step over all ranks"),
    "step_time": (_seconds, None, "seconds of one training step (0.25, 250ms)"),
    "spatial": (_splits, (), "a spatial split to weigh, e.g. 2,1,1 (repeat for several)"),
    "halo": (_ints, 0, "halo width: one, or one per spatial axis"),
    "boundary": (_text, "zero", "halo outside the volume: zero or clip"),
    "prefetch": (_count(1), 2, "batches prepared ahead (the loader's prefetch)"),
    "window": (_count(1), 4096, "K of shuffle='window:K'"),
    "activation_factor": (_non_negative, 0.0, "GPU bytes a step takes per byte of input batch"),
    "max_exchange_share": (_positive, 0.1, "share of a step the global exchange may take"),
}
MACHINE = (
    "nodes", "gpus_per_node", "ranks_per_node", "memory_per_node", "gpu_memory",
    "nvme_per_node", "pfs_read_bw", "nvme_write_bw", "network_bw", "exchange_bw",
)  # fmt: skip

EPILOG = """\
values: flags override the --machine file, which overrides the defaults. Sizes and
bandwidths take K, M, G, T (powers of 1024): 256G, 3T, 25G or 25GiB/s; plain numbers are
bytes (per second). Every key of the file is a flag's name with underscores:

  # machine.toml
  nodes = 64
  gpus_per_node = 4
  memory_per_node = "512G"
  nvme_per_node = "3.5T"
  pfs_read_bw = "80G"       # measured: the job's share of the filesystem
  nvme_write_bw = "5G"
  network_bw = "23G"
  exchange_bw = "6G"        # measured: the store's own exchange rate (plan_check.py)
  global_batch = 256
  step_time = 0.4

exit codes:
  0  planned (also when no layout fits: the reasons say so)
  2  bad input: a missing or malformed value or dataset, a split that cannot work

examples:
  datastore plan /lustre/proj/cosmo --machine machine.toml
  datastore plan --samples 100000 --shape 4,128,128,128 --dtype float32 --nodes 16 \\
      --global-batch 64 --step-time 0.3 --spatial 2,1,1 --halo 1 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``datastore plan`` (``datastore.cli`` makes its parser)."""
    what = "a dataset (as for inspect)"
    p.add_argument("dataset", type=path_arg, nargs="?", metavar="DATASET", help=what)
    p.add_argument(
        "--layout",
        choices=("shards", "per-sample"),
        help="how a set of HDF5 files of DATASET holds its samples (as inspect's --layout)",
    )
    d = p.add_argument_group("a dataset given by its sizes (instead of DATASET)")
    d.add_argument("--samples", type=option_type(_count(1), "--samples"), help="number of samples")
    what = "bytes per sample (no spatial split then)"
    d.add_argument("--sample-bytes", type=option_type(_room, "--sample-bytes"), help=what)
    what = "per-sample shape, e.g. 4,128,128,128"
    d.add_argument("--shape", type=option_type(_shape, "--shape"), help=what)
    d.add_argument("--dtype", help="dtype of --shape (default float32)")
    what = "spatial axes of --shape (default: the last 3)"
    d.add_argument("--spatial-axes", type=option_type(_ints, "--spatial-axes"), help=what)
    what = "files it is stored in (default: one per sample)"
    d.add_argument("--files", type=option_type(_count(1), "--files"), help=what)
    what = "a TOML file of the values below"
    p.add_argument("--machine", type=path_arg, metavar="FILE", help=what)
    m = p.add_argument_group("machine and job (measured values beat the defaults)")
    for key, (parse, default, text) in DEFAULTS.items():
        shown = "" if default in (None, ()) else f" (default {default})"
        flag = "--" + key.replace("_", "-")
        if key == "spatial":  # each a split: _ints
            text += " (default: a ladder of splits)"
            m.add_argument(flag, type=option_type(_ints, flag), action="append", help=text)
        else:
            m.add_argument(flag, type=option_type(parse, flag), help=text + shown)
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ----------------------------------------------------------------------------- values


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--machine {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--machine {path}: not valid TOML ({exc})") from None
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"--machine {path}: unknown key(s) {', '.join(unknown)}; the keys are "
            + ", ".join(DEFAULTS)
        )
    return values


def values_of(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """Every machine and job value, parsed (the flags' by argparse), and where each came from
    (``flag``, the file's path, ``default``)."""
    found = _read_file(args.machine) if args.machine else {}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, (parse, default, _) in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        given = getattr(args, key)
        if given is not None:
            values[key], origin[key] = tuple(given) if key == "spatial" else given, "flag"
        elif key in found:
            values[key] = parse(found[key], f"{args.machine}: {key}")
            origin[key] = args.machine
        elif key == "ranks_per_node":  # one per GPU
            values[key] = max(1, values["gpus_per_node"])
            origin[key] = "default"
        elif key == "exchange_bw":  # the link, no cost of its own
            values[key] = values["network_bw"]
            origin[key] = "default"
        elif default is None:
            raise ValueError(f"missing {flag} (or {key} = ... in the --machine file)")
        else:
            values[key] = () if key == "spatial" else parse(default, key)
            origin[key] = "default"
    return values, origin


def dataset_of(args: argparse.Namespace) -> tuple[DatasetSize, str]:
    """The dataset's sizes, and how to name it."""
    import numpy as np

    from datastore.plan.plan_model import DatasetSize
    from datastore.readers.base import FieldInfo, default_spatial_axes

    direct = [args.samples, args.sample_bytes, args.shape, args.dtype, args.spatial_axes]
    direct.append(args.files)
    if args.dataset is not None:
        if any(v is not None for v in direct):
            raise ValueError(
                "give a DATASET path or its sizes (--samples with --sample-bytes or --shape), "
                "not both"
            )
        return _read_dataset(args.dataset, args.layout), args.dataset
    if args.layout is not None:
        raise ValueError("--layout goes with a DATASET path, not with its sizes")
    if args.samples is None:
        raise ValueError("missing the dataset: a DATASET path, or --samples with --sample-bytes "
                         "or --shape")  # fmt: skip
    samples, files = args.samples, args.files or 0
    if files > samples:
        raise ValueError(
            f"--files {files} is more than the {samples} samples (a file holds one or more)"
        )
    if (args.sample_bytes is None) == (args.shape is None):
        raise ValueError("give exactly one of --sample-bytes and --shape (with --dtype)")
    if args.sample_bytes is not None:
        if args.dtype is not None or args.spatial_axes is not None:
            raise ValueError("--dtype and --spatial-axes go with --shape, not --sample-bytes")
        field = FieldInfo("sample", np.dtype(np.uint8), (args.sample_bytes,))
    else:
        shape = args.shape
        try:
            dtype = np.dtype(args.dtype or "float32")
        except TypeError:
            raise ValueError(f"--dtype: not a numpy dtype: {args.dtype!r}") from None
        if dtype.itemsize < 1:
            raise ValueError(f"--dtype {args.dtype!r} has no fixed size")
        if dtype.kind not in "biufc":  # an object is a pointer, a string no tensor's element
            raise ValueError(
                f"--dtype {args.dtype!r}: not a numeric dtype (bool, int, float, complex)"
            )
        if args.spatial_axes is None:
            axes = default_spatial_axes(len(shape))
        else:
            axes = args.spatial_axes
            if len(set(axes)) != len(axes) or max(axes) >= len(shape):
                raise ValueError(
                    f"--spatial-axes {','.join(map(str, axes))}: distinct axes of the "
                    f"{len(shape)}-axis --shape"
                )
        field = FieldInfo("x", dtype, shape, axes)
    ds = DatasetSize(samples, (field,), files=files)
    return ds, "(sizes given)"


def _read_dataset(path: str, layout: str | None) -> DatasetSize:
    from datastore.plan.plan_model import DatasetSize
    from datastore.readers.spec import open_dataset

    with open_dataset(path, layout=layout) as reader:
        reader.check_files()
        disk = [_disk_bytes(f) for f in reader.files]
        counts = _file_samples(reader)
        sizes = () if counts is None else tuple(zip(disk, counts, strict=True))
        return DatasetSize(len(reader), tuple(reader.fields.values()), len(disk), sum(disk), sizes)


def _file_samples(reader: Any) -> list[int] | None:
    """The samples in each of ``reader``'s files (where ``datastore stage --mode shard`` places
    them): one each in a set of one-sample files, a shard's count in a set of shards (its
    ``offsets``), all in a dataset of one file; ``None`` where not known."""
    files, offsets = reader.files, getattr(reader, "offsets", None)
    if len(files) == 1:
        return [len(reader)]
    if offsets is not None and len(offsets) == len(files) + 1:
        return [int(b - a) for a, b in itertools.pairwise(offsets)]
    return [1] * len(files) if len(files) == len(reader) else None


def _disk_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    total = 0
    for top, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(top, n)) for n in names)
    return total


# ----------------------------------------------------------------------------- output


def _rate_text(bps: float) -> str:
    return human_bytes(bps) + "/s"


def _parts(parts: tuple[int, ...] | None) -> str:
    return "none" if parts is None else "x".join(map(str, parts))


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Aligned columns, indented; the columns in ``right`` to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        return "  " + "  ".join(cells).rstrip()

    return [line(r) for r in rows]


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def format_text(plan: Plan, name: str, origin: dict[str, str]) -> str:
    """The plan as tables for people."""
    from datastore.plan.plan_model import duration

    ds, m, job = plan.dataset, plan.machine, plan.job
    fields = ", ".join(f"{f.name} {f.dtype.name} {tuple(f.shape)}" for f in ds.fields)
    gpus = f"{m.gpus_per_node} GPUs of {human_bytes(m.gpu_memory)}" if m.gpus_per_node else "no GPU"
    lines = [
        f"dataset {name}: {ds.num_samples:,} samples of {human_bytes(ds.sample_bytes)} "
        f"({fields}) = {human_bytes(ds.nbytes)}; {ds.files:,} file(s), "
        f"{human_bytes(ds.stored_bytes)} on disk",
        f"machine: {m.nodes:,} nodes x {m.ranks_per_node} ranks ({gpus}); per node "
        f"{human_bytes(m.memory_per_node)} memory, {human_bytes(m.nvme_per_node)} NVMe, "
        f"NVMe write {_rate_text(m.nvme_write_bw)}, network {_rate_text(m.network_bw)}"
        + (f" (exchange {_rate_text(m.exchange_rate)})" if m.exchange_rate < m.network_bw else "")
        + f"; PFS read {_rate_text(m.pfs_read_bw)} shared",
        f"job: global batch {job.global_batch:,}, step {job.step_time:.3g} s, prefetch "
        f"{job.prefetch}, halo {','.join(map(str, job.halo))} ({job.boundary})",
    ]
    defaults = [k for k, v in origin.items() if v == "default" and k in MACHINE]
    if defaults:
        lines.append(f"defaults (measure yours): {', '.join(defaults)}")
    lines += ["", "staging (datastore stage; the busiest node)"]
    rows = [["mode", "per node", "time", "bound by", "fits NVMe"]]
    for s in plan.staging:
        rows.append(
            [s.mode, human_bytes(s.bytes_per_node), duration(s.seconds), s.bound, _yes(s.fits_nvme)]
        )
    lines += _table(rows, {1, 2})
    lines += ["", "spatial splits (a rank's data; the largest block)"]
    rows = [["parts", "blocks", "data ranks", "batch/rank", "per sample", "extra", "buffers",
             "GPU", "fits GPU"]]  # fmt: skip
    for s in plan.splits:
        mark = " *" if s is plan.split else ""
        rows.append(
            [
                _parts(s.parts) + mark,
                str(s.blocks),
                f"{s.data_world:,}",
                str(s.local_batch),
                human_bytes(s.rank_sample_bytes),
                f"{100 * s.overhead:.1f}%",
                human_bytes(s.buffer_bytes),
                human_bytes(s.gpu_bytes) if m.gpus_per_node else "-",
                _yes(s.fits_gpu) if m.gpus_per_node else "-",
            ]
        )
    lines += _table(rows, {1, 2, 3, 4, 5, 6, 7})
    lines += ["", f"layouts (spatial {_parts(plan.split.parts)}; memory and network per node)"]
    rows = [["staging", "shuffle", "source", "resident", "+ buffers", "in memory", "on NVMe",
             "off-node/rank/step", "share of step", "a data rank draws from"]]  # fmt: skip
    for r in plan.layouts:
        rows.append(
            [
                r.staging,
                r.shuffle,
                r.source,
                human_bytes(r.resident_bytes),
                human_bytes(r.buffer_bytes),
                _yes(r.fits_memory),
                _yes(r.fits_nvme),
                human_bytes(r.exchange_bytes),
                f"{100 * r.exchange_share:.1f}%",
                r.draws_from,
            ]
        )
    lines += _table(rows, {3, 4, 7, 8})
    lines.append("")
    rec = plan.recommended
    if rec is None:
        lines.append("recommended: none fits")
    else:
        spatial = (
            "whole samples" if plan.split.parts is None else f"spatial parts {plan.split.parts}"
        )
        via = "datastore serve" if rec.source == "serve" else "the embedded DataStoreLoader"
        lines.append(
            f"recommended: datastore stage --mode {rec.staging}; shuffle={rec.shuffle!r}; "
            f"{spatial}; via {via}"
        )
    lines += [f"  - {r}" for r in plan.reasons]
    return "\n".join(lines)


def plan_dict(plan: Plan, name: str, origin: dict[str, str]) -> dict[str, Any]:
    """The plan as plain JSON-able data."""
    ds = plan.dataset
    staging = [{**asdict(s), "seconds": s.seconds} for s in plan.staging]
    rows = [{**asdict(r), "memory_bytes": r.memory_bytes} for r in plan.layouts]
    rec = plan.recommended
    return {
        "dataset": {
            "name": name,
            "num_samples": ds.num_samples,
            "sample_bytes": ds.sample_bytes,
            "nbytes": ds.nbytes,
            "files": ds.files,
            "stored_bytes": ds.stored_bytes,
            "fields": {
                f.name: {
                    "dtype": f.dtype.str,
                    "shape": list(f.shape),
                    "spatial_axes": list(f.spatial_axes),
                }
                for f in ds.fields
            },
        },
        "machine": asdict(plan.machine),
        "job": asdict(plan.job),
        "origin": origin,
        "staging": staging,
        "splits": [asdict(s) for s in plan.splits],
        "split": asdict(plan.split),
        "layouts": rows,
        "recommended": None if rec is None else {**asdict(rec), "parts": plan.split.parts},
        "reasons": list(plan.reasons),
    }


def run(args: argparse.Namespace) -> int:
    from datastore.plan.plan_model import Job, Machine, make_plan
    from datastore.readers.base import DatasetError

    try:
        ds, name = dataset_of(args)
        values, origin = values_of(args)
        machine = Machine(**{k: values[k] for k in MACHINE})
        job = Job(**{k: v for k, v in values.items() if k not in MACHINE})
        plan = make_plan(ds, machine, job)
    except (DatasetError, ValueError, OSError) as exc:
        print(f"datastore plan: error: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    if args.json:
        print(json.dumps(plan_dict(plan, name, origin)))
    else:
        print(format_text(plan, name, origin))
    return Exit.OK
