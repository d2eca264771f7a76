"""Gradients and optimizers of the trainer: the pure maths (LR schedule, LARS and Lion steps by
hand, bit packing, bucket plans, byte counts) in one process; GradientReducer and LionCub under
real ``mpiexec`` ranks on gloo (tests/trainer_jobs/optim_job.py, once per rank count)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC
from torch import nn

from staging.cluster import LAUNCH_ENV
from trainer.lion_cub import CommStats, majority, pack_bits, unpack_bits
from trainer.optim import LARS, Lion, LRSchedule, lr_at, set_lr, split_decay_groups
from trainer.reduce import plan_buckets

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent

sys.path.insert(0, str(JOBS))
import optim_job  # noqa: E402  (the case lists, to parametrize over)

ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


# --- learning-rate schedule -------------------------------------------------------------------


def test_lr_scales_linearly_with_the_global_batch():
    s = LRSchedule(0.1, global_batch=1024, base_batch=256)
    assert s.peak_lr == pytest.approx(0.4, abs=0)
    assert [lr_at(k, s) for k in (0, 7, 10**6)] == [s.peak_lr] * 3


def test_lr_warmup_then_constant():
    s = LRSchedule(0.5, global_batch=2, base_batch=1, warmup_steps=4)  # peak 1.0
    assert [lr_at(k, s) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_warmup_then_linear_decay():
    s = LRSchedule(1.0, warmup_steps=2, total_steps=6, decay="linear", final_lr=0.2)
    # warmup 0.5, 1.0; then t = 0, 1/4, 2/4, 3/4 of the way from 1.0 to 0.2; 0.2 from step 6
    want = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert [lr_at(k, s) for k in range(8)] == pytest.approx(want, abs=1e-15)


def test_lr_warmup_then_cosine_decay():
    s = LRSchedule(2.0, warmup_steps=1, total_steps=5, decay="cosine")
    want = [2.0, 2.0, 1 + math.cos(math.pi / 4), 1.0, 1 - math.cos(math.pi / 4), 0.0, 0.0]
    assert [lr_at(k, s) for k in range(7)] == pytest.approx(want, abs=1e-15)
    assert lr_at(3, s) == 1.0  # cos(pi / 2) / 2 lands on the middle exactly


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_lr": -1.0},
        {"base_lr": 1.0, "global_batch": 0},
        {"base_lr": 1.0, "warmup_steps": -1},
        {"base_lr": 1.0, "decay": "step"},
        {"base_lr": 1.0, "decay": "cosine", "warmup_steps": 5, "total_steps": 5},
    ],
)
def test_lr_schedule_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        LRSchedule(**kwargs)


def test_set_lr_and_sgd_momentum_follow_the_schedule():
    w = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=0.0, momentum=0.5)
    s = LRSchedule(0.25, global_batch=4, base_batch=2, warmup_steps=2)  # 0.25, 0.5, 0.5
    for k in range(3):
        set_lr(opt, lr_at(k, s))
        w.grad = torch.tensor([1.0], dtype=torch.float64)
        opt.step()
    # buffers 1, 1.5, 1.75; w = 1 - 0.25 * 1 - 0.5 * 1.5 - 0.5 * 1.75
    assert w.item() == 1 - 0.25 - 0.75 - 0.875


# --- LARS and Lion by hand --------------------------------------------------------------------


def test_split_decay_groups_excludes_biases_and_norms():
    model = nn.Sequential(nn.Conv3d(1, 2, 3), nn.BatchNorm3d(2))
    groups = split_decay_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]  # conv weight | conv bias, bn w, bn b
    assert groups[0]["weight_decay"] == 0.1 and "lars_exclude" not in groups[0]
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["lars_exclude"] is True


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(p: torch.Tensor, *want: float) -> None:
    torch.testing.assert_close(p.detach(), f64(*want), rtol=0, atol=1e-15)


def test_lars_two_steps_by_hand():
    w, b, zero = nn.Parameter(f64(3, 4)), nn.Parameter(f64(1)), nn.Parameter(f64(0, 0))
    groups = [
        {"params": [w, zero], "weight_decay": 0.1},
        {"params": [b], "weight_decay": 0.1, "lars_exclude": True},
    ]
    opt = LARS(groups, lr=0.5, momentum=0.9, eta=0.01)
    g = [0.6, 0.8]
    for step in range(2):  # the same gradients twice
        w.grad, zero.grad, b.grad = f64(*g), f64(*g), f64(0.5)
        opt.step()
        if step == 0:
            # ||w|| = 5, ||g|| = 1: trust = 0.01 * 5 / (1 + 0.1 * 5) = 1/30;
            # d = g + 0.1 w = (0.9, 1.2); v = lr * trust * d = (0.015, 0.02)
            v1 = [0.5 / 30 * 0.9, 0.5 / 30 * 1.2]
            close(w, 3 - v1[0], 4 - v1[1])
            close(b, 1 - 0.25)  # excluded: momentum SGD without decay, v = 0.5 * 0.5
            close(zero, -0.3, -0.4)  # ||w|| = 0: trust 1, v = lr * g
    w1 = [3 - v1[0], 4 - v1[1]]  # 0.995 * (3, 4), norm 4.975
    trust = 0.01 * 4.975 / (1 + 0.1 * 4.975)
    v2 = [0.9 * v1[i] + 0.5 * trust * (g[i] + 0.1 * w1[i]) for i in range(2)]
    close(w, w1[0] - v2[0], w1[1] - v2[1])
    close(b, 1 - 0.25 - (0.9 * 0.25 + 0.25))


def test_lion_two_steps_by_hand():
    # Dyadic numbers: every intermediate is exact in binary, so the steps compare with ==.
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = Lion([w], lr=0.125, betas=(0.5, 0.75), weight_decay=0.5)
    w.grad = torch.tensor([0.25, -1.0, 0.0], dtype=torch.float64)
    opt.step()
    # c = 0.5 * g = (0.125, -0.5, 0): update (1, -1, 0); w * (1 - 0.0625) - 0.125 * update
    assert w.tolist() == [0.8125, -1.75, 0.46875]
    assert opt.state[w]["exp_avg"].tolist() == [0.0625, -0.25, 0.0]  # 0.25 * g
    w.grad = torch.tensor([-0.5, 0.25, -1.0], dtype=torch.float64)
    opt.step()
    # c = 0.5 * m + 0.5 * g = (-0.21875, 0, -0.5): update (-1, 0, -1)
    assert w.tolist() == [0.76171875 + 0.125, -1.640625, 0.439453125 + 0.125]
    assert opt.state[w]["exp_avg"].tolist() == [-0.078125, -0.125, -0.25]


# --- Lion Cub pieces ----------------------------------------------------------------------------


def test_pack_bits_high_bit_first_and_round_trip():
    bits = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [160, 128]
    rng = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 66, 1000):
        b = torch.rand(n, generator=rng) > 0.5
        packed = pack_bits(b)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
        assert torch.equal(unpack_bits(packed, n), b)


def test_majority_vote_ties_give_zero():
    assert majority(torch.tensor([3, -1, 0, 2, -4])).tolist() == [1, -1, 0, 1, -1]


def test_comm_stats():
    s = CommStats(steps=2, bytes_sent=25, bytes_fp32=100)
    assert (s.bytes_saved, s.ratio) == (75, 0.25)
    assert CommStats().ratio == 1.0


def test_plan_buckets_close_before_overflow_and_on_new_keys():
    sizes = [(4, "a"), (4, "a"), (4, "a"), (20, "a"), (4, "b"), (4, "a")]
    assert plan_buckets(sizes, 8) == [[0, 1], [2], [3], [4], [5]]
    assert plan_buckets(sizes, 10**9) == [[0, 1, 2, 3], [4], [5]]
    assert plan_buckets(sizes, 1) == [[i] for i in range(6)]
    with pytest.raises(ValueError):
        plan_buckets(sizes, 0)


# --- under mpiexec ------------------------------------------------------------------------------


_results: dict[int, dict] = {}


def results(n: int, tmp_path_factory) -> dict:
    """Run optim_job.py on ``n`` ranks once per module; ``{case: {check: worst value}}``."""
    if n not in _results:
        assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
        out = tmp_path_factory.mktemp(f"optim{n}") / "out.json"
        cmd = [
            MPIEXEC,
            "-n",
            str(n),
            sys.executable,
            "-m",
            "mpi4py",
            str(JOBS / "optim_job.py"),
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _results[n] = json.loads(out.read_text())
    return _results[n]


def _data(n: int, parts: tuple[int, ...]) -> int:
    return n // math.prod(parts)


REDUCER_CASES = [
    pytest.param(
        n,
        f"reducer parts={p}, data={_data(n, p)}, bucket={b}, reduce_data={r}",
        id=f"{n}ranks-parts={p}-bucket={b}-reduce_data={r}",
    )
    for n, (parts, _) in optim_job.CASES.items()
    for p in parts
    for b, r in optim_job.REDUCERS
]
LION_CASES = [
    pytest.param(n, f"lion_cub parts={p}, data={_data(n, p)}", _data(n, p), id=f"{n}ranks-{p}")
    for n, (_, parts) in optim_job.CASES.items()
    for p in parts
]


@pytest.mark.mpi
@pytest.mark.parametrize(("n", "key"), REDUCER_CASES)
def test_gradient_reducer_matches_explicit_allreduce_and_single_process(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    for round_ in (0, 1):  # the second backward after finish() and zero_grad()
        assert r[f"launched_in_backward_{round_}"] == 1.0, r  # every bucket started in backward
        assert r[f"explicit_abs_{round_}"] == 0.0, r  # bitwise: per-parameter all_reduce
        assert r[f"single_rel_{round_}"] < 1e-6, r  # float64: the whole batch in one process
        if key.endswith("reduce_data=True"):
            assert r[f"spread_{round_}"] == 0.0, r  # every rank holds the same gradient
    assert r["unused_head_grad_abs"] == 0.0, r  # no gradient anywhere: zeros come back
    assert r["unused_head_others_abs"] == 0.0, r


@pytest.mark.mpi
def test_gradient_reducer_bucket_counts(tmp_path_factory):
    # 8 parameters; the head (not spatially partial) never shares a bucket with the rest.
    got = {
        k.split("bucket=")[1]: v["buckets"]
        for k, v in results(2, tmp_path_factory).items()
        if k.startswith("reducer parts=(1, 1, 1)")
    }
    assert got == {
        "1, reduce_data=True": 8,
        "400, reduce_data=True": 5,
        "1000000000, reduce_data=True": 2,
        "400, reduce_data=False": 5,
    }


@pytest.mark.mpi
@pytest.mark.parametrize(("n", "key", "data"), LION_CASES)
def test_lion_cub(n, key, data, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    # (a) one data rank: plain Lion, exactly
    if data == 1:
        assert r["lion_params_abs"] == 0.0, r
    else:
        assert r["lion_params_abs"] > 0, r  # the vote differs from each rank's own Lion
    # (b) the same parameters everywhere, equal to the single-process majority vote
    assert r["spread_params"] == 0.0, r
    assert r["sim_params_abs"] == 0.0, r
    assert r["sim_momentum_abs"] < 1e-15, r
    # (c) packed bits and int8 sums agree
    assert r["packed_vs_int8_params"] == 0.0, r
    assert r["packed_vs_int8_momentum"] == 0.0, r
    # (d) bytes: every step's votes, plus the momentum sync (float64) every SYNC_EVERY steps;
    # packed: flag byte + sign plane, and the zero plane on step 0 (rank 0 has zero votes).
    numel = sum(math.prod(s) for s in optim_job.LION_SHAPES)
    steps, syncs = optim_job.STEPS, optim_job.STEPS // optim_job.SYNC_EVERY
    momentum = syncs * numel * 8
    want = {
        "int8": steps * numel + momentum,
        "packed": steps * (1 + math.ceil(numel / 8)) + math.ceil(numel / 8) + momentum,
    }
    for mode, sent in want.items():
        sent, fp32 = (sent, steps * numel * 4) if data > 1 else (0, 0)
        assert r[f"{mode}_bytes_sent"] == r[f"{mode}_bytes_sent_min"] == sent, (mode, r)
        assert r[f"{mode}_bytes_fp32"] == fp32, (mode, r)
        assert r[f"{mode}_bytes_saved"] == fp32 - sent, (mode, r)
        assert r[f"{mode}_ratio"] == pytest.approx(sent / fp32 if fp32 else 1.0, rel=1e-15)
