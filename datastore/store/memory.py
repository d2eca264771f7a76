"""Sizes in bytes: ``"64G"`` as users write them, and the memory this process can still use."""

from __future__ import annotations

import math
import os

__all__ = ["available_memory", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: int | str, name: str = "size", least: int = 0) -> int:
    """``"64G"`` -> bytes (K, M, G, T: powers of 1024; ``"64GiB"``/``"64GB"`` alike; an int or
    a plain number: bytes), ``least`` or more. Raises ``ValueError`` naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes or a size like '64G', got {value!r}")
    unit = ""
    if isinstance(value, int):
        number = float(value)
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _UNITS else ""
        try:
            number = float(text[: len(text) - len(unit)]) * _UNITS[unit]
        except ValueError:
            raise ValueError(
                f"{name} must be bytes or a size like '512M' or '64G', got {value!r}"
            ) from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite size like '512M' or '64G', got {value!r}")
    if number < least:
        raise ValueError(f"{name} must be >= {least}, got {value!r}")
    if not unit and number != int(number):  # 1.5 was 1 byte: meant 1.5G?
        raise ValueError(f"{name} must be whole bytes or a size like '1.5G', got {value!r}")
    return int(number)


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's ``MemAvailable``, capped by a
    cgroup limit; ``DATASTORE_MEMORY_AVAILABLE`` overrides (e.g. for tests). ``None``:
    unknown."""
    override = os.environ.get("DATASTORE_MEMORY_AVAILABLE")
    if override:
        return parse_size(override, "DATASTORE_MEMORY_AVAILABLE")
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
