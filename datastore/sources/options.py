"""The settings of each source of ``DataStoreLoader``: small frozen objects, checked when made.

- :class:`StoreOptions`: the embedded store (this rank's samples in memory, or spilled).
- :class:`ExchangeOptions`: the exchange between ranks that hold the dataset once between them.
- :class:`ServiceOptions`: ``datastore serve`` streams the batches instead.

A bad field raises ``ValueError`` (``TypeError`` for a wrong type) naming the object and the
field, e.g. ``StoreOptions.preload must be True or False, got 'no'``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from datastore.service.paths import named_address
from datastore.store.memory import parse_size

__all__ = [
    "ExchangeOptions", "ServiceOptions", "StoreOptions", "check_options", "moved_keywords",
    "service_of",
]  # fmt: skip


def _flag(owner: str, name: str, value: Any, none: bool = False) -> None:
    if value is None and none:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if none else "True or False"
        raise ValueError(f"{owner}.{name} must be {allowed}, got {value!r}")


def _text(owner: str, name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a string or None, got {value!r}")


@dataclass(frozen=True)
class StoreOptions:
    """The embedded store's settings (local reads or an exchange; refused with a service).

    Args:
        preload: read the rank's samples when the loader is made, not on first use.
            Default: ``True``.
        memory_budget: RAM for the store, in bytes or as ``"64G"``; beyond it samples spill to
            ``spill_dir`` or are re-read (``0``: every sample, never "no limit"). Default:
            ``None`` (no limit; a dataset larger than the memory available is refused before
            reading).
        spill_dir: where the store spills: a directory, made if its parent exists.
            Default: ``None``.
    """

    preload: bool = True
    memory_budget: int | str | None = None
    spill_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        _flag("StoreOptions", "preload", self.preload)
        if self.memory_budget is not None:
            budget = parse_size(self.memory_budget, "StoreOptions.memory_budget")
            object.__setattr__(self, "memory_budget", budget)
        spill = self.spill_dir
        if spill is not None and not isinstance(spill, str | os.PathLike):
            raise TypeError(f"StoreOptions.spill_dir must be a path or None, got {spill!r}")
        if spill is not None and os.path.exists(spill) and not os.path.isdir(spill):
            raise ValueError(f"StoreOptions.spill_dir {os.fspath(spill)!r} is not a directory")
        parent = os.path.dirname(os.path.abspath(spill)) if spill is not None else ""
        if spill is not None and not os.path.isdir(parent):  # (a typo would fill another disk)
            raise ValueError(
                f"StoreOptions.spill_dir {os.fspath(spill)!r}: its parent {parent!r} is not a "
                "directory (the spill directory is made, its parents are not)"
            )


@dataclass(frozen=True)
class ExchangeOptions:
    """The exchange's settings: the ranks hold the dataset once between them.

    Args:
        enabled: force (``True``) or forbid (``False``) the exchange. Default: ``None``
            (automatic: with more than one rank under MPI or ``torch.distributed``).
        comm: an mpi4py communicator to exchange over. Default: ``COMM_WORLD`` under MPI.
        group: a ``torch.distributed`` group to exchange over when there is no MPI
            (torchrun). Default: the default group, when initialized.
    """

    enabled: bool | None = None
    comm: Any = None
    group: Any = None

    def __post_init__(self) -> None:
        _flag("ExchangeOptions", "enabled", self.enabled, none=True)
        if self.enabled is False and (self.comm is not None or self.group is not None):
            raise ValueError("ExchangeOptions(enabled=False) takes no comm or group")


@dataclass(frozen=True)
class ServiceOptions:
    """Stream the batches from ``datastore serve``.

    Args:
        address: the service's Unix socket (``unix://PATH``) or ``HOST:PORT``.
        token: the TCP token (``datastore token``). Default: ``None``.
        transport: ``"auto"`` (shared memory over a Unix socket, else in the messages),
            ``"shm"`` or ``"inline"``. Default: ``"auto"``.
        job_id: the job's name in ``datastore status``. Default: the launcher's job id.
        tls_ca: the CA certificate of a service with TLS. Default: ``None``.
    """

    address: str
    token: str | None = None
    transport: str = "auto"
    job_id: str = ""
    tls_ca: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(
                f"ServiceOptions.address must be 'unix://PATH' or 'HOST:PORT', got {self.address!r}"
            )
        _text("ServiceOptions", "token", self.token)
        from datastore.service.client import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"ServiceOptions.transport must be one of {', '.join(TRANSPORTS)}, got "
                f"{self.transport!r}"
            )
        if not isinstance(self.job_id, str):
            raise TypeError(f"ServiceOptions.job_id must be a string, got {self.job_id!r}")
        if self.tls_ca is not None and not isinstance(self.tls_ca, str | os.PathLike):
            raise TypeError(f"ServiceOptions.tls_ca must be a path or None, got {self.tls_ca!r}")


def service_of(
    service: ServiceOptions | None, env: dict[str, str] | None = None
) -> ServiceOptions | None:
    """The service a loader streams from: ``service``, else one at ``$DATASTORE_ADDRESS``;
    ``None``: the embedded store."""
    if service is not None:
        return service
    address = named_address(None, env)
    return ServiceOptions(address) if address is not None else None


def check_options(name: str, value: Any, cls: type) -> None:
    """Refuse, naming the argument, a settings object of the wrong class."""
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name}= takes {cls.__name__}(...) or None, got {value!r}")


# the keywords DataStoreLoader took before its settings objects (issue 24), and their new home
MOVED = {
    **{k: ("store", StoreOptions) for k in ("preload", "memory_budget", "spill_dir")},
    **{k: ("exchange", ExchangeOptions) for k in ("comm", "group")},
    **{
        k: ("service", ServiceOptions)
        for k in ("address", "token", "transport", "job_id", "tls_ca")
    },
}


# torch DataLoader's keywords that DataStoreLoader does not take, and what does their job
TORCH_KEYWORDS = {
    "collate_fn": "here collate= (what iteration yields) or transform= (per batch)",
    "num_workers": "here a thread prefetches (prefetch=), threads= copying each batch",
    "prefetch_factor": "here prefetch= (batches ready ahead)",
    "persistent_workers": "here the store lasts across epochs (nothing to set)",
    "worker_init_fn": "there are no workers: transform= runs in the iterating thread",
    "sampler": "here the loader orders the samples: shuffle=, seed=, rank=, world=",
    "batch_sampler": "here the loader orders the samples: shuffle=, seed=, rank=, world=",
    "generator": "here seed= (the order is a function of seed and epoch)",
    "pin_memory_device": "here device= (batches copied to it from pinned memory)",
    "multiprocessing_context": "there are no worker processes",
    "in_order": "batches always come in order",
}


def moved_keywords(names: list[str]) -> str:
    """Why ``DataStoreLoader`` refuses these keywords: where each moved, what does the job of
    torch's ``DataLoader`` keywords, or that it is unknown."""
    parts = []
    for name in names:
        if name in MOVED:
            arg, cls = MOVED[name]
            parts.append(f"{name}= is now {arg}={cls.__name__}({name}=...)")
        elif name in TORCH_KEYWORDS:
            parts.append(f"{name}= is torch DataLoader's: {TORCH_KEYWORDS[name]}")
        else:
            parts.append(f"{name}= is not an argument")
    return "DataStoreLoader: " + "; ".join(parts)
