"""Spatial layers: the pure block geometry in one process, then strided ``DistConv3d``, pools,
``DistBatchNorm3d``, ``global_avg_pool`` and ``gather_flatten`` under real ``mpiexec`` ranks on
gloo (one job per rank count: tests/trainer_jobs/layers_job.py) against single-process torch."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import MPIEXEC

from datastore.partition import Grid, block_bounds, split_sizes
from staging.cluster import LAUNCH_ENV
from trainer.geometry import (
    block_offsets,
    check_aligned,
    check_pool_blocks,
    check_pool_windows,
    conv_out_size,
    conv_window,
    owned_outputs,
    pool_out_size,
)
from trainer.grid import ProcessGrid, neighbours_of, spatial_coords_of
from trainer.layers import DistConv3d
from trainer.pool import DistAvgPool3d, DistMaxPool3d

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent

sys.path.insert(0, str(JOBS))
import layers_job  # noqa: E402  (the case list, to parametrize over)

ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


pytestmark = pytest.mark.usefixtures("no_stale_mpich_shm")

# ---- pure geometry, one process ----------------------------------------------------------


def _conv1d_len(n: int, k: int, s: int) -> int:
    return F.conv1d(torch.zeros(1, 1, n), torch.zeros(1, 1, k), stride=s, padding=k // 2).shape[-1]


@pytest.mark.parametrize(("k", "s"), list(itertools.product([1, 3, 5, 7], [1, 2, 3])))
def test_output_sizes_are_torch(k, s):
    for n in range(1, 20):
        assert conv_out_size(n, k, s) == _conv1d_len(n, k, s)
        if n >= k:
            assert pool_out_size(n, k, s) == F.max_pool1d(torch.zeros(1, 1, n), k, s).shape[-1]


def _aligned_splits(n: int, s: int) -> list[tuple[int, ...]]:
    """Splits of ``n`` (the loader's rule, and hand-made ones) whose blocks start on ``s``."""
    splits = [split_sizes(n, p) for p in range(1, min(n, 4) + 1)]
    splits += [(s * a, n - s * a) for a in range(1, n // s) if n - s * a > 0]
    return [b for b in splits if all(x % s == 0 for x in b[:-1])]


@pytest.mark.parametrize(("k", "s"), list(itertools.product([1, 3, 5], [1, 2, 3])))
def test_conv_window_reproduces_the_global_conv_per_block(k, s):
    """Along one axis: each block's valid conv over its window (zero outside the volume) is its
    owned slice of the global conv, and the owned slices tile the global output."""
    w = torch.randn(1, 1, k, dtype=torch.float64)
    for n in range(1, 14):
        x = torch.randn(1, 1, n, dtype=torch.float64)
        ref = F.conv1d(x, w, stride=s, padding=k // 2)[0, 0]
        m = n + k  # zeros far enough out on both sides
        padded = F.pad(x, (m, m))[0, 0]
        for sizes in _aligned_splits(n, s):
            got, start = [], 0
            for b in sizes:
                left, right = conv_window(b, k, s)
                assert left == k // 2
                if s == 1:
                    assert right == k // 2
                window = padded[m + start - left : m + start + b + right]
                out = F.conv1d(window.view(1, 1, -1), w, stride=s)[0, 0]
                assert len(out) == owned_outputs(b, s)
                got.append(out)
                start += b
            torch.testing.assert_close(torch.cat(got), ref, rtol=0, atol=1e-12)


def test_conv_window_examples():
    assert conv_window(4, 3, 2) == (1, 0)  # even block, k3 s2: nothing from the right
    assert conv_window(5, 3, 2) == (1, 1)  # odd (last) block: one voxel of right padding
    assert conv_window(4, 5, 2) == (2, 1)
    assert conv_window(4, 1, 2) == (0, -1)  # the block's last voxel is read by nobody
    assert conv_window(6, 3, 1) == (1, 1)
    with pytest.raises(ValueError, match="odd kernel"):
        conv_window(4, 2, 2)


def test_check_aligned_names_the_axis():
    check_aligned((4, 5, 3), (2, 2, 1), (0, 1, 0), (2, 2, 2))  # last blocks, unsplit axes: any
    with pytest.raises(
        ValueError, match="split axis 1 has 5 voxels, not a multiple of the stride 2"
    ):
        check_aligned((4, 5, 3), (2, 2, 1), (0, 0, 0), (2, 2, 2), "DistConv3d")
    with pytest.raises(ValueError, match=r"^DistConv3d: block 1 of 4 along split axis 0"):
        check_aligned((3, 4, 4), (4, 1, 1), (1, 0, 0), (2, 1, 1), "DistConv3d")


def test_pool_checks():
    check_pool_windows((2, 2, 1), (2, 3, 1))
    with pytest.raises(ValueError, match="stride 1 < kernel 2 along axis 2"):
        check_pool_windows((2, 2, 2), (2, 2, 1))
    check_pool_blocks((4, 3, 7), (2, 2, 1), (0, 1, 0), (2, 2, 2), (2, 2, 2))
    with pytest.raises(ValueError, match="split axis 0 has 3 voxels"):
        check_pool_blocks((3, 4, 4), (2, 1, 1), (0, 0, 0), (2, 2, 2), (2, 2, 2))
    with pytest.raises(
        ValueError, match="1 voxels along split axis 0 is shorter than the kernel 2"
    ):
        check_pool_blocks((1, 4, 4), (2, 1, 1), (1, 0, 0), (2, 2, 2), (2, 2, 2))


@pytest.mark.parametrize("parts", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (3, 1, 2), (4,)])
def test_block_offsets_are_the_partition(parts):
    shape = tuple(2 * p + 3 for p in parts)
    grid = Grid(shape, parts)
    bounds = [block_bounds(grid, r) for r in range(math.prod(parts))]
    offsets, whole = block_offsets(parts, [tuple(b.stop - b.start for b in bb) for bb in bounds])
    assert whole == shape
    assert offsets == [tuple(b.start for b in bb) for bb in bounds]


def test_block_offsets_reject_a_non_box():
    with pytest.raises(ValueError, match="along axis 1 differ in length"):
        block_offsets((2, 1), [(3, 4), (3, 5)])
    with pytest.raises(ValueError, match="3 shapes for 2 blocks"):
        block_offsets((2,), [(3,), (3,), (3,)])


def _grid(parts, spatial_rank) -> ProcessGrid:
    """A grid without process groups: any communication attempt would fail."""
    return ProcessGrid(
        rank=spatial_rank,
        world=math.prod(parts),
        parts=parts,
        data_rank=0,
        data_size=1,
        spatial_rank=spatial_rank,
        spatial_coords=spatial_coords_of(parts, spatial_rank),
        neighbours=neighbours_of(parts, spatial_rank),
    )


def test_layers_reject_a_misaligned_block_before_communicating():
    conv = DistConv3d(1, 1, 3, _grid((2, 1, 1), 0), stride=2, broadcast=False)
    with pytest.raises(ValueError, match="DistConv3d: block 0 of 2 along split axis 0 has 5"):
        conv(torch.zeros(1, 1, 5, 4, 4))
    pool = DistMaxPool3d(2, _grid((1, 2, 1), 0))
    with pytest.raises(ValueError, match="DistMaxPool3d: block 0 of 2 along split axis 1 has 3"):
        pool(torch.zeros(1, 1, 4, 3, 4))
    with pytest.raises(ValueError, match="DistAvgPool3d: stride 1 < kernel 2 along axis 0"):
        DistAvgPool3d(2, _grid((2, 1, 1), 0), stride=(1, 2, 2))


# ---- real ranks ----------------------------------------------------------------------------


_results: dict[int, dict] = {}


def results(n: int, tmp_path_factory) -> dict:
    """Run the layers job on ``n`` ranks once per module; ``{case: {check: worst error}}``."""
    if n not in _results:
        assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
        out = tmp_path_factory.mktemp(f"layers{n}") / "out.json"
        job = str(JOBS / "layers_job.py")
        cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", job, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _results[n] = json.loads(out.read_text())
    return _results[n]


def cases(*kinds: str) -> list:
    """The job's result keys whose first word is one of ``kinds``, for every rank count."""
    return [
        pytest.param(n, key, id=f"{n}ranks-{key}", marks=pytest.mark.mpi)
        for n in layers_job.CASES
        for key in layers_job.case_keys(n)
        if key.split(" ")[0].rstrip(",") in kinds
    ]


def _close(r: dict, skip: tuple[str, ...] = ()) -> None:
    for check, err in r.items():
        if check not in skip:
            assert err < 1e-10, (check, r)  # float64 throughout


@pytest.mark.parametrize(("n", "key"), cases("conv"))
def test_strided_dist_conv3d_matches_conv3d(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    assert r["tiles"] == 0, r  # the owned output blocks cover the global output once
    _close(r)  # output, input/weight/bias gradients, weight gradient summed over the data group


@pytest.mark.parametrize(("n", "key"), cases("maxpool", "avgpool"))
def test_dist_pools_match_torch(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    assert r["tiles"] == 0, r
    _close(r)


@pytest.mark.parametrize(("n", "key"), cases("batchnorm"))
def test_dist_batchnorm_matches_batchnorm_of_the_concatenation(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    if "float32" in key:  # float32 layer, float64 reference
        assert max(r.values()) < 1e-5, r
        return
    assert r["batches_tracked"] == 0, r
    # output, input/gamma/beta gradients, running mean/var after two steps, evaluation output
    _close(r)


@pytest.mark.parametrize(("n", "key"), cases("global_avg_pool"))
def test_global_avg_pool_matches_mean(n, key, tmp_path_factory):
    _close(results(n, tmp_path_factory)[key])


@pytest.mark.parametrize(("n", "key"), cases("gather_flatten"))
def test_gather_flatten_is_torch_flatten(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    assert r["output_rel"] == 0.0, r  # a copy: bit for bit
    _close(r)


@pytest.mark.parametrize(("n", "key"), cases("chain"))
def test_cosmoflow_like_chain_matches_torch(n, key, tmp_path_factory):
    _close(results(n, tmp_path_factory)[key])
