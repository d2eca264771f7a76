"""The training driver: config loading and errors, exact resume, the JSON log, and learning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import job_env, serving, set_args

from trainer.__main__ import main
from trainer.checkpoint import (
    load_checkpoint,
    load_own_optimizer,
    own_optimizer_name,
    prune_own_optimizer,
    save_checkpoint,
)
from trainer.config import ConfigError, TrainConfig, load_config, parse_override
from trainer.cosmology import write_split
from trainer.dense import DistFlattenLinear
from trainer.metrics import Sums
from trainer.optim import lr_at
from trainer.start import schedule_of
from trainer.train import Trainer, train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """40 training and 8 validation samples of 8^3."""
    out = tmp_path_factory.mktemp("cosmo8")
    write_split(out, 40, 8, 8, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """192 training and 64 validation samples of 16^3."""
    out = tmp_path_factory.mktemp("cosmo16")
    write_split(out, 192, 64, 16, seed=0)
    return str(out)


# -- config ------------------------------------------------------------------------------------
def test_config_from_toml_with_overrides(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('data = "d"\nlr = 1\nepochs = 2\nspatial_parts = [1, 1, 1]\n')
    cfg = load_config(path, ["optimizer=sgd", "lr=0.5", "width=4", "log_file=/tmp/a b.jsonl"])
    assert cfg == TrainConfig(
        data="d", lr=0.5, epochs=2, optimizer="sgd", width=4, log_file="/tmp/a b.jsonl"
    )
    assert isinstance(load_config(path).lr, float)  # an integer is a valid float
    assert parse_override('data="x=y"') == ("data", "x=y")
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # frozen


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=d", "lrr=1"], "unknown config key 'lrr'"),
        (["data=d", "lr=fast"], "config key 'lr': cannot read"),
        (["data=d", "epochs=1.5"], "config key 'epochs': expected an integer"),
        (["data=d", "epochs=true"], "config key 'epochs': expected an integer"),
        (["data=d", "width=0"], "config key 'width': must be >= 1"),
        (["data=d", "optimizer=lamb"], "config key 'optimizer': 'lamb' is not one of sgd, adam"),
        (["data=d", "spatial_parts=[2,1]"], "config key 'spatial_parts': expected a list of 3"),
        (["data=d", "spatial_parts=[0,1,1]"], "config key 'spatial_parts': expected a list of 3"),
        (["data=1"], "config key 'data': expected a string"),
        (["data=d", "lr"], "expected key=value"),
        (["lr=1"], "config key 'data' is missing"),
        (["data=d", "lr=nan"], "config key 'lr': expected a finite number, got nan"),
        (["data=d", "lr=1e400"], "config key 'lr': expected a finite number, got inf"),
        (["data=d", "dropout=nan"], "config key 'dropout': expected a finite number"),
        (["data=d", "weight_decay=-inf"], "config key 'weight_decay': expected a finite number"),
        (["data=d", "comm_timeout=inf"], "config key 'comm_timeout': expected a finite number"),
        (["data=d", "comm_timeout=1e300"], "config key 'comm_timeout': must be positive and at"),
        (["data=d", "seed=-1"], "config key 'seed': must be between 0 and 2**64 - 1, got -1"),
        (["data=d", f"seed={2**64}"], "config key 'seed': must be between 0 and 2**64 - 1"),
        # settings that would be ignored: refused, not taken silently
        (["data=d", "model=unet3d", "dropout=0.2"], "config key 'dropout': model 'unet3d' has"),
        (["data=d", "momentum=0.5"], "config key 'momentum': optimizer 'adam' takes no momentum"),
        (["data=d", "optimizer=lion", "momentum=0"], "config key 'momentum': optimizer 'lion'"),
        (["data=d", "checkpoint_interval=5"], "config key 'checkpoint_interval': 5 steps, but"),
        # was refused by each rank's loader after the start ("field 'x': named twice in the
        # spec", and mpi4py aborted)
        (["data=d", "target_field=x"], "config keys 'input_field', 'target_field': both name"),
    ],
)
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_settings_that_apply_are_taken():
    assert load_config(None, ["data=d", "optimizer=sgd", "momentum=0.5"]).momentum == 0.5
    assert load_config(None, ["data=d", "optimizer=lars", "momentum=0"]).momentum == 0
    assert load_config(None, ["data=d", "momentum=0.9"]).optimizer == "adam"  # the default
    cfg = load_config(None, ["data=d", "checkpoint_dir=c", "checkpoint_interval=5"])
    assert cfg.checkpoint_interval == 5
    assert load_config(None, ["data=d", "dropout=0.2"]).dropout == 0.2  # cosmoflow has it


def test_cli_exits_2_on_a_bad_config(tmp_path, capsys):
    path = tmp_path / "cfg.toml"
    path.write_text('data = "d"\nepoch = 3\n')
    assert main(["train", "--config", str(path)]) == 2
    assert "unknown config key 'epoch'" in capsys.readouterr().err
    assert main(["train", "--set", "data=d", "--set", "lr=-1"]) == 2
    assert "config key 'lr'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err
    assert main(["train", "--set", f"data={tmp_path}"]) == 2  # no train.h5 there
    err = capsys.readouterr().err  # (was "trainer: .../train.h5: no such file or directory")
    assert err.startswith("trainer: config keys 'data', 'train_file': ") and "train.h5" in err
    path.write_bytes(b'data = "d"\nlr = 1e-3 \xff\n')  # not UTF-8
    assert main(["train", "--config", str(path)]) == 2
    assert "not valid TOML: not UTF-8 text" in capsys.readouterr().err


def test_data_errors_name_their_keys(tiny, tmp_path, capsys):
    """Errors found in the data name the keys to change, as every config error does."""
    base = [f"data={tiny}", "width=2", "steps=1", "global_batch=4"]
    for sets, message in [
        (["validation_file=none.h5"], "config keys 'data', 'validation_file': "),
        # 8^3 pools 3 times at most (was: "side 8 along axis 0 is not divisible by 2**4 (4
        # poolings)", naming no key)
        (["conv_blocks=4"], "config key 'conv_blocks': side 8 along axis 0 is not divisible by "
         "2**4 (4 poolings; at most 3 divide every side)"),
    ]:  # fmt: skip
        assert main(["train", *set_args([*base, *sets])]) == 2, sets
        err = capsys.readouterr().err
        assert err.startswith(f"trainer: {message}") and err.count("\n") == 1, (sets, err)


def test_a_service_without_room_for_the_ring_still_trains_the_job(tiny, tmp_path, capfd):
    """A service without room for the job's shared-memory ring refused it: a 30-line
    traceback and exit 1, then one line and exit 1; the trainer leaves the transport to the
    service, which now streams such a job inline. Under a budget of 200,000 bytes the
    training and validation loaders' inline rings (3 batches of 32,816 bytes each: 196,896
    together) fit, the shared-memory ring (6 of them, 196,896) beside the resident dataset
    does not."""
    log = tmp_path / "serve.log"
    with serving(tmp_path, job_env(), "--memory-budget", "200000", log=log) as sock:
        sets = [f"data={tiny}", "width=2", "steps=2", "global_batch=4", f"data_address={sock}"]
        assert main(["train", *(a for s in sets for a in ("--set", s))]) == 0
    assert capfd.readouterr().err == ""
    assert log.read_text().count('"streaming_inline"') == 2  # (once a session)


def test_output_paths_are_refused_before_training(tiny, tmp_path, capsys):
    """A checkpoint_dir or log_file that cannot be written is named before the first step,
    not a traceback when the first checkpoint or log record is written."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    base = [f"data={tiny}", "width=2", "global_batch=8", "steps=1"]
    for sets, message in [
        ([f"checkpoint_dir={afile}"], f"config key 'checkpoint_dir': {afile}: {afile} is not a "),
        ([f"checkpoint_dir={afile}/ck"], f"{afile} is not a directory"),
        ([f"log_file={afile}/run.jsonl"], f"config key 'log_file': {afile}: {afile} is not a "),
        ([f"log_file={tmp_path}"], f"config key 'log_file': {tmp_path} is a directory"),
    ]:
        assert main(["train", *set_args([*base, *sets])]) == 2, sets
        out, err = capsys.readouterr()
        assert message in err and err.count("\n") == 1 and "trained" not in out, err
    # a log in a directory not made yet (the shipped configs' run/log.jsonl): made for it
    log = tmp_path / "run" / "log.jsonl"
    assert main(["train", *set_args([*base, f"log_file={log}"])]) == 0
    assert '"loss"' in log.read_text()


