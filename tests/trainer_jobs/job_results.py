"""The end every trainer job shares: rank 0 writes the results, then the ranks leave together."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch.distributed as dist


def write_results(results: dict[str, Any], rank: int) -> None:
    """Rank 0 writes ``results`` as JSON to the path in ``sys.argv[1]``; then every rank waits
    for the others (none leaves while another still sends) and leaves the process group."""
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
