"""Synthetic cosmology fields: the spectrum they follow, determinism, their HDF5 files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from datastore.readers import open_dataset
from trainer import cosmology as cosmo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_spectrum_is_the_formula_and_zero_at_k0():
    k = np.array([0.0, 0.05, 0.1, 0.4])
    p = cosmo.power_spectrum(k, 2.0, -2.0, 0.2)
    assert p[0] == 0
    assert np.allclose(p[1:], 2.0 * k[1:] ** -2.0 * np.exp(-((k[1:] / 0.2) ** 2)), rtol=1e-14)


def test_amplitude_gives_the_requested_variance():
    size, sigma, n_s, k_c = 16, 0.5, -2.0, 0.2
    a = cosmo.amplitude_for_sigma(size, sigma, n_s, k_c)
    assert cosmo.power_spectrum(cosmo.wavenumbers(size), a, n_s, k_c).mean() == pytest.approx(
        sigma**2, rel=1e-12
    )
    rng = np.random.default_rng(0)
    var = np.mean([cosmo.gaussian_field(rng, size, sigma, n_s, k_c).var() for _ in range(40)])
    assert var == pytest.approx(sigma**2, rel=0.05)


@pytest.mark.parametrize(
    ("sigma", "n_s", "k_c"), [(0.5, -2.0, 0.2), (0.3, -1.0, 0.3), (0.8, -3.0, 0.1)]
)
def test_measured_power_follows_the_requested_spectrum(sigma, n_s, k_c):
    size, fields = 32, 8
    rng = np.random.default_rng(1)
    measured = np.mean(
        [
            cosmo.radial_power(cosmo.gaussian_field(rng, size, sigma, n_s, k_c))[1]
            for _ in range(fields)
        ],
        axis=0,
    )
    amp = cosmo.amplitude_for_sigma(size, sigma, n_s, k_c)
    _, expected, modes = cosmo.shell_average(
        cosmo.power_spectrum(cosmo.wavenumbers(size), amp, n_s, k_c)
    )
    # A real field's modes come in conjugate pairs: ~modes/2 independent ones per field.
    many = modes * fields / 2 >= 400  # relative error ~ 1/sqrt(400) = 5% per shell
    assert many.sum() >= 12
    assert np.all(np.abs(measured[many] / expected[many] - 1) < 0.12)
    weighted = (measured * modes).sum() / (expected * modes).sum()
    assert weighted == pytest.approx(1.0, abs=0.05)


def test_channels_are_lognormal_densities_of_the_grown_field():
    rng = np.random.default_rng(2)
    sigma = 0.6
    g = cosmo.gaussian_field(rng, 32, sigma, -2.0, 0.2)
    x = cosmo.lognormal_channels(g, sigma)
    assert x.shape == (4, 32, 32, 32) and x.dtype == np.float32
    for c, d in enumerate(cosmo.GROWTH):
        assert np.allclose(np.log(x[c]), d * g - (d * sigma) ** 2 / 2, atol=1e-5)
    assert np.allclose(x.mean(axis=(1, 2, 3)), 1.0, atol=0.1)


def test_params_map_to_minus_one_one_and_back():
    lo, hi = cosmo.PARAM_RANGES[:, 0], cosmo.PARAM_RANGES[:, 1]
    assert np.allclose(cosmo.normalise_params(lo), -1) and np.allclose(
        cosmo.normalise_params(hi), 1
    )
    p = cosmo.draw_params(np.random.default_rng(3))
    assert np.all((p >= lo) & (p <= hi))
    assert np.allclose(cosmo.denormalise_params(cosmo.normalise_params(p)), p)


def test_samples_are_fixed_by_seed_split_and_index():
    x, y = cosmo.sample(5, 0, 3, 16)
    x2, y2 = cosmo.sample(5, 0, 3, 16)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    for other in [(6, 0, 3), (5, 1, 3), (5, 0, 4)]:
        assert not np.array_equal(cosmo.sample(*other, 16)[0], x)
    assert y.shape == (3,) and np.all(np.abs(y) <= 1)


def test_hdf5_round_trip_through_the_datastore_reader(tmp_path):
    path = tmp_path / "train.h5"
    cosmo.write_dataset(path, 5, 16, seed=7)
    with open_dataset(str(path)) as ds:
        assert len(ds) == 5
        assert ds.fields["x"].shape == (4, 16, 16, 16) and ds.fields["x"].spatial_axes == (1, 2, 3)
        assert ds.fields["y"].shape == (3,) and ds.fields["y"].spatial_axes == ()
        for i in range(5):
            x, y = cosmo.sample(7, 0, i, 16)
            assert np.array_equal(ds.read(i, "x"), x) and np.array_equal(ds.read(i, "y"), y)
        block = ds.read(2, "x", (slice(None), slice(0, 8), slice(4, 12), slice(0, 16)))
        assert np.array_equal(block, cosmo.sample(7, 0, 2, 16)[0][:, 0:8, 4:12, :])
    with h5py.File(path) as f:
        assert list(f.attrs["params"]) == list(cosmo.PARAMS) and f.attrs["seed"] == 7
    # the first samples do not depend on how many are written; no temporary file is left
    cosmo.write_dataset(tmp_path / "more.h5", 8, 16, seed=7)
    with h5py.File(path) as a, h5py.File(tmp_path / "more.h5") as b:
        assert np.array_equal(a["x"][...], b["x"][:5]) and np.array_equal(a["y"][...], b["y"][:5])
    assert sorted(os.listdir(tmp_path)) == ["more.h5", "train.h5"]


def test_cli_writes_a_split_that_datastore_inspect_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = tmp_path / "cosmo"
    args = [str(out), "--samples", "6", "--val-samples", "3", "--size", "8", "--seed", "1"]
    subprocess.run([sys.executable, "-m", "trainer.cosmology", *args], check=True, env=env)
    inspect = [sys.executable, "-m", "datastore", "inspect", "--json"]
    for name, n, split in [("train.h5", 6, 0), ("validation.h5", 3, 1)]:
        r = subprocess.run([*inspect, str(out / name)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["num_samples"] == n
        assert info["fields"]["x"]["spatial_axes"] == [1, 2, 3]
        with h5py.File(out / name) as f:
            assert np.array_equal(f["x"][0], cosmo.sample(1, split, 0, 8)[0])
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.cosmology", str(out), "--size", "1"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert bad.returncode == 2 and "size >= 2" in bad.stderr


def test_per_sample_files_hold_the_same_samples_and_read_as_hdf5_per_sample(tmp_path):
    out = tmp_path / "train"
    cosmo.write_dataset(out, 3, 8, seed=2, noise=0.1, per_sample=True)
    assert sorted(os.listdir(out)) == [f"sample-0000{i}.h5" for i in range(3)]
    with open_dataset(str(out)) as ds:
        assert (ds.format, len(ds)) == ("hdf5-per-sample", 3)
        assert ds.fields["x"].shape == (4, 8, 8, 8) and ds.fields["x"].spatial_axes == (1, 2, 3)
        assert ds.fields["y"].shape == (3,) and ds.fields["noisy"].shape == (4, 8, 8, 8)
        for i in range(3):
            x, y = cosmo.sample(2, 0, i, 8)
            assert np.array_equal(ds.read(i, "x"), x) and np.array_equal(ds.read(i, "y"), y)
            assert np.array_equal(ds.read(i, "noisy"), cosmo.noisy_copy(x, 0.1, 2, 0, i))
    with h5py.File(out / "sample-00001.h5") as f:
        assert (f.attrs["index"], f.attrs["seed"], f.attrs["split"]) == (1, 2, 0)
    # a second write replaces the directory whole and leaves no temporary behind
    cosmo.write_dataset(out, 2, 8, seed=2, per_sample=True)
    assert sorted(os.listdir(tmp_path)) == ["train"] and len(os.listdir(out)) == 2
    with pytest.raises(ValueError, match="n_samples"):
        cosmo.write_dataset(tmp_path / "none", 0, 8, seed=2, per_sample=True)
    assert sorted(os.listdir(tmp_path)) == ["train"]


def test_cli_per_sample_writes_two_directories(tmp_path):
    args = [str(tmp_path), "--samples", "3", "--val-samples", "2", "--size", "4", "--per-sample"]
    assert cosmo.main(args) == 0
    assert len(os.listdir(tmp_path / "train")) == 3
    assert len(os.listdir(tmp_path / "validation")) == 2
    with h5py.File(tmp_path / "validation" / "sample-00001.h5") as f:
        assert np.array_equal(f["x"][...], cosmo.sample(0, 1, 1, 4)[0])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["out", "--samples", "x"], "argument --samples: must be a whole number >= 1, got 'x'"),
        (["out", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_usage_error_is_one_line(argv, says, capsys):
    """argparse's usage block came above the error."""
    with pytest.raises(SystemExit) as stopped:
        cosmo.main(argv)
    assert stopped.value.code == 2
    prog = "python -m trainer.cosmology"
    assert capsys.readouterr() == ("", f"{prog}: error: {says} (see {prog} --help)\n")


