"""What one rank receives, and filling its batches: the delivery core of every source.

A rank gets, for every delivered field, the whole sample (non-spatial fields, or no spatial
split) or its block with halo (``datastore.maths.partition``). The embedded loader, its exchanges
and ``datastore serve`` all describe a rank's fields with :func:`delivered_fields` and fill
batch buffers with the copies of :func:`batch_copies` (run by ``datastore.store.gather``), so
every path gives the same shapes, the same bytes and the same zero halo outside the volume.

Buffers are reused, and a consumer may edit a batch in place, so a fill writes the whole
delivered box every time: the part inside the volume from the sample, the rest zeros.

This module plans the copies (views, nothing written); ``datastore.store.gather`` runs them.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.maths.partition import BOUNDARIES, Grid, full_region
from datastore.maths.subarray import MIN_RUN, outside, piece_sizes

__all__ = [
    "Copy",
    "Delivered",
    "batch_copies",
    "batch_pad_copies",
    "box_copies",
    "chosen_fields",
    "covered",
    "covered_sizes",
    "delivered_fields",
    "pad_copies",
    "parse_spatial",
    "part_copy",
    "spatial_grid",
    "tensor_dtype_problem",
]


def tensor_dtype_problem(dtype: Any) -> str | None:
    """Why a field of ``dtype`` cannot be delivered as a torch tensor, or ``None`` if it can."""
    dt = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.itemsize > (16 if dt.kind == "c" else 8):
        return f"its dtype {dt.str} ({dt.name}) has no torch tensor type (numbers and bools only)"
    if not dt.isnative:
        return f"its dtype {dt.str} is not in this machine's byte order, as torch tensors need"
    return None


def chosen_fields(
    info: dict[str, Any], names: Sequence[str] | None, show: Callable[[str], str] = repr
) -> dict[str, Any]:
    """The fields ``names`` (``None`` or empty: all) of a dataset with fields ``info``, each one
    a batch can carry as a tensor.

    Raises:
        ValueError: a name the dataset lacks, or a field no tensor can hold (``show`` formats
            a name for the message).
    """
    names = list(names or info)
    for n in names:
        if n not in info:
            raise ValueError(f"no field {show(n)} in the dataset (it has {', '.join(info)})")
        problem = tensor_dtype_problem(info[n].dtype)
        if problem is not None:
            raise ValueError(f"field {show(n)}: {problem}; leave it out with fields=[...]")
    return {n: info[n] for n in names}


@dataclass(frozen=True)
class Delivered:
    """One field as one rank receives it."""

    name: str
    dtype: np.dtype
    spatial_axes: tuple[int, ...]
    shape: tuple[int, ...]  # per sample, with halo
    origin: tuple[int, ...]  # where the delivered box starts in the whole sample (may be < 0)
    blocked: bool
    sample_shape: tuple[int, ...] = ()  # the whole sample's shape (``shape`` when not blocked)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # exact: no int64 wrap-around


@functools.lru_cache(maxsize=1024)  # (a fetch's hot path: the same few fields every batch)
def covered(f: Delivered) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """``(in the sample, in the delivered box)``: the part of ``f``'s box inside the volume."""
    if not f.blocked:
        whole = tuple(slice(0, n) for n in f.shape)
        return whole, whole
    src, dst = [], []
    for o, n, size in zip(f.origin, f.shape, f.sample_shape, strict=True):
        lo, hi = max(o, 0), min(o + n, size)
        src.append(slice(lo, hi))
        dst.append(slice(lo - o, hi - o))
    return tuple(src), tuple(dst)


@functools.lru_cache(maxsize=1024)
def covered_sizes(f: Delivered) -> tuple[int, ...]:
    """The sizes of the messages one sample's part of ``f`` inside the volume travels in
    between services, as its owner cuts it from a C-contiguous sample
    (:func:`~datastore.maths.subarray.pieces`): what the asker posts receives for."""
    shape = f.sample_shape if f.blocked else f.shape
    return tuple(piece_sizes(shape, f.dtype.itemsize, covered(f)[0], MIN_RUN))