def test_a_checkpoint_of_another_run_is_refused(tiny, small, tmp_path, capsys):
    sets = [f"data={tiny}", "width=2", "global_batch=8", f"checkpoint_dir={tmp_path}"]
    assert main(["train", *set_args([*sets, "steps=2"])]) == 0
    capsys.readouterr()
    other = [*sets, "steps=4", "width=4", "optimizer=sgd"]
    assert main(["train", *set_args(other)]) == 2
    err = capsys.readouterr().err
    assert "config key 'checkpoint_dir': cannot resume" in err
    assert "width=2 (now 4), optimizer='adam' (now 'sgd')" in err
    # The same keys on other data: a training set of another size (refused before the start;
    # was each rank's loader's refusal, after it) ...
    data = [*sets, f"data={small}", "steps=4"]
    assert main(["train", *set_args(data)]) == 2
    err = capsys.readouterr().err
    assert "config key 'checkpoint_dir': cannot resume" in err
    assert "it was written with 40 training samples (now 192)" in err
    # ... or of another side (before the start, naming the shapes; was torch's two-line "size
    # mismatch for head.0.weight" when loading the model, and MPI_Abort on every rank)
    write_split(tmp_path / "side16", 40, 8, 16, seed=0)
    data = [*sets, f"data={tmp_path / 'side16'}", "steps=4"]
    assert main(["train", *set_args(data)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"trainer: config key 'checkpoint_dir': cannot resume {tmp_path}/checkpoint.pt: it was "
        "written with input 'x' of shape (4, 8, 8, 8) (now (4, 16, 16, 16)); resume with the "
        "same settings or choose another checkpoint_dir\n"
    )
    # ... or other data of the same size and shapes (the loader's state names its files)
    write_split(tmp_path / "other8", 40, 8, 8, seed=1)
    data = [*sets, f"data={tmp_path / 'other8'}", "steps=4"]
    assert main(["train", *set_args(data)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt: the state_dict was saved over" in err and "other8" in err
    assert len(err.splitlines()) == 1, err
    (tmp_path / "checkpoint.pt").write_text("not a checkpoint")
    assert main(["train", *set_args([*sets, "steps=4"])]) == 2
    assert "is not a checkpoint of this trainer" in capsys.readouterr().err


def test_a_resume_that_would_change_the_updates_of_the_steps_left_is_refused(
    tiny, tmp_path, capsys
):
    """Resumed over more steps, a decaying rate was stretched (the rate went back up); a
    changed learning rate or dropout was taken silently. A constant rate may run longer."""
    sets = [f"data={tiny}", "width=2", "global_batch=8", "lr_schedule=cosine", "warmup=1"]
    decaying = [*sets, f"checkpoint_dir={tmp_path / 'cos'}"]
    assert main(["train", *set_args([*decaying, "steps=3"])]) == 0
    capsys.readouterr()
    for more, says in [
        (["steps=4"], "lr_schedule='cosine' over 3 steps (now 4: the rate of every step left"),
        (["steps=3", "lr=0.01", "dropout=0.5"], "dropout=0.0 (now 0.5), lr=0.001 (now 0.01)"),
    ]:
        assert main(["train", *set_args([*decaying, *more])]) == 2, more
        err = capsys.readouterr().err
        assert "config key 'checkpoint_dir': cannot resume" in err and says in err, err
    constant = [f"data={tiny}", "width=2", "global_batch=8", f"checkpoint_dir={tmp_path / 'c'}"]
    assert main(["train", *set_args([*constant, "steps=2"])]) == 0
    assert main(["train", *set_args([*constant, "steps=3"])]) == 0
    assert "resumed from step 2" in capsys.readouterr().out


def test_a_checkpoint_dir_another_run_holds_is_refused(tiny, tmp_path, capsys):
    """Two runs on one checkpoint_dir (a job resubmitted while the first runs) took over each
    other's checkpoints and both exited 0; the second is now refused, naming the first."""
    ck = tmp_path / "ck"
    ck.mkdir()
    hold = f"from trainer.checkpoint import hold_directory as h; h({str(ck)!r}); input()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold], stdin=subprocess.PIPE, text=True, env=job_env()
    )
    sets = [f"data={tiny}", "width=2", "global_batch=8", "steps=1", f"checkpoint_dir={ck}"]
    lock, deadline = ck / "run.lock", time.monotonic() + 60
    try:
        while not (lock.exists() and "pid" in lock.read_text()):
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.05)
        assert main(["train", *set_args(sets)]) == 2
        err = capsys.readouterr().err
        says = f"config key 'checkpoint_dir': {ck} is in use by another run (pid {holder.pid} on"
        assert says in err
        assert err.count("\n") == 1 and not (ck / "checkpoint.pt").exists()
    finally:
        holder.communicate("", timeout=30)  # its end releases the hold
    assert main(["train", *set_args(sets)]) == 0
    assert main(["train", *set_args(sets)]) == 0  # (this process holds it now: again is fine)


def test_other_dtypes_train_and_a_constant_target_prints(tmp_path, capsys):
    """float64 inputs and integer targets train as float32; a constant validation target
    (baseline 0) prints its ratio instead of dividing by zero; an empty validation set is
    named."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    for name, n in (("train.h5", 8), ("validation.h5", 4)):
        with h5py.File(tmp_path / name, "w") as f:
            f["x"] = rng.standard_normal((n, 1, 8, 8, 8))  # float64
            f["y"] = np.ones((n, 2), dtype=np.int32)
    base = [f"data={tmp_path}", "width=2", "global_batch=4", "steps=2"]
    assert main(["train", *set_args(base)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("trained 2 steps") and "baseline 0.0000 (ratio inf)" in last
    with h5py.File(tmp_path / "empty.h5", "w") as f:
        f["x"] = np.zeros((0, 1, 8, 8, 8))
        f["y"] = np.zeros((0, 2), dtype=np.int32)
    assert main(["train", *set_args([*base, "validation_file=empty.h5"])]) == 2
    assert "config key 'validation_file':" in capsys.readouterr().err


def test_warmup_is_linear_then_flat():
    cfg = TrainConfig(data="d", lr=0.4, warmup=4)
    schedule = schedule_of(cfg, 100)
    assert [lr_at(s, schedule) for s in range(6)] == [0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4]


def test_the_schedule_keys_reach_the_learning_rate():
    """lr scaled from base_batch to global_batch, warm-up, then cosine to final_lr."""
    cfg = TrainConfig(
        data="d", lr=0.1, base_batch=8, global_batch=16, warmup=2, lr_schedule="cosine",
        final_lr=0.01,
    )  # fmt: skip
    s = schedule_of(cfg, 10)
    assert [lr_at(i, s) for i in (0, 1)] == [0.1, 0.2]
    assert lr_at(6, s) == pytest.approx(0.01 + (0.2 - 0.01) * 0.5)  # halfway through the decay
    assert lr_at(10, s) == 0.01


# -- checkpoints and resume --------------------------------------------------------------------
def test_checkpoint_is_replaced_atomically(tmp_path):
    save_checkpoint(tmp_path, {"step": 1})
    save_checkpoint(tmp_path, {"step": 2, "t": torch.ones(3)})
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
    assert load_checkpoint(tmp_path)["step"] == 2
    assert load_checkpoint(tmp_path / "none") is None


def test_a_data_rank_s_own_optimizer_files_are_named_by_their_step(tmp_path):
    """A save killed between the data ranks' files (step 4) and checkpoint.pt (still step 3)
    leaves step 3's files to resume from; the older ones go, other ranks' stay; a file of the
    format before (``optimizer.dR.pt``) resumes when it is from the step."""
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, {"step": step, "m": step}, own_optimizer_name(0, step))
    save_checkpoint(tmp_path, {"step": 2}, own_optimizer_name(1, 2))
    prune_own_optimizer(tmp_path, 0, {4, 3})
    assert sorted(os.listdir(tmp_path)) == [
        "optimizer.d0.step3.pt", "optimizer.d0.step4.pt", "optimizer.d1.step2.pt",
    ]  # fmt: skip
    assert load_own_optimizer(tmp_path, 0, 3) == {"step": 3, "m": 3}
    assert load_own_optimizer(tmp_path, 0, 2) is None
    save_checkpoint(tmp_path, {"step": 7, "m": 7}, "optimizer.d2.pt")
    assert load_own_optimizer(tmp_path, 2, 7) == {"step": 7, "m": 7}
    assert load_own_optimizer(tmp_path, 2, 8) is None


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_equals_uninterrupted_training(tiny, tmp_path, optimizer):
    """5 batches per epoch: stop mid-epoch at step 7, resume across the epoch-2 boundary to 13."""
    base = dict(
        data=tiny, width=2, global_batch=8, lr=0.01, warmup=3, optimizer=optimizer,
        dropout=0.3, seed=4, checkpoint_interval=2,
    )  # fmt: skip
    whole = TrainConfig(**base, steps=13, checkpoint_dir=str(tmp_path / "a"))
    first = TrainConfig(**base, steps=7, checkpoint_dir=str(tmp_path / "b"))
    rest = TrainConfig(**base, steps=13, checkpoint_dir=str(tmp_path / "b"))
    ra, r1, r2 = train(whole), train(first), train(rest)
    assert r1["resumed_from"] is None and r2["resumed_from"] == 7
    assert len(ra["losses"]) == 13 and r1["losses"] + r2["losses"] == ra["losses"]
    assert r2["val_mse"] == ra["val_mse"]
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    assert a["step"] == b["step"] == 13 and a["loader"] == b["loader"]
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    assert len(a["rng"]) == len(b["rng"]) == 1  # one data rank
    assert torch.equal(a["rng"][0], b["rng"][0])


def test_a_checkpoint_of_the_format_before_per_rank_dropout_resumes_exactly(tiny, tmp_path):
    """Checkpoints written before each data rank had its own dropout stream hold one RNG
    state (a tensor, not a list by data rank): they still resume, exactly."""
    base = dict(data=tiny, width=2, global_batch=8, lr=0.01, dropout=0.3, seed=4)
    whole = train(TrainConfig(**base, steps=6))
    train(TrainConfig(**base, steps=3, checkpoint_dir=str(tmp_path)))
    saved = load_checkpoint(tmp_path)
    saved["rng"] = saved["rng"][0]  # as the trainer wrote it until 2026-11-29
    save_checkpoint(tmp_path, saved)
    rest = train(TrainConfig(**base, steps=6, checkpoint_dir=str(tmp_path)))
    assert rest["resumed_from"] == 3 and rest["losses"] == whole["losses"][3:]


def _peak_mib(fn) -> tuple[float, float]:
    """``(peak, after)``: this process's RSS while ``fn()`` runs, its highest and at its end,
    over the RSS before it, in MiB (``VmHWM`` reset first)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # (the peak starts again from here)
    before = status("VmRSS:")
    fn()
    return (status("VmHWM:") - before) / 1024, (status("VmRSS:") - before) / 1024


def test_a_data_rank_resuming_its_own_momenta_reads_only_what_it_keeps(tmp_path):
    """With lion_cub's own momenta a rank read the whole checkpoint, data rank 0's momenta
    included, and copied its unsplit dense weight and momenta once more by indexing: its peak
    grew by 4 times the weight (as 258 MiB at width 32). Now the checkpoint is mapped, only
    the model is read from it (into the parameters), and the momenta it keeps are its own
    file's: 2 times the weight at the peak, 1 kept (the momenta), the mapping gone."""
    grid = SimpleNamespace(parts=(1, 1, 1), spatial_rank=0, spatial_size=1, data_rank=1, rank=1)
    model = DistFlattenLinear(4, (32, 32, 32), 32, grid)  # a (32, 131072) weight: 16 MiB
    weight_mib = model.weight.numel() * 4 / 2**20
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.ones_like(p)  # (as a step leaves it)
    state = {"step": 3, "optimizer": opt.state_dict()}
    torch.save(state, tmp_path / own_optimizer_name(1, 3))
    targets = {"total": torch.ones(3, dtype=torch.float64), "count": 2}
    torch.save(
        {
            **state, "model": model.state_dict(), "loader": {}, "targets": [targets] * 2,
            "rng": [torch.get_rng_state()] * 2, "buffers": [{}, {}],
        },
        tmp_path / "checkpoint.pt",
    )  # fmt: skip
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t = SimpleNamespace(
        cfg=SimpleNamespace(checkpoint_dir=str(tmp_path), seed=0), grid=grid, model=model,
        opt=opt, loader=SimpleNamespace(load_state_dict=lambda s: None), gpu=False,
        target_sums=Sums(3, torch.device("cpu")), _own_optimizer=lambda: True,
    )  # fmt: skip
    t._load = lambda saved: Trainer._load(t, saved)
    peak, kept = _peak_mib(lambda: Trainer.resume(t))
    # (upper bounds only: in a worker that freed memory before, RSS may not grow at all)
    assert peak < 2.5 * weight_mib and kept < 1.5 * weight_mib, (peak, kept)
    assert t.step == 3 and t.target_sums.count == 2
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), k
    momentum = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, torch.ones_like(momentum))


