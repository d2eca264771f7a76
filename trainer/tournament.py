"""A tournament of trainers (LBANN's LTFB, "Livermore Tournament Fast Batch").

``K`` trainers, one process each (``mpiexec -n K`` or ``torchrun``: trainer ``k`` is rank
``k``), train the same model with their own learning rate (``lrs[k]``) and seed
(``train.seed + k``: their initial weights and their shuffle), each with
:func:`trainer.train.fit`, every one reading its batches from the one ``datastore serve`` at
``data_address``, which holds the dataset once for all of them.

Rounds
    After every ``interval``-th step, trainer ``k`` draws the round's held-out batch (the same
    batch for every trainer: a shuffled stream of the validation split seeded by the
    tournament's ``seed``, one batch per round) and scores its model on it (the training loss,
    in evaluation mode). The round's pairs are :func:`pairs_of` (a seeded permutation, paired
    off in order; with odd ``K`` one trainer sits out). The two trainers of a pair send each
    other their scores; both pick the same winner (:func:`winner_of`: the lower score, the
    lower trainer index on a tie, a NaN never wins), and the winner sends the loser its model
    (parameters and buffers) and its optimizer state, byte for byte, in one message. The loser
    keeps its own hyperparameters (learning rate, schedule, seed), its data position and its
    step count.

Messages
    Point-to-point over a gloo group of all the ranks (``trainer.comm``, with the
    ``comm_timeout``): whatever device the model is on, its state travels as one byte buffer in
    host memory (:func:`pack_state`), so the tournament needs neither NCCL nor a GPU per pair.

Log
    Each trainer logs its run as ``trainer train`` does, to its own file
    (:func:`~trainer.config.trainer_log`: ``run.jsonl`` gives ``run.t0.jsonl``, ...), every
    record with ``"trainer": k``, plus per round ``{"event": "round", "round", "step",
    "pairs", "partner", "score", "partner_score", "winner", "state_sha256_before",
    "state_sha256"}`` (the SHA-256 of the packed state before and after the round: a loser's
    ``state_sha256`` equals its winner's). Rank 0 writes the tournament's summary to
    ``log_file`` itself and prints it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from datastore import DataStoreLoader
from trainer.comm import all_gather, exchange
from trainer.config import TournamentConfig
from trainer.start import data_paths, start
from trainer.train import Log, Trainer, fit, loader_of, timed_batches

__all__ = [
    "Rounds",
    "best_of",
    "pack_state",
    "pairs_of",
    "partner_of",
    "state_tensors",
    "tournament",
    "unpack_state",
    "winner_of",
]

_SCORE_TAG, _STATE_TAG = 7100, 7101


def pairs_of(round_: int, trainers: int, seed: int) -> list[tuple[int, int]]:
    """The pairs of round ``round_``: a permutation of the trainers drawn from
    ``numpy.random.default_rng([seed, round_])``, paired off in order (the last one sits out
    when ``trainers`` is odd); each pair ``(low, high)``, the pairs sorted."""
    order = np.random.default_rng([seed, round_]).permutation(trainers).tolist()
    pairs = [tuple(sorted(order[i : i + 2])) for i in range(0, trainers - 1, 2)]
    return sorted(pairs)  # type: ignore[arg-type]


def partner_of(pairs: list[tuple[int, int]], k: int) -> int | None:
    """Trainer ``k``'s partner in ``pairs`` (``None``: it sits out)."""
    for a, b in pairs:
        if k in (a, b):
            return b if k == a else a
    return None


