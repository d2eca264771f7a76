"""Two ranks: DataStoreLoader against DataLoader + DistributedSampler (StatefulDataLoader for
state) under ``torchrun --nproc_per_node 2`` (the process group made before our loader, and
after it) and ``mpiexec -n 2``. One launch per way runs every scenario (``rank_job.py``); the
states it saves are resumed by a second launch, a new process. The union over the ranks is
compared per pass: counts, coverage, duplicates and padding, and what a resumption yields."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest
from helpers import MPIEXEC, rank_rows

from conformance.common import HERE, PYTHON, write_dataset
from staging.cluster import LAUNCH_ENV

N, TAIL, WORLD = 64, 61, 2
STEPS = N // (8 * WORLD)  # batches a rank gets per epoch
JOB = os.path.join(HERE, "rank_job.py")
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(PYTHON)) or "torchrun"

pytest.importorskip("torchdata", reason="torchdata (dev extras) is not installed")


def launch(mode: str, out: str, data: tuple[str, str]) -> list[dict]:
    """Both ranks of ``mode`` under ``torchrun --standalone --nproc_per_node 2`` or
    ``mpiexec -n 2``; each rank's row."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    if mode.startswith("mpi"):
        cmd = [MPIEXEC, "-n", str(WORLD), PYTHON, "-m", "mpi4py"]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(WORLD)]
    return rank_rows([*cmd, JOB, mode, out, *data], f"{out}.{mode}", WORLD, env)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("torchrun", marks=pytest.mark.slow),
        pytest.param("mpi", marks=[pytest.mark.slow, pytest.mark.mpi]),
    ],
)
def runs(request, tmp_path_factory):
    """The scenario launch and its resuming launch (under torchrun: ours made before the
    process group)."""
    tmp = tmp_path_factory.mktemp(request.param)
    data = write_dataset(str(tmp / "d.h5"), N), write_dataset(str(tmp / "t.h5"), TAIL)
    out = str(tmp / "out")
    again = "torchrun-late-resume" if request.param == "torchrun" else "mpi-resume"
    return request.param, launch(request.param, out, data), launch(again, out, data)


def union(rows: list[dict], pick) -> Counter:
    """How often each sample came, over the ranks, of what ``pick(row)`` gives (batches)."""
    return Counter(i for row in rows for batch in pick(row) for i in batch)


def whole(rows: list[dict], pick, steps: int = STEPS) -> bool:
    """Every rank got ``steps`` batches of 8 and every sample came once."""
    full = all([len(b) for b in pick(row)] == [8] * steps for row in rows)
    return full and union(rows, pick) == Counter(range(N))


def test_sources_and_len(runs):
    mode, rows, again = runs
    assert [r["source"] for r in rows] == ["torch.distributed" if mode == "torchrun" else mode] * 2
    assert all(r["len"] == [STEPS, STEPS] for r in rows)
    if mode == "torchrun":  # ours made before init_process_group: each rank reads its own
        assert [r["source"] for r in again] == ["local"] * 2


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_every_pass_covers_the_dataset_once_over_the_ranks(runs, kind):
    """After no pass, a peek, a whole pass and a break; after each set_epoch."""
    _, rows, again = runs
    for run in (rows, again) if kind == "ours" and "passes" in again[0] else (rows,):
        p = [r["passes"][kind] for r in run]
        for k in range(3):
            assert whole(p, lambda x, k=k: x["fresh"][k])
            assert whole(p, lambda x, k=k: x["set_epoch"][k])
        assert whole(p, lambda x: x["after_break"])


def test_set_epoch_called_and_never_called(runs):
    """set_epoch(0), (1), (0): both give epoch 0's order twice and epoch 1's between. Never
    called: torch's every pass is epoch 0's order; ours moves on every pass (documented)."""
    _, rows, _ = runs
    for r in rows:
        for kind in ("torch", "ours"):
            e0, e1, e0_again = r["passes"][kind]["set_epoch"]
            assert e0 == e0_again != e1
        fresh = r["passes"]["torch"]["fresh"]
        assert fresh[0] == fresh[1] == fresh[2]
        fresh = r["passes"]["ours"]["fresh"]
        assert fresh[0] != fresh[1] != fresh[2]


def test_two_iterators_alive_at_once(runs):
    """torch: two whole passes. Ours with an exchange: the second refuses at once (the
    ranks step through one pass at a time), the first goes on to a whole pass (documented)."""
    _, rows, _ = runs
    assert whole(rows, lambda r: r["two"]["torch"]["first"])
    assert whole(rows, lambda r: r["two"]["torch"]["second"])
    assert whole(rows, lambda r: r["two"]["ours"]["first"])
    for r in rows:
        assert r["two"]["ours"]["second"].startswith("another iterator of this loader is still")


def test_drop_last_both_ways_and_the_padding(runs):
    """61 samples, 8 per rank. drop_last=True: both 3 steps, 48 samples. False: both 4 steps;
    torch's DistributedSampler repeats one sample to even the ranks (a duplicate counted as
    real) and the last batches are short (8, 8, 8, 7); ours gives whole batches, 3 padding
    repeats marked in ``valid``, every real sample once (documented)."""
    _, rows, _ = runs
    drop = [r["tails"]["drop_True"] for r in rows]
    assert all(d["len"] == [3, 3] for d in drop)
    assert sum(union(drop, lambda d: d["torch"]).values()) == 48
    ours = union(drop, lambda d: d["ours"])
    assert len(ours) == sum(ours.values()) == 48
    pad = [r["tails"]["drop_False"] for r in rows]
    assert all(d["len"] == [4, 4] for d in pad)
    assert all([len(b) for b in d["torch"]] == [8, 8, 8, 7] for d in pad)
    theirs = union(pad, lambda d: d["torch"])
    assert set(theirs) == set(range(TAIL)) and sum(theirs.values()) == TAIL + 1
    assert all([len(b) for b in d["ours"]] == [8] * 4 for d in pad)
    real = Counter(
        i
        for d in pad
        for b, v in zip(d["ours"], d["valid"], strict=True)
        for i, ok in zip(b, v, strict=True)
        if ok
    )
    assert real == Counter(range(TAIL))
    assert sum(not ok for d in pad for v in d["valid"] for ok in v) == 64 - TAIL


def test_state_dict_resumes_in_a_new_process(runs):
    """Saved at step 0, after 2 batches and after an epoch; resumed by new processes (under
    torchrun by loaders made before the process group, which read for themselves). The first
    pass is the uninterrupted loader's continuation on each rank, for both; the second a
    whole pass."""
    _, rows, again = runs
    for r, a in zip(rows, again, strict=True):
        for kind in ("ours", "torch"):
            straight, resumed = r["straight"][kind], a["resumed"]
            assert resumed[f"{kind}-0"][0] == straight[0]
            assert resumed[f"{kind}-mid"][0] == straight[0][2:]
            assert resumed[f"{kind}-end"][0] == straight[1]
    for name in ("ours-0", "ours-mid", "ours-end", "torch-0", "torch-mid", "torch-end"):
        assert whole(again, lambda a, name=name: a["resumed"][name][1])
