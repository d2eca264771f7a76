"""The ``npy`` reader: one ``.npy`` or ``.npz`` file per sample (``persample`` locates and checks
the arrays).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from datastore.readers.base import DatasetError
from datastore.readers.npyfile import locate_npy, locate_npz
from datastore.readers.persample import Located, PerSampleFiles, reading
from datastore.readers.registry import Format, register, resolve_paths

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = ["NpyReader"]


class NpyReader(PerSampleFiles):
    """``npy``: file ``k`` (in path order) is sample ``k``; all ``.npy`` or all ``.npz``."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        kinds = {os.path.splitext(f)[1].lower() for f in self.files}
        if len(kinds) != 1 or not kinds <= {".npy", ".npz"}:
            raise DatasetError(
                self.location, f"samples must be all .npy or all .npz files, found {sorted(kinds)}"
            )
        self.kind = kinds.pop()[1:]
        self._length = len(self.files)
        self._setup(self.kind == "npy")

    def _locate(self, index: int) -> Located:
        path = self.files[index]
        field = self._npy_field if self.kind == "npy" else None
        with reading(path, self.kind, field):
            if self.kind == "npy":
                return {self._npy_field: locate_npy(path)}
            return dict(locate_npz(path))

    def _where(self, index: int) -> str:
        return self.files[index]


def _settle(files: list[str], where: str) -> str:
    """``npy``, but for one file named by itself: detection would read it as one sample, and an
    array of many (``np.save("train.npy", x)``, ``x`` of shape ``(N, C, D, H, W)``) came back as
    a batch of one ``(1, N, C, D, H, W)`` sample."""
    if files == [where]:
        raise DatasetError(
            where,
            "one .npy/.npz file is one sample, not an array of samples: save one file per sample "
            "into a directory (np.save(f'{i:06d}.npy', x[i])) and name the directory, or write "
            "the arrays to HDF5 or zarr, whose leading axis is the sample axis",
        )
    return "npy"


register(Format("npy", NpyReader, suffixes=(".npy", ".npz"), settle=_settle))
