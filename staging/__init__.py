"""Verified, resumable, MPI-parallel staging from a parallel filesystem to node-local storage."""
