"""What the driver checks before training: device and backend choice, GPUs per node, the model's
blocks at every level, fields and world (pure functions); and under real ``mpiexec``, a
configuration that cannot work is one clear error on every rank within seconds, not one rank's
traceback while the others wait out the halo timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC, set_args, trainer_refusals

from staging.cluster import LAUNCH_ENV
from trainer.config import load_config
from trainer.cosmology import write_split
from trainer.devices import check_gpus, pick_backend, pick_device, ranks_on_device
from trainer.models import CosmoFlow, UNet3D, count_parameters
from trainer.preflight import (
    check_fields,
    check_memory,
    check_run,
    check_world,
    level_blocks,
    model_depth,
    model_parameters,
    optimizer_copies,
    rank_parameters,
)
from trainer.start import _check, memory_of

ROOT = Path(__file__).parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
CUDA0, CPU = torch.device("cuda", 0), torch.device("cpu")


# -- devices and backends ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "gpus", "local_rank", "want"),
    [
        ("auto", 0, 3, CPU),
        ("auto", 4, 3, torch.device("cuda", 3)),
        ("auto", 4, 5, torch.device("cuda", 1)),  # ranks beyond the GPUs share them round-robin
        ("auto", 2, None, CUDA0),
        ("cuda", 2, 1, torch.device("cuda", 1)),
        ("cuda:1", 2, 0, torch.device("cuda", 1)),
        ("cpu", 8, 0, CPU),
    ],
)
def test_the_rank_gets_its_gpu(setting, gpus, local_rank, want):
    assert pick_device(setting, gpus=gpus, local_rank=local_rank) == want


@pytest.mark.parametrize(
    ("setting", "gpus", "message"),
    [
        ("cuda", 0, "device 'cuda': CUDA is not available"),
        ("cuda:2", 2, "device 'cuda:2': this node has 2 GPU(s)"),
        ("cuda:x", 2, "expected cuda:N"),
        ("tpu", 2, "expected auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_device_that_is_not_there_is_named(setting, gpus, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pick_device(setting, gpus=gpus, local_rank=0)


def test_backends_follow_the_device():
    assert pick_backend("auto", CUDA0) == "nccl"
    assert pick_backend("auto", CPU) == "gloo"
    assert pick_backend("gloo", CUDA0) == "gloo"  # GPUs shared through host memory
    with pytest.raises(ValueError, match="backend 'nccl' needs a CUDA device"):
        pick_backend("nccl", CPU)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        pick_backend("mpi", CPU)


def test_nccl_needs_a_gpu_per_rank_and_says_how_to_share():
    check_gpus("nccl", CUDA0, ranks_per_node=4, gpus=4)
    check_gpus("gloo", CUDA0, ranks_per_node=4, gpus=1)
    check_gpus("gloo", CPU, ranks_per_node=64, gpus=0)
    with pytest.raises(ValueError, match=r"4 ranks on this node but 2 GPU\(s\).*backend = 'gloo'"):
        check_gpus("nccl", CUDA0, ranks_per_node=4, gpus=2)


@pytest.mark.parametrize(
    ("setting", "device", "gpus", "want"),
    [
        ("cpu", CPU, 0, 4),  # the host's memory: every rank of the node
        ("auto", CPU, 0, 4),
        ("auto", torch.device("cuda", 1), 2, 2),  # local ranks 1 and 3
        ("auto", CUDA0, 3, 2),  # local ranks 0 and 3
        ("auto", CUDA0, 4, 1),
        ("cuda:1", torch.device("cuda", 1), 2, 4),  # every rank asked for it
    ],
)
def test_the_ranks_sharing_a_device_are_counted(setting, device, gpus, want):
    assert ranks_on_device(setting, device, gpus=gpus, ranks_per_node=4) == want


# -- the model's blocks ------------------------------------------------------------------------
def test_block_lengths_through_the_levels():
    # 32 split in 2 along depth: 16 | 16, then 8 | 8, 4 | 4, 2 | 2 (3 poolings)
    levels = level_blocks((32, 32, 32), (2, 1, 1), 3)
    assert [lv[0] for lv in levels] == [(16, 16), (8, 8), (4, 4), (2, 2)]
    assert [lv[1] for lv in levels] == [(32,), (16,), (8,), (4,)]
    # an uneven split whose blocks stay even: 48 in 4 -> 12 each -> 6 -> 3 (2 poolings)
    assert level_blocks((48, 8, 8), (4, 1, 1), 2)[-1][0] == (3, 3, 3, 3)


@pytest.mark.parametrize(
    ("shape", "parts", "depth", "message"),
    [
        ((16, 16, 16), (2, 1, 1), 4, "level 3: a block of 1 voxel along split axis 0 cannot be "
         "pooled"),
        ((16, 16, 16), (1, 1, 4), 3, "level 2: a block of 1 voxel along split axis 2"),
        ((24, 24, 24), (2, 1, 1), 3, "level 2: block 0 along split axis 0 has 3 voxels, an odd"),
        ((32, 32, 32), (3, 1, 1), 2, "level 0: block 0 along split axis 0 has 11 voxels"),
        ((20, 20, 20), (1, 1, 1), 3, "side 20 along axis 0 is not divisible by 2**3"),
    ],
)  # fmt: skip
def test_a_split_the_model_cannot_run_is_named(shape, parts, depth, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        level_blocks(shape, parts, depth)


@pytest.mark.timeout(30)  # a hang guard: 2**depth used to be computed first
def test_a_huge_conv_blocks_is_refused_at_once():
    # 10**11 poolings hung, building a 12 GB integer.
    with pytest.raises(ValueError, match=r"side 16 along axis 0 is not divisible by 2\*\*10000"):
        level_blocks((16, 16, 16), (1, 1, 1), 10**11)


def test_default_depths():
    assert model_depth("cosmoflow", 128, 0) == 5
    assert model_depth("cosmoflow", 16, 0) == 4
    assert model_depth("unet3d", 128, 0) == 3
    assert model_depth("unet3d", 16, 0) == 2
    assert model_depth("unet3d", 16, 1) == 1


def test_fields_must_suit_the_model():
    x = ("x", (4, 16, 16, 16), (1, 2, 3))
    check_fields("cosmoflow", x, ("y", (3,), ()))
    check_fields("unet3d", x, ("clean", (1, 16, 16, 16), (1, 2, 3)))
    with pytest.raises(ValueError, match="target field 'y': unet3d predicts a volume"):
        check_fields("unet3d", x, ("y", (3,), ()))
    with pytest.raises(ValueError, match="target field 'x': cosmoflow predicts a vector"):
        check_fields("cosmoflow", x, x)
    with pytest.raises(ValueError, match=r"input field 'y': expected \(channels, depth"):
        check_fields("cosmoflow", ("y", (3,), ()), ("y", (3,), ()))
    with pytest.raises(ValueError, match="cosmoflow needs a cube"):
        check_fields("cosmoflow", ("x", (4, 16, 16, 8), (1, 2, 3)), ("y", (3,), ()))


def test_world_must_hold_whole_replicas():
    assert check_world(8, (2, 2, 1)) == 2
    with pytest.raises(ValueError, match=r"6 rank\(s\) cannot hold .* multiple of 4"):
        check_world(6, (2, 2, 1))
    x, y = ("x", (4, 32, 32, 32), (1, 2, 3)), ("y", (3,), ())
    assert check_run("cosmoflow", x, y, (2, 1, 1), 4, 4) == 4
    with pytest.raises(ValueError, match="level 4"):  # 5 poolings of 16: 16, 8, 4, 2, 1
        check_run("cosmoflow", x, y, (2, 1, 1), 0, 4)


# -- the model's memory -----------------------------------------------------------------------
@pytest.mark.parametrize("width", [1, 2, 5, 8])
@pytest.mark.parametrize("depth", [0, 1, 3, 4])
def test_the_parameter_count_is_the_built_models(width, depth):
    with torch.device("meta"):  # shapes only
        cosmo = CosmoFlow(4, 3, input_size=32, conv_size=width, n_conv=depth)
        assert count_parameters(cosmo) == model_parameters("cosmoflow", 4, 3, 32, width, depth)
        if depth:
            for cin, cout in ((4, 4), (4, 1)):
                unet = UNet3D(cin, cout, base=width, depth=depth, residual=cin == cout)
                n = model_parameters("unet3d", cin, cout, 32, width, depth)
                assert count_parameters(unet) == n


@pytest.mark.timeout(30)  # a hang guard: building the model would take minutes, or fail
@pytest.mark.parametrize("width", [10**11, 2**100])
def test_a_model_far_larger_than_memory_is_refused_without_building_it(width):
    # torch cannot even describe it: building width 10**11 on "meta" overflows its sizes.
    n = model_parameters("cosmoflow", 4, 4, 128, width, 5)
    with pytest.raises(ValueError, match=r"^config keys 'width', 'conv_blocks', 'model': a "
                       rf"cosmoflow of width {width} with 5 poolings has .* parameters; with "
                       r"their gradients and adam's 2 state copies \(4 bytes each\) training "
                       r"needs .* TiB, more than the 64 GiB available on the host; choose a "
                       "smaller width"):  # fmt: skip
        check_memory("cosmoflow", width, 5, n, "adam", 2, "cpu", 64 << 30, 64 << 30)
    assert n > width**2


def test_only_what_cannot_fit_is_refused():
    n = model_parameters("unet3d", 4, 4, 64, 8, 3)
    need = n * 4 * (2 + optimizer_copies("adam", 0.9))
    check_memory("unet3d", 8, 3, n, "adam", 2, "cpu", need, need)  # exactly fits
    check_memory("unet3d", 8, 3, n, "adam", 2, "cpu", None, None)  # unknown: not checked
    with pytest.raises(ValueError, match=r"more than the .* available on the host"):
        check_memory("unet3d", 8, 3, n, "adam", 2, "cpu", need - 1, need)
    # On a GPU: the device's free memory, and the host's for the parameters it builds first.
    check_memory("unet3d", 8, 3, n, "sgd", 0, "cuda:0", n * 8, n * 4)
    with pytest.raises(ValueError, match=r"and no sgd state .* more than the .* free on cuda:0"):
        check_memory("unet3d", 8, 3, n, "sgd", 0, "cuda:0", n * 8 - 1, None)
    with pytest.raises(ValueError, match="built whole on the host before it moves to cuda:0"):
        check_memory("unet3d", 8, 3, n, "sgd", 0, "cuda:0", None, n * 4 - 1)
    assert [optimizer_copies(o, m) for o, m in [("adam", 0), ("sgd", 0), ("sgd", 0.9),
            ("lars", 0.9), ("lion", 0), ("lion_cub", 0)]] == [2, 0, 1, 1, 1, 1]  # fmt: skip


def test_a_split_rank_holds_its_block_s_columns_of_the_first_dense_layer():
    """CosmoFlow 4 x 32^3, width 2, 3 poolings: the first dense layer takes 8 channels x 4^3
    features to 128 (65,536 weights); a 2-way split keeps half of them on a rank, a 3-way one
    the largest block's (2 of the 4 planes)."""
    whole = model_parameters("cosmoflow", 4, 4, 32, 2, 3)
    assert rank_parameters("cosmoflow", 4, 4, 32, 2, 3, (1, 1, 1)) == whole
    assert rank_parameters("cosmoflow", 4, 4, 32, 2, 3, (2, 1, 1)) == whole - 65_536 // 2
    assert rank_parameters("cosmoflow", 4, 4, 32, 2, 3, (3, 1, 1)) == whole - 65_536 // 2
    assert rank_parameters("cosmoflow", 4, 4, 32, 2, 3, (2, 2, 2)) == whole - 65_536 * 7 // 8
    assert rank_parameters("unet3d", 4, 4, 32, 2, 2, (2, 1, 1)) == model_parameters(
        "unet3d", 4, 4, 32, 2, 2
    )  # (no dense layer: every rank holds all)


