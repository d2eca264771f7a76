"""The package version, apart from ``datastore/__init__`` so that the service can name it
without depending on the loader's front end (``tests/test_structure.py``)."""

__version__ = "0.1.0"