def test_log_records_steps_validation_and_checkpoints(tiny, tmp_path):
    log = tmp_path / "log.jsonl"
    cfg = TrainConfig(
        data=tiny, width=2, global_batch=8, epochs=3, log_file=str(log),
        checkpoint_dir=str(tmp_path / "ck"), checkpoint_interval=5,
    )  # fmt: skip
    train(cfg)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 16))
    assert [r["epoch"] for r in steps] == [0] * 5 + [1] * 5 + [2] * 5
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait"] <= 1 for r in steps)
    start = records[0]
    assert start["event"] == "start" and start["device"] == "cpu" and start["world"] == 1
    assert start["data_source"] == "local" and start["total_steps"] == 15
    events = [(r["event"], r["step"]) for r in records[1:] if "event" in r]
    # an epoch's validation before the checkpoint at its last step: a run stopped between
    # the two (the checkpoint first, before) resumed in the next epoch, that validation lost
    assert events == [
        ("validation", 5), ("checkpoint", 5), ("validation", 10), ("checkpoint", 10),
        ("validation", 15), ("checkpoint", 15),
    ]  # fmt: skip
    val = next(r for r in records if r.get("event") == "validation")
    assert val["ratio"] == pytest.approx(val["val_mse"] / val["baseline_mse"])