def test_a_split_that_fits_on_each_rank_is_not_refused():
    whole = model_parameters("cosmoflow", 4, 4, 32, 2, 3)
    on_rank = rank_parameters("cosmoflow", 4, 4, 32, 2, 3, (2, 2, 2))
    fits = on_rank * 4 * 2  # sgd without momentum: parameters and gradients
    check_memory("cosmoflow", 2, 3, whole, "sgd", 0, "cuda:0", fits, None, on_rank=on_rank)
    with pytest.raises(ValueError, match=r"parameters \([0-9,]+ on the rank of the largest "
                       r"block\); with their gradients .* free on cuda:0"):  # fmt: skip
        check_memory("cosmoflow", 2, 3, whole, "sgd", 0, "cuda:0", fits - 1, None, on_rank=on_rank)
    with pytest.raises(ValueError, match="free on cuda:0"):  # the whole model would not fit
        check_memory("cosmoflow", 2, 3, whole, "sgd", 0, "cuda:0", fits, None)
    # several ranks: the reducer's buckets are one more copy of the gradients
    check_memory("cosmoflow", 2, 3, whole, "sgd", 0, "cuda:0", fits * 3 // 2, None,
                 on_rank=on_rank, buckets=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"no sgd state and the gradient reducer's buckets "
                       r"\(4 bytes each\) training needs"):  # fmt: skip
        check_memory("cosmoflow", 2, 3, whole, "sgd", 0, "cuda:0", fits * 3 // 2 - 1, None,
                     on_rank=on_rank, buckets=True)  # fmt: skip


