"""The sample order: which samples each rank gets at every step, as pure functions.

The global order of an epoch is a function of ``(seed, epoch)`` alone: position ``p`` of the
epoch holds sample ``sample_at(p)``, a keyed bijection of ``[0, N)`` (:func:`sample_at`), so
every rank, node and NumPy version computes the same order without talking to the others, and
a rank computes only the positions it needs: O(its share) time and memory per epoch, never
the whole permutation (10^8 samples on 4,096 ranks: 24,414 positions per rank per epoch).

The bijection is a balanced Feistel network on ``2 * h`` bits (``4**h >= N``, so the domain is
less than ``4 N``): the position splits into halves ``(L, R)``; each of :data:`ROUNDS` rounds
maps ``(L, R)`` to ``(R, L xor F(R, k_i))``, ``F`` the splitmix64 finaliser of ``R + k_i``
masked to ``h`` bits, a permutation of the domain whatever ``F`` is. Round keys are the 64-bit
words of ``blake2b("seed:epoch")``. Cycle walking keeps it inside ``[0, N)``: a position whose
image is ``>= N`` is mapped again until it lands below ``N`` (fewer than 4 rounds of the
network on average), which restricts the domain's permutation to a permutation of ``[0, N)``.
Everything is explicit uint64 arithmetic and a standard hash: the same numbers on every
platform and NumPy version.

Step ``s`` of an epoch is the global batch ``order[s*B:(s+1)*B]`` for a global batch of ``B``
samples. Data-parallel rank ``r`` of ``W`` takes the contiguous slice ``[r*B/W:(r+1)*B/W]`` of
it, so the sequence of global batches (and so of samples seen) is the same for any ``W`` that
divides ``B``: elastic determinism, as in MosaicML Streaming, with no canonical node count.

The tail of an epoch (``N mod B`` samples) is dropped (``tail="drop"``) or filled up with the
first samples of the same epoch's order (``tail="pad"``): either way every rank gets the same
number of equal batches, so no rank waits at a collective for a batch that never comes.

That is ``shuffle="global"``. Two more keep each data rank on the samples its own ranks hold
(its *home*, ``datastore.maths.ownership.Homes``), so no sample crosses between data ranks:
``"shard"`` draws a keyed bijection of the home every epoch, ``"window:K"`` reads the home in
shuffled windows of ``K`` consecutive samples (:func:`home_order`). Both trade mixing for
traffic and depend on the world size; ``"none"`` keeps storage order.

Resuming is O(1) in the number of batches seen: the state is ``(epoch, step)``; the epoch's
order is recomputed and iteration starts at ``step``, with nothing replayed.

Ranks of a hybrid job are numbered spatial-fastest: ``rank = data_rank * S + spatial_rank``
for ``S`` spatial blocks per sample (``rank_layout``).
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.maths.ownership import Homes

__all__ = [
    "ROUNDS",
    "SHUFFLES",
    "TAILS",
    "EpochPosition",
    "RankLayout",
    "Schedule",
    "check_state",
    "epoch_order",
    "home_order",
    "parse_shuffle",
    "position_of",
    "rank_layout",
    "round_keys",
    "sample_at",
    "state",
]

TAILS = ("drop", "pad")
SHUFFLES = ("global", "shard", "window:K", "none")


def parse_shuffle(value: Any) -> str:
    """The canonical form of a ``shuffle`` argument: ``"global"`` (also ``True``),
    ``"none"`` (also ``False``), ``"shard"`` or ``"window:K"`` for a whole ``K >= 1``.

    Raises:
        ValueError: anything else, named.
    """
    if value is True or value is False:
        return "global" if value else "none"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("global", "shard", "none"):
            return v
        kind, _, k = v.partition(":")
        if kind == "window" and k.isdigit() and int(k) >= 1:
            return f"window:{int(k)}"
    raise ValueError(
        f"shuffle must be True, False or one of {', '.join(SHUFFLES)} (K a whole number "
        f">= 1), got {value!r}"
    )


ROUNDS = 8  # 6 left tiny datasets visibly skewed (chi-square per cell 2.8 at N = 5)
_M1, _M2, _GOLDEN = (
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
    np.uint64(0x9E3779B97F4A7C15),
)
_POW2 = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))


def round_keys(seed: int, epoch: int, stream: str = "") -> np.ndarray:
    """The :data:`ROUNDS` 64-bit round keys of ``(seed, epoch)`` (and of one ``stream`` of
    them: the global order has none; the per-rank orders of ``shuffle="shard"``/``"window"``
    each their own)."""
    text = f"{seed}:{epoch}" + (f":{stream}" if stream else "")
    digest = hashlib.blake2b(text.encode(), digest_size=8 * ROUNDS).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)


def _mix(x: np.ndarray, key: Any) -> np.ndarray:
    """splitmix64's finaliser of ``x + key`` (uint64, wrapping; ``key`` broadcasts)."""
    z = (x + key) * _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    return z ^ (z >> np.uint64(31))


