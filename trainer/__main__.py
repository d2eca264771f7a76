"""``python -m trainer train --config cfg.toml --set key=value ...`` and
``mpiexec -n K python -m mpi4py -m trainer tournament --config cfg.toml --set ...``.

Exit codes: ``0`` trained; ``2`` bad configuration (one line on stderr naming the key, or what
cannot work: a field, a split the model cannot run, more ranks than GPUs for NCCL, a
tournament's trainers against its processes; the same on every rank) or unreadable data;
``1`` failed (the data service stopped, refused or had no room: one line; a rank that failed);
``130`` interrupted (Ctrl-C, SIGINT: one line; a rerun resumes from the last checkpoint);
``141`` stdout's reader went away (``| head``), quietly.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from staging.console import Parser, grpc_errors_only, reader_gone, whole_lines
from staging.exitcodes import Exit
from staging.launcher import finalize_mpi
from trainer.config import ConfigError, load_config, load_tournament

__all__ = ["main"]


def main(argv: list[str] | None = None, *, last: bool = False) -> int:
    """Run the command of ``argv``; its exit code. ``last``: this process ends after it, so a
    refusal every rank made alike ends MPI cleanly (``python -m trainer``)."""
    whole_lines()  # (the ranks' errors share one terminal)
    grpc_errors_only()  # (a loader of a service)
    p = Parser(prog="python -m trainer", description="Train a 3-D CNN.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a TOML config (trainer/config.py lists the keys)")
    k = sub.add_parser(
        "tournament",
        help="K trainers, one process each, that pit their models against each other every N "
        "steps (LTFB; keys in the config's [tournament] table, see docs/trainer.md)",
    )
    for cmd in (t, k):
        cmd.add_argument("--config", metavar="TOML", help="config file (flat TOML)")
        cmd.add_argument(
            "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
            help="override a config key (repeatable), e.g. --set lr=0.01 --set optimizer=sgd "
            "(tournament keys: --set tournament.trainers=3)",
        )  # fmt: skip
    a = p.parse_args(argv)
    if a.command == "train":
        return _run(load_config, _train, a, last)
    return _run(load_tournament, _tournament, a, last)


def _run(
    load: Callable[..., Any], go: Callable[[Any], int], a: argparse.Namespace, last: bool
) -> int:
    """Load the config and run ``go``; a bad configuration is one line and exit code 2."""
    from datastore.errors import DataStoreError
    from datastore.readers import DatasetError
    from staging.launcher import LaunchMismatch

    try:
        return go(load(a.config, a.overrides))
    except (ConfigError, DatasetError, LaunchMismatch) as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        if last and getattr(exc, "everywhere", False):
            _finalize_mpi()
        return Exit.BAD_INPUT
    except DataStoreError as exc:  # the data service stopped, refused, ran out of memory, ...
        print(f"trainer: {exc}", file=sys.stderr)
        return Exit.FAILED
    except BrokenPipeError:
        if not reader_gone():  # (a socket's: a real failure)
            raise
        return Exit.READER_GONE  # `| head` has its lines: quietly, as `cat` ends
    except KeyboardInterrupt:  # Ctrl-C (SIGINT): the last checkpoint is where a rerun resumes
        print("trainer: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    finally:
        _end_process_group()


def _finalize_mpi() -> None:
    """End MPI with ``MPI_Finalize`` where every rank refused alike (``python -m mpi4py``
    would abort: ``staging.exitcodes.Agreed``), the process group first (its gloo threads)."""
    _end_process_group()
    finalize_mpi()


def _end_process_group() -> None:
    """Destroy the process group before the interpreter exits: left to shutdown, gloo's
    threads could be torn down mid-loop ('terminate called without an active exception',
    exit 134, seen under Open MPI after a run that had finished)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _train(cfg: Any) -> int:
    from trainer.train import train

    result = train(cfg)
    if result["rank"] == 0:
        print(
            f"trained {result['steps']} steps: validation MSE {result['val_mse']:.4f}, "
            f"predict-the-mean baseline {result['baseline_mse']:.4f} "
            f"(ratio {_ratio(result['val_mse'], result['baseline_mse']):.3f})"
        )
    return Exit.OK


def _ratio(mse: float, baseline: float) -> float:
    """``mse / baseline``; a constant validation target has a baseline of 0."""
    if baseline:
        return mse / baseline
    return math.inf if mse else math.nan


def _tournament(tc: Any) -> int:
    from trainer.tournament import tournament

    result = tournament(tc)
    if result["rank"] == 0:
        rows = result["trainers"]
        best = rows[result["best"]]
        ratio = _ratio(best["val_mse"], best["baseline_mse"])
        print(
            f"tournament of {len(rows)} trainers, {result['steps']} steps, "
            f"{result['rounds']} rounds: best validation MSE {best['val_mse']:.4f} (trainer "
            f"{best['trainer']}, lr {best['lr']:g}), predict-the-mean baseline "
            f"{best['baseline_mse']:.4f} (ratio {ratio:.3f})"
        )
        for r in rows:
            print(
                f"  trainer {r['trainer']}: lr {r['lr']:g}, validation MSE {r['val_mse']:.4f}, "
                f"won {r['wins']}, lost {r['losses']}"
            )
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main(last=True))