def test_ranks_that_each_fit_alone_but_not_together_are_refused():
    """4 ranks on one host (or one GPU) share its memory: each used to be checked alone."""
    n = model_parameters("unet3d", 4, 4, 64, 8, 3)
    need = n * 4 * (2 + 2)  # adam
    check_memory("unet3d", 8, 3, n, "adam", 2, "cpu", need * 4, None, host_ranks=4,
                 device_ranks=4)  # fmt: skip
    with pytest.raises(ValueError, match=rf"training needs {need / 2**20:.3g} MiB a rank, "
                       rf"{need * 4 / 2**20:.3g} MiB for the 4 ranks on this host, more than the "
                       rf"{(need * 4 - 1) / 2**20:.3g} MiB available on the host; choose a smaller "
                       r"width or fewer conv_blocks, or launch fewer ranks per host$"):  # fmt: skip
        check_memory("unet3d", 8, 3, n, "adam", 2, "cpu", need * 4 - 1, None, device_ranks=4)
    # a GPU shared by 2 ranks (gloo); the host builds 4 whole models before they move
    check_memory("unet3d", 8, 3, n, "adam", 2, "cuda:0", need * 2, n * 16, device_ranks=2,
                 host_ranks=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"MiB for the 2 ranks on cuda:0, more than the .* free "
                       r"on cuda:0; .* or launch fewer ranks per GPU$"):  # fmt: skip
        check_memory("unet3d", 8, 3, n, "adam", 2, "cuda:0", need * 2 - 1, None, device_ranks=2)
    built = r"MiB for the 4 ranks on this host\), built whole on the host before it moves to cuda:0"
    with pytest.raises(ValueError, match=rf"{built}: .* or launch fewer ranks per host$"):
        check_memory("unet3d", 8, 3, n, "adam", 2, "cuda:0", None, n * 16 - 1, host_ranks=4)