def _tagged(keys: np.ndarray, tags: np.ndarray) -> np.ndarray:
    """Round keys of their own for each of ``tags`` (uint64): ``(ROUNDS, len(tags))``."""
    return _mix(np.asarray(tags, dtype=np.uint64)[None, :], keys.reshape(ROUNDS, -1))


def _feistel(x: np.ndarray, half: Any, keys: np.ndarray) -> np.ndarray:
    """The Feistel permutation of ``[0, 4**half)`` (module docstring) applied to ``x``;
    ``half`` and each round's key may be one per element."""
    shift = np.asarray(half, dtype=np.uint64)
    mask = (np.uint64(1) << shift) - np.uint64(1)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right, k) & mask)
    return (left << shift) | right


def _feistel_inverse(x: np.ndarray, half: Any, keys: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_feistel`: its rounds undone in reverse order."""
    shift = np.asarray(half, dtype=np.uint64)
    mask = (np.uint64(1) << shift) - np.uint64(1)
    left, right = x >> shift, x & mask
    for k in keys[::-1]:
        left, right = right ^ (_mix(left, k) & mask), left
    return (left << shift) | right


def _permute(pos: np.ndarray, n: Any, keys: np.ndarray, inverse: bool = False) -> np.ndarray:
    """The keyed bijection of ``[0, n)`` at ``pos`` (all uint64 below ``n``), or its
    ``inverse``; ``n`` may be one per element, and ``keys`` ``(ROUNDS,)`` or
    ``(ROUNDS, len(pos))``."""
    network = _feistel_inverse if inverse else _feistel
    if np.ndim(n) == 0 and keys.ndim == 1:  # one domain, one key: scalars all through
        half = np.uint64(max(1, (max(int(n), 1) - 1).bit_length() + 1) // 2)  # 4**half >= n
        n = np.uint64(n)
        out = network(pos, half, keys)
        outside = np.flatnonzero(out >= n)
        while outside.size:  # cycle walking: map again until inside [0, n)
            out[outside] = network(out[outside], half, keys)
            outside = outside[out[outside] >= n]
        return out
    n = np.broadcast_to(np.asarray(n, dtype=np.uint64), pos.shape)
    keys = np.broadcast_to(keys.reshape(ROUNDS, -1), (ROUNDS, pos.size))
    bits = np.searchsorted(_POW2, np.maximum(n, np.uint64(1)) - np.uint64(1), side="right")
    half = np.maximum(1, (bits + 1) // 2).astype(np.uint64)  # 4**half >= n
    out = network(pos, half, keys)
    outside = np.flatnonzero(out >= n)
    while outside.size:  # cycle walking: map again until inside [0, n)
        out[outside] = network(out[outside], half[outside], keys[:, outside])
        outside = outside[out[outside] >= n[outside]]
    return out


def sample_at(
    positions: np.ndarray | int, num_samples: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """The samples at ``positions`` (each in ``[0, num_samples)``) of ``epoch``'s order.

    A bijection of ``[0, num_samples)`` for every ``(seed, epoch)`` (module docstring); the
    identity when not shuffling. O(len(positions)) time and memory.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= num_samples):
        raise IndexError(f"positions outside 0..{num_samples - 1}")
    if not shuffle or num_samples <= 1:
        return pos.copy()
    flat = pos.reshape(-1).astype(np.uint64)
    return _permute(flat, num_samples, round_keys(seed, epoch)).astype(np.int64).reshape(pos.shape)


def position_of(
    samples: np.ndarray, num_samples: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """Where each of ``samples`` sits in ``epoch``'s order: the inverse of :func:`sample_at`,
    also O(len(samples))."""
    smp = np.asarray(samples, dtype=np.int64)
    if not shuffle or num_samples <= 1:
        return smp.copy()
    flat = smp.reshape(-1).astype(np.uint64)
    back = _permute(flat, num_samples, round_keys(seed, epoch), inverse=True)
    return back.astype(np.int64).reshape(smp.shape)


def home_order(
    data_rank: np.ndarray, index: np.ndarray, sizes: np.ndarray, seed: int, epoch: int, window: int
) -> np.ndarray:
    """Where data rank ``d``'s ``index``-th sample of ``epoch`` sits in its home (each index in
    ``[0, sizes[d])``): a bijection of each home, its own per rank and epoch.

    ``window == 0`` (``shuffle="shard"``): the keyed bijection of the whole home.
    ``window = K`` (``shuffle="window:K"``): the home, rotated by a keyed offset, is cut into
    windows of ``K`` consecutive samples; the whole windows come in a keyed order, the partial
    one last, and the samples of each window in a keyed order of their own: like a streaming
    loader's ``K``-sample shuffle buffer over shuffled shards, each window one sequential read.
    """
    d = np.asarray(data_rank, dtype=np.int64)
    j = np.asarray(index, dtype=np.int64).astype(np.uint64)
    n = sizes[d].astype(np.uint64)
    tags = d.astype(np.uint64)
    if window == 0:
        return _permute(j, n, _tagged(round_keys(seed, epoch, "home"), tags)).astype(np.int64)
    k = np.uint64(window)
    whole = n // k  # whole windows per home
    q, o = j // k, j % k  # output window, place in it
    in_whole = q < whole
    size = np.where(in_whole, k, n - whole * k)  # the partial window holds the rest
    w = np.where(in_whole, 0, q)
    if in_whole.any():
        keys = _tagged(round_keys(seed, epoch, "windows"), tags[in_whole])
        w[in_whole] = _permute(q[in_whole], whole[in_whole], keys)
    within_keys = _tagged(_tagged(round_keys(seed, epoch, "within"), tags), w)
    stored = w * k + _permute(o, size, within_keys)
    rotate = _mix(tags, round_keys(seed, epoch, "rotate")[0]) % np.maximum(n, np.uint64(1))
    return ((stored + rotate) % np.maximum(n, np.uint64(1))).astype(np.int64)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The whole permutation of ``range(num_samples)`` for ``epoch`` (identity when not
    shuffling): :func:`sample_at` of every position. O(N): for tests and tools; the loaders
    compute only their positions (:meth:`Schedule.rank_samples`)."""
    return sample_at(np.arange(num_samples, dtype=np.int64), num_samples, seed, epoch, shuffle)


@dataclass(frozen=True)
class Schedule:
    """Batches of an epoch for a dataset of ``num_samples`` and a global batch of ``global_batch``.

    Args:
        num_samples: samples in the dataset.
        global_batch: samples per step over all data-parallel ranks together.
        seed: the shuffle seed. Default: ``0``.
        shuffle: ``"global"`` (or ``True``), ``"shard"``, ``"window:K"`` or ``"none"`` (or
            ``False``); kept in its canonical form (:func:`parse_shuffle`). Default: ``True``.
        tail: ``"drop"`` the last partial batch or ``"pad"`` it. Default: ``"drop"``.
        homes: what each data rank draws from; needed by (and only by) ``"shard"`` and
            ``"window:K"``, whose epochs are as long as the smallest home allows (``drop``)
            or the largest needs (``pad``, smaller homes repeat their first samples).
    """

    num_samples: int
    global_batch: int
    seed: int = 0
    shuffle: Any = True
    tail: str = "drop"
    homes: Homes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shuffle", parse_shuffle(self.shuffle))
        if self.num_samples < 1:
            raise ValueError(f"the dataset has no samples (num_samples={self.num_samples})")
        if self.global_batch < 1:
            raise ValueError(f"global batch size must be >= 1, got {self.global_batch}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {', '.join(TAILS)}, got {self.tail!r}")
        local = self.shuffle == "shard" or self.shuffle.startswith("window")
        if local != (self.homes is not None):
            raise ValueError(f"shuffle={self.shuffle!r} {'needs' if local else 'takes no'} homes")
        if self.homes is not None:
            self._check_homes(self.homes)
        elif self.tail == "drop" and self.global_batch > self.num_samples:
            raise ValueError(
                f"global batch {self.global_batch} exceeds the {self.num_samples} samples: "
                "with drop_last=True an epoch would have no batch (use a smaller batch, or "
                "drop_last=False: the last batch padded)"
            )

    def _check_homes(self, homes: Homes) -> None:
        if int(homes.sizes.sum()) != self.num_samples:
            raise ValueError(f"the homes hold {homes.sizes.sum()} samples, not {self.num_samples}")
        b = self.local_batch(homes.data_world)
        empty = np.flatnonzero(homes.sizes == 0)
        if empty.size:
            raise ValueError(
                f"with shuffle={self.shuffle!r} data rank {empty[0]} would draw from the "
                "samples its ranks hold, and they hold none (use shuffle='global')"
            )
        smallest = int(np.argmin(homes.sizes))
        if self.tail == "drop" and homes.sizes[smallest] < b:
            raise ValueError(
                f"with shuffle={self.shuffle!r} data rank {smallest} draws only from the "
                f"{homes.sizes[smallest]} samples its ranks hold, fewer than its {b} per step: "
                "with drop_last=True an epoch would have no batch (use a smaller batch, "
                "drop_last=False or shuffle='global')"
            )

    @property
    def window(self) -> int:
        """``K`` of ``"window:K"``, else 0."""
        return int(self.shuffle.partition(":")[2] or 0)

    @property
    def steps_per_epoch(self) -> int:
        if self.homes is not None:
            b = self.global_batch // self.homes.data_world
            sizes = self.homes.sizes
            return int(sizes.min() // b if self.tail == "drop" else -(-sizes.max() // b))
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and self.tail == "pad" else 0)

    def at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` of the epoch's padded sequence (position ``p >= N``
        repeats position ``p mod N``: the padding of the last batch). With homes, position
        ``p`` of step ``s`` is data rank ``d``'s ``j``-th sample of the epoch, drawn from its
        home (a smaller home repeats from its start)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.homes is None:
            return sample_at(positions % self.num_samples, self.num_samples, self.seed, epoch,
                             self.shuffle == "global")  # fmt: skip
        homes = self.homes
        b = self.global_batch // homes.data_world
        step, within = np.divmod(positions, self.global_batch)
        d, i = np.divmod(within, b)
        j = (step * b + i) % homes.sizes[d]
        return homes.sample(d, home_order(d, j, homes.sizes, self.seed, epoch, self.window))

    def positions_of(self, epoch: int, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, samples)``: every position of the epoch's padded sequence that holds
        one of ``samples`` (a padded epoch repeats some), sorted by position. O(len(samples)):
        what a rank that owns ``samples`` sends in the whole epoch, without the epoch's order.
        Global and unshuffled orders only (with homes, a data rank's step is all there is)."""
        if self.homes is not None:
            raise ValueError("positions_of needs a global order (no homes)")
        smp = np.asarray(samples, dtype=np.int64)
        first = position_of(smp, self.num_samples, self.seed, epoch, self.shuffle == "global")
        total = self.steps_per_epoch * self.global_batch
        pos, out = [first], [smp]
        k = 1
        while k * self.num_samples < total:  # the padding repeats position p mod N
            again = first + k * self.num_samples
            pos.append(again)
            out.append(smp)
            k += 1
        pos_all, smp_all = np.concatenate(pos), np.concatenate(out)
        keep = pos_all < total  # the dropped tail holds none
        order = np.argsort(pos_all[keep], kind="stable")
        return pos_all[keep][order], smp_all[keep][order]

    def order(self, epoch: int) -> np.ndarray:
        """Every sample of ``epoch`` in order, tail dropped or padded: ``steps * B`` indices.
        O(N): for tests and tools; loaders use :meth:`global_batch_at`/:meth:`rank_samples`."""
        need = self.steps_per_epoch * self.global_batch
        return self.at(epoch, np.arange(need, dtype=np.int64))

    def global_batch_at(self, epoch: int, step: int) -> np.ndarray:
        """The ``B`` sample indices of ``step``: O(B)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        first = step * self.global_batch
        return self.at(epoch, np.arange(first, first + self.global_batch, dtype=np.int64))

    def rank_epoch(self, epoch: int, data_rank: int, data_world: int) -> np.ndarray:
        """``(steps, B / data_world)``: data rank ``data_rank``'s samples at every step of
        ``epoch``, in O(N / data_world) time and memory."""
        b = self.local_batch(data_world)
        starts = np.arange(self.steps_per_epoch, dtype=np.int64) * self.global_batch
        positions = (starts + data_rank * b)[:, None] + np.arange(b, dtype=np.int64)
        return self.at(epoch, positions.reshape(-1)).reshape(self.steps_per_epoch, b)

    def rank_samples(self, epoch: int, step: int, data_rank: int, data_world: int) -> np.ndarray:
        """Data rank ``data_rank``'s share of step ``step``: O(B / data_world), computed without
        the rest of the global batch."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        b = self.local_batch(data_world)
        first = step * self.global_batch + data_rank * b
        return self.at(epoch, np.arange(first, first + b, dtype=np.int64))

    def local_batch(self, data_world: int) -> int:
        """Samples per step on each of ``data_world`` ranks; they must divide the global batch."""
        if data_world < 1 or self.global_batch % data_world:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by {data_world} "
                "data-parallel ranks: every rank must get the same number of samples"
            )
        if self.homes is not None and data_world != self.homes.data_world:
            raise ValueError(
                f"the homes are for {self.homes.data_world} data-parallel ranks, not {data_world}"
            )
        return self.global_batch // data_world

    def valid(self, step: int, data_rank: int, data_world: int) -> np.ndarray:
        """Which of data rank ``data_rank``'s samples at ``step`` are real (``True``) rather
        than the repeats that pad the epoch's last batch (``tail="pad"``)."""
        b = self.local_batch(data_world)
        if self.homes is not None:
            return step * b + np.arange(b) < self.homes.sizes[data_rank]
        first = step * self.global_batch + data_rank * b
        return np.arange(first, first + b) < self.num_samples


