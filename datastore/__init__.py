"""datastore: staging, in-memory sample store and loader for distributed deep learning on HPC."""

from typing import Any

from datastore._version import __version__

__all__ = [
    "DataStoreLoader",
    "DatasetSpec",
    "ExchangeOptions",
    "ServiceOptions",
    "StoreOptions",
    "__version__",
    "describe_dataset",
]

_OPTIONS = ("ExchangeOptions", "ServiceOptions", "StoreOptions")


def __getattr__(name: str) -> Any:
    # torch is imported only by those who ask for the loader, not by the CLI
    if name == "DataStoreLoader":
        from datastore.loader import DataStoreLoader

        return DataStoreLoader
    if name in _OPTIONS:
        from datastore.sources import options

        return getattr(options, name)
    if name == "DatasetSpec":
        from datastore.readers import DatasetSpec

        return DatasetSpec
    if name == "describe_dataset":
        from datastore.sources.describe import describe_dataset

        return describe_dataset
    raise AttributeError(f"module 'datastore' has no attribute {name!r}")
