"""Draw docs/img/architecture.png: how a sample flows from the parallel filesystem to a GPU.

``python docs/img/architecture.py`` (needs matplotlib: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

BOXES = {  # name: (x, y, w, h, title, lines, colour)
    "pfs": (
        0.2,
        4.3,
        2.6,
        1.3,
        "parallel filesystem",
        ["Lustre / GPFS", "HDF5, zarr, LMDB,", "npy, tar shards"],
        "#d9d9d9",
    ),
    "stage": (
        3.4,
        4.3,
        3.0,
        1.3,
        "datastore stage",
        ["splice copy + XXH3", "atomic, resumable", "MPI: one rank per node"],
        "#a6cee3",
    ),
    "nvme": (
        7.0,
        4.3,
        2.6,
        1.3,
        "node-local NVMe",
        ["DEST/ + manifest", "(replicate or shard)"],
        "#d9d9d9",
    ),
    "serve": (
        6.6,
        1.9,
        3.4,
        1.7,
        "datastore serve (per node)",
        ["readers -> resident store", "sessions, shuffle, blocks", "peers: MPI or gRPC"],
        "#b2df8a",
    ),
    "embedded": (
        2.6,
        1.9,
        3.4,
        1.7,
        "embedded store (per rank)",
        ["readers -> store slots", "Feistel order, halos", "exchange: MPI / gloo"],
        "#fdbf6f",
    ),
    "loader": (
        4.4,
        0.0,
        3.4,
        1.2,
        "DataStoreLoader",
        ["ring of pinned batches", "side-stream copy to GPU"],
        "#cab2d6",
    ),
    "gpu": (8.6, 0.0, 1.4, 1.2, "GPU", ["trainer/", "halo, NCCL"], "#fb9a99"),
}
ARROWS = [
    ("pfs", "stage", "read"),
    ("stage", "nvme", "write"),
    ("nvme", "serve", "resident for\nthe campaign"),
    ("nvme", "embedded", "each job\nreads itself"),
    ("serve", "loader", "gRPC: shm\nor TCP"),
    ("embedded", "loader", ""),
    ("loader", "gpu", "H2D"),
]


def _anchor(box: tuple, toward: tuple) -> tuple[float, float]:
    x, y, w, h = box[:4]
    cx, cy = x + w / 2, y + h / 2
    tx, ty = toward[0] + toward[2] / 2, toward[1] + toward[3] / 2
    if abs(tx - cx) * h > abs(ty - cy) * w:  # leave by a side
        return (x + w if tx > cx else x), cy
    return cx, (y + h if ty > cy else y)


def draw(path: str) -> None:
    fig, ax = plt.subplots(figsize=(10.5, 6.2))
    for x, y, w, h, title, lines, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#333"))
        ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="top", fontsize=10, weight="bold")
        ax.text(x + w / 2, y + h - 0.6, "\n".join(lines), ha="center", va="top", fontsize=8.5)
    for a, b, label in ARROWS:
        start, end = _anchor(BOXES[a], BOXES[b]), _anchor(BOXES[b], BOXES[a])
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.4))
        if label:
            mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
            ax.text(mx, my + 0.12, label, ha="center", va="bottom", fontsize=8, style="italic")
    ax.set_xlim(0, 10.2)
    ax.set_ylim(-0.2, 5.8)
    ax.axis("off")
    ax.set_title("datastore: from the parallel filesystem to a GPU", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(os.path.join(os.path.dirname(os.path.abspath(__file__)), "architecture.png"))
