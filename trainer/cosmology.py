"""Cosmology-like training data: lognormal density fields whose statistics depend on 3 parameters.

Each sample starts from a Gaussian random field ``g`` on a periodic ``size^3`` grid with the
power spectrum

    P(k) = A * k**n_s * exp(-(k / k_c)**2),    P(0) = 0,

``k`` in cycles per cell (``|numpy.fft.fftfreq|``, at most ``sqrt(3) / 2``). ``A`` is set so
that ``g`` has variance ``sigma**2`` on the grid (:func:`amplitude_for_sigma`). The parameters
``(sigma, n_s, k_c)`` are drawn uniformly from :data:`PARAM_RANGES`.

The 4 channels mimic CosmoFlow's 4 redshifts: the same field grown by the linear growth factors
:data:`GROWTH` = ``(0.25, 0.5, 0.75, 1.0)`` and made a lognormal matter density of mean 1,

    rho_c = exp(D_c * g - (D_c * sigma)**2 / 2).

The target ``y`` holds the parameters mapped linearly from their ranges to ``[-1, 1]``
(:func:`normalise_params`).

Convention: with numpy's unnormalised FFT, a field ``g`` on ``N`` cells has power
``|fftn(g)[k]|**2 / N`` at mode ``k`` (:func:`radial_power` averages it over shells), and
its variance is the mean of ``P`` over all ``N`` modes.

Files (``write_dataset``): one HDF5 file, datasets ``x`` ``(N, 4, S, S, S)`` float32 (chunked
one sample per chunk, uncompressed, so ``datastore`` reads regions without HDF5) and ``y``
``(N, 3)`` float32; spatial axes ``(1, 2, 3)`` of ``x`` by ``datastore``'s default. Attributes
record ``params``, ``ranges``, ``growth``, ``seed``, ``split`` and ``size``. Sample ``i`` of
split ``s`` is drawn from ``numpy.random.default_rng([seed, s, i])`` alone, so a file's
samples do not depend on how many are written. The command line writes a train/validation
split as two files, ``OUT/train.h5`` (split 0) and ``OUT/validation.h5`` (split 1)::

    python -m trainer.cosmology OUT --samples 512 --val-samples 128 --size 32 --seed 0

With ``--noise SIGMA`` each file also holds ``noisy``: ``x`` plus Gaussian noise of standard
deviation ``SIGMA`` (:func:`noisy_copy`), the input of the U-Net's denoising task (recover ``x``
from ``noisy``).

With ``--per-sample`` (``write_dataset(..., per_sample=True)``) each split is a directory of one
HDF5 file per sample instead, ``OUT/train/sample-00000.h5``... (``x`` ``(4, S, S, S)``, ``y``
``(3,)``, ``noisy``), read as ``hdf5-per-sample``: the layout ``datastore stage --mode shard``
spreads over nodes and ``datastore serve`` peers serve as one store (set ``train_file =
"train"``, ``validation_file = "validation"``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from staging.console import Parser, whole
from staging.exitcodes import Exit

__all__ = [
    "GROWTH",
    "PARAMS",
    "PARAM_RANGES",
    "SPLITS",
    "amplitude_for_sigma",
    "denormalise_params",
    "draw_params",
    "gaussian_field",
    "lognormal_channels",
    "main",
    "noisy_copy",
    "normalise_params",
    "power_spectrum",
    "radial_power",
    "sample",
    "shell_average",
    "wavenumbers",
    "write_dataset",
    "write_split",
]

PARAMS = ("sigma", "n_s", "k_c")
PARAM_RANGES = np.array([[0.2, 0.8], [-3.0, -1.0], [0.08, 0.3]])  # rows follow PARAMS
GROWTH = (0.25, 0.5, 0.75, 1.0)
SPLITS = {"train": 0, "validation": 1}


def wavenumbers(size: int) -> np.ndarray:
    """``|k|`` in cycles per cell for every mode of ``numpy.fft.fftn`` on a ``size^3`` grid."""
    f = np.fft.fftfreq(size)
    return np.sqrt(f[:, None, None] ** 2 + f[None, :, None] ** 2 + f[None, None, :] ** 2)


def power_spectrum(k: np.ndarray, amplitude: float, n_s: float, k_c: float) -> np.ndarray:
    """``A * k**n_s * exp(-(k / k_c)**2)``, and ``0`` at ``k = 0`` (the field has zero mean)."""
    k = np.asarray(k, dtype=np.float64)
    out = np.zeros_like(k)
    pos = k > 0
    out[pos] = amplitude * k[pos] ** n_s * np.exp(-((k[pos] / k_c) ** 2))
    return out


def amplitude_for_sigma(size: int, sigma: float, n_s: float, k_c: float) -> float:
    """The ``A`` that gives the field variance ``sigma**2`` on a ``size^3`` grid."""
    return float(sigma**2 / power_spectrum(wavenumbers(size), 1.0, n_s, k_c).mean())


def gaussian_field(
    rng: np.random.Generator, size: int, sigma: float, n_s: float, k_c: float
) -> np.ndarray:
    """A periodic Gaussian random field ``(size,)*3`` (float64) with the module's spectrum.

    White noise filtered by ``sqrt(P(k))`` in Fourier space: ``E|fftn(g)[k]|**2 / N = P(k)``.
    """
    amp = amplitude_for_sigma(size, sigma, n_s, k_c)
    noise = rng.standard_normal((size, size, size))
    f = np.fft.fftfreq(size)
    fr = np.fft.rfftfreq(size)
    k = np.sqrt(f[:, None, None] ** 2 + f[None, :, None] ** 2 + fr[None, None, :] ** 2)
    filt = np.sqrt(power_spectrum(k, amp, n_s, k_c))
    return np.fft.irfftn(np.fft.rfftn(noise) * filt, s=noise.shape, axes=(0, 1, 2))


def lognormal_channels(
    g: np.ndarray, sigma: float, growth: tuple[float, ...] = GROWTH
) -> np.ndarray:
    """``(len(growth), *g.shape)`` float32: ``exp(D g - (D sigma)**2 / 2)`` for each ``D``."""
    d = np.asarray(growth, dtype=np.float64).reshape(-1, *([1] * g.ndim))
    return np.exp(d * g - (d * sigma) ** 2 / 2).astype(np.float32)


def shell_average(values: np.ndarray, nbins: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Average per-mode ``values`` (a cubic ``fftn`` layout) over shells of ``|k|``.

    Shells split ``0 < |k| <= 0.5`` into ``nbins`` equal widths; empty shells are dropped.

    Returns:
        ``(mean |k|, mean value, number of modes)`` per shell.
    """
    k = wavenumbers(values.shape[0]).ravel()
    v = np.asarray(values, dtype=np.float64).ravel()
    keep = (k > 0) & (k <= 0.5)
    which = np.digitize(k[keep], np.linspace(0.0, 0.5, nbins + 1)[1:-1], right=True)
    counts = np.bincount(which, minlength=nbins).astype(np.float64)
    ksum = np.bincount(which, k[keep], minlength=nbins)
    vsum = np.bincount(which, v[keep], minlength=nbins)
    nz = counts > 0
    return ksum[nz] / counts[nz], vsum[nz] / counts[nz], counts[nz]


