"""Under ``mpiexec -n N python -m mpi4py``: ``python -m trainer train ARGS`` where every rank
is killed (``os._exit(9)``) in the save of step STEP, after the data ranks' own optimizer files
are written and before ``checkpoint.pt`` is (as a time limit or a failed node would).

Usage: save_crash_job.py STEP TRAIN_ARGS...
"""

from __future__ import annotations

import os
import sys

import trainer.train
from trainer.__main__ import main

_rng_states = trainer.train.Trainer._rng_states


def killed_mid_save(self: trainer.train.Trainer):
    if self.step == int(sys.argv[1]):
        os._exit(9)
    return _rng_states(self)


if __name__ == "__main__":
    trainer.train.Trainer._rng_states = killed_mid_save
    sys.exit(main(["train", *sys.argv[2:]]))