@pytest.mark.parametrize(
    ("option", "value"), [("--samples", "0"), ("--samples", "-1"), ("--val-samples", "0")]
)
def test_a_count_below_one_is_a_usage_error_writing_nothing(option, value, tmp_path, capsys):
    """``--samples 0`` got past argparse, made OUT and was refused by ``write_split``."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        cosmo.main([str(out), option, value])
    assert stopped.value.code == 2
    prog = "python -m trainer.cosmology"
    says = f"argument {option}: must be a whole number >= 1, got '{value}'"
    assert capsys.readouterr() == ("", f"{prog}: error: {says} (see {prog} --help)\n")
    assert not out.exists()


def test_a_refused_split_writes_nothing(tmp_path, capsys):
    """``--size 1`` left an empty OUT; a validation count of 0 left ``train.h5`` written
    beside the error."""
    with pytest.raises(ValueError, match=r"need n_samples >= 1 and size >= 2, got 0, 8"):
        cosmo.write_split(tmp_path / "a", 4, 0, 8, 0)
    assert cosmo.main([str(tmp_path / "b"), "--size", "1"]) == 2
    said = "trainer.cosmology: need n_samples >= 1 and size >= 2, got 512, 1\n"
    assert capsys.readouterr() == ("", said)
    assert sorted(os.listdir(tmp_path)) == []