def test_a_split_whose_ranks_cannot_all_draw_the_whole_model_on_the_cpu_is_refused():
    """Every rank draws the first dense layer's weight whole before it keeps its columns: 4
    ranks of a (2, 2, 1) split counted 48 MiB each (sgd) but peaked at 100 MiB each building
    it; the host check was made on a GPU only."""
    shape = ("cosmoflow", 4, 3, 32, 32, 1)
    whole, on_rank = model_parameters(*shape), rank_parameters(*shape, (2, 2, 1))
    assert (whole, on_rank) == (16_789_283, 4_206_371)
    fits = on_rank * 3 * 4 * 4  # parameters, gradients and buckets of 4 ranks: 193 MiB
    with pytest.raises(ValueError, match=r"^config keys .* \(64.0 MiB a rank, 256 MiB for the 4 "
                       r"ranks on this host\), built whole on the host: more than the 193 MiB "
                       r"available on the host; .* or launch fewer ranks per host$"):  # fmt: skip
        check_memory("cosmoflow", 32, 1, whole, "sgd", 0, "cpu", fits, fits, on_rank=on_rank,
                     buckets=True, device_ranks=4, host_ranks=4)  # fmt: skip
    check_memory("cosmoflow", 32, 1, whole, "sgd", 0, "cpu", whole * 16, whole * 16,
                 on_rank=on_rank, buckets=True, device_ranks=4, host_ranks=4)  # fmt: skip