@dataclass(frozen=True)
class RankLayout:
    """A rank of a hybrid job: ``data_rank`` of ``data_world``, block ``spatial_rank`` of ``S``."""

    rank: int
    world: int
    data_rank: int
    data_world: int
    spatial_rank: int
    spatial_size: int


def rank_layout(rank: int, world: int, spatial_size: int = 1) -> RankLayout:
    """Place ``rank`` of ``world`` in a data x spatial grid, spatial-fastest."""
    if spatial_size < 1 or world % spatial_size:
        raise ValueError(f"world size {world} is not a multiple of {spatial_size} spatial blocks")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    return RankLayout(
        rank, world, rank // spatial_size, world // spatial_size, rank % spatial_size, spatial_size
    )


STATE_VERSIONS = (1, 2)
"""The ``state_dict`` formats read: 1 (without ``"dataset"``) and 2, the one written."""


def state(
    schedule: Schedule, epoch: int, step: int, dataset: dict[str, str] | None = None
) -> dict[str, Any]:
    """The resumable position: everything that fixes the sample sequence, plus where we are;
    ``dataset``: ``{"location": ..., "identity": ...}`` of the data it is over."""
    return {
        "version": STATE_VERSIONS[-1],
        "epoch": epoch,
        "step": step,
        "num_samples": schedule.num_samples,
        "global_batch": schedule.global_batch,
        "seed": schedule.seed,
        "shuffle": schedule.shuffle,
        "tail": schedule.tail,
        "homes": schedule.homes.digest() if schedule.homes is not None else None,
        "dataset": dict(dataset) if dataset is not None else None,  # the caller's to edit
    }