def winner_of(a: int, score_a: float, b: int, score_b: float) -> int:
    """The trainer of the lower score; on a tie the lower index; a NaN score never wins."""
    key_a = (math.isnan(score_a), score_a if not math.isnan(score_a) else 0.0, a)
    key_b = (math.isnan(score_b), score_b if not math.isnan(score_b) else 0.0, b)
    return a if key_a < key_b else b


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a loser takes from its winner, in one fixed order: the model's state (parameters
    and buffers), then the optimizer's state per parameter (keys sorted). The model's tensors
    share storage with the model: writing them changes it."""
    out = list(model.state_dict().values())
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {key!r} is not a tensor: {value!r}")
                out.append(value)
    return out


def pack_state(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors``, one after the other, as one ``uint8`` CPU tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors])


def unpack_state(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` with the bytes :func:`pack_state` laid out in ``buf`` (nothing is
    written unless the sizes agree)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    if sum(sizes) != buf.numel():
        raise ValueError(f"a state of {buf.numel()} bytes for tensors of {sum(sizes)} bytes")
    at = 0
    for t, n in zip(tensors, sizes, strict=True):
        # A copy: a slice at an odd offset cannot be viewed as a wider dtype.
        t.copy_(buf[at : at + n].clone().view(t.dtype).view(t.shape))
        at += n


def _digest(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.numpy().tobytes()).hexdigest()


class Rounds:
    """The tournament's rounds, for :func:`~trainer.train.fit`'s ``after_step``.

    Args:
        tc: the tournament.
        me: this trainer's index (its rank in ``group``).
        holdout: the held-out batches' loader (the same seed, batch and split on every rank).
        group: a gloo group of all the trainers, ranked by trainer index.
        timeout: how long a message to the partner may wait.

    Attributes:
        wins, losses: this trainer's rounds won and lost so far.
    """

    def __init__(
        self,
        tc: TournamentConfig,
        me: int,
        holdout: DataStoreLoader,
        group: Any,
        timeout: datetime.timedelta,
    ) -> None:
        self.tc, self.me, self.group, self.timeout = tc, me, group, timeout
        self.holdout = holdout
        self._batches = _endless(holdout)
        self.wins = self.losses = 0

    def __call__(self, t: Trainer) -> dict[str, Any] | None:
        if t.step % self.tc.interval:
            return None
        round_ = t.step // self.tc.interval - 1
        score = t.loss_on(next(self._batches))  # every trainer draws, paired or not
        pairs = pairs_of(round_, self.tc.trainers, self.tc.seed)
        partner = partner_of(pairs, self.me)
        tensors = state_tensors(t.model, t.opt)
        buf = pack_state(tensors)
        before = _digest(buf)
        record = {
            "event": "round", "round": round_, "step": t.step, "pairs": pairs,
            "partner": partner, "score": score, "partner_score": None, "winner": None,
            "state_sha256_before": before, "state_sha256": before,
        }  # fmt: skip
        if partner is None:
            return record
        timeout = self.timeout
        mine = torch.tensor([score, buf.numel()], dtype=torch.float64)
        theirs = torch.empty(2, dtype=torch.float64)
        exchange([(partner, mine, _SCORE_TAG)], [(partner, theirs, _SCORE_TAG)], self.group,
                 timeout)  # fmt: skip
        if int(theirs[1]) != buf.numel():
            raise RuntimeError(
                f"trainers {self.me} and {partner} hold states of {buf.numel()} and "
                f"{int(theirs[1])} bytes: they must train the same model with the same optimizer"
            )
        their_score = float(theirs[0])
        winner = winner_of(self.me, score, partner, their_score)
        if winner == self.me:
            self.wins += 1
            exchange([(partner, buf, _STATE_TAG)], [], self.group, timeout)
        else:
            self.losses += 1
            exchange([], [(partner, buf, _STATE_TAG)], self.group, timeout)
            unpack_state(buf, tensors)
            record["state_sha256"] = _digest(pack_state(tensors))
        record.update(partner_score=their_score, winner=winner)
        return record

    def close(self) -> None:
        """Stop the held-out stream and close its loader."""
        self._batches.close()
        self.holdout.close()


def _endless(loader: DataStoreLoader) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches, epoch after epoch."""
    for batch, _ in timed_batches(loader):
        if batch is not None:
            yield batch


def tournament(tc: TournamentConfig) -> dict[str, Any]:
    """Run this rank's trainer of the tournament (module docstring).

    Returns:
        ``{"rank", "steps", "rounds", "trainers": [{"trainer", "lr", "val_mse",
        "baseline_mse", "wins", "losses"}, ...] (every trainer's, on every rank), "best"}``
        (``best``: :func:`best_of` the trainers).

    Raises:
        ConfigError: on every rank alike, naming what cannot work.
    """
    run = start(tc.train, tc)
    me = dist.get_rank()
    cfg = tc.trainer_config(me)
    timeout = datetime.timedelta(seconds=cfg.comm_timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    t = Trainer(cfg, run)
    t.label = {"trainer": me}
    batch = tc.holdout_batch or cfg.global_batch
    holdout_cfg = dataclasses.replace(cfg, seed=tc.seed, global_batch=batch)
    holdout = loader_of(holdout_cfg, data_paths(cfg)[1], run, validation=False)
    rounds = Rounds(tc, me, holdout, group, timeout)
    try:
        result = fit(t, after_step=rounds)
    finally:
        rounds.close()
    mine = torch.tensor(
        [result["val_mse"], result["baseline_mse"], rounds.wins, rounds.losses],
        dtype=torch.float64,
    )
    rows = all_gather(mine, group, timeout)
    dist.destroy_process_group(group)
    lrs = tc.lrs or (tc.train.lr,) * tc.trainers
    trainers = [
        {"trainer": k, "lr": lrs[k], "val_mse": float(r[0]), "baseline_mse": float(r[1]),
         "wins": int(r[2]), "losses": int(r[3])}
        for k, r in enumerate(rows)
    ]  # fmt: skip
    best = best_of(trainers)
    summary = {
        "rank": me, "steps": result["steps"], "rounds": result["steps"] // tc.interval,
        "trainers": trainers, "best": best,
    }  # fmt: skip
    if me == 0:
        log = Log(tc.train.log_file)
        log.write({"event": "tournament", **{k: v for k, v in summary.items() if k != "rank"}})
        log.close()
    return summary


def best_of(trainers: Sequence[dict[str, Any]]) -> int:
    """The trainer of the lowest final ``val_mse`` (NaN last); on a tie the one of more
    ``wins``, then the lower index. A tie is usually a loser of the last round holding its
    winner's state, trained at the winner's learning rate, not at its own."""

    def key(k: int) -> tuple[float, int, int]:
        mse = trainers[k]["val_mse"]
        return (math.inf if math.isnan(mse) else mse, -trainers[k]["wins"], k)

    return min(range(len(trainers)), key=key)
