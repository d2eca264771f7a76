"""The gRPC peer link's own costs: what a service pays per byte it exchanges with its peers.

Each case runs in a fresh interpreter, since what it checks (the process's ``malloc``
settings) is process-wide.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Rounds of 8 chunk-sized buffers alive at once, written then freed (what a service does with
# the messages of the fetches in flight): the page faults per round after the first 3.
ROUNDS = """
import resource
from datastore.service.grpc_peers import CHUNK, GrpcPeers

def round():
    buffers = [bytearray(CHUNK) for _ in range(8)]
    for b in buffers:
        b[::4096] = b"x" * (CHUNK // 4096)

def page_faults():
    for _ in range(3):
        round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        round()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10

if {peers}:
    GrpcPeers(("127.0.0.1:1",), 0, "token")
print(page_faults())
"""
PAGES = 8 * 4 * 1024 * 1024 // 4096  # the pages of a round's buffers


def _page_faults(peers: bool) -> int:
    run = subprocess.run(
        [sys.executable, "-c", ROUNDS.format(peers=peers)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_peering_service_keeps_freed_message_memory():
    """Before: every round mapped its buffers afresh (a page fault per page, each page
    zeroed), half the receiving service's CPU per byte exchanged."""
    fresh = _page_faults(peers=False)
    assert fresh > PAGES // 2, f"{fresh} page faults of {PAGES} pages: the control measures none"
    kept = _page_faults(peers=True)
    assert kept < PAGES // 100, f"{kept} page faults of {PAGES} pages once peering over gRPC"
