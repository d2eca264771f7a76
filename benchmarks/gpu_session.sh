#!/usr/bin/env bash
# One run on the GPU machine: the CUDA tests and the GPU benchmarks, each step under its own time
# limit within one budget, every log and JSON result written to $OUT (what `device` brings back).
#
# A session lent a GPU has about 15 minutes of device time, start-up included, and at most
# 10 minutes a command: so everything goes in two commands run back to back (below), and a
# step that fails or runs out of time leaves its log and the next step still runs. First the
# CUDA tests of several ranks (`-m mpi`: ranks sharing the one GPU over gloo; NCCL refuses two
# ranks on one GPU) and train_gpu's cases 2-4 (split memory, exposure); then the other CUDA
# tests, gpu_feed and train_gpu's case 1 (docs/benchmarks.md: an H100 on 2026-11-27, an H200 on
# 2026-11-29). pytest prints its 15 slowest tests, to size the
# steps' limits.
#
# On the CPU machine, once:   ../shared/tools/gpu-wheels.sh --mpi    (fills .whl/)
#                             and msgspec (zarr >= 3.2 imports it; the tool leaves it out):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl msgspec
# Then two device runs (all steps took 594 s on an H200 on 2026-11-29: env 8, cuda-ranks 175,
# train-split 147, cuda-tests 127, gpu-feed 113, train-fed 24), each carry [".whl"]:
#   timeout_s 450: GPU_SESSION_BUDGET=420 GPU_SESSION_STEPS="env cuda-ranks train-split" \
#                      OUT=$OUT bash benchmarks/gpu_session.sh
#   timeout_s 330, at once (the machine is still warm): GPU_SESSION_BUDGET=300 \
#       GPU_SESSION_STEPS="cuda-tests gpu-feed train-fed" OUT=$OUT bash benchmarks/gpu_session.sh
# Afterwards, here: copy the returned gpu_feed.json to benchmarks/results/ and run
#                             python benchmarks/report.py --skip-run   (docs/benchmarks.md, plots)
# Locally (no GPU), a smoke run of the same steps at toy sizes on the CPU:
#                             GPU_SESSION_SMOKE=1 OUT=/tmp/gs bash benchmarks/gpu_session.sh
#
# Variables: OUT (default ./gpu-session-out), GPU_SESSION_BUDGET seconds for all steps
# (default 560), GPU_SESSION_SMOKE=1 (CPU, toy sizes), PYTHON (default python3),
# GPU_SESSION_STEPS (the names of the steps to run, e.g. "env gpu-feed train-fed" for a rerun;
# default all).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/gpu-session-out}
BUDGET=${GPU_SESSION_BUDGET:-560}
SMOKE=${GPU_SESSION_SMOKE:-0}
PY=${PYTHON:-python3}
STEPS=${GPU_SESSION_STEPS:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 # a step cut off by its limit keeps what it printed
start=$SECONDS

if [ -d .whl ]; then # the GPU machine's image lacks these (../shared/reference/gpu.md)
    wheels=(); mpich=()
    for w in .whl/*.whl; do case $w in .whl/mpich-*) mpich+=("$w") ;; *) wheels+=("$w") ;; esac; done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" \
        > "$OUT/wheels.log" 2>&1 || echo "wheels: install failed, see wheels.log"
    export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    if [ ${#mpich[@]} -gt 0 ]; then
        # pip --target drops a wheel's data lib/ (the mpich wheel's libmpi.so.12), and mpi4py's
        # binary wheel then loads the image's Open MPI under the wheel's mpiexec: every rank a
        # world of 1. --prefix keeps lib/, and MPI4PY_LIBMPI names the library to load.
        "$PY" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
            --prefix /tmp/mpich "${mpich[@]}" >> "$OUT/wheels.log" 2>&1 || echo "mpich: install failed"
        # The tests launch with DATASTORE_TEST_MPIEXEC (tests/helpers.py), train_gpu with the
        # first mpiexec on PATH: both the wheel's.
        export PATH=/tmp/mpich/bin:$PATH MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12 \
            DATASTORE_TEST_MPIEXEC=/tmp/mpich/bin/mpiexec
    fi
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME LIMIT_S COMMAND...: run COMMAND into $OUT/NAME.log under min(LIMIT_S, budget left)
step() {
    local name=$1 limit=$2 left rc t0=$SECONDS
    shift 2
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then
        return
    fi
    left=$((BUDGET - (SECONDS - start)))
    if [ "$left" -lt 15 ]; then
        echo "== $name: skipped, budget spent" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local why="rc $rc"
    [ "$rc" -eq 124 ] && why="cut off at ${limit} s"
    echo "== $name: $why, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

: > "$OUT/summary.txt"
if [ "$SMOKE" = 1 ]; then
    feed=(--quick --device cpu --width 4 --workers 2)
    train=(--device cpu --reps 1 --samples 8 --steps 2 --sides 32 48 --cpu-side 32
        --halo-side 32 --job-steps 2)
    fed=("${train[@]}")
else
    # 48 samples of 32 MiB (1.5 GiB), three repetitions (targets are medians of 3): gpu-feed
    # 113 s, train-fed 24 s on an H200; the split cases stay at one (147 s)
    feed=(--samples 48 --steps 24 --warmup 6 --reps 3 --workers "8,14")
    train=(--reps 1)
    fed=(--reps 3)
fi

# what runs where; a 2-rank world must say "world: 2 rank(s)" (a world of 1 is an MPI mix-up)
env_check="nvidia-smi || true
$PY -c 'import torch; c = torch.cuda.is_available(); print(torch.__version__, c, c and torch.cuda.get_device_name(0))'
mpiexec -n 2 $PY deploy/check_mpi.py || true
$PY -c 'import zarr, numcodecs, lmdb, grpc, mpi4py; print(\"imports ok: zarr\", zarr.__version__)'
echo 'tests launch with' \"\${DATASTORE_TEST_MPIEXEC:-the mpiexec next to $PY, else on PATH}\"
$PY -c 'import sys; sys.path[0] = \"benchmarks\"; from common import venv_tool; print(\"train_gpu launches with\", venv_tool(\"mpiexec\"))'"
step env 60 bash -c "$env_check"
tests=(-m pytest -q -rs -p no:cacheprovider --durations=15 -k cuda tests)
step cuda-ranks 270 "$PY" "${tests[@]}" -m mpi
step train-split 150 "$PY" benchmarks/train_gpu.py "${train[@]}" --cases 234
step cuda-tests 150 "$PY" "${tests[@]}" -m "not mpi"
step gpu-feed 170 "$PY" benchmarks/gpu_feed.py "${feed[@]}" --json "$OUT/gpu_feed.json"
step train-fed 90 "$PY" benchmarks/train_gpu.py "${fed[@]}" --cases 1
mode=""
[ "$SMOKE" = 1 ] && mode=" (CPU smoke run)"
echo "== all steps: $((SECONDS - start)) s of a ${BUDGET} s budget$mode" | tee -a "$OUT/summary.txt"
