"""One process: what a user of DataStoreLoader observes against torch's DataLoader
(``shuffle=True``), a one-rank DistributedSampler and torchdata's StatefulDataLoader, over the
same HDF5 file. Orders differ (other shuffles): counts, coverage and resumption are compared."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from conformance.common import (
    HERE,
    PYTHON,
    H5Samples,
    counts,
    epoch,
    flat,
    ours,
    theirs,
    valid_ids,
    write_dataset,
)
from datastore.sources.options import ServiceOptions

N, B = 64, 8  # 8 batches an epoch
TAIL = 60  # with B: 7 whole batches and 4 left over


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    return write_dataset(str(tmp / "d.h5"), N), write_dataset(str(tmp / "tail.h5"), TAIL)


def both(path: str, **kw):
    """torch's loader and ours, built alike."""
    return {"torch": theirs(path, B, **kw), "ours": ours(path, B, **kw)}


def whole(batches: list[list[int]], n: int = N) -> bool:
    """A pass of full batches holding every sample once."""
    return all(len(b) == B for b in batches) and sorted(flat(batches)) == list(range(n))


@pytest.mark.parametrize(("drop_last", "want"), [(True, 7), (False, 8)])
def test_len_is_torchs(data, drop_last, want):
    for name, loader in both(data[1], drop_last=drop_last).items():
        assert len(loader) == want, name


def test_a_fresh_iter_is_a_whole_pass_after_no_a_partial_and_a_whole_epoch(data):
    """Issue 22, 2a: ``next(iter(loader))`` to peek, then ``for b in loader``. Before the fix
    ours continued the peeked epoch (7 of 8 batches); now, as torch's, every ``iter()`` is a
    whole pass, and each a new permutation (torch's RandomSampler draws one per iter)."""
    for name, loader in both(data[0]).items():
        first = epoch(loader)  # no epoch before
        next(iter(loader))  # a peek: a partial epoch
        after_peek = epoch(loader)
        after_whole = epoch(loader)  # a whole epoch before
        for p in (first, after_peek, after_whole):
            assert len(p) == len(loader) == N // B and whole(p), name
        assert first != after_peek != after_whole, name


def test_break_and_loop_again_is_a_whole_pass(data):
    for name, loader in both(data[0]).items():
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert whole(epoch(loader)), name


def test_two_iterators_alive_at_once_each_yield_a_whole_pass(data):
    """Ours follows the newest for its position (as StatefulDataLoader's state does)."""
    for name, loader in both(data[0]).items():
        one = iter(loader)
        head = epoch([next(one)])
        two = epoch(iter(loader))
        assert whole(head + epoch(one)) and whole(two), name
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["step"] == 0


def test_set_epoch_called_gives_that_epochs_order_as_distributed_sampler(data):
    """``set_epoch(e)`` before each pass: epoch e's permutation, the same every time asked."""
    sampler = DistributedSampler(H5Samples(data[0]), num_replicas=1, rank=0, seed=0)
    loaders = {"torch": DataLoader(sampler.dataset, B, sampler=sampler), "ours": ours(data[0], B)}
    for name, loader in loaders.items():
        target = sampler if name == "torch" else loader
        passes = {}
        for e in (0, 1, 0):
            target.set_epoch(e)
            passes.setdefault(e, []).append(epoch(loader))
        assert passes[0][0] == passes[0][1] != passes[1][0], name
        assert all(whole(p[0]) for p in passes.values()), name


def test_set_epoch_never_called_repeats_torchs_order_and_moves_ours_on(data):
    """A documented difference (docs/loader.md): torch's DistributedSampler without set_epoch
    gives every pass the same order; ours moves to the next epoch with every pass (a new
    permutation, as DataLoader(shuffle=True)), so a forgotten set_epoch cannot repeat one."""
    sampler = DistributedSampler(H5Samples(data[0]), num_replicas=1, rank=0, seed=0)
    torchs = DataLoader(sampler.dataset, B, sampler=sampler)
    assert epoch(torchs) == epoch(torchs)
    mine = ours(data[0], B)
    one, two = epoch(mine), epoch(mine)
    assert one != two and whole(one) and whole(two)
    again = ours(data[0], B)
    again.set_epoch(1)
    assert epoch(again) == two  # pass k is epoch k: the same order as set_epoch(k)


def test_drop_last_drops_the_same_number_of_samples(data):
    for name, loader in both(data[1], drop_last=True).items():
        for _ in range(2):
            ids = flat(epoch(loader))
            assert len(ids) == len(set(ids)) == TAIL - TAIL % B, name


