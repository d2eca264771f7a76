"""Ranks that disagree raise the same clear error on every rank, before they communicate
(issue 11, traps 9, 10): real ``mpiexec -n 2`` ranks (``tests/mpi_jobs/traps_job.py``).
Traps 1, 3, 4 and 12 again through the MPI exchange, over epochs
(``tests/mpi_jobs/traps_epochs_job.py``). Ranks that stop early: test_loader_stops_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_traps import EPOCHS_JOB, Job, N, write_data

from datastore.maths.order import Schedule

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return write_data(tmp_path_factory.mktemp("trapsmpi"))


# every rank refuses these before it communicates a batch: one launch runs them all
REFUSALS = ["seed", "batch", "spatial", "fields", "dataset", "halo", "halo_axis", "one_bad",
            "one_bad_geometry", "one_bad_parts", "parts_world"]  # fmt: skip


@pytest.fixture(scope="module")
def refusals(data) -> Job:
    return Job(REFUSALS, *data)


@pytest.mark.parametrize(
    ("case", "argument", "values"),
    [
        ("seed", "seed", ("0", "1")),
        ("batch", "batch_size", ("2", "3")),
        ("spatial", "spatial", ("(0, 0, 0)", "(1, 1, 1)")),
        ("fields", "fields", ("('x', 'idx')", "('idx',)")),
    ],
)
def test_9_ranks_that_disagree_all_raise_naming_the_argument_and_ranks(
    refusals, case, argument, values
):
    job = refusals[case]
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch", r
        assert f"disagree on {argument}" in text
        assert "ranks 0: " in text and "ranks 1: " in text
        assert all(v in text for v in values), text
        assert r["ids"] == []
    for rank in (0, 1):  # each rank's own traceback
        assert job.raised(rank, f"datastore.errors.RankMismatch: ranks disagree on {argument}")


def test_9_a_dataset_that_differs_between_ranks_is_named(refusals):
    job = refusals["dataset"]
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch" and "disagree on dataset" in text
        assert f"ranks 0: {N} samples" in text and f"ranks 1: {N + 4} samples" in text
    for rank in (0, 1):
        assert job.raised(rank, "datastore.errors.RankMismatch: ranks disagree on dataset")


def test_10_a_geometry_that_cannot_work_is_refused_on_every_rank_alike(refusals):
    job = refusals["halo"]
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and "halo" in text


def test_10_a_halo_wider_than_a_block_is_refused_on_every_rank_alike(refusals):
    job = refusals["halo_axis"]  # D=8 in 4 parts: blocks of 2 voxels, halo 3
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError"
    assert text.startswith("halo[0]=3 is wider than the smallest neighbouring block (2 voxels")
    for rank in (0, 1):
        assert job.raised(rank, "ValueError: halo[0]=3 is wider")


def test_10_one_rank_with_a_bad_argument_takes_both_down(refusals):
    job = refusals["one_bad"]
    kind, text = job.rows[1]["error"]
    assert kind == "ValueError" and text == "prefetch must be an int >= 1, got 0"
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and text == "rank 1 refused: prefetch must be an int >= 1, got 0"
    assert job.raised(0, "ValueError: rank 1 refused: prefetch")
    assert job.raised(1, "ValueError: prefetch must be an int >= 1")


# -- 10, one rank alone: geometry refused on every rank -------------------------------------
def test_10_one_rank_whose_geometry_cannot_work_takes_both_down(refusals):
    """Same arguments on both ranks (parts (2, 1, 1), halo 2), but rank 1's volumes are 2
    voxels wide: only rank 1 finds halo 2 wider than its blocks of 1; rank 0 raises too."""
    job = refusals["one_bad_geometry"]
    want = "halo[0]=2 is wider than the smallest neighbouring block (1 voxels"
    kind, text = job.rows[1]["error"]
    assert kind == "ValueError" and text.startswith(want), text
    kind, zero = job.rows[0]["error"]
    assert kind == "ValueError" and zero == f"rank 1 refused: {text}"
    assert all(r["ids"] == [] for r in job.rows)
    assert job.raised(0, f"ValueError: rank 1 refused: {want}")
    assert job.raised(1, f"ValueError: {want}")


def test_10_one_rank_asking_for_other_parts_is_a_mismatch_on_both(refusals):
    job = refusals["one_bad_parts"]  # rank 1 alone: parts (3, 1, 1)
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "RankMismatch" and text.startswith("ranks disagree on spatial: ranks 0: ")
    assert "'parts': (2, 1, 1)" in text and "ranks 1: {'parts': (3, 1, 1)" in text


def test_10_parts_the_ranks_cannot_hold_are_refused_on_both(refusals):
    job = refusals["parts_world"]  # parts (3, 1, 1) on 2 ranks, on both
    for r in job.rows:
        assert r["error"] == ["ValueError", "world size 2 is not a multiple of 3 spatial blocks"]
        assert r["ids"] == []


# -- 1, 3, 4, 12 through the MPI exchange, over epochs ----------------------------------------
def padded_order(seed: int, epoch: int, global_batch: int) -> np.ndarray:
    """The epoch's permutation, its tail padded with its first samples: (steps, global_batch)."""
    perm = Schedule(N, 1, seed=seed).order(epoch)
    pad = -N % global_batch
    return np.concatenate([perm, perm[:pad]]).reshape(-1, global_batch)


