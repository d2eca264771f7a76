"""Spatial layers: the pure block geometry in one process (with the interior and shell of the
overlapped convolution), then strided ``DistConv3d`` (stride 1 with and without overlap), pools,
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

from datastore.maths.partition import Grid, block_bounds, split_sizes
from staging.cluster import LAUNCH_ENV
from trainer.geometry import (
    block_offsets,
    box_size,
    check_aligned,
    check_pool_blocks,
    check_pool_windows,
    conv_input_box,
    conv_out_size,
    conv_window,
    interior_box,
    owned_outputs,
    pool_out_size,
    shell_slabs,
)
from trainer.grid import ProcessGrid, neighbours_of, spatial_coords_of
from trainer.layers import DistConv3d
from trainer.pool import DistAvgPool3d

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent

sys.path.insert(0, str(JOBS))
import layers_job  # noqa: E402  (the case list, to parametrize over)

ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


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


def test_interior_box_examples():
    sides = [(True, True), (False, True), (False, False)]
    assert interior_box((8, 8, 8), (1, 1, 1), sides) == ((1, 7), (0, 7), (0, 8))
    assert interior_box((8, 8, 8), (2, 1, 0), sides) == ((2, 6), (0, 7), (0, 8))
    # n < 2h with two neighbours: empty along that axis (start == stop), never inverted
    assert interior_box((3, 2, 1), (2, 2, 0), [(True, True)] * 3) == ((2, 2), (2, 2), (0, 1))
    assert interior_box((4, 4, 4), (1, 1, 1), [(False, False)] * 3) == ((0, 4),) * 3
    with pytest.raises(ValueError, match="length mismatch"):
        interior_box((4, 4), (1, 1, 1), sides)


def test_shell_slabs_examples():
    inner = ((1, 3), (0, 2), (1, 4))
    assert shell_slabs((4, 2, 5), inner) == [
        (0, 0, ((0, 1), (0, 2), (0, 5))),
        (0, 1, ((3, 4), (0, 2), (0, 5))),
        # axis 1: the interior covers it whole, no slab
        (2, 0, ((1, 3), (0, 2), (0, 1))),
        (2, 1, ((1, 3), (0, 2), (4, 5))),
    ]
    assert shell_slabs((3, 3, 3), ((0, 3),) * 3) == []
    assert box_size(((2, 2), (0, 3), (0, 3))) == 0
    with pytest.raises(ValueError, match="does not lie in the block"):
        shell_slabs((3, 3, 3), ((0, 4), (0, 3), (0, 3)))


def _blocks_and_sides():
    """300 random blocks: 1..5 voxels, halos 0..2 (at most the block), random neighbour sides."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(300):
        owned = tuple(int(v) for v in torch.randint(1, 6, (3,), generator=gen))
        halo = tuple(
            min(int(v), n)
            for v, n in zip(torch.randint(0, 3, (3,), generator=gen), owned, strict=True)
        )
        sides = [tuple(bool(b) for b in torch.randint(0, 2, (2,), generator=gen)) for _ in owned]
        out.append((owned, halo, sides))
    return out


def test_interior_and_shell_tile_the_block_and_nest():
    """Interior and slabs cover every output once, and wrapping the interior in the slabs of the
    last axis, then the one before, ... (torch.cat) gives the block in order."""
    for owned, halo, sides in _blocks_and_sides():
        inner = interior_box(owned, halo, sides)
        slabs = shell_slabs(owned, inner)
        count = torch.zeros(owned, dtype=torch.int64)
        for box in [inner] + [b for _, _, b in slabs]:
            count[tuple(slice(a, b) for a, b in box)] += 1
        assert bool((count == 1).all()), (owned, halo, sides)
        ids = torch.arange(math.prod(owned)).view(owned)
        cut = {(axis, side): box for axis, side, box in slabs}

        def piece(box, ids=ids):
            return ids[tuple(slice(a, b) for a, b in box)] if box and box_size(box) else None

        core = piece(inner)
        for axis in (2, 1, 0):
            pieces = [piece(cut.get((axis, 0))), core, piece(cut.get((axis, 1)))]
            pieces = [p for p in pieces if p is not None]
            core = torch.cat(pieces, axis) if pieces else None
        assert core is not None and torch.equal(core, ids), (owned, halo, sides)