@pytest.mark.parametrize("launcher", ["MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"])
def test_the_start_up_check_counts_the_ranks_the_launcher_put_on_this_host(
    data, monkeypatch, launcher
):
    cfg = load_config(None, [f'data="{data}"', "width=64", "conv_blocks=2", "steps=2"])
    n = model_parameters("cosmoflow", 4, 3, 16, 64, 2)
    need = n * 4 * (2 + 2)  # adam, one process: no buckets
    monkeypatch.setenv("DATASTORE_MEMORY_AVAILABLE", str(need * 3))
    _check(cfg, 1, CPU, "gloo", 0)  # alone it fits
    monkeypatch.setenv(launcher, "4")
    with pytest.raises(ValueError, match=r"a rank, .* for the 4 ranks on this host, more than"):
        _check(cfg, 1, CPU, "gloo", 0)


def test_the_host_memory_is_what_the_loader_sees(monkeypatch):
    monkeypatch.setenv("DATASTORE_MEMORY_AVAILABLE", "3G")
    assert memory_of(CPU) == (3 << 30, 3 << 30)


# -- refused on every rank alike, under mpiexec ------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cosmo")
    write_split(out, 16, 4, 16, 0)
    return out


def launch(n: int, sets: list[str], per_rank: bool = False) -> subprocess.CompletedProcess:
    argv = set_args(sets)
    assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "trainer", "train", *argv]
    if per_rank:  # rank 1 gets another learning rate: an MPMD launch
        other = set_args([*sets, "lr=0.5"])
        cmd = [
            MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", "-m", "trainer", "train", *argv,
            ":", "-n", "1", sys.executable, "-m", "mpi4py", "-m", "trainer", "train", *other,
        ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)


# every rank refuses these before it trains: one launch runs them all (trainer_refusals)
BAD_SETUPS = {
    "split": (["spatial_parts=[2,1,1]"], "config keys 'spatial_parts', 'conv_blocks': level 3: "
              "a block of 1 voxel along split axis 0"),
    "batch": (["conv_blocks=3", "global_batch=3"],
              "global_batch': 3 samples do not split evenly over 2"),
    "replicas": (["spatial_parts=[4,1,1]", "conv_blocks=2"],
                 "cannot hold data x spatial replicas of 4"),
    "field": (["input_field=rho"], "input field 'rho' is not in"),
    # rank 0 alone writes the log: it used to fail at its first record, mid-training
    "log": (["log_file=/dev/null/run.jsonl"],
            "config key 'log_file': /dev/null: /dev/null is not a directory"),
    "checkpoints": (["checkpoint_dir=/dev/null", "checkpoint_interval=1"],
                    "config key 'checkpoint_dir': /dev/null: /dev/null is not a directory"),
    # an out-of-memory traceback while the model was built
    "huge": (["width=100000000000"],
             "config keys 'width', 'conv_blocks', 'model': a cosmoflow of width 100000000000 "
             "with 4 poolings has 1.13e+25 parameters"),
    "huger": (["width=1267650600228229401496703205376", "optimizer=sgd", "momentum=0"],
              "a cosmoflow of width 1267650600228229401496703205376 with 4 poolings"),
}  # fmt: skip


@pytest.fixture(scope="module")
def bad_setups(data, tmp_path_factory) -> dict[str, list[dict]]:
    """Each of ``BAD_SETUPS`` run as ``trainer train`` on the same 2 ranks: per rank, what it
    said."""
    base = [f"data={data}", "width=2", "steps=2", "comm_timeout=60"]
    cases = [[*base, *sets] for sets, _ in BAD_SETUPS.values()]
    got = trainer_refusals(2, "train", cases, tmp_path_factory.mktemp("refused"))
    return dict(zip(BAD_SETUPS, got, strict=True))


