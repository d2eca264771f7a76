"""How the MPI jobs hand their results back: each rank's JSON row in a file of its own."""

from __future__ import annotations

import json
import os
from typing import Any


def write_row(prefix: str, rank: int, row: dict[str, Any]) -> None:
    """Write ``row`` to ``PREFIX.RANK.json`` whole (under a temporary name, then renamed), so
    the test never reads half a row (``helpers.rank_rows`` reads them)."""
    tmp = f"{prefix}.{rank}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, f"{prefix}.{rank}.json")