# -- learning ----------------------------------------------------------------------------------
@pytest.mark.slow  # trains for 20 s: not in `make test-quick`
def test_cosmoflow_learns_the_parameters(small, tmp_path, capsys):
    """10 epochs on 192 samples of 16^3 (a few seconds): the loss falls and the validation error
    ends well below that of predicting the mean training target (measured: 0.66x, 0.64x)."""
    log = tmp_path / "log.jsonl"
    args = [f"data={small}", "width=4", "epochs=10", "warmup=5", f"log_file={log}"]
    assert main(["train", *set_args(args)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("trained 120 steps")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records if "event" not in r]
    vals = [r for r in records if r.get("event") == "validation"]
    assert len(losses) == 120 and len(vals) == 10  # after each epoch
    assert sum(losses[-12:]) < 0.8 * sum(losses[:12])
    assert vals[-1]["ratio"] < 0.8, vals[-1]


@pytest.mark.slow  # trains for 20 s: not in `make test-quick`
def test_unet_learns_to_denoise(tmp_path, capsys):
    """The U-Net recovers the clean field from one with noise 0.3 (the identity's MSE 0.09):
    after 6 epochs of 96 samples of 16^3 its validation MSE is below both baselines (measured:
    0.056 vs 0.090 for the identity and 0.166 for the mean)."""
    from trainer.cosmology import write_split

    write_split(tmp_path, 96, 16, 16, seed=0, noise=0.3)
    log = tmp_path / "log.jsonl"
    sets = [
        f"data={tmp_path}", "model=unet3d", "input_field=noisy", "target_field=x", "width=8",
        "epochs=6", "global_batch=8", "lr=1e-3", "warmup=5", f"log_file={log}",
    ]  # fmt: skip
    assert main(["train", *set_args(sets)]) == 0
    vals = [json.loads(r) for r in log.read_text().splitlines() if '"validation"' in r]
    last = vals[-1]
    assert last["identity_mse"] == pytest.approx(0.09, rel=0.05)  # the noise's variance
    assert last["val_mse"] < 0.8 * last["identity_mse"], last
    assert last["val_mse"] < 0.6 * last["baseline_mse"], last
    assert len(last["val_mse_per_target"]) == 4  # one per channel


def test_a_users_own_hdf5_with_its_own_names(tmp_path, capsys):
    """Any file and field names: volumes under 'runs/a.h5' with fields 'density' and 'params'."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    (tmp_path / "runs").mkdir()
    for name, n in (("a.h5", 16), ("b.h5", 8)):
        with h5py.File(tmp_path / "runs" / name, "w") as f:
            f["density"] = rng.standard_normal((n, 2, 8, 8, 8), dtype=np.float32)
            f["params"] = rng.uniform(-1, 1, (n, 5)).astype(np.float32)
    base = [
        f"data={tmp_path}", "train_file=runs/a.h5", "validation_file=runs/b.h5",
        "input_field=density", "target_field=params", "width=2", "steps=3", "global_batch=4",
    ]  # fmt: skip
    assert main(["train", *set_args(base)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("trained 3 steps")
    bad = [*base, "target_field=label"]
    assert main(["train", *set_args(bad)]) == 2
    err = capsys.readouterr().err
    assert "target field 'label' is not in" in err and "(its fields: density, params)" in err


def test_resuming_says_so(tiny, tmp_path, capsys):
    sets = [f"data={tiny}", "width=2", "global_batch=8", f"checkpoint_dir={tmp_path}"]
    assert main(["train", *set_args([*sets, "steps=2"])]) == 0
    assert "resumed" not in capsys.readouterr().out
    assert main(["train", *set_args([*sets, "steps=4"])]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "resumed from step 2"


def test_cuda_is_refused_clearly_without_a_gpu(tiny, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["train", "--set", f"data={tiny}", "--set", "device=cuda"]) == 2
    assert "device 'cuda': CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cosmoflow", "unet3d"])
def test_the_example_configs_train(name, tmp_path, capsys):
    """trainer/configs/*.toml load, and train on small data with their own keys."""
    from pathlib import Path

    from trainer.cosmology import write_split

    path = Path(__file__).parent.parent / "trainer" / "configs" / f"{name}.toml"
    write_split(tmp_path, 16, 4, 16, seed=0, noise=0.3)
    sets = [f"data={tmp_path}", "steps=2", "warmup=1", "global_batch=4", "width=2",
            f"checkpoint_dir={tmp_path}/ck", f"log_file={tmp_path}/log"]  # fmt: skip
    cfg = load_config(path, sets)
    assert cfg.model == name
    assert main(["train", "--config", str(path), *set_args(sets)]) == 0
    assert "trained 2 steps" in capsys.readouterr().out


def test_data_ranks_draw_dropout_from_streams_of_their_own():
    """Each data rank's seed differs (every rank drew from ``seed``: the same masks on every
    rank's samples); an older checkpoint's one state is rank 0's, and the others start a
    stream of their own from the step resumed."""
    from trainer.train import _own_rng, dropout_seed

    seeds = {dropout_seed(4, r) for r in range(64)} | {dropout_seed(4, 1, 7)}
    assert len(seeds) == 65 and all(0 <= s < 2**64 for s in seeds)
    legacy = {"rng": torch.arange(5, dtype=torch.uint8)}
    assert torch.equal(_own_rng(legacy, 0), legacy["rng"]) and _own_rng(legacy, 1) is None
    now = {"rng": [torch.zeros(2, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8)]}
    assert torch.equal(_own_rng(now, 1), now["rng"][1])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "--config"], "argument --config: expected one argument"),
        (["tournament", "--set"], "argument --set: expected one argument"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_command(argv, says, capsys):
    """argparse's usage block came above the error, and an unknown option of ``train`` was
    said to be the top command's."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    command = f"python -m trainer {argv[0]}"
    assert capsys.readouterr() == ("", f"{command}: error: {says} (see {command} --help)\n")
