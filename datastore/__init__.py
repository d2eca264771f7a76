"""datastore: staging, in-memory sample store and loader for distributed deep learning on HPC."""

__version__ = "0.1.0"
__all__ = ["__version__"]
