"""``python -m trainer train --config cfg.toml --set key=value ...``.

Exit codes: ``0`` trained; ``2`` bad configuration (one line on stderr naming the key, or what
cannot work: a field, a split the model cannot run, more ranks than GPUs for NCCL; the same on
every rank) or unreadable data.
"""

from __future__ import annotations

import argparse
import sys

from staging.exitcodes import Exit
from trainer.config import ConfigError, load_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Train a 3-D CNN.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a TOML config (trainer/config.py lists the keys)")
    t.add_argument("--config", metavar="TOML", help="config file (flat TOML)")
    t.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
        help="override a config key (repeatable), e.g. --set lr=0.01 --set optimizer=sgd",
    )  # fmt: skip
    a = p.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
    except ConfigError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    from datastore.readers import DatasetError
    from trainer.train import train

    try:
        result = train(cfg)
    except (ConfigError, DatasetError) as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    if result["rank"] != 0:
        return Exit.OK
    print(
        f"trained {result['steps']} steps: validation MSE {result['val_mse']:.4f}, "
        f"predict-the-mean baseline {result['baseline_mse']:.4f} "
        f"(ratio {result['val_mse'] / result['baseline_mse']:.3f})"
    )
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
