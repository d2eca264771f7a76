"""The plots of ``benchmarks/report.py``: one function per figure, from one benchmark's results.

Each function takes the JSON document a benchmark wrote (:func:`common.write_results`: its
``results`` and ``command``, ``machine``, ``date``) and returns a matplotlib figure, or ``None``
when the run did not measure what the figure shows (a case left out, no GPU). Bars are medians
with min-max error bars over the repetitions; the command, machine and date are the caption.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

__all__ = ["block_reads", "gpu_feed", "loader_epochs", "service_clients", "staging", "training"]

OURS, PEER, OTHER, REFERENCE = "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f"


def new_figure(
    doc: dict[str, Any], panels: int = 1, width: float = 8.0, title: str = ""
) -> tuple[Figure, list]:
    """A figure of ``panels`` side by side: ``title`` on top, a row of room for
    :func:`legend` under it, and the run's command, machine and date as the caption."""
    fig, axes = plt.subplots(1, panels, figsize=(width, 5.0), squeeze=False)
    caption = f"{doc['command']}\n{doc['machine']}, {doc['date']}"
    lines = [ln for part in caption.split("\n") for ln in textwrap.wrap(part, 130)]
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=6.5, color="#444444", va="bottom")
    fig.suptitle(title, fontsize=11, y=0.985)
    fig.subplots_adjust(bottom=0.17 + 0.025 * len(lines), top=0.86, wspace=0.3)
    return fig, list(axes[0])