def check_state(
    schedule: Schedule, saved: dict[str, Any], dataset: dict[str, str] | None = None
) -> tuple[int, int]:
    """``(epoch, step)`` of a saved state, refusing one that would change the sequence, one
    over other data than ``dataset`` (a state without its ``"dataset"`` resumes on any), or
    one that is not a loader's state at all."""
    now = state(schedule, 0, 0, dataset)
    _check_form(saved, now)
    saved = {**saved, "homes": saved.get("homes")}
    with contextlib.suppress(ValueError):  # positions saved before "shard" said True/False
        saved["shuffle"] = parse_shuffle(saved.get("shuffle"))
    for key in ("num_samples", "global_batch", "seed", "shuffle", "tail", "homes"):
        if saved.get(key) != now[key]:
            what = (
                "homes: the data ranks hold other shards (another world size or layout)"
                if key == "homes"
                else f"saved {key}={saved.get(key)!r} but this loader has {key}={now[key]!r}"
            )
            raise ValueError(f"cannot resume: {what} (the sample sequence would differ)")
    was = saved.get("dataset")
    if dataset is not None and was is not None and was.get("identity") != dataset["identity"]:
        raise ValueError(
            f"cannot resume: the state_dict was saved over {was.get('location')!r} (files "
            f"{was.get('identity')}), this loader reads {dataset['location']!r} (files "
            f"{dataset['identity']}): other data of the same size. A copy that keeps the "
            "file names, sizes and modification times (datastore stage, cp -a, rsync -a) "
            "resumes; to go on over other data on purpose, set the state's "
            '"dataset" to None'
        )
    epoch, step = saved["epoch"], saved["step"]
    if epoch < 0:
        raise ValueError(f"cannot resume: epoch {epoch} is negative")
    if not 0 <= step <= schedule.steps_per_epoch:
        raise ValueError(f"cannot resume: step {step} outside 0..{schedule.steps_per_epoch}")
    return epoch, step


