"""What a loader would see of a dataset, in either mode, without making a loader; and a
service asked to hold datasets before the loaders come."""

from __future__ import annotations

import os
from typing import Any

from datastore.readers import open_dataset
from datastore.readers.base import FieldInfo
from datastore.sources.options import ServiceOptions, check_options

__all__ = ["describe_dataset", "hold_datasets"]


def describe_dataset(
    dataset: Any,
    service: ServiceOptions | None = None,
    *,
    layout: str | None = None,
    timeout: float = 300.0,
) -> tuple[int, dict[str, FieldInfo]]:
    """``(samples, {name: FieldInfo})`` of ``dataset`` as ``DataStoreLoader(dataset,
    service=service, layout=layout)`` sees it: opened here, or asked of the service, which
    sees the whole store where this node may hold only its share (``datastore stage --mode
    shard``). Unlike the loader, no ``$DATASTORE_ADDRESS`` default: ``service=None`` opens the
    dataset here.

    Args:
        dataset: a path (on the service's node with ``service``) or a ``DatasetSpec``.
        service: the ``datastore serve`` to ask. Default: ``None`` (embedded).
        layout: for HDF5 files opened here (see ``DataStoreLoader``). Default: ``None``.
        timeout: seconds to wait for the service. Default: ``300``.

    Raises:
        DatasetNotFound, PathNotAllowed, ServiceUnavailable: see ``datastore.errors``.
        ValueError: ``layout`` with ``service``, or a dataset that cannot be read.
    """
    check_options("service", service, ServiceOptions)
    if service is None:
        with open_dataset(dataset, layout=layout) as ds:
            return len(ds), dict(ds.fields)
    if layout is not None:
        raise ValueError("layout= is for a dataset opened here: with service=, name a spec file")
    if not isinstance(dataset, str | os.PathLike):
        raise TypeError("with service=, the dataset is a path (on the service's node)")
    from datastore.service.client import Client

    with Client(
        service.address, token=service.token, timeout_s=timeout, tls_ca=service.tls_ca
    ) as client:
        return client.describe(os.path.abspath(os.fspath(dataset)))


def hold_datasets(paths: Any, service: ServiceOptions, *, timeout: float = 300.0) -> None:
    """Ask ``service`` to hold the datasets at ``paths`` in memory and wait until they are (at
    most ``timeout`` seconds each): loaders that then open sessions start on memory, and each
    sample is read from disk once. The first caller starts a load; the others wait for it.

    Raises:
        DatasetNotFound, PathNotAllowed, ServiceUnavailable: see ``datastore.errors``.
    """
    check_options("service", service, ServiceOptions)
    if service is None:
        raise ValueError("hold_datasets needs service=ServiceOptions(address)")
    from datastore.service.client import Client

    with Client(
        service.address, token=service.token, timeout_s=timeout, tls_ca=service.tls_ca
    ) as client:
        for path in paths:
            client.load(os.path.abspath(os.fspath(path)), wait=True)