def legend(fig: Figure, ax: Axes, columns: int = 3, note: str = "") -> None:
    """The legend of ``ax``'s bars, then its lines, under the figure's title (never over a bar
    or a label), and ``note`` under it; the axes start below them."""
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(handles)), key=lambda i: not isinstance(handles[i], BarContainer))
    rows = -(-len(handles) // columns)
    fig.legend(
        [handles[i] for i in order], [labels[i] for i in order], loc="upper center",
        bbox_to_anchor=(0.5, 0.94), ncol=columns, fontsize=7.5, frameon=False,
    )  # fmt: skip
    below = 0.94 - 0.045 * rows
    if note:
        fig.text(0.5, below, note, ha="center", va="top", fontsize=7.5, color="#444444")
        below -= 0.04 * (note.count("\n") + 1)
    fig.subplots_adjust(top=below - 0.07)


def label(ax: Axes, x: float, y: float, text: str) -> None:
    """``text`` just above ``(x, y)`` (the top of an error bar), on a white ground drawn over
    the bars, error bars and reference lines, so that none of them hides it."""
    ax.annotate(
        text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
        fontsize=7, zorder=5, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"},
    )  # fmt: skip


def errors(stats: Sequence[dict[str, float] | None]) -> tuple[list[float], list[list[float]]]:
    """Medians and matplotlib's ``yerr`` (below, above) of :func:`common.stats` records."""
    med = [s["median"] if s else 0.0 for s in stats]
    below = [s["median"] - s["min"] if s else 0.0 for s in stats]
    above = [s["max"] - s["median"] if s else 0.0 for s in stats]
    return med, [below, above]


def rate(nbytes: float, seconds: dict[str, float] | None, scale: float = 1e9) -> dict | None:
    """Seconds (a stats record) as a rate ``nbytes / s / scale``: the slowest rep is the min."""
    if not seconds:
        return None
    return {
        "median": nbytes / seconds["median"] / scale,
        "min": nbytes / seconds["max"] / scale,
        "max": nbytes / seconds["min"] / scale,
    }


def bars(
    ax: Axes,
    groups: list[str],
    series: list[tuple[str, str, list[dict[str, float] | None]]],
    fmt: str = "{:.2f}",
) -> None:
    """Grouped bars: for each ``(name, colour, stats per group)`` one bar per group, with its
    min-max error bar and its median written above it."""
    width = 0.8 / len(series)
    for i, (name, colour, stats) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        keep = [j for j, s in enumerate(stats) if s]
        med, err = errors([stats[j] for j in keep])
        ax.bar([xs[j] for j in keep], med, width, yerr=err, capsize=3, color=colour, label=name)
        for j, m, hi in zip(keep, med, err[1], strict=True):
            label(ax, xs[j], m + hi, fmt.format(m))
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.margins(y=0.12)


# ----------------------------------------------------------------------------- the figures


def staging(doc: dict[str, Any]) -> Figure | None:
    """``datastore stage`` vs ``cp -r`` / ``cp`` / ``tar -xf``, cold cache, up to a final
    ``sync``: seconds per case, with the device floor where it was measured."""
    cases = doc["results"]["cases"]
    if not cases:
        return None
    title = "Staging vs the standard tools (ratio = peer time / ours)"
    fig, (ax,) = new_figure(doc, title=title)
    groups = [
        f"{key}: {c['title']}\n{c['files']} file{'s' * (c['files'] != 1)}, "
        f"{c['bytes'] / 2**20:.0f} MiB\nvs {c['peer_name']}: {c['ratio']:.2f}x"
        for key, c in cases.items()
    ]
    series = [
        ("datastore stage", OURS, [c["seconds"]["ours"] for c in cases.values()]),
        ("peer (cp -r, cp, tar -xf)", PEER, [c["seconds"]["peer"] for c in cases.values()]),
    ]
    if any(c["seconds"]["floor"] for c in cases.values()):
        floors = [c["seconds"]["floor"] for c in cases.values()]
        series.append(("device floor (benchmarks/floor.py)", REFERENCE, floors))
    bars(ax, groups, series, "{:.2f}")
    ax.set_ylabel("seconds, up to a final sync\n(lower is better)")
    legend(fig, ax)
    return fig


def loader_epochs(doc: dict[str, Any]) -> Figure | None:
    """``DataStoreLoader`` vs the fastest torch ``DataLoader`` reading from disk and from
    memory: GB/s per epoch, one panel per format. Dashed: one thread's ``numpy.copyto`` of
    256 MiB, measured at the start of the same run; a reference, not a ceiling: the loader
    copies 4 MiB samples into 32 MiB batch buffers (sizes the CPU caches help with) with one
    thread per core, so it can go faster."""
    res = doc["results"]
    runs = res["loader"]
    if not runs:
        return None
    title = "DataStoreLoader vs torch DataLoader, per epoch"
    fig, axes = new_figure(doc, len(runs), 5.0 * len(runs), title)
    phases = {"epoch1": "epoch 1, cold\n(ours: + preload)", "cold": "epochs >= 2\ncache dropped"}
    phases["warm"] = "epochs >= 2\nwarm cache"
    nbytes = res["epoch_bytes"]
    for ax, run in zip(axes, runs, strict=True):
        best = {(c["kind"], c["phase"]): c for c in run["compare"]}
        secs = run["seconds"]

        def peer(kind: str, phase: str, best: dict = best, secs: dict = secs) -> dict | None:
            c = best.get((kind, phase))
            return rate(nbytes, secs[c["peer"]][phase]) if c else None

        series = [
            ("DataStoreLoader", OURS, [rate(nbytes, secs["ours"][p]) for p in phases]),
            ("disk DataLoader (fastest)", PEER, [peer("disk", p) for p in phases]),
            ("in-memory DataLoader (fastest)", OTHER, [peer("memory", p) for p in phases]),
        ]
        bars(ax, list(phases.values()), series, "{:.1f}")
        memcpy = f"memcpy of 256 MiB, 1 thread, this run: {res['memcpy_gbps']:.1f} GB/s"
        ax.axhline(res["memcpy_gbps"], color=REFERENCE, ls="--", lw=1, label=memcpy)
        ax.set_ylabel("GB/s of samples delivered (higher is better)")
        ax.set_title(f"{run['format']}: {res['samples']} samples x 4 MiB", fontsize=10)
    note = (
        "memcpy is a reference, not a ceiling: the loader copies 4 MiB samples into 32 MiB "
        "batches, sizes the caches help with, one thread per core"
    )
    legend(fig, axes[0], 4, note)
    return fig


def block_reads(doc: dict[str, Any]) -> Figure | None:
    """Reading block 0 of a sample split into k along its depth (+halo): its time as a
    fraction of a full sample's read, per k and format, with the target's bound."""
    res = doc["results"]
    runs = res["blocks"]
    if not runs:
        return None
    title = f"Block 0 of a depth split into k (+halo {res['halo']}), warm cache (lower is better)"
    fig, (ax,) = new_figure(doc, title=title)
    ks = list(runs[0]["k"])
    series = []
    for i, run in enumerate(runs):
        full = run["full_seconds"]["median"]
        fractions = [
            {key: run["k"][k]["seconds"][key] / full for key in ("median", "min", "max")}
            for k in ks
        ]
        series.append((run["format"], (OURS, PEER, OTHER, REFERENCE)[i % 4], fractions))
    bars(ax, [f"k = {k}" for k in ks], series, "{:.3f}")
    bounds = [runs[0]["k"][k]["bound"] for k in ks]
    xs = range(len(ks))
    ax.hlines(bounds, [x - 0.4 for x in xs], [x + 0.4 for x in xs], "k", lw=2, label="target bound")
    ax.set_ylabel("block read time / full sample read time")
    legend(fig, ax, 4)
    return fig


def service_clients(doc: dict[str, Any]) -> Figure | None:
    """``datastore serve`` to n clients (the ranks of one job) over shared memory and gRPC,
    against the embedded loader and a bare gRPC stream: aggregate GB/s. Dashed: one thread's
    ``numpy.copyto`` of 256 MiB in the same run, a reference: the clients copy batch-sized
    pieces in several processes, so they can go faster."""
    res = doc["results"]
    found = {(d["kind"], d["clients"]): d["gbps"] for d in res["delivery"]}
    if not found:
        return None
    names = {
        "shm": ("service, shared memory", OURS),
        "inline": ("service, gRPC inline", OTHER),
        "embedded": ("embedded loader (each its own copy)", PEER),
        "bare": ("bare gRPC stream (ceiling of inline)", REFERENCE),
    }
    fig, (ax,) = new_figure(doc, title="Service delivery vs clients (higher is better)")
    clients = res["clients"]
    series = [
        (names[k][0], names[k][1], [found.get((k, n)) for n in clients])
        for k in res["kinds"]
        if k in names
    ]
    bars(ax, [f"{n} client{'s' * (n > 1)}" for n in clients], series, "{:.2f}")
    memcpy = f"memcpy of 256 MiB, 1 thread, this run: {res['memcpy_gbps']:.1f} GB/s"
    ax.axhline(res["memcpy_gbps"], color=REFERENCE, ls="--", lw=1, label=memcpy)
    ax.set_ylabel("aggregate GB/s delivered")
    note = "memcpy is a reference, not a ceiling: each client copies batch-sized pieces"
    legend(fig, ax, 3, note)
    return fig


def training(doc: dict[str, Any]) -> Figure | None:
    """CosmoFlow training steps fed by ``DataStoreLoader`` and by torch ``DataLoader``: the
    share of the step spent waiting for data, and the step time."""
    res = doc["results"]
    pipes = res["pipelines"]
    s = res["settings"]
    title = (
        f"CosmoFlow training steps ({s['side']}^3, batch {s['batch']}, width {s['width']}) "
        "by input pipeline"
    )
    fig, (wait, step) = new_figure(doc, 2, 10.0, title)
    names = list(pipes)
    labels = [
        n.replace("DataStoreLoader", "DataStore-\nLoader")
        .replace("DataLoader(num_workers=", "DataLoader\nworkers=")
        .rstrip(")")
        for n in names
    ]
    colours = [OURS if n == "DataStoreLoader" else PEER for n in names]
    for ax, key, scale, unit, fmt in (
        (wait, "wait_share", 100.0, "data-wait share of the step, %", "{:.1f}"),
        (step, "step_ms", 1.0, "median step time, ms", "{:.0f}"),
    ):
        stats = [{k: v * scale for k, v in pipes[n][key].items() if k != "values"} for n in names]
        med, err = errors(stats)
        ax.bar(range(len(names)), med, 0.6, yerr=err, capsize=3, color=colours)
        for x, m, hi in zip(range(len(names)), med, err[1], strict=True):
            label(ax, x, m + hi, fmt.format(m))
        ax.set_xticks(range(len(names)), labels, fontsize=8)
        ax.set_ylabel(f"{unit} (lower is better)")
        ax.margins(y=0.12)
    return fig


def gpu_feed(doc: dict[str, Any]) -> Figure | None:
    """CosmoFlow on one GPU: samples/s by input pipeline against the batch resident on the
    GPU, with the targets.

    ``None`` unless the feeds ran on a GPU.
    """
    res = doc["results"]
    feeds = {k: f for k, f in res["feeds"].items() if f["samples_per_s"]}
    if not res["cuda"] or "a" not in feeds:
        return None
    title = f"Feeding one GPU ({res['device']}); ratio to (a), targets dotted"
    fig, (ax,) = new_figure(doc, title=title)
    keys = list(feeds)
    med, err = errors([feeds[k]["samples_per_s"] for k in keys])
    colours = [REFERENCE if k == "a" else PEER if k.startswith("e") else OURS for k in keys]
    ax.bar(range(len(keys)), med, 0.6, yerr=err, capsize=3, color=colours)
    for x, k in enumerate(keys):
        ratio = feeds[k]["ratio_to_ceiling"]
        label(ax, x, med[x] + err[1][x], f"{med[x]:.0f}\n{ratio:.2f}x")
    ceiling = med[keys.index("a")]
    for target in sorted({f["target"] for f in feeds.values() if f["target"]}):
        ax.axhline(target * ceiling, color="k", ls=":", lw=1)
        ax.annotate(f"{target}x (a)", (-0.45, target * ceiling), va="top", fontsize=7)
    names = {
        "a": "resident\nbatch",
        "b": "embedded",
        "c": "service\nshm",
        "d": "service\nTCP",
        "e": "DataLoader",
    }
    ticks = [
        f"({f['case']}) {names[f['case']]}" + (f"\n{f['workers']} workers" if f["workers"] else "")
        for f in feeds.values()
    ]
    ax.set_xticks(range(len(keys)), ticks, fontsize=7)
    ax.set_ylabel("samples/s (higher is better)")
    ax.margins(y=0.2)
    return fig