def _check_form(saved: Any, now: dict[str, Any]) -> None:
    """Refuse what is not a loader's state of a format read here, or has a value of the
    wrong type (a hand-edited or damaged state)."""
    needed = ("epoch", "step", "num_samples", "global_batch", "seed")
    if not isinstance(saved, dict) or any(key not in saved for key in needed):
        has = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(
            f"cannot resume: not a loader's state_dict (got {has}; a loader's has {', '.join(now)})"
        )
    version = saved.get("version", 1)
    if version not in STATE_VERSIONS:
        raise ValueError(
            f"cannot resume: a state_dict of format version {version!r}; this datastore reads "
            f"versions {', '.join(map(str, STATE_VERSIONS))} (saved by another datastore?)"
        )
    missing = [key for key in now if key not in saved] if version >= 2 else []
    if missing:
        raise ValueError(f"cannot resume: the state_dict has no {', '.join(missing)}")
    for key in needed:
        if type(saved[key]) is not int:
            raise ValueError(
                f"cannot resume: the state_dict's {key} is {saved[key]!r}, not an integer"
            )
    was = saved.get("dataset")
    if was is not None and not (isinstance(was, dict) and isinstance(was.get("identity"), str)):
        raise ValueError(
            f"cannot resume: the state_dict's dataset is {was!r}, not "
            '{"location": ..., "identity": ...}'
        )


