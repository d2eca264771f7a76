"""``trainer tournament`` (LTFB): the pairing schedule, the winner, the state's bytes in one
process; then 3 trainers under real ``mpiexec`` against a real ``datastore serve``: the
schedule of the logs, losers holding their winners' exact state, the service reading every
sample once while delivering it to all three, and bad settings refused alike on every rank."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC, serving, set_args, trainer_refusals

from datastore.loader import DataStoreLoader
from datastore.service.client import Client
from staging.cluster import LAUNCH_ENV
from trainer.__main__ import main
from trainer.config import ConfigError, load_tournament, trainer_log
from trainer.cosmology import write_split
from trainer.tournament import (
    best_of,
    pack_state,
    pairs_of,
    partner_of,
    state_tensors,
    unpack_state,
    winner_of,
)

ROOT = Path(__file__).parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
SAMPLES, VAL, STEPS, BATCH = 24, 8, 6, 4  # one epoch of 6 steps; rounds after steps 2, 4, 6
SCHEDULE = [[[0, 2]], [[0, 2]], [[1, 2]]]  # pairs_of(r, 3, seed=0) for r = 0, 1, 2


# -- one process -------------------------------------------------------------------------------
def test_pairing_schedule_is_fixed_by_the_seed():
    assert [pairs_of(r, 3, 0) for r in range(6)] == [
        [(0, 2)], [(0, 2)], [(1, 2)], [(1, 2)], [(1, 2)], [(0, 1)],
    ]  # fmt: skip
    assert [pairs_of(r, 3, 1) for r in range(3)] == [[(0, 1)], [(0, 2)], [(0, 1)]]
    assert [pairs_of(r, 4, 0) for r in range(3)] == [
        [(0, 2), (1, 3)], [(0, 3), (1, 2)], [(0, 3), (1, 2)],
    ]  # fmt: skip
    assert [pairs_of(r, 5, 0) for r in range(3)] == [
        [(0, 3), (2, 4)], [(0, 3), (1, 4)], [(0, 1), (2, 4)],
    ]  # fmt: skip
    for k in range(2, 9):
        for r in range(20):
            pairs = pairs_of(r, k, 7)
            members = [m for p in pairs for m in p]
            assert len(pairs) == k // 2 and len(set(members)) == len(members)
            assert all(a < b for a, b in pairs) and pairs == sorted(pairs)


def _row(k: int, mse: float, wins: int) -> dict:
    return {"trainer": k, "lr": 1e-3, "val_mse": mse, "baseline_mse": 1.0, "wins": wins}


def test_the_best_trainer_is_the_lowest_mse_and_on_a_tie_the_one_that_won():
    """A loser of the last round holds its winner's state and scores the same: the summary
    names the winner (and so its learning rate), as a new user's 2-trainer run showed it
    naming the loser."""
    assert best_of([_row(0, 0.3, 0), _row(1, 0.2, 0)]) == 1
    assert best_of([_row(0, 0.3048, 0), _row(1, 0.3048, 2)]) == 1  # the user's run
    assert best_of([_row(0, 0.3, 1), _row(1, 0.3, 1)]) == 0  # then the lower index
    assert best_of([_row(0, math.nan, 5), _row(1, 0.9, 0)]) == 1  # NaN last


def test_partner_and_winner():
    assert [partner_of([(0, 3), (1, 2)], k) for k in range(5)] == [3, 2, 1, 0, None]
    assert winner_of(0, 0.5, 1, 0.25) == 1 and winner_of(1, 0.25, 0, 0.5) == 1
    assert winner_of(2, 0.5, 1, 0.5) == 1 and winner_of(1, 0.5, 2, 0.5) == 1  # tie: lower index
    assert winner_of(0, math.nan, 1, 9.0) == 1 and winner_of(0, 9.0, 1, math.nan) == 0
    assert winner_of(3, math.nan, 1, math.nan) == 1


def test_state_travels_byte_for_byte():
    torch.manual_seed(0)
    tensors = [
        torch.randn(3, 5), torch.tensor(7, dtype=torch.int64), torch.tensor([True, False, True]),
        torch.randn(2, 2, dtype=torch.float64), torch.empty(0), torch.randn(4).half(),
    ]  # fmt: skip
    buf = pack_state(tensors)
    assert buf.dtype == torch.uint8
    assert buf.numel() == sum(t.numel() * t.element_size() for t in tensors) == 111
    into = [torch.zeros_like(t) for t in tensors]
    unpack_state(buf, into)  # the float64 starts at the odd offset 71
    for a, b in zip(tensors, into, strict=True):
        assert a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes()
    short = [torch.zeros_like(t) for t in tensors[:-1]] + [torch.zeros(3).half()]
    with pytest.raises(ValueError, match="a state of 111 bytes for tensors of 109 bytes"):
        unpack_state(buf, short)
    assert not any(bool(t.any()) for t in short)  # nothing written


def test_state_tensors_are_the_model_then_the_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    assert len(state_tensors(model, opt)) == 7  # 2 + 2 parameters, 3 BatchNorm buffers
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    got = state_tensors(model, opt)
    assert len(got) == 7 + 4 * 3  # Adam: exp_avg, exp_avg_sq, step per parameter
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    other_opt = torch.optim.Adam(other.parameters())
    other(torch.randn(4, 3)).sum().backward()
    other_opt.step()
    unpack_state(pack_state(got), state_tensors(other, other_opt))  # writes into the model
    assert pack_state(state_tensors(other, other_opt)).numpy().tobytes() == (
        pack_state(got).numpy().tobytes()
    )
    assert torch.equal(other[0].weight, model[0].weight)


def write_config(path: Path, table: str = "", **keys: object) -> Path:
    base = {"data": "d", "data_address": "/x.sock", **keys}
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in base.items()) + table)
    return path


def test_tournament_config(tmp_path):
    path = write_config(tmp_path / "t.toml", "[tournament]\ntrainers = 3\nlrs = [1, 2e-3, 3]\n",
                        log_file="out/run.jsonl", seed=5)  # fmt: skip
    tc = load_tournament(path, ["tournament.interval=4", "lr=0.5"])
    assert (tc.trainers, tc.interval, tc.lrs, tc.seed, tc.train.lr) == (
        3,
        4,
        (1.0, 2e-3, 3.0),
        0,
        0.5,
    )
    one = tc.trainer_config(1)
    assert (one.lr, one.seed, one.log_file) == (2e-3, 6, "out/run.t1.jsonl")
    assert trainer_log("", 3) == "" and trainer_log("log", 2) == "log.t2"
    same = load_tournament(write_config(tmp_path / "u.toml"), ["tournament.trainers=2"])
    assert same.trainer_config(1).lr == same.train.lr == 1e-3


@pytest.mark.parametrize(
    "table, sets, message",
    [
        ("", ["tournament.trainers=1"], "'tournament.trainers': a tournament needs at least 2"),
        ("", ["tournament.interval=0"], "'tournament.interval': rounds must be at least 1 step"),
        ("", ["tournament.lrs=[0.1]"], "1 learning rates for 2 trainers"),
        ("", ["tournament.lrs=[0.1, 0]"], "'tournament.lrs': must be positive"),
        ("", ["tournament.trainers=2.5"], "'tournament.trainers': expected an integer"),
        ('[tournament]\nlrs = [1, "x"]\n', [], "'tournament.lrs': expected a list of numbers"),
        ("", ["tournament.holdout_batch=-1"], "'tournament.holdout_batch': must be >= 0"),
        ("", ["tournament.rounds=3"], "unknown config key 'tournament.rounds'"),
        ("[tournament]\nsize = 2\n", [], "unknown config key 'tournament.size'"),
        ("tournament = 3\n", [], "'tournament' must be a table"),
        ("", ["data_address="], "'data_address': a tournament's trainers read through one"),
        ("", ["spatial_parts=[2,1,1]"], "'spatial_parts': each trainer of a tournament is one"),
        ("", ["checkpoint_dir=ck"], "'checkpoint_dir': a tournament does not checkpoint"),
        ("", ["checkpoint_dir=ck", "checkpoint_interval=5"], "empty, and checkpoint_interval=0"),
        ("", ["tournament.lrs=[nan, 1e-3]"], "'tournament.lrs': expected a finite number"),
        ("", ["tournament.seed=-1"], "'tournament.seed': must be between 0 and 2**64 - 1"),
        ("", [f"seed={2**64 - 1}"], "'seed': trainer k takes seed + k, and seed"),
    ],
)
def test_bad_tournament_settings_are_named(tmp_path, table, sets, message):
    path = write_config(tmp_path / "t.toml", table)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_tournament(path, sets)


def test_one_process_is_told_to_launch_one_per_trainer(tmp_path, capsys, monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    path = write_config(tmp_path / "t.toml")
    assert main(["tournament", "--config", str(path), "--set", "tournament.trainers=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs one process per trainer: launch 3 (mpiexec -n 3" in err


# -- real ranks, a real service ----------------------------------------------------------------
def launch(n: int, sets: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    argv = set_args(sets)
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "trainer", "tournament"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cosmo")
    write_split(out, SAMPLES, VAL, 16, 0)
    return out


def settings(data: Path, log: Path, sock: Path, *more: str) -> list[str]:
    return [
        f"data={data}", "width=2", "conv_blocks=3", f"global_batch={BATCH}", f"steps={STEPS}",
        "optimizer=adam", f"data_address={sock}", f"log_file={log}", "tournament.trainers=3",
        "tournament.interval=2", "tournament.lrs=[1e-3, 3e-3, 1e-2]", "tournament.seed=0",
        *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tourney(data, tmp_path_factory):
    """A 3-trainer tournament against a fresh ``datastore serve``: ``(logs, status, stdout)``."""
    tmp = tmp_path_factory.mktemp("tourney")
    with serving(tmp, ENV) as sock:
        proc = launch(3, settings(data, tmp / "run.jsonl", sock))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with Client(sock) as client:
            status = {d.path: d for d in client.status().datasets}
    logs = {k: read(Path(trainer_log(str(tmp / "run.jsonl"), k))) for k in range(3)}
    logs["all"] = read(tmp / "run.jsonl")
    return logs, status, proc.stdout


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rounds_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") == "round"]


@pytest.mark.mpi
def test_rounds_follow_the_schedule(tourney):
    logs = tourney[0]
    for k in range(3):
        rounds = rounds_of(logs[k])
        assert [r["round"] for r in rounds] == [0, 1, 2]
        assert [r["step"] for r in rounds] == [2, 4, 6]
        assert [r["pairs"] for r in rounds] == SCHEDULE
        assert [r["partner"] for r in rounds] == [partner_of(p, k) for p in SCHEDULE]
        assert all(r["trainer"] == k for r in logs[k])
        assert len([r for r in logs[k] if "loss" in r]) == STEPS


@pytest.mark.mpi
def test_the_loser_holds_the_winners_exact_state(tourney):
    logs = tourney[0]
    for i, pairs in enumerate(SCHEDULE):
        for a, b in pairs:
            ra, rb = rounds_of(logs[a])[i], rounds_of(logs[b])[i]
            assert ra["winner"] == rb["winner"] == winner_of(a, ra["score"], b, rb["score"])
            assert (ra["partner_score"], rb["partner_score"]) == (rb["score"], ra["score"])
            win, lose = (ra, rb) if ra["winner"] == a else (rb, ra)
            assert win["state_sha256"] == win["state_sha256_before"]  # the winner keeps its own
            assert lose["state_sha256_before"] != win["state_sha256_before"]
            assert lose["state_sha256"] == win["state_sha256"]  # the loser's bytes are the winner's
    # The last round is at the last step: its loser validates the winner's model, exactly.
    (a, b), = SCHEDULE[-1]  # fmt: skip
    final = {k: [r for r in logs[k] if r.get("event") == "validation"][-1] for k in (a, b)}
    assert final[a]["val_mse"] == final[b]["val_mse"]
    assert final[a]["val_mse_per_target"] == final[b]["val_mse_per_target"]


@pytest.mark.mpi
def test_the_service_reads_each_sample_once_for_all_trainers(data, tourney):
    status = tourney[1]
    train, val = status[str(data / "train.h5")], status[str(data / "validation.h5")]
    fields = 2  # x and y: the store counts one read per sample and field
    # (a miss: a sample a batch asked for before the load had read it; the load's own reads
    # are neither)
    assert train.misses <= SAMPLES * fields and val.misses <= VAL * fields
    assert (train.bytes_read, val.bytes_read) == (train.bytes_total, val.bytes_total)  # once
    # delivered to each of the 3 trainers, and to each the next epoch's first batches, which the
    # service fills ahead over shared memory at an epoch's end (docs/loader.md)
    ahead = inspect.signature(DataStoreLoader).parameters["prefetch"].default
    assert train.hits + train.misses == 3 * (STEPS + ahead) * BATCH * fields
    assert val.hits + val.misses > 3 * VAL * fields  # every trainer's validation and held-out


@pytest.mark.mpi
def test_the_summary_names_the_best_trainer(tourney):
    logs, _, stdout = tourney
    (summary,) = logs["all"]
    assert summary["event"] == "tournament" and summary["rounds"] == 3
    rows = summary["trainers"]
    assert [r["lr"] for r in rows] == [1e-3, 3e-3, 1e-2]
    final = [
        [r for r in logs[k] if r.get("event") == "validation"][-1]["val_mse"] for k in range(3)
    ]
    assert [r["val_mse"] for r in rows] == final
    wins = [sum(r["winner"] == k for r in rounds_of(logs[k])) for k in range(3)]
    assert [r["wins"] for r in rows] == wins and sum(wins) == 3
    # the lowest MSE; a last round's loser ties with its winner, which is named
    assert summary["best"] == min(range(3), key=lambda k: (final[k], -wins[k], k))
    assert stdout.count("tournament of 3 trainers, 6 steps, 3 rounds: best validation MSE") == 1


# refused on every rank before any reaches a service: one launch of 2 ranks runs them all
BAD_SETTINGS = {
    "one-trainer": (["tournament.trainers=1"],
                    "'tournament.trainers': a tournament needs at least 2"),
    "no-interval": (["tournament.interval=0"],
                    "'tournament.interval': rounds must be at least 1 step"),
    "ranks": (["tournament.trainers=3"], "3 trainers but 2 processes were launched"),
    "log": (["log_file=/dev/null/r.jsonl"], "'log_file': /dev/null: /dev/null is not a direc"),
}  # fmt: skip


@pytest.fixture(scope="module")
def bad_settings(data, tmp_path_factory) -> dict[str, list[dict]]:
    """Each of ``BAD_SETTINGS`` run as ``trainer tournament`` on the same 2 ranks: per rank,
    what it said."""
    tmp = tmp_path_factory.mktemp("refused")
    base = settings(data, tmp / "r.jsonl", tmp / "none.sock")
    cases = [[*base, *sets] for sets, _ in BAD_SETTINGS.values()]
    return dict(zip(BAD_SETTINGS, trainer_refusals(2, "tournament", cases, tmp), strict=True))


@pytest.mark.mpi
@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_settings_are_one_error_on_every_rank(bad_settings, case):
    message = BAD_SETTINGS[case][1]
    for rank, r in enumerate(bad_settings[case]):
        assert r["code"] == 2, (rank, r)
        assert r["stderr"].count("trainer: ") == 1 and r["stderr"].count(message) == 1, (rank, r)


@pytest.mark.mpi
def test_a_tournament_without_a_round_is_refused(data, tmp_path):
    """Rounds further apart than the run is long: refused on every rank, not a run that
    plays no round and exits 0."""
    with serving(tmp_path, ENV) as sock:
        sets = settings(data, tmp_path / "r.jsonl", sock, "tournament.trainers=2",
                        "tournament.lrs=[]", "tournament.interval=100")  # fmt: skip
        proc = launch(2, sets, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = "'tournament.interval': rounds every 100 steps, but each trainer trains 6 steps"
    assert proc.stderr.count(message) == 2, proc.stderr
