"""Running a batch's copies: plain numpy copies, which release the GIL, spread over threads.

One thread copies well below what a GPU consumes, so :class:`Gather` splits one batch's
copies (planned by :func:`datastore.maths.delivery.batch_copies` and friends) between several.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from datastore.maths.delivery import Copy, Delivered, batch_copies
from staging.cluster import local_size

__all__ = ["Gather", "default_threads", "fill_batch", "run_copies"]

_PIECE = 2 << 20  # bytes: copies larger than this are split between threads


def default_threads() -> int:
    """Gather threads for this rank: the cores it may use, shared with the ranks on its node."""
    cores = len(os.sched_getaffinity(0))
    per_node = local_size()
    if per_node > 1 and cores > per_node * 2:  # an unbound rank sees the whole node
        cores //= per_node
    return max(1, min(16, cores))


class Gather:
    """Runs a batch's copies on ``threads`` threads (the calling one included).

    Args:
        threads: copies at a time. Default: :func:`default_threads`.
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads!r}")
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="datastore-gather")
            if self.threads > 1
            else None
        )

    def run(self, copies: list[Copy]) -> None:
        """Do every copy; large ones are split along their first axis between the threads.
        Copies of :data:`_PIECE` bytes or fewer in all run on the calling thread: waking
        another costs more than it would take off (a block's zero halo, a few small fields)."""
        total = sum(d.nbytes for d, _ in copies)
        if self._pool is None or total <= _PIECE:
            _copy_all(copies)
            return
        piece = max(_PIECE, total // (self.threads * 2))
        work: list[Copy] = []
        for dst, src in copies:
            work.extend(_split(dst, src, piece))
        if len(work) <= 1:
            _copy_all(work)
            return
        per = math.ceil(len(work) / self.threads)
        parts = [work[i : i + per] for i in range(0, len(work), per)]
        futures = [self._pool.submit(_copy_all, p) for p in parts[1:]]
        try:
            _copy_all(parts[0])
        finally:  # a failed copy here must not leave the other threads writing on
            wait(futures)
        for fut in futures:
            fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copy(dst: np.ndarray, src: np.ndarray | None) -> None:
    if src is None:
        dst.fill(0)
    else:
        np.copyto(dst, src, casting="same_kind")


def _copy_all(copies: list[Copy]) -> None:
    for dst, src in copies:
        _copy(dst, src)


def _split(dst: np.ndarray, src: np.ndarray | None, piece: int) -> list[Copy]:
    if dst.nbytes <= piece or dst.ndim == 0 or dst.shape[0] < 2:
        return [(dst, src)]
    n = min(dst.shape[0], math.ceil(dst.nbytes / piece))
    cuts = np.linspace(0, dst.shape[0], n + 1).astype(int)
    return [
        (dst[a:b], None if src is None else src[a:b])
        for a, b in itertools.pairwise(cuts.tolist())
        if b > a
    ]


def run_copies(copies: list[Copy], gather: Gather | None = None) -> None:
    """Do ``copies``: on ``gather``'s threads, or on this one."""
    if gather is None:
        _copy_all(copies)
    else:
        gather.run(copies)


def fill_batch(
    samples: Sequence[int],
    fields: Sequence[Delivered],
    sample: Callable[[int, str], np.ndarray],
    out: dict[str, np.ndarray],
    fetched: dict[tuple[int, str], np.ndarray] | None = None,
    gather: Gather | None = None,
) -> None:
    """Write ``samples`` into ``out`` (:func:`datastore.maths.delivery.batch_copies`)."""
    run_copies(batch_copies(samples, fields, sample, out, fetched), gather)