def _epoch_of(epoch: Any) -> int:
    """``set_epoch``'s argument as an epoch: a whole number >= 0 (``numpy`` and 0-d integer
    tensors too), never a truncated float."""
    try:
        value = None if isinstance(epoch, bool) else operator.index(epoch)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"set_epoch takes an int >= 0, got {epoch!r}")
    return value


class EpochPosition:
    """Where a loader is in its sequence: ``epoch`` and ``_step`` (the next batch) over
    ``schedule``. An epoch ends when its last batch is handed out, not when a ``for`` loop
    asks for one more: a consumer that stops after ``len(loader)`` batches (Lightning,
    ``islice``) still moves on to the next epoch.

    Every ``iter()`` is a pass from an epoch's first batch, as with torch's ``DataLoader``:
    of the current epoch when none of it was handed out (a new loader, after ``set_epoch``
    or a whole epoch), else of the next one (after a ``break`` or a peek). Only the first
    ``iter()`` after ``load_state_dict`` resumes mid-epoch. The position follows the newest
    pass."""

    schedule: Schedule
    epoch: int
    _step: int
    _data_id: dict[str, str] | None = None  # the data's location and identity, if known
    _resume: bool = False  # a loaded position that the next iter() resumes
    _pass: int = 0  # the newest pass

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration (a loaded position in
        ``epoch`` still resumes, as a ``DistributedSampler``'s under ``StatefulDataLoader``;
        a loaded start of the next epoch is the end of ``epoch``: its pass is empty). A pass
        still live goes on without moving the position, as a sampler's old iterator."""
        epoch = _epoch_of(epoch)
        if self._resume and self._step == 0 and epoch == self.epoch - 1:
            self.epoch, self._step = epoch, self.schedule.steps_per_epoch
        elif not (self._resume and epoch == self.epoch):
            self.epoch, self._step, self._resume = epoch, 0, False
        self._pass += 1

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out; resuming from it is O(1)."""
        return state(self.schedule, self.epoch, self._step, self._data_id)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resume at ``saved``'s position at the next ``iter()`` (once); a pass still live
        goes on without moving the position, as ``StatefulDataLoader``'s old iterator."""
        epoch, step = check_state(self.schedule, saved, self._data_id)
        done = step >= self.schedule.steps_per_epoch
        self.epoch, self._step = (epoch + 1, 0) if done else (epoch, step)
        self._resume = True
        self._pass += 1

    def _new_pass(self) -> tuple[int, int, int]:
        """``(epoch, step, pass)`` where a new ``iter()`` starts; ``step`` is the epoch's
        length when nothing is left of it (a loaded end of an epoch)."""
        if self._step > 0 and not self._resume:
            self.epoch, self._step = self.epoch + 1, 0
        self._resume = False
        self._pass += 1
        at = self.epoch, self._step, self._pass
        if self._step >= self.schedule.steps_per_epoch:
            self.epoch, self._step = self.epoch + 1, 0
        return at

    def _handed_out(self, epoch: int, step: int, pass_: int) -> None:
        """Batch ``step`` of ``epoch`` is with the consumer: the next one, or the next
        epoch's first (only the newest pass moves the position)."""
        if pass_ != self._pass:
            return
        self.epoch, self._step = epoch, step + 1
        if self._step >= self.schedule.steps_per_epoch:
            self.epoch, self._step = self.epoch + 1, 0