@pytest.fixture(scope="module")
def consumed(data) -> Job:
    return Job(["consume_spatial", "consume_data"], data[0], job=EPOCHS_JOB)


@pytest.mark.parametrize("case", ["consume_spatial", "consume_data"])
def test_1_3_4_12_over_the_mpi_exchange(consumed, case):
    """3 epochs as ``islice(loader, len(loader))`` each, no set_epoch (1): epochs 0, 1, 2 in
    the schedule's order, the position moving on at each epoch's last batch. Every batch holds
    the file's bytes (with spatial: the whole box, zero border included, cut by np.pad here).
    Epoch 0's batches are kept and still hold their bytes after epochs 1 and 2 (3); epochs 1
    and 2 are edited in place (``x.mul_(0).add_(7)``, ``idx.mul_(0)``) and no edit reaches a
    later batch (12). ``consume_data``: global batch 6 over 16 samples, drop_last=False: the
    exact ``valid`` mask (4)."""
    job = consumed[case]
    spatial = case == "consume_spatial"
    gb = 2 if spatial else 6
    steps = N // gb if spatial else -(-N // gb)
    for r in job.rows:
        assert r["error"] is None, r["error"]
        assert r["source"] == "mpi" and r["len"] == steps
        assert len(r["epochs"]) == 3
        for epoch, row in enumerate(r["epochs"]):
            order = padded_order(3, epoch, gb)
            assert len(order) == steps
            share = slice(0, gb) if spatial else slice(3 * r["rank"], 3 * r["rank"] + 3)
            assert row["ids"] == order[:, share].tolist(), (r["rank"], epoch)
            assert row["bad"] == 0, (r["rank"], epoch)
            want = [[epoch, i + 1] for i in range(steps - 1)] + [[epoch + 1, 0]]
            assert row["positions"] == want
            assert row["after"] == [epoch + 1, epoch + 1, 0]
            if spatial:
                assert row["valid"] == []
            else:
                assert row["valid"] == [
                    [step * gb + share.start + j < N for j in range(3)] for step in range(steps)
                ]
        assert r["kept"] == steps and r["kept_bad"] == 0
    if not spatial:  # the real samples of both ranks: the dataset once per epoch
        for epoch in range(3):
            row = [r["epochs"][epoch] for r in job.rows]
            real = [
                i
                for rr in row
                for ids, mask in zip(rr["ids"], rr["valid"], strict=True)
                for i, m in zip(ids, mask, strict=True)
                if m
            ]
            assert sorted(real) == list(range(N))
        assert job.rows[1]["epochs"][0]["valid"][-1] == [True, False, False]