def test_interior_reads_no_received_halo_and_is_the_largest_such_box():
    for owned, halo, sides in _blocks_and_sides():
        inner = interior_box(owned, halo, sides)
        window = conv_input_box(inner, halo)
        for axis, (n, h, (lo, hi)) in enumerate(zip(owned, halo, sides, strict=True)):
            (a, b), (wa, wb) = inner[axis], window[axis]
            assert (wa, wb) == (a, b + 2 * h)  # output o reads [o, o + 2h] of the padded block
            if a == b:
                continue
            # the padded block's received halo slabs are [0, h) (low) and [h + n, n + 2h) (high)
            assert not lo or wa >= h
            assert not hi or wb <= h + n
            # one output more on either side would read a received halo voxel
            assert a == 0 or (lo and a - 1 < h)
            assert b == n or (hi and b + 1 + 2 * h > h + n)


@pytest.mark.parametrize("kernel", [(3, 3, 3), (5, 3, 1), (1, 5, 3)])
def test_interior_from_the_unfilled_block_and_shell_give_the_global_conv(kernel):
    """One process, a volume cut into 2 x 3 x 2 blocks: per block, the interior from the
    zero-padded block alone and the shell from the block with its halo give its slice of the
    global "same" convolution (what DistConv3d's overlapped forward computes)."""
    halo = tuple(k // 2 for k in kernel)
    shape, parts = (7, 9, 6), (2, 3, 2)
    v = torch.randn(1, 2, *shape, dtype=torch.float64)
    w = torch.randn(3, 2, *kernel, dtype=torch.float64)
    ref = F.conv3d(v, w, padding=halo)
    grid = Grid(shape, parts, halo, "zero")
    whole = F.pad(v, [p for h in reversed(halo) for p in (h, h)])
    for r in range(math.prod(parts)):
        bounds = block_bounds(grid, r)
        coords = spatial_coords_of(parts, r)
        owned = tuple(b.stop - b.start for b in bounds)
        sides = [
            (c > 0 and h > 0, c < p - 1 and h > 0)
            for c, p, h in zip(coords, parts, halo, strict=True)
        ]
        filled = whole[
            (..., *(slice(b.start, b.stop + 2 * h) for b, h in zip(bounds, halo, strict=True)))
        ]
        unfilled = F.pad(v[(..., *bounds)], [p for h in reversed(halo) for p in (h, h)])

        def conv(t, box):
            return F.conv3d(t[(..., *(slice(a, b) for a, b in conv_input_box(box, halo)))], w)

        inner = interior_box(owned, halo, sides)
        want = ref[(..., *bounds)]
        if box_size(inner):
            got = conv(unfilled, inner)
            torch.testing.assert_close(got, want[(..., *(slice(a, b) for a, b in inner))])
        for _, _, box in shell_slabs(owned, inner):
            got = conv(filled, box)
            torch.testing.assert_close(got, want[(..., *(slice(a, b) for a, b in box))])


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


def test_a_pool_with_overlapping_windows_is_refused_when_built():
    # Refused blocks are agreed over the spatial group: tests/test_trainer_geometry_agree.py.
    with pytest.raises(ValueError, match="DistAvgPool3d: stride 1 < kernel 2 along axis 0"):
        DistAvgPool3d(2, _grid((2, 1, 1), 0), stride=(1, 2, 2))


def test_dist_conv3d_overlaps_for_stride_1_with_a_split_axis_only():
    def conv(parts, **kw):
        kw.setdefault("overlap", True)
        return DistConv3d(1, 1, kw.pop("k", 3), _grid(parts, 0), broadcast=False, **kw)

    assert DistConv3d(1, 1, 3, _grid((2, 1, 1), 0), broadcast=False).overlap  # on by default
    assert conv((2, 1, 1)).overlapped()
    assert conv((1, 1, 2), k=(1, 1, 3)).overlapped()
    assert not conv((2, 1, 1), overlap=False).overlapped()
    assert not conv((2, 1, 1), stride=2).overlapped()
    assert not conv((2, 1, 1), stride=(1, 2, 1)).overlapped()
    assert not conv((1, 1, 1)).overlapped()  # nothing to exchange
    assert not conv((2, 1, 1), k=(1, 3, 3)).overlapped()  # the split axis has no halo
    assert not conv((2, 1, 1), k=1).overlapped()


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