@pytest.mark.mpi
@pytest.mark.parametrize("case", BAD_SETUPS)
def test_a_bad_setup_is_one_error_on_every_rank(bad_setups, case):
    message = BAD_SETUPS[case][1]
    for rank, r in enumerate(bad_setups[case]):
        assert r["code"] == 2, (rank, r)
        assert r["seconds"] < 60, (rank, r)  # not the 60 s timeout: nobody waits for a failed rank
        # one line, naming the fault, no traceback
        assert r["stderr"].count("trainer: ") == 1 and r["stderr"].count(message) == 1, (rank, r)
        assert "Traceback" not in r["stderr"], (rank, r)


@pytest.mark.mpi
def test_ranks_started_with_different_configs_are_refused(data):
    proc = launch(2, [f"data={data}", "width=2", "steps=2", "conv_blocks=3"], per_rank=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("trainer: ") == 2, proc.stderr
    # the key that differs and each rank's value, not two whole configurations (1,500 chars)
    said = "ranks disagree on config key 'lr': ranks 0: 0.001; ranks 1: 0.5. Every rank"
    assert proc.stderr.count(said) == 2, proc.stderr
    assert max(len(line) for line in proc.stderr.splitlines()) < 200, proc.stderr


@pytest.mark.mpi
def test_a_checkpoint_of_another_world_or_dataset_is_refused_on_every_rank(data, tmp_path):
    """A checkpoint of 2 ranks resumed with a training set of another size, or by another
    number of ranks: refused before any step, on every rank alike (was: each rank's loader
    refused another size once training had begun, and mpi4py aborted: 'Abort(2) on node 1';
    MPI_Abort's MPICH segment of 2 MiB stayed in /dev/shm)."""
    sets = [f"data={data}", "width=2", "conv_blocks=3", "global_batch=4", "comm_timeout=60"]
    sets.append(f"checkpoint_dir={tmp_path}/ck")
    assert launch(2, [*sets, "steps=1"]).returncode == 0
    write_split(tmp_path / "more", 20, 4, 16, 0)
    proc = launch(2, [*sets, "steps=2", f"data={tmp_path}/more"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("trainer: ") == 2, proc.stderr
    assert proc.stderr.count("it was written with 16 training samples (now 20)") == 2, proc.stderr
    assert "Abort" not in proc.stderr and "ABORT" not in proc.stderr, proc.stderr
    proc = launch(1, [*sets, "steps=2"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("it was written with 2 rank(s) (now 1)") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr, proc.stderr


def _readme_commands(text: str) -> list[list[str]]:
    """The README's shell lines, continuations joined, as words."""
    return [line.split() for line in text.replace("\\\n", " ").splitlines()]


def test_the_readmes_trainer_commands_pass_the_geometry_checks():
    """Every ``trainer train`` line of the README, with the side its ``trainer.cosmology``
    line writes for that directory and its number of ranks, passes the checks a run makes
    first (before, its 2 x 2 line lacked ``conv_blocks=4``: a 16-voxel half cannot be pooled
    5 times, and the run stopped at once, as a new user found)."""
    lines = _readme_commands((Path(__file__).parent.parent / "README.md").read_text())
    sides = {}  # the side of each directory the README writes data into
    for w in lines:
        if "trainer.cosmology" in w and "--size" in w:
            sides[w[w.index("trainer.cosmology") + 1]] = int(w[w.index("--size") + 1])
    runs = [w for w in lines if "trainer" in w and "train" in w and "--config" in w]
    assert len(runs) >= 3, runs  # the one-process, the 2 x 2 and the U-Net lines
    for words in runs:
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        cfg = load_config(Path(__file__).parent.parent / words[words.index("--config") + 1], sets)
        side = sides[str(cfg.data)]
        ranks = int(words[words.index("-n") + 1]) if words[0] == "mpiexec" else 1
        check_world(ranks, cfg.spatial_parts)
        level_blocks((side,) * 3, cfg.spatial_parts, model_depth(cfg.model, side, cfg.conv_blocks))