def test_drop_last_false_torch_gives_a_short_batch_ours_pads_and_marks(data):
    """A documented difference: torch's last batch is short (4 of 8); ours is whole, its 4
    padding repeats (the epoch's first samples) marked False in ``batch["valid"]``."""
    torchs = theirs(data[1], B, drop_last=False)
    got = epoch(torchs)
    assert [len(b) for b in got] == [8] * 7 + [4] and sorted(flat(got)) == list(range(TAIL))
    mine = ours(data[1], B, drop_last=False)
    batches = list(mine)
    assert [len(b["idx"]) for b in batches] == [8] * 8
    real = [i for b in batches for i in valid_ids(b)]
    assert sorted(real) == list(range(TAIL))
    last = batches[-1]
    pads = [i for i, v in zip(last["idx"].tolist(), last["valid"].tolist(), strict=True) if not v]
    assert pads == batches[0]["idx"][:4].tolist()
    assert all(b["valid"].all() for b in batches[:-1])


def test_state_dict_at_step_0_mid_epoch_and_end_resumes_in_a_new_process(data, tmp_path):
    """StatefulDataLoader and ours, each saved at step 0, after 3 batches and after a whole
    epoch; a new process loads each into a fresh loader and runs two passes. Both: the first
    pass is what the uninterrupted loader yields from there (the rest of the epoch, or the
    next epoch), the second a whole pass; except that torch's loader, loaded with a state saved
    at the end of an epoch, gives a whole pass but not the order the uninterrupted one gives
    next (torchdata 0.11); ours does (documented)."""
    pytest.importorskip("torchdata", reason="torchdata (dev extras) is not installed")
    states, want = {}, {}
    for kind in ("ours", "theirs"):

        def fresh(kind=kind):
            return ours(data[0], B) if kind == "ours" else theirs(data[0], B, stateful=True)

        straight = fresh()
        passes = [epoch(straight) for _ in range(3)]
        at0 = fresh()
        states[f"{kind}-0"] = at0.state_dict()
        want[f"{kind}-0"] = passes[0]
        mid = fresh()
        it = iter(mid)
        for _ in range(3):
            next(it)
        states[f"{kind}-mid"] = mid.state_dict()
        want[f"{kind}-mid"] = passes[0][3:]
        del it
        end = fresh()
        epoch(end)
        states[f"{kind}-end"] = end.state_dict()
        want[f"{kind}-end"] = passes[1]
    torch.save(states, tmp_path / "states.pt")
    out = tmp_path / "resumed.json"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    subprocess.run(
        [PYTHON, os.path.join(HERE, "resume_job.py"), data[0], str(tmp_path / "states.pt"), out],
        check=True, env=env, timeout=120,
    )  # fmt: skip
    got = json.loads(out.read_text())
    for name, (first, second) in got.items():
        if name == "theirs-end":
            assert whole(first) and first != want[name]
        else:
            assert first == want[name], name
        assert whole(second), name
    assert counts(flat(got["ours-mid"][0])).total() == N - 3 * B


def test_the_service_source_passes_and_resumes_as_the_embedded_one(data, tmp_path):
    """Through ``datastore serve`` (``service=``): the passes after none, a peek and a
    break, and a mid-epoch resumption yield exactly the embedded loader's batches (one
    sequence for every source). Two iterators alive at once: the second is refused while
    the first runs (its stream's batches were overwritten by the second's; documented)."""
    from helpers import serving

    from staging.cluster import LAUNCH_ENV

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)

    def scenario(loader) -> list:
        got = [epoch(loader)]
        next(iter(loader))
        got.append(epoch(loader))
        for i, _ in enumerate(loader):
            if i == 2:
                break
        got.append(epoch(loader))
        it = iter(loader)
        got.append(epoch([next(it), next(it)]))
        state = loader.state_dict()
        del it
        return [*got, state]

    embedded = scenario(ours(data[0], B))
    with serving(tmp_path, env) as sock:
        remote = ours(data[0], B, service=ServiceOptions(str(sock)))
        got = scenario(remote)
        resumed = ours(data[0], B, service=ServiceOptions(str(sock)))
        resumed.load_state_dict(got[-1])
        rest = epoch(resumed)
        one = iter(remote)
        next(one)
        with pytest.raises(RuntimeError) as err:
            next(iter(remote))
        refused = str(err.value)
        del one
        remote.close()
        resumed.close()
    assert got == embedded and all(whole(p) for p in got[:3])
    assert refused.startswith("another iterator of this loader is still running")
    mine = ours(data[0], B)
    mine.set_epoch(got[-1]["epoch"])
    assert got[-2] + rest == epoch(mine)
