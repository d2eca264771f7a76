"""datastore: staging, in-memory sample store and loader for distributed deep learning on HPC."""

from typing import Any

from datastore._version import __version__

__all__ = ["DataStoreLoader", "__version__"]


def __getattr__(name: str) -> Any:
    # torch is imported only by those who ask for the loader, not by the CLI
    if name == "DataStoreLoader":
        from datastore.loader import DataStoreLoader

        return DataStoreLoader
    raise AttributeError(f"module 'datastore' has no attribute {name!r}")
