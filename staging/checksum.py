"""Chunk-tree checksums: every chunk is hashed while it is copied; a file's digest combines them.

A file of ``n`` bytes is cut into leaves of ``LEAF_BYTES`` (the last one shorter; an empty file
has one empty leaf). Each leaf is hashed on its own, so large files are copied and verified in
parallel, and a resumed copy re-checks only the leaves it keeps. The file digest is the hash of
the concatenated leaf digests, written ``"<algo>:<hex>"``.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

__all__ = ["ALGORITHMS", "LEAF_BYTES", "Hasher", "combine", "leaf_ranges", "new_hasher"]

LEAF_BYTES = 32 * 1024 * 1024
ALGORITHMS = ("xxh3", "blake2b")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


def new_hasher(algo: str) -> Hasher:
    """A fresh incremental hasher for ``algo`` (``"xxh3"``: XXH3-128, ``"blake2b"``: 128-bit)."""
    if algo == "xxh3":
        return xxhash.xxh3_128()
    if algo == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise ValueError(f"unknown checksum algorithm {algo!r}; choose from {', '.join(ALGORITHMS)}")


def leaf_ranges(size: int, leaf: int = LEAF_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of every leaf of a ``size``-byte file; ``[(0, 0)]`` when empty."""
    if size == 0:
        return [(0, 0)]
    return [(off, min(leaf, size - off)) for off in range(0, size, leaf)]


def combine(algo: str, leaf_digests: list[bytes]) -> str:
    """The file digest ``"<algo>:<hex>"`` from its leaf digests, in file order."""
    h = new_hasher(algo)
    for d in leaf_digests:
        h.update(d)
    return f"{algo}:{h.hexdigest()}"