def radial_power(field: np.ndarray, nbins: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shell-averaged power ``|fftn(field)|**2 / N`` of a cubic field (:func:`shell_average`)."""
    return shell_average(np.abs(np.fft.fftn(field)) ** 2 / field.size, nbins)


def normalise_params(params: np.ndarray) -> np.ndarray:
    """Parameters ``(..., 3)`` in their :data:`PARAM_RANGES` to ``[-1, 1]``."""
    lo, hi = PARAM_RANGES[:, 0], PARAM_RANGES[:, 1]
    return 2.0 * (np.asarray(params) - lo) / (hi - lo) - 1.0


def denormalise_params(y: np.ndarray) -> np.ndarray:
    """Inverse of :func:`normalise_params`."""
    lo, hi = PARAM_RANGES[:, 0], PARAM_RANGES[:, 1]
    return lo + (np.asarray(y) + 1.0) * (hi - lo) / 2.0


def draw_params(rng: np.random.Generator) -> np.ndarray:
    """``(sigma, n_s, k_c)`` uniform in :data:`PARAM_RANGES`."""
    return rng.uniform(PARAM_RANGES[:, 0], PARAM_RANGES[:, 1])


def sample(seed: int, split: int, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index`` of a split: ``(x (4, S, S, S) float32, y (3,) float32)``."""
    rng = np.random.default_rng([seed, split, index])
    params = draw_params(rng)
    g = gaussian_field(rng, size, *params)
    x = lognormal_channels(g, params[0])
    return x, normalise_params(params).astype(np.float32)


def noisy_copy(x: np.ndarray, noise: float, seed: int, split: int, index: int) -> np.ndarray:
    """``x`` plus Gaussian noise of standard deviation ``noise`` (float32), drawn from
    ``default_rng([seed, split, index, 1])``: the input of the denoising task."""
    rng = np.random.default_rng([seed, split, index, 1])
    return (x + noise * rng.standard_normal(x.shape)).astype(np.float32)


def _check_sizes(n_samples: int, size: int, noise: float) -> None:
    if n_samples < 1 or size < 2:
        raise ValueError(f"need n_samples >= 1 and size >= 2, got {n_samples}, {size}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")


def _file_attrs(seed: int, split: int, size: int, noise: float) -> dict[str, Any]:
    """The HDF5 attributes every file records (module docstring)."""
    return dict(
        params=list(PARAMS), ranges=PARAM_RANGES, growth=list(GROWTH),
        seed=seed, split=split, size=size, noise=noise,
    )  # fmt: skip


@contextlib.contextmanager
def _renamed_when_written(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` to write a file or a directory under, renamed to
    ``path`` (replacing what is there) when the block ends and removed if it raises: a reader
    never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        if os.path.isdir(tmp) and os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.exists(tmp):
            os.unlink(tmp)


def _samples(
    n_samples: int, size: int, seed: int, split: int, noise: float
) -> Iterator[dict[str, np.ndarray]]:
    """Each sample's arrays in order: ``x``, ``y`` and, when ``noise`` is positive, ``noisy``."""
    for i in range(n_samples):
        x, y = sample(seed, split, i, size)
        arrays = {"x": x, "y": y}
        if noise > 0:
            arrays["noisy"] = noisy_copy(x, noise, seed, split, i)
        yield arrays


def _write_file(path: str, samples: Iterator, attrs: dict[str, Any], n_samples: int) -> None:
    """One HDF5 file, the samples stacked on a leading axis (one chunk a sample)."""
    size = attrs["size"]
    with h5py.File(path, "w") as f:
        volume = dict(
            shape=(n_samples, len(GROWTH), size, size, size), dtype=np.float32,
            chunks=(1, len(GROWTH), size, size, size),
        )  # fmt: skip
        out = {"x": f.create_dataset("x", **volume)}
        if attrs["noise"] > 0:
            out["noisy"] = f.create_dataset("noisy", **volume)
        out["y"] = f.create_dataset("y", (n_samples, len(PARAMS)), np.float32)
        for i, arrays in enumerate(samples):
            for name, a in arrays.items():
                out[name][i] = a
        f.attrs.update(attrs)


def _write_dir(path: str, samples: Iterator, attrs: dict[str, Any], n_samples: int) -> None:
    """A directory of one HDF5 file a sample, without the sample axis."""
    os.makedirs(path)
    for i, arrays in enumerate(samples):
        with h5py.File(os.path.join(path, f"sample-{i:05d}.h5"), "w") as f:
            for name, a in arrays.items():
                f.create_dataset(name, data=a)
            f.attrs.update(attrs)
            # datastore_layout is what detection reads (hdf5_reader)
            f.attrs.update(index=i, datastore_layout="per-sample")


def write_dataset(
    path: str | os.PathLike,
    n_samples: int,
    size: int,
    seed: int,
    *,
    split: int = 0,
    noise: float = 0.0,
    per_sample: bool = False,
) -> None:
    """Write ``n_samples`` samples of a ``size^3`` grid to one HDF5 file (module docstring),
    or with ``per_sample`` to a directory of one HDF5 file each.

    Args:
        path: the ``.h5`` file (or with ``per_sample`` the directory) to create, replaced if
            it exists; written under a temporary name and renamed, so a reader never sees half
            of it.
        n_samples: samples to write.
        size: grid points per axis.
        seed: the dataset seed.
        split: the seed stream: ``0`` training, ``1`` validation (:data:`SPLITS`). Default: ``0``.
        noise: when positive, also write ``noisy`` (:func:`noisy_copy` of ``x``), the input of
            the U-Net's denoising task. Default: ``0.0``.
        per_sample: write ``sample-00000.h5``... into the directory ``path``, each holding
            ``x``, ``y`` (and ``noisy``) without the sample axis and the file's attributes plus
            ``index`` and ``datastore_layout = "per-sample"``. Default: ``False``.
    """
    _check_sizes(n_samples, size, noise)
    write = _write_dir if per_sample else _write_file
    samples = _samples(n_samples, size, seed, split, noise)
    with _renamed_when_written(os.fspath(path)) as tmp:
        write(tmp, samples, _file_attrs(seed, split, size, noise), n_samples)


def write_split(
    out_dir: str | os.PathLike,
    n_train: int,
    n_val: int,
    size: int,
    seed: int,
    noise: float = 0.0,
    per_sample: bool = False,
) -> None:
    """``out_dir/train.h5`` (split 0) and ``out_dir/validation.h5`` (split 1); with
    ``per_sample``, the directories ``out_dir/train`` and ``out_dir/validation``
    (:func:`write_dataset`); nothing is written when either split would be refused."""
    for n in (n_train, n_val):
        _check_sizes(n, size, noise)
    os.makedirs(out_dir, exist_ok=True)
    for name, n, split in (("train", n_train, 0), ("validation", n_val, 1)):
        path = os.path.join(out_dir, name if per_sample else f"{name}.h5")
        write_dataset(path, n, size, seed, split=split, noise=noise, per_sample=per_sample)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.cosmology OUT --samples N --size S --seed K``."""
    p = Parser(
        prog="python -m trainer.cosmology",
        description="Write OUT/train.h5 and OUT/validation.h5 (with --per-sample: OUT/train/ "
        "and OUT/validation/): lognormal density fields (4 growth factors) labelled with their "
        "spectrum parameters in [-1, 1].",
    )
    p.add_argument("out", metavar="OUT", help="directory to write the two splits in")
    p.add_argument("--samples", type=whole, default=512, help="training samples (default 512)")
    p.add_argument(
        "--val-samples", type=whole, default=None, help="validation samples (default samples/4)"
    )
    p.add_argument("--size", type=int, default=32, help="grid points per axis (default 32)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    p.add_argument(
        "--noise", type=float, default=0.0,
        help="also write 'noisy', x plus Gaussian noise of this standard deviation: the "
        "input of the U-Net's denoising task (default 0: not written)",
    )  # fmt: skip
    p.add_argument(
        "--per-sample", action="store_true",
        help="write OUT/train/ and OUT/validation/ as one HDF5 file per sample (the layout "
        "`datastore stage --mode shard` spreads over nodes)",
    )  # fmt: skip
    a = p.parse_args(argv)
    n_val = max(1, a.samples // 4) if a.val_samples is None else a.val_samples
    try:
        write_split(a.out, a.samples, n_val, a.size, a.seed, a.noise, a.per_sample)
    except (ValueError, OSError) as exc:
        print(f"trainer.cosmology: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    print(f"wrote {a.samples} training and {n_val} validation samples of {a.size}^3 to {a.out}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