def _pads(f: Delivered) -> list[tuple[slice, ...]]:
    """Disjoint slabs of ``f``'s box outside the volume (empty when nothing is padded)."""
    return outside(f.shape, covered(f)[1])


def parse_spatial(spatial: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``spatial=`` checked and normalised to ``{"parts", "halo", "boundary"}`` (tuples).

    ``halo`` may be one int for every axis. Raises ``ValueError`` naming what is wrong.
    """
    if spatial is None:
        return None
    if not isinstance(spatial, Mapping):
        raise ValueError(
            f"spatial must be a dict like {{'parts': (2, 1, 1), 'halo': 1}}, got {spatial!r}"
        )
    unknown = set(spatial) - {"parts", "halo", "boundary"}
    if unknown:
        raise ValueError(
            f"spatial has unknown key(s) {sorted(unknown)}: it takes parts, halo, boundary"
        )
    if "parts" not in spatial:
        raise ValueError("spatial needs 'parts': blocks per spatial axis, e.g. (2, 1, 1)")
    parts = _ints("spatial['parts']", spatial["parts"])
    if not parts or min(parts) < 1:
        raise ValueError(f"spatial['parts'] must be ints >= 1, got {spatial['parts']!r}")
    halo_in = spatial.get("halo", 0)
    if isinstance(halo_in, int):
        halo = (halo_in,) * len(parts)
    else:
        halo = _ints("spatial['halo']", halo_in)
    if len(halo) != len(parts):
        raise ValueError(f"spatial['halo'] {halo} needs one width per axis of parts {parts}")
    boundary = spatial.get("boundary", "zero")
    if boundary not in BOUNDARIES:
        raise ValueError(f"spatial['boundary'] must be one of {BOUNDARIES}, got {boundary!r}")
    return {"parts": parts, "halo": halo, "boundary": boundary}


def _ints(name: str, value: Any) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}") from None


def spatial_grid(info: dict[str, Any], spatial: Mapping[str, Any] | None) -> Grid | None:
    """The grid splitting every spatial field, from ``{"parts", "halo", "boundary"}``."""
    spatial = parse_spatial(spatial)
    if not spatial:
        return None
    volumes = {
        tuple(fi.shape[a] for a in fi.spatial_axes) for fi in info.values() if fi.spatial_axes
    }
    if not volumes:
        shapes = ", ".join(f"{name} {tuple(fi.shape)}" for name, fi in info.items())
        raise ValueError(
            f"a spatial layout was given but no delivered field has spatial axes ({shapes} per "
            "sample): by default they are the last three axes of a field of three or more; "
            "name them in a spec file (fields = [{name, spatial_axes}])"
        )
    if len(volumes) > 1:
        each = ", ".join(
            f"{name} {tuple(fi.shape[a] for a in fi.spatial_axes)}"
            for name, fi in info.items()
            if fi.spatial_axes
        )
        raise ValueError(
            f"spatial fields have different volumes ({each}): leave out the fields not to "
            "split (fields=[...]), or name the spatial axes in a spec file"
        )
    volume = volumes.pop()
    if len(volume) != len(spatial["parts"]):
        raise ValueError(
            f"spatial['parts'] {spatial['parts']} has {len(spatial['parts'])} axes, the "
            f"volume {volume} has {len(volume)}"
        )
    return Grid(volume, spatial["parts"], spatial["halo"], spatial["boundary"])


def delivered_fields(info: dict[str, Any], grid: Grid | None, block: int) -> list[Delivered]:
    """The fields ``info`` (``{name: FieldInfo}``) as block ``block`` of ``grid`` receives them."""
    out = []
    for name, fi in info.items():
        shape, axes = tuple(int(s) for s in fi.shape), tuple(fi.spatial_axes)
        dtype = np.dtype(fi.dtype)
        if grid is None or not axes:
            out.append(Delivered(name, dtype, axes, shape, (0,) * len(shape), False, shape))
            continue
        read, pad = full_region(grid, block, len(shape), axes)
        box = tuple(
            r.indices(n)[1] - r.indices(n)[0] + a + b
            for r, n, (a, b) in zip(read, shape, pad, strict=True)
        )
        origin = tuple(r.indices(n)[0] - a for r, n, (a, _) in zip(read, shape, pad, strict=True))
        out.append(Delivered(name, dtype, axes, box, origin, True, shape))
    return out


Copy = tuple[np.ndarray, np.ndarray | None]  # (destination, source); None: fill with zeros


def part_copy(f: Delivered, dst: np.ndarray, vol: np.ndarray) -> Copy:
    """The copy writing the part of ``f``'s box ``dst`` inside the volume from the whole
    sample ``vol`` (the whole box where ``f`` is not blocked); the halo outside the volume
    is :func:`pad_copies`' or :func:`batch_pad_copies`'."""
    if not f.blocked:
        return (dst, vol)
    src, inner = covered(f)
    return (dst[inner], vol[src])


def box_copies(f: Delivered, dst: np.ndarray, vol: np.ndarray) -> list[Copy]:
    """The copies writing ``f``'s whole box ``dst`` from the whole sample ``vol``."""
    return [part_copy(f, dst, vol), *pad_copies(f, dst)]


def pad_copies(f: Delivered, dst: np.ndarray) -> list[Copy]:
    """The zero fills of ``f``'s box outside the volume (the rest is written by someone else)."""
    return [(dst[s], None) for s in _pads(f)] if f.blocked else []


def batch_pad_copies(f: Delivered, rows: Any, n: int, skip: Set[int] = frozenset()) -> list[Copy]:
    """The zero fills of ``f``'s box outside the volume at every position ``< n`` of a batch
    but those in ``skip`` (``rows[pos, ...]`` a position's box): one fill per slab for each
    run of consecutive positions where ``rows`` is an array (a fill per slab and position
    touches the same memory, in more calls)."""
    if not f.blocked:
        return []
    if isinstance(rows, np.ndarray):
        return [(rows[(slice(a, b), *s)], None) for a, b in _runs(n, skip) for s in _pads(f)]
    return [c for pos in range(n) if pos not in skip for c in pad_copies(f, rows[pos, ...])]


def _runs(n: int, skip: Set[int]) -> list[tuple[int, int]]:
    """The runs ``[a, b)`` of consecutive positions ``< n`` not in ``skip``."""
    out: list[tuple[int, int]] = []
    for pos in range(n):
        if pos in skip:
            continue
        if out and out[-1][1] == pos:
            out[-1] = (out[-1][0], pos + 1)
        else:
            out.append((pos, pos + 1))
    return out


def batch_copies(
    samples: Sequence[int],
    fields: Sequence[Delivered],
    sample: Callable[[int, str], np.ndarray],
    out: dict[str, np.ndarray],
    fetched: dict[tuple[int, str], np.ndarray] | None = None,
) -> list[Copy]:
    """The copies writing ``samples`` into ``out[field][position]`` (whole boxes, zero halo
    included): ``fetched[(index, field)]`` (from other nodes: the delivered array, or its part
    inside the volume, the rest then zero), else cut from ``sample(index, field)``, the whole
    stored array of a sample's field. Views only: nothing is written."""
    copies: list[Copy] = []
    for pos, index in enumerate(samples):
        for f in fields:
            dst = out[f.name][pos, ...]
            got = fetched.get((int(index), f.name)) if fetched else None
            if got is None:
                copies.append(part_copy(f, dst, sample(int(index), f.name)))
            elif got.shape == dst.shape and f.blocked:  # the whole box: its halo is zeros
                inner = covered(f)[1]
                copies.append((dst[inner], got[inner]))
            elif got.shape == dst.shape:
                copies.append((dst, got))
            else:  # the part inside the volume
                copies.append((dst[covered(f)[1]], got))
    for f in fields:
        copies += batch_pad_copies(f, out[f.name], len(samples))
    return copies
