"""Which members of tar shards make one sample: WebDataset's naming convention.

A member's **key** is its name up to the first dot of its basename (the directory part
included), its **kind** the last suffix, its **slot** what lies between them (the kind itself
when nothing does)::

    train/000123.x.npy  ->  key "train/000123", slot "x",    kind "npy"
    train/000123.cls    ->  key "train/000123", slot "cls",  kind "cls"
    train/000123.json   ->  key "train/000123", slot "json", kind "json"

The members of a shard that share a key are one sample, wherever they lie in the tar; samples
follow each other shard after shard, in the order their keys first appear. Every sample has
the same slots, and a slot once per sample; anything else is an error naming the shard and the
key. (A sample that is one ``KEY.npy`` member is the one-array-per-member layout.)
"""

from __future__ import annotations

from collections.abc import Sequence

from datastore.readers.base import DatasetError

__all__ = ["KINDS", "Entry", "Sample", "group_samples", "split_member"]

KINDS = ("npy", "npz", "cls", "json")

Entry = tuple[str, str, str, int, int]
"""One member of a sample: ``(slot, kind, member name, data offset, size)``."""
Sample = tuple[int, str, tuple[Entry, ...]]
"""``(shard index, key, entries sorted by slot)``."""


def split_member(name: str) -> tuple[str, str, str]:
    """``(key, slot, kind)`` of the member ``name``.

    Raises:
        ValueError: the reason, for a basename with no key or no suffix, or a kind not in
            ``KINDS``.
    """
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not stem or not dot or not ext:
        raise ValueError(f"member {name!r} is not named KEY.FIELD (e.g. 000123.x.npy)")
    rest, _, kind = ext.rpartition(".")
    kind = kind.lower()
    if kind not in KINDS:
        raise ValueError(
            f"member {name!r}: .{kind} members are not read (only .npy, .npz, .cls and .json)"
        )
    return folder + slash + stem, rest or kind, kind


def group_samples(shards: Sequence[tuple[str, Sequence[tuple[str, int, int]]]]) -> list[Sample]:
    """The samples of ``shards``: ``(path, [(member name, data offset, size), ...])`` each,
    members in tar order.

    Raises:
        DatasetError: naming the shard, the key and the slot, for a member name
            ``split_member`` refuses, two members of one sample in the same slot, or a sample
            that lacks a slot another sample has.
    """
    samples: list[Sample] = []
    first_with: dict[str, tuple[str, str]] = {}  # slot -> (shard, key) of its first sample
    for k, (path, members) in enumerate(shards):
        by_key: dict[str, dict[str, Entry]] = {}
        for name, offset, size in members:
            try:
                key, slot, kind = split_member(name)
            except ValueError as exc:
                raise DatasetError(path, str(exc)) from None
            entries = by_key.setdefault(key, {})
            if slot in entries:
                raise DatasetError(
                    path,
                    f"sample {key!r} has two members for this field: {entries[slot][2]!r} "
                    f"and {name!r}",
                    slot,
                )
            entries[slot] = (slot, kind, name, offset, size)
        for key, entries in by_key.items():
            for slot in entries:
                first_with.setdefault(slot, (path, key))
            samples.append((k, key, tuple(entries[s] for s in sorted(entries))))
    every = sorted(first_with)
    for k, key, entries in samples:
        if len(entries) != len(every):
            missing = next(s for s in every if s not in {e[0] for e in entries})
            path, other = first_with[missing]
            raise DatasetError(
                shards[k][0],
                f"sample {key!r} has no member for this field, which sample {other!r} in "
                f"{path} has (every sample needs one member per field: {', '.join(every)})",
                missing,
            )
    return samples
