"""What one rank of a session receives, and filling its batches from a resident dataset.

A rank gets, for every delivered field, the whole sample (non-spatial fields, or no spatial
split) or its block with halo (``datastore.partition``), exactly as the embedded
``DataStoreLoader`` delivers them: same shapes, same zero halo outside the volume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.partition import Grid, extract_block, full_region

__all__ = ["Delivered", "delivered_fields", "fill_batch", "spatial_grid"]


@dataclass(frozen=True)
class Delivered:
    """One field as one rank receives it."""

    name: str
    dtype: np.dtype
    spatial_axes: tuple[int, ...]
    shape: tuple[int, ...]  # per sample, with halo
    origin: tuple[int, ...]  # where the delivered box starts in the whole sample (may be < 0)
    blocked: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def spatial_grid(info: dict[str, Any], spatial: dict[str, Any] | None) -> Grid | None:
    """The grid splitting every spatial field, from ``{"parts", "halo", "boundary"}``."""
    if not spatial:
        return None
    volumes = {
        tuple(fi.shape[a] for a in fi.spatial_axes) for fi in info.values() if fi.spatial_axes
    }
    if not volumes:
        raise ValueError("a spatial layout was given but no delivered field has spatial axes")
    if len(volumes) > 1:
        raise ValueError(f"spatial fields have different volumes: {sorted(volumes)}")
    return Grid(
        volumes.pop(),
        tuple(spatial["parts"]),
        tuple(spatial.get("halo", ())),
        spatial.get("boundary", "zero"),
    )


def delivered_fields(info: dict[str, Any], grid: Grid | None, block: int) -> list[Delivered]:
    """The fields ``info`` (``{name: FieldInfo}``) as block ``block`` of ``grid`` receives them."""
    out = []
    for name, fi in info.items():
        shape, axes = tuple(int(s) for s in fi.shape), tuple(fi.spatial_axes)
        if grid is None or not axes:
            out.append(Delivered(name, np.dtype(fi.dtype), axes, shape, (0,) * len(shape), False))
            continue
        read, pad = full_region(grid, block, len(shape), axes)
        box = tuple(
            r.indices(n)[1] - r.indices(n)[0] + a + b
            for r, n, (a, b) in zip(read, shape, pad, strict=True)
        )
        origin = tuple(r.indices(n)[0] - a for r, n, (a, _) in zip(read, shape, pad, strict=True))
        out.append(Delivered(name, np.dtype(fi.dtype), axes, box, origin, True))
    return out


def fill_batch(
    samples: Sequence[int],
    fields: Sequence[Delivered],
    grid: Grid | None,
    block: int,
    sample: Callable[[int, str], np.ndarray],
    out: dict[str, np.ndarray],
    fetched: dict[tuple[int, str], np.ndarray] | None = None,
) -> None:
    """Write ``samples`` into ``out[field][position]``: ``fetched[(index, field)]`` as it is
    (delivered arrays from other nodes), else cut from ``sample(index, field)``, the whole
    stored array of a sample's field."""
    for pos, index in enumerate(samples):
        for f in fields:
            dst = out[f.name][pos, ...]
            if fetched and (int(index), f.name) in fetched:
                dst[...] = fetched[(int(index), f.name)]
                continue
            vol = sample(int(index), f.name)
            if f.blocked:
                extract_block(vol, grid, block, f.spatial_axes, out=dst)  # type: ignore[arg-type]
            else:
                dst[...] = vol
