"""The gRPC peer link's own costs: what a service pays per byte it exchanges with its peers.

Each case runs in a fresh interpreter, since what it checks (the process's ``malloc``
settings) is process-wide.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from datastore.maths.subarray import view
from datastore.service.grpc_answer import PeersServicer, add_peers_to_server
from datastore.service.grpc_peers import GrpcPeers, _as_bytes, _Filler
from datastore.service.peer_link import Pieces
from datastore.service.peer_stats import STATS_ENV, read_stats

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


def _strided_targets(rng):
    """A few C-contiguous arrays and boxes in them (some strided), as a fetch's targets."""
    out = []
    for _ in range(rng.integers(1, 4)):
        shape = tuple(int(n) for n in rng.integers(1, 7, size=rng.integers(1, 4)))
        array = np.full(shape, -1.0, np.float32)
        box = tuple(slice(int(lo), int(lo) + int(rng.integers(1, n - lo + 1)))
                    for lo, n in ((int(rng.integers(0, n)), n) for n in shape))  # fmt: skip
        out.append((array, box) if rng.random() < 0.7 else array.reshape(-1).view(np.uint8))
    return out


def test_a_reply_cut_anywhere_lands_in_place_in_c_order():
    """A reply's bytes, in chunks cut anywhere, land in the targets' parts (strided ones
    included) as one copy in C order would put them, and nothing outside the parts changes."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        targets = _strided_targets(rng)
        arrays = [t[0] if isinstance(t, tuple) else t for t in targets]
        expected = [a.copy() for a in arrays]
        total = sum(view(*t).nbytes if isinstance(t, tuple) else t.nbytes for t in targets)
        data = rng.integers(0, 256, size=total, dtype=np.uint8)
        at = 0
        for t, e in zip(targets, expected, strict=True):
            part = view(e, t[1]) if isinstance(t, tuple) else e
            part[...] = data[at : at + part.nbytes].view(part.dtype).reshape(part.shape)
            at += part.nbytes
        filler = _Filler([_as_bytes(t) for t in targets])
        cuts = sorted(rng.integers(0, total + 1, size=rng.integers(0, 5)).tolist())
        for a, b in zip([0, *cuts], [*cuts, total], strict=True):
            assert filler.put(data[a:b])
        assert filler.at == total and not filler.put(np.zeros(1, np.uint8))
        for got, e in zip(arrays, expected, strict=True):
            assert np.array_equal(got.view(np.uint8), e.view(np.uint8))


def test_a_fetch_of_pieces_lands_amid_the_halo_straight_from_the_owners_store(
    tmp_path, monkeypatch
):
    """A real ``Peers`` server answering from a stored sample: the asker's ``pieces`` reach
    the owner (which then packs nothing), the part inside the volume lands in place in the
    batch slot, the link zeroes the halo around it (the rest of the sample's box, not the other
    sample's), and the fetch's legs (asked to first chunk, to
    last byte) are in the peer stats (before: the flag was not sent, so the owner packed whole
    boxes, a part amid its halo was refused as a target, and the legs were zero)."""
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats{node}.jsonl"))
    stored = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
    inside = (slice(1, 4), slice(0, 6), slice(2, 5))  # the block's part inside the volume
    asked = []

    def answer(request):
        asked.append(request)
        return Pieces([(stored, inside)])

    server = grpc.server(ThreadPoolExecutor(2))
    add_peers_to_server(PeersServicer(1, 2, answer, lambda s: None), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    link = GrpcPeers(("127.0.0.1:9", f"127.0.0.1:{port}"), 0, "token", timeout_s=10)
    try:
        slot = np.full((2, 5, 8, 5), -1.0, np.float32)  # two samples' boxes, halo included
        amid = (slice(1, 4), slice(1, 7), slice(0, 3))
        request = {"path": "d", "samples": [3], "fields": ["data"], "spatial": None}
        link.fetch(1, {**request, "block": 0, "pieces": True}, [(slot[1], amid)])
    finally:
        link.close(stop_all=False)
        server.stop(None)
    assert [r["pieces"] for r in asked] == [True]
    stats = read_stats(str(tmp_path / "stats0.jsonl"))
    assert stats["bytes"] == stored[inside].nbytes and stats["fetches"] == [[stored[inside].nbytes]]
    ((to_first, to_last),) = stats["legs"]
    assert to_first > 0 and to_last >= 0, stats["legs"]
    want = np.full_like(slot, -1.0)
    want[1] = 0
    want[1][amid] = stored[inside]
    assert np.array_equal(slot, want)
