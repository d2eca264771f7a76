"""Under ``mpiexec -n 4 python -m mpi4py``: ``python -m trainer train ARGS`` where rank 1
raises at step 2 (``python -m mpi4py`` then aborts the whole job).

Usage: train_fail_job.py TRAIN_ARGS...
"""

from __future__ import annotations

import sys

import torch.distributed as dist

import trainer.train
from trainer.__main__ import main
from trainer.optim import LRSchedule

_lr_at = trainer.train.lr_at


def failing_lr_at(step: int, schedule: LRSchedule) -> float:
    if step == 2 and dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose at step 2")
    return _lr_at(step, schedule)


if __name__ == "__main__":
    trainer.train.lr_at = failing_lr_at
    sys.exit(main(["train", *sys.argv[1:]]))
