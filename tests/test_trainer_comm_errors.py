"""A gloo transfer of ``trainer.comm`` that fails is one line: a peer killed mid-run left its
neighbour with gloo's ``RuntimeError`` and a 40-line traceback (``Read error ... Connection
reset by peer``) from the halo's backward; a stalled one, ``Timed out waiting 30000ms``. Now
``PeerFailed`` and ``ExchangeTimeout`` (``DataStoreError``s: ``trainer: ...``, exit 1)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket

import pytest
import torch
import torch.distributed as dist

from datastore.errors import ExchangeTimeout, PeerFailed
from trainer import comm
from trainer.grid import init_distributed

TIMEOUT = datetime.timedelta(seconds=30)
RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:39347: Connection reset by peer."
)


class Work:
    """A gloo work whose wait raises ``error``."""

    def __init__(self, error: str) -> None:
        self.error = error

    def wait(self, timeout: datetime.timedelta) -> None:
        raise RuntimeError(self.error)


def test_a_closed_connection_is_a_peer_failed():
    with pytest.raises(PeerFailed) as got:
        comm.Pending([Work(RESET)], False, TIMEOUT, kind="all_reduce").wait()
    assert str(got.value) == (
        "the trainer's all_reduce over gloo lost its connection to a peer rank: it exited or "
        f"failed ({RESET})"
    )


def test_a_wait_past_the_timeout_is_an_exchange_timeout():
    late = "[.../unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation to complete"
    with pytest.raises(ExchangeTimeout) as got:
        comm.Pending([Work(late)], False, TIMEOUT).wait()
    assert str(got.value) == (
        "the trainer's exchange over gloo did not complete within comm_timeout (30 s): a peer "
        f"rank stalled or failed ({late})"
    )


def test_other_errors_stay_as_they_are():
    with pytest.raises(RuntimeError) as got:
        comm.Pending([Work("op.preamble.length <= op.nbytes")], False, TIMEOUT).wait()
    assert type(got.value) is RuntimeError and str(got.value) == "op.preamble.length <= op.nbytes"


def _rank(rank: int, port: int, results) -> None:
    """Rank 1 exits once the group is up; rank 0's halo-style exchange with it must fail."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    t = torch.zeros(4)
    try:
        for _ in range(50):  # until the closed connection shows, at posting or waiting
            comm.exchange([(1, t, 0)], [(1, torch.empty(4), 0)], None, TIMEOUT)
        results.put("no error")
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
    os._exit(0)


def test_a_peer_that_exited_fails_an_exchange_with_one_line():
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:  # a hang fails this test, not the suite
        p.join(30)
        if p.is_alive():
            p.kill()
    got = results.get() if not results.empty() else "rank 0 ended without an answer"
    assert got.startswith(
        "PeerFailed: the trainer's exchange over gloo lost its connection to a peer rank: it "
        "exited or failed ("
    ), got


def test_a_rank_that_never_joins_the_group_is_a_timeout_naming_comm_timeout(monkeypatch):
    """Rank 1 killed while the ranks started: rank 0 raised ``DistStoreError`` with a
    traceback from ``init_process_group`` after comm_timeout (30 s under torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in {**env, "GLOO_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ExchangeTimeout) as got:
        init_distributed("gloo", timeout=datetime.timedelta(seconds=1), env=env)
    assert str(got.value).startswith(
        "the process group of 2 ranks did not form within comm_timeout (1 s) at env://: a rank "
        "did not start, or died (Timed out after "
    ), str(got.value)
    assert not dist.is_initialized()
