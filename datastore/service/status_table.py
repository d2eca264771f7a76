"""The reply of ``datastore status``: as plain JSON-able data, and as tables for people."""

from __future__ import annotations

import time
from typing import Any

from staging.progress import human_bytes

__all__ = ["format_status", "status_dict"]

DATASET_COLUMNS = [
    "path", "format", "samples", "bytes", "resident", "loading", "sessions", "hit rate",
]  # fmt: skip
SESSION_COLUMNS = [
    "job", "session", "world", "batch", "streams", "batches", "bytes", "rate", "stall",
]  # fmt: skip


def status_dict(reply: Any) -> dict[str, Any]:
    """A reply (``Status``) as plain JSON-able data: every field under its name in the
    protocol, defaults included, integers as integers (protobuf's ``MessageToDict`` writes the
    64-bit ones as strings). Nested messages become dicts, repeated fields lists."""

    def value(field: Any, v: Any) -> Any:
        return status_dict(v) if field.message_type is not None else v

    return {
        f.name: (
            [value(f, v) for v in getattr(reply, f.name)]
            if f.is_repeated
            else value(f, getattr(reply, f.name))
        )
        for f in reply.DESCRIPTOR.fields
    }


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` to the left, the others to the right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


def format_status(d: dict[str, Any], now: float | None = None) -> str:
    """The status (as :func:`status_dict` gives it) as tables for people.

    Args:
        d: the reply.
        now: the time throughputs are measured to (Unix seconds). Default: now.
    """
    now = time.time() if now is None else now
    budget = d["memory_budget"]
    rows = [
        ("service", f"datastore {d['version']}, pid {d['pid']}, up {d['uptime_s']:.1f} s"),
        ("listen", ", ".join(d["listen"]) or "-"),
        ("memory budget", human_bytes(budget) if budget else "no limit"),
        ("resident", human_bytes(d["bytes_resident"])),
        ("clients", str(d["clients"])),
        (
            "served",
            f"{d['batches_served']} batches, "
            f"{human_bytes(d['bytes_served'])}, {d['calls_served']} calls",
        ),
    ]
    if d["nodes"] > 1:
        store = f"node {d['node']} of {d['nodes']}, "
        rows.append(("store", store + f"{human_bytes(d['bytes_exchanged'])} fetched"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]

    lines += _section("datasets", DATASET_COLUMNS, [_dataset_row(x) for x in d["datasets"]])
    lines += [f"  {x['path']}: {x['load_error']}" for x in d["datasets"] if x["load_error"]]
    sessions = sorted(d["sessions"], key=lambda x: (x["job_id"], x["session_id"]))
    lines += _section("sessions", SESSION_COLUMNS, [_session_row(x, now) for x in sessions])
    return "\n".join(lines)


def _section(name: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A titled table, its rows counted (no header when there are none)."""
    return ["", f"{name} ({len(rows)})", *(_table(header, rows, left=2) if rows else [])]


def _dataset_row(x: dict[str, Any]) -> list[str]:
    """A resident dataset's row, its hit rate that of its store's reads."""
    reads = x["hits"] + x["misses"]
    return [
        x["path"],
        x["format"] or "-",
        str(x["num_samples"]),
        human_bytes(x["bytes_total"]),
        human_bytes(x["bytes_resident"]),
        "failed" if x["load_error"] else "yes" if x["loading"] else "no",
        str(x["sessions"]),
        f"{100 * x['hits'] / reads:.1f}%" if reads else "-",
    ]


def _session_row(x: dict[str, Any], now: float) -> list[str]:
    """A session's row, its rate the bytes served over the time since it opened."""
    seconds = now - x["opened_unix_s"]
    rate = f"{human_bytes(x['bytes_served'] / seconds)}/s" if seconds > 0 else "-"
    return [
        x["job_id"] or "-",
        x["session_id"][:12],
        str(x["world_size"]),
        str(x["global_batch"]),
        str(x["streams"]),
        str(x["batches_served"]),
        human_bytes(x["bytes_served"]),
        rate,
        f"{x['stall_s']:.2f} s",
    ]
