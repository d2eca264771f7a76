"""A new process resumes from saved states: ``resume_job.py DATA STATES OUT``.

``STATES`` (``torch.save``) maps a name ``"{kind}-{where}"`` (kind ``ours`` or ``theirs``,
StatefulDataLoader) to a state_dict; for each, a fresh loader over ``DATA`` (batch 8) loads it
and runs two passes. ``OUT`` (JSON) maps the name to the ids of every batch of each pass."""

from __future__ import annotations

import json
import sys

import torch

from conformance.common import epoch, ours, theirs


def main() -> None:
    data, states, out = sys.argv[1:4]
    got = {}
    for name, state in torch.load(states, weights_only=False).items():
        kind = name.split("-")[0]
        loader = ours(data, 8) if kind == "ours" else theirs(data, 8, stateful=True)
        loader.load_state_dict(state)
        got[name] = [epoch(loader), epoch(loader)]
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
