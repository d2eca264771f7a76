"""``datastore serve`` through a campaign: concurrent jobs, dead clients, restarts, eviction,
hostile requests, metrics, and the ``status`` / ``load`` / ``unload`` commands.

Every service is a real ``python -m datastore serve`` subprocess (``test_service_basic``'s
``Server``), with ``XDG_RUNTIME_DIR`` and ``XDG_STATE_HOME`` in ``tmp_path``; every job is a
``DataStoreLoader(service=ServiceOptions(...))``, here or in a child process that prints a hash
per batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
from pathlib import Path

import grpc
import h5py
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from datastore.errors import DataStoreError
from datastore.loader import DataStoreLoader
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.client import (
    Client,
    RemoteBatches,
    open_channel,
    stream_batches,
    target_of,
)
from datastore.service.config import ServeConfig
from datastore.service.session import MAX_GLOBAL_BATCH
from datastore.service.shm import MEMORY_FS, filesystem_of
from datastore.service.status_table import format_status, status_dict
from datastore.sources.options import ExchangeOptions, ServiceOptions
from tests.test_service_basic import REPO, Server, cli, wait_serving

SAMPLES = 48  # 12 steps of 4: more than a shared-memory stream's slots
SAMPLE_BYTES = 2 * 6 * 6 * 6 * 4 + 8  # "x" (2, 6, 6, 6) float32 and "idx" int64

# A job in a child process: hashes of its batches, one line each ("batch STEP HASH"); then
# "done" and it waits for a line on stdin before closing its session. Args: dataset, socket,
# job id, transport, seconds to sleep after each batch, epochs.
JOB = textwrap.dedent(
    """
    import hashlib, sys, time
    from datastore import DataStoreLoader, ServiceOptions
    from datastore.errors import DataStoreError
    path, sock, job, transport, pause, epochs = sys.argv[1:7]
    service = ServiceOptions(sock, transport=transport, job_id=job)
    r = DataStoreLoader(path, batch_size=4, seed=3, service=service)
    print("opened", r.session_id, flush=True)
    try:
        for epoch in range(int(epochs)):
            r.set_epoch(epoch)
            for i, b in enumerate(r):
                h = hashlib.sha256()
                for k in sorted(b):
                    h.update(k.encode() + b[k].numpy().tobytes())
                print("batch", epoch, i, h.hexdigest(), flush=True)
                time.sleep(float(pause))
    except DataStoreError as exc:
        print("error", type(exc).__name__, flush=True)
        sys.exit(3)
    print("done", flush=True)
    sys.stdin.readline()
    r.close()
    """
)


def make_dataset(path: Path, seed: int = 0, n: int = SAMPLES) -> Path:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((n, 2, 6, 6, 6)).astype(np.float32)
        f["idx"] = np.arange(n, dtype=np.int64)
    return path


def digest(batch: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode() + batch[k].numpy().tobytes())
    return h.hexdigest()


def embedded_hashes(path: Path, epochs: int = 1) -> list[tuple[int, int, str]]:
    """``(epoch, step, hash)`` of the embedded loader's batches: what every job must get."""
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False)
    )
    try:
        out = []
        for epoch in range(epochs):
            local.set_epoch(epoch)
            out += [(epoch, i, digest(b)) for i, b in enumerate(local)]
        return out
    finally:
        local.close()


class Job:
    """A ``JOB`` child process."""

    def __init__(self, path, sock, job, transport="auto", pause=0.0, epochs=1) -> None:
        args = [str(path), str(sock), job, transport, str(pause), str(epochs)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", JOB, *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.session_id = ""  # once read: "opened SESSION" is the child's first line
        self.batches: list[tuple[int, int, str]] = []

    def read_until(self, word: str) -> str:
        """Lines up to one starting with ``word`` (batches recorded); that line."""
        while line := self.proc.stdout.readline():
            if line.startswith("opened "):
                self.session_id = line.split()[1]
            if line.startswith("batch "):
                _, epoch, step, h = line.split()
                self.batches.append((int(epoch), int(step), h))
            if line.startswith(word):
                return line.strip()
        raise AssertionError(f"job ended (exit {self.proc.wait(10)}) before {word!r}")

    def finish(self) -> int:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
        return self.proc.wait(20)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def env(tmp_path, short_tmp):
    return {
        **os.environ,
        "XDG_RUNTIME_DIR": str(short_tmp),  # never the real default directory; a short path
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }


@pytest.fixture
def start(tmp_path, env):
    """``start(*args)``: a serving ``datastore serve`` subprocess, killed at teardown."""
    started: list[Server] = []

    def _start(*args: str) -> Server:
        s = Server(tmp_path / "logs", list(args), env)
        started.append(s)
        wait_serving(s.listening(30)[0], s.proc, timeout=30)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)


@pytest.fixture
def jobs():
    """Every ``Job`` made through ``jobs(...)``, killed at teardown."""
    made: list[Job] = []

    def _job(*args, **kw) -> Job:
        made.append(Job(*args, **kw))
        return made[-1]

    yield _job
    for j in made:
        j.kill()


def status(sock: Path) -> pb.StatusResponse:
    with grpc.insecure_channel(target_of(sock)) as ch:
        return pb_grpc.DataStoreStub(ch).Status(pb.StatusRequest(), timeout=10)


def segments(pid: int, where: Path = Path("/dev/shm")) -> list[Path]:
    return sorted(where.glob(f"datastore.{os.getuid()}.{pid}.*"))


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return got


# -- `datastore status` as a table ------------------------------------------------------------
def constructed_status() -> pb.StatusResponse:
    return pb.StatusResponse(
        version="1.2.3",
        pid=4242,
        uptime_s=12.5,
        listen=["unix:///run/x/datastore.sock"],
        datasets=[
            pb.DatasetStatus(
                path="/l/ssd/train.h5",
                format="hdf5",
                num_samples=1000,
                bytes_total=3 << 30,
                bytes_resident=1 << 30,
                sessions=2,
                loading=True,
                hits=300,
                misses=100,
            ),
            pb.DatasetStatus(path="/l/ssd/val.h5", format="npy", num_samples=10, bytes_total=10),
        ],
        sessions=[
            pb.SessionStatus(
                session_id="f" * 32,
                dataset_path="/l/ssd/train.h5",
                job_id="job-7",
                world_size=8,
                global_batch=64,
                clients=3,
                streams=3,
                batches_served=120,
                bytes_served=10 << 20,
                opened_unix_s=1000.0,
                stall_s=1.25,
            ),
            pb.SessionStatus(session_id="a" * 32, world_size=1, global_batch=4),
        ],
        clients=3,
        batches_served=120,
        bytes_served=10 << 20,
        calls_served=99,
        memory_budget=4 << 30,
        bytes_resident=1 << 30,
    )


def test_status_table_from_a_constructed_reply():
    text = format_status(status_dict(constructed_status()), now=1005.0)
    lines = text.splitlines()
    row = {ln.split("  ")[0].strip(): ln for ln in lines}
    assert "pid 4242" in row["service"] and "unix:///run/x/datastore.sock" in row["listen"]
    assert row["memory budget"].endswith("4.0 GiB") and row["resident"].endswith("1.0 GiB")
    assert row["clients"].split()[-1] == "3"
    assert "120 batches, 10.0 MiB, 99 calls" in row["served"]

    i = lines.index("datasets (2)")
    header = lines[i + 1].split()
    assert header == [
        "path",
        "format",
        "samples",
        "bytes",
        "resident",
        "loading",
        "sessions",
        "hit",
        "rate",
    ]
    train = lines[i + 2].split()
    assert train == [
        "/l/ssd/train.h5",
        "hdf5",
        "1000",
        "3.0",
        "GiB",
        "1.0",
        "GiB",
        "yes",
        "2",
        "75.0%",
    ]
    assert lines[i + 3].split() == [
        "/l/ssd/val.h5",
        "npy",
        "10",
        "10",
        "B",
        "0",
        "B",
        "no",
        "0",
        "-",
    ]
    # the columns line up: every cell of a column ends (right-aligned) or starts at one place
    assert lines[i + 1].index("samples") + len("samples") == lines[i + 2].index("1000") + 4

    j = lines.index("sessions (2)")
    assert lines[j + 1].split() == [
        "job",
        "session",
        "world",
        "batch",
        "streams",
        "batches",
        "bytes",
        "rate",
        "stall",
    ]
    by_job = {ln.split()[0]: ln.split() for ln in lines[j + 2 : j + 4]}
    # throughput: 10 MiB served over the 5 s since the session opened
    assert by_job["job-7"] == f"job-7 {'f' * 12} 8 64 3 120 10.0 MiB 2.0 MiB/s 1.25 s".split()
    assert by_job["-"][:7] == ["-", "a" * 12, "1", "4", "0", "0", "0"]


def test_load_and_unload_when_nothing_listens(tmp_path, env):
    for args in (["load", "/d.h5", "--wait"], ["unload", "/d.h5"]):
        r = cli(*args, "--socket", str(tmp_path / "none.sock"), "--timeout", "2", env=env)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and f"datastore {args[0]}: no service answers" in r.stderr


def test_status_table_when_empty():
    text = format_status(status_dict(pb.StatusResponse(version="1", pid=1)), now=0.0)
    assert "memory budget  no limit" in text
    assert "datasets (0)" in text and "sessions (0)" in text
    assert text.splitlines()[-1] == "sessions (0)"


# -- a campaign on one service ----------------------------------------------------------------
def test_two_jobs_share_one_resident_copy_and_get_the_embedded_batches(start, tmp_path, jobs, env):
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    start("--socket", str(sock))
    a = jobs(path, sock, "job-a", "shm")
    b = jobs(path, sock, "job-b", "inline")
    a.read_until("done")
    b.read_until("done")
    expected = embedded_hashes(path)
    assert a.batches == expected and b.batches == expected

    st = status(sock)  # both sessions still open
    assert len(st.datasets) == 1
    ds = st.datasets[0]
    assert ds.path == str(path) and ds.sessions == 2 and ds.num_samples == SAMPLES
    assert ds.bytes_total == SAMPLES * SAMPLE_BYTES
    assert {(x.job_id, x.session_id) for x in st.sessions} == {
        ("job-a", a.session_id),
        ("job-b", b.session_id),
    }
    # over shared memory an epoch's last batch asks for the next epoch's first ``prefetch``
    # (2) batches, sent ahead
    served = {x.job_id: x.batches_served for x in st.sessions}
    assert served == {"job-a": len(expected) + 2, "job-b": len(expected)}
    assert all(x.dataset_path == str(path) for x in st.sessions)
    table = cli("status", "--socket", str(sock), env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "sessions (2)" in lines and "datasets (1)" in lines
    assert {ln.split()[0] for ln in lines[lines.index("sessions (2)") + 2 :]} == {"job-a", "job-b"}
    row = lines[lines.index("datasets (1)") + 2].split()
    assert row[0] == str(path) and row[-2] == "2"  # sessions
    assert a.finish() == 0 and b.finish() == 0
    st = status(sock)
    assert not st.sessions and st.datasets[0].sessions == 0  # resident for the next job


def test_killed_client_ends_and_the_other_job_streams_on(start, tmp_path, jobs):
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--session-idle", "2")
    steady = jobs(path, sock, "steady", "inline", pause=0.1, epochs=5)
    doomed = jobs(path, sock, "doomed", "shm", pause=60)
    doomed.read_until("batch")
    steady.read_until("batch")
    doomed.kill()

    def streams_of_doomed() -> int | None:
        by_id = {x.session_id: x.streams for x in status(sock).sessions}
        return by_id.get(doomed.session_id)

    # its stream and session end with its process (not after --session-idle)
    until(lambda: streams_of_doomed() is None, 6, "the dead client's session closed")
    st = status(sock)
    assert [x.job_id for x in st.sessions] == ["steady"]
    assert steady.proc.poll() is None  # still streaming
    ended = [x["session"] for x in s.logs() if x["event"] == "session_client_ended"]
    assert ended == [doomed.session_id]
    assert not [x for x in s.logs() if x["event"] == "session_expired"]
    assert segments(s.proc.pid) == []  # the dead client's segment went with its stream

    assert steady.read_until("done") == "done"
    assert steady.batches == embedded_hashes(path, epochs=5)  # undisturbed
    st = status(sock)  # steady's stream ended; its session stays open until it closes
    assert st.clients == 1 and [x.streams for x in st.sessions] == [0]
    assert steady.finish() == 0
    assert status(sock).clients == 0
    assert s.proc.poll() is None


def test_a_loader_whose_session_expired_reopens_and_carries_on(start, tmp_path):
    """Between epochs the service closes the idle session; the next epoch reopens it and gets
    the same batches, and the old session's mappings are dropped, not leaked."""
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--session-idle", "1")
    loader = DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock), transport="shm")
    )
    try:
        got = [(0, i, digest(b)) for i, b in enumerate(loader)]
        first, old_maps = loader._source.session_id, loader._source._maps
        until(lambda: not status(sock).sessions, 6, "the idle session closed")
        loader.set_epoch(1)
        got += [(1, i, digest(b)) for i, b in enumerate(loader)]
        assert loader._source.session_id != first and loader._source._maps is not old_maps
        assert old_maps._maps == {}  # the old session's mappings were dropped
    finally:
        loader.close()
    assert got == embedded_hashes(path, epochs=2)
    assert [x["event"] for x in s.logs()].count("session_expired") == 1


def test_a_loader_whose_dataset_grew_while_its_session_was_closed_raises(start, tmp_path):
    """The service closed the idle session (or restarted) and the dataset grew from 32 to 48
    samples meanwhile: the reopened session streamed the 48-sample permutation's first 8
    steps where the loader's 8 steps of 32 were due (9 new samples in, 9 old ones lost,
    silently). Reopening is now refused naming both counts."""
    data = tmp_path / "grow"
    data.mkdir()
    for i in range(32):
        np.save(data / f"{i:02d}.npy", np.full(3, i, np.float32))
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--session-idle", "1")
    loader = DataStoreLoader(str(data), batch_size=4, seed=3, service=ServiceOptions(str(sock)))
    try:
        assert sorted(int(v) for b in loader for v in b["data"][:, 0]) == list(range(32))
        until(lambda: not status(sock).sessions, 6, "the idle session closed")
        for i in range(32, 48):
            np.save(data / f"{i:02d}.npy", np.full(3, i, np.float32))
        loader.set_epoch(1)
        with pytest.raises(DataStoreError, match="32 samples when the loader was made, 48 now"):
            list(loader)
    finally:
        loader.close()


def test_sigterm_with_open_streams_exits_cleanly(start, tmp_path, jobs):
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--grace", "1")
    # shared memory: a paused client holds its slots, so its stream stays open
    streaming = [jobs(path, sock, f"job-{i}", "shm", pause=0.2, epochs=100) for i in range(2)]
    for j in streaming:
        j.read_until("batch")
    # a stream ends once its last batch is sent: between epochs a job has none for a moment
    until(lambda: status(sock).clients == 2, 10, "both jobs streaming")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0  # not held by the open streams (100 epochs each)
    assert not sock.exists() and segments(s.proc.pid) == []
    assert s.logs()[-1]["event"] == "stopped"
    for j in streaming:  # an error, not a hang
        assert j.proc.wait(15) == 3
        assert j.proc.stdout.read().splitlines()[-1].split()[0] == "error"


def test_restart_reloads_what_was_resident_until_unloaded(start, tmp_path, env):
    path = make_dataset(tmp_path / "data.h5")
    sock, state = tmp_path / "s.sock", tmp_path / "state.json"
    s = start("--socket", str(sock), "--state-file", str(state))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))) as r:
        assert len([1 for _ in r]) == SAMPLES // 4
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0
    assert json.loads(state.read_text()) == {"resident": [[str(path), str(path)]]}

    s = start("--socket", str(sock), "--state-file", str(state))
    st = status(sock)  # no client asked for it
    assert [x.path for x in st.datasets] == [str(path)] and not st.sessions
    assert any(x["event"] == "reloading" for x in s.logs())
    loaded = cli("load", str(path), "--wait", "--socket", str(sock), env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert f"{path}: resident" in loaded.stdout
    assert status(sock).datasets[0].bytes_resident == SAMPLES * SAMPLE_BYTES

    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))):
        busy = cli("unload", str(path), "--socket", str(sock), env=env)
        assert busy.returncode == 1 and busy.stdout == ""
        assert busy.stderr.count("\n") == 1
        assert "refused: FAILED_PRECONDITION" in busy.stderr
        assert "used by 1 open session" in busy.stderr
    table = cli("status", "--socket", str(sock), env=env)
    assert table.returncode == 0 and str(path) in table.stdout and "100.0%" not in table.stdout
    gone = cli("unload", str(path), "--socket", str(sock), env=env)
    assert gone.returncode == 0, gone.stderr
    assert "unloaded" in gone.stdout and not status(sock).datasets
    again = cli("unload", str(path), "--socket", str(sock), env=env)
    assert again.returncode == 1 and "NOT_FOUND" in again.stderr
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0

    start("--socket", str(sock), "--state-file", str(state))
    assert not status(sock).datasets


def test_a_state_file_that_cannot_be_written_fails_no_load(start, tmp_path, env):
    path = make_dataset(tmp_path / "data.h5")
    sock, state = tmp_path / "s.sock", tmp_path / "state.json"
    s = start("--socket", str(sock), "--state-file", str(state))
    state.mkdir()  # made a directory behind the service's back: the state cannot be replaced
    loaded = cli("load", str(path), "--wait", "--socket", str(sock), env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert status(sock).datasets[0].bytes_resident == SAMPLES * SAMPLE_BYTES
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0, s.stderr
    assert [x["path"] for x in s.logs() if x["event"] == "state_unwritable"] == [str(state)]
    assert "internal" not in s.stderr and not list(tmp_path.glob(".state.json.*"))


def test_next_start_removes_segments_of_a_killed_service(start, tmp_path, env):
    # segments of their own: a service started meanwhile by another test would reclaim
    # the stale one from /dev/shm before ours could (CI failed so)
    where = tmp_path / "shm"
    where.mkdir()
    env["DATASTORE_SHM_DIR"] = str(where)
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    with grpc.insecure_channel(target_of(sock)) as ch:
        ds = pb_grpc.DataStoreStub(ch)
        sid = ds.OpenSession(
            pb.OpenSessionRequest(dataset_path=str(path), global_batch=4), timeout=10
        ).session_id
        first = pb.StreamBatchesRequest(
            session_id=sid, transport=pb.TRANSPORT_SHARED_MEMORY, prefetch=1
        )
        call = ds.StreamBatches(iter([first]), timeout=30)
        batch = next(call)  # never mapped: the service keeps the file for us
        shm = Path(batch.tensors[0].shm.path)
        assert shm.parent == where and segments(s.proc.pid, where) == [shm]
        s.proc.kill()
        s.proc.wait(10)
        call.cancel()
    assert shm.exists()  # stale

    s2 = start("--socket", str(sock))
    assert not shm.exists()
    removed = [x for x in s2.logs() if x["event"] == "removed_stale_segments"]
    assert [x["count"] for x in removed] == [1]
    on_disk = [x["level"] for x in s2.logs() if x["event"] == "segments_on_disk"]
    assert on_disk == ([] if filesystem_of(where) in MEMORY_FS else ["warning"])
    assert any(x["event"] == "removed_stale_socket" for x in s2.logs())


def test_lru_eviction_under_the_memory_budget(start, tmp_path, env):
    a = make_dataset(tmp_path / "a.h5", seed=1)
    b = make_dataset(tmp_path / "b.h5", seed=2)
    sock = tmp_path / "s.sock"
    size = SAMPLES * SAMPLE_BYTES
    start("--socket", str(sock), "--memory-budget", str(size * 3 // 2))  # room for one
    for p in (a, b):
        r = cli("load", str(p), "--wait", "--socket", str(sock), env=env)
        assert r.returncode == 0, r.stderr
    st = status(sock)
    assert [x.path for x in st.datasets] == [str(b)]  # a was evicted for b
    assert st.bytes_resident == size and st.memory_budget == size * 3 // 2

    with DataStoreLoader(str(a), batch_size=4, seed=3, service=ServiceOptions(str(sock))) as job:
        st = status(sock)  # a is back, b made room
        assert [(x.path, x.sessions) for x in st.datasets] == [(str(a), 1)]
        r = cli("load", str(b), "--wait", "--socket", str(sock), env=env)
        assert r.returncode == 0, r.stderr
        st = status(sock)  # a is in use: never evicted; b gets what room is left
        by = {x.path: x for x in st.datasets}
        assert by[str(a)].sessions == 1 and by[str(b)].sessions == 0
        assert by[str(a)].bytes_resident == size
        assert st.bytes_resident <= st.memory_budget
        got = [(0, i, digest(x)) for i, x in enumerate(job)]
        assert by[str(a)].bytes_total == size
    assert got == embedded_hashes(a)
    assert status(sock).datasets[0].path in (str(a), str(b))


def test_a_budget_smaller_than_the_dataset_still_delivers_the_embedded_batches(start, tmp_path):
    """Samples left out of memory are read into a per-thread scratch buffer; a batch took all
    its samples before copying them, so each such row came out as the last one read."""
    path = make_dataset(tmp_path / "a.h5")
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--memory-budget", str(SAMPLES * SAMPLE_BYTES // 4))
    service = ServiceOptions(str(sock), transport="inline")
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=service) as job:
        got = [(0, i, digest(x)) for i, x in enumerate(job)]
    assert got == embedded_hashes(path)
    assert 0 < status(sock).bytes_resident < SAMPLES * SAMPLE_BYTES  # some read from disk


def test_a_dataset_whose_files_change_is_read_again(start, tmp_path, env):
    """A resident dataset was served as first read for as long as the service ran: a campaign
    staging new data to the same path (or `datastore stage --service --load`) got the old."""
    path = make_dataset(tmp_path / "a.h5", seed=1)
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    service = ServiceOptions(str(sock))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=service) as job:
        first = [(0, i, digest(x)) for i, x in enumerate(job)]
        assert first == embedded_hashes(path)
        make_dataset(tmp_path / "new.h5", seed=2).rename(path)  # as a stage places files
        time.sleep(1.2)  # (the files are compared at most once a second)
        with DataStoreLoader(str(path), batch_size=4, seed=3, service=service) as second:
            got = [(0, i, digest(x)) for i, x in enumerate(second)]
        job.set_epoch(0)  # the job that began before the change still reads what it read
        assert [(0, i, digest(x)) for i, x in enumerate(job)] == first
    assert got == embedded_hashes(path) != first
    assert [x["event"] for x in s.logs()].count("dataset_changed") == 1
    make_dataset(tmp_path / "new.h5", seed=3).rename(path)
    time.sleep(1.2)
    r = cli("load", str(path), "--wait", "--socket", str(sock), env=env)
    assert r.returncode == 0, r.stderr
    assert [x["event"] for x in s.logs()].count("dataset_changed") == 2
    assert [x.path for x in status(sock).datasets] == [str(path)]


def test_a_loader_dropped_without_close_ends_its_session(start, tmp_path):
    """A loader dropped without close() (a notebook, a sweep in one process) held its session,
    and the service its rings, until the process ended: 20 such loaders, 20 sessions."""
    import gc

    path = make_dataset(tmp_path / "a.h5")
    sock = tmp_path / "s.sock"
    start("--socket", str(sock))
    for seed in range(3):
        job = DataStoreLoader(str(path), batch_size=4, seed=seed, service=ServiceOptions(str(sock)))
        next(iter(job))  # a pass left open too
        assert len(status(sock).sessions) == 1
        del job
        gc.collect()
        assert len(status(sock).sessions) == 0


def test_a_dataset_larger_than_the_budget_leaves_room_for_the_jobs_rings(start, tmp_path):
    """A dataset that did not fit took the whole budget, so every job's shared-memory ring
    (the default transport, the trainer's) was refused with RESOURCE_EXHAUSTED."""
    n = 480
    path = make_dataset(tmp_path / "a.h5", n=n)
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--memory-budget", str(n * SAMPLE_BYTES // 2))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))):
        pass  # the first session makes the dataset resident: all the room it may take
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))) as job:
        got = [(0, i, digest(x)) for i, x in enumerate(job)]
        st = status(sock)
    assert got == embedded_hashes(path)
    assert st.datasets[0].bytes_resident <= st.memory_budget * 7 // 8
    assert st.bytes_resident <= st.memory_budget  # its ring in it


def test_a_frozen_service_is_reported_within_the_loaders_timeout(start, tmp_path):
    """A service that stops answering (SIGSTOP): the error came after 2 x timeout + 15 s (the
    consumer's wait, then a join of the stuck producer for the timeout + 10 s), and close()
    took 10 s more; now the timeout (and the 5 s the consumer gives the producer's own error,
    which names the peer), and close() at most the timeout."""
    from datastore.errors import ExchangeTimeout

    path = make_dataset(tmp_path / "a.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    loader = DataStoreLoader(str(path), batch_size=1, timeout=2, service=ServiceOptions(str(sock)))
    it = iter(loader)
    next(it)
    s.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ExchangeTimeout, match="no batch within 7 s"):
            for _ in range(SAMPLES):
                next(it)
        assert time.monotonic() - t0 < 2 + 5 + 3  # (was 19 s)
        t0 = time.monotonic()
        loader.close()
        assert time.monotonic() - t0 < 2 + 3  # (was 10 s; its CloseSession waits 2 s at most)
    finally:
        s.proc.send_signal(signal.SIGCONT)


def _open_raw(ch: grpc.Channel, data: bytes) -> pb.OpenSessionResponse:
    """``OpenSession`` with request bytes made by hand."""
    call = ch.unary_unary(
        "/datastore.v1.DataStore/OpenSession",
        request_serializer=None,
        response_deserializer=pb.OpenSessionResponse.FromString,
    )
    return call(data, timeout=10)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_hostile_requests_are_refused_and_the_service_serves_on(start, tmp_path, env):
    root = tmp_path / "allowed"
    root.mkdir()
    path = make_dataset(root / "data.h5")
    outside = make_dataset(tmp_path / "outside.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--allow", str(root))
    expected = embedded_hashes(path)

    def refused(request) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(target_of(sock)) as ch:
            ds = pb_grpc.DataStoreStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                if isinstance(request, bytes):
                    _open_raw(ch, request)
                else:
                    ds.OpenSession(request, timeout=10)
        with DataStoreLoader(
            str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
        ) as job:
            assert [(0, i, digest(x)) for i, x in enumerate(job)] == expected
        return err.value.code(), err.value.details()

    def req(**kw) -> pb.OpenSessionRequest:
        return pb.OpenSessionRequest(**{"dataset_path": str(path), "global_batch": 4, **kw})

    code, msg = refused(req(dataset_path=str(outside)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "outside the allowed roots" in msg
    escape = str(root / ".." / "outside.h5")  # .. does not get out
    assert refused(req(dataset_path=escape))[0] == grpc.StatusCode.PERMISSION_DENIED
    r = cli("load", str(outside), "--socket", str(sock), env=env)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "refused: PERMISSION_DENIED" in r.stderr
    code, msg = refused(req(dataset_path="allowed/data.h5"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "absolute" in msg
    assert refused(req(dataset_path=str(root / "none.h5")))[0] == grpc.StatusCode.NOT_FOUND
    for gb in (0, SAMPLES + 1, MAX_GLOBAL_BATCH + 1, 2**32 - 1):
        code, msg = refused(req(global_batch=gb, drop_last=True))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (gb, msg)
    code, msg = refused(req(fields=["x", "nope"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'nope'" in msg

    # global_batch = -1 as a client in another language may send it: the 10-byte varint
    path_bytes = str(path).encode()
    negative = b"\x0a" + _varint(len(path_bytes)) + path_bytes + b"\x18" + _varint(-1)
    assert len(_varint(-1)) == 10
    assert pb.OpenSessionRequest.FromString(negative).global_batch == 2**32 - 1
    assert refused(negative)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refused(b"\xff\xff\xff")[0] == grpc.StatusCode.INVALID_ARGUMENT  # not a message

    code, msg = refused(req(dataset_path="/" + "x" * (8 << 20)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, msg
    assert s.proc.poll() is None
    assert max(len(line) for line in s.stderr.splitlines()) < 10_000  # nothing huge was logged


@pytest.mark.timeout(60)  # a regression would block on the FIFO: fail, do not hang
def test_a_fifo_is_refused_at_once_and_status_answers(start, tmp_path, env):
    """LoadDataset (and OpenSession) of a FIFO under an allowed root, as data or as a spec
    file: opening it would block until a writer comes; it is refused at once, the service
    answers Status meanwhile, and the embedded loader refuses it alike (a spec file is opened
    non-blocking and checked on its descriptor)."""
    root = tmp_path / "allowed"
    root.mkdir()
    fifos = [root / "samples.h5", root / "spec.json"]
    for fifo in fifos:
        os.mkfifo(fifo)
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--allow", str(root))
    with grpc.insecure_channel(target_of(sock)) as ch:
        ds = pb_grpc.DataStoreStub(ch)
        calls = [  # a call that hung opening the FIFO would end DEADLINE_EXCEEDED
            call.future(request, timeout=10)
            for fifo in fifos
            for call, request in (
                (ds.LoadDataset, pb.LoadDatasetRequest(dataset_path=str(fifo))),
                (ds.OpenSession, pb.OpenSessionRequest(dataset_path=str(fifo), global_batch=1)),
            )
        ]
        assert ds.Status(pb.StatusRequest(), timeout=5).pid > 0
        for call in calls:
            assert call.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not a regular file or directory" in call.details()
            assert str(root) in call.details()
    for fifo in fifos:
        with pytest.raises(ValueError, match="not a regular file"):
            DataStoreLoader(str(fifo), batch_size=1)


SLOW_SAMPLES = 50_000  # members of the slow tar: indexing them takes the service seconds


def many_member_tar(path: Path, n: int) -> Path:
    """An uncompressed tar of ``n`` one-byte ``.npy`` samples (``s00000000.npy`` ...; sample
    ``i`` holds ``i % 256``). Its reader reads every member's header on open, in Python: seconds
    for 50,000. Written from one member's bytes with numpy (``tarfile`` would take as long to
    write it as the service takes to read it)."""
    buf = io.BytesIO()
    np.save(buf, np.uint8(0))
    data = buf.getvalue()
    info = tarfile.TarInfo("s00000000.npy")
    info.size = len(data)
    member = info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(512 - len(data))
    rec = np.tile(np.frombuffer(member, np.uint8), (n, 1))  # header, data padded to 512
    i = np.arange(n)
    for d in range(8):  # the name's digits
        rec[:, 8 - d] = ord("0") + i // 10**d % 10
    rec[:, 512 + len(data) - 1] = i % 256
    rec[:, 148:156] = np.frombuffer(b"        ", np.uint8)  # the checksum counts as spaces
    check = rec[:, :512].sum(axis=1, dtype=np.int64)
    for d in range(6):  # ... then is written as six octal digits, a NUL and a space
        rec[:, 153 - d] = ord("0") + (check >> (3 * d) & 7)
    rec[:, 154] = 0
    path.write_bytes(rec.tobytes() + bytes(1024))
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["LoadDataset", "OpenSession"])
def test_a_slow_dataset_open_blocks_no_other_client(start, tmp_path, call):
    """While one client's LoadDataset (or OpenSession) spends seconds opening a dataset (a tar
    of 50,000 members: its index reads every member's header), Status from another client
    answers at once, without that dataset (it is not resident yet), and a third client opens a
    session on a resident dataset and streams the embedded loader's first batch; all before the
    slow call returns, which then gives the whole dataset."""
    root = tmp_path / "allowed"
    root.mkdir()
    fast = make_dataset(root / "fast.h5")
    slow = many_member_tar(root / "slow.tar", SLOW_SAMPLES)
    local = DataStoreLoader(
        str(fast), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False)
    )
    want = {k: v.numpy() for k, v in next(iter(local)).items()}
    local.close()
    resident = os.path.realpath(fast)  # as the service names it
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--allow", str(root))
    opener, watcher, streamer = (open_channel(target_of(sock)) for _ in range(3))
    try:
        ds = pb_grpc.DataStoreStub(watcher)
        ds.LoadDataset(pb.LoadDatasetRequest(dataset_path=str(fast), wait=True), timeout=10)
        calls = ds.Status(pb.StatusRequest(), timeout=10).calls_served
        slow_call = (
            pb_grpc.DataStoreStub(opener).LoadDataset.future(
                pb.LoadDatasetRequest(dataset_path=str(slow)), timeout=50
            )
            if call == "LoadDataset"
            else pb_grpc.DataStoreStub(opener).OpenSession.future(
                pb.OpenSessionRequest(dataset_path=str(slow), global_batch=1), timeout=50
            )
        )
        t_slow = time.monotonic()
        # Status until the service has taken the slow call (calls_served counts a call as it
        # arrives: one more than these Status calls)
        polls = 0
        while True:
            reply = ds.Status(pb.StatusRequest(), timeout=10)  # answered while...
            polls += 1
            assert [d.path for d in reply.datasets] == [resident]  # slow: not resident yet
            if reply.calls_served > calls + polls:
                break
            assert time.monotonic() - t_slow < 30, "the service never took the slow call"
            time.sleep(0.02)
        assert not slow_call.done()  # ...the slow call is still running
        # a third client streams a batch of the resident dataset meanwhile
        opened = pb_grpc.DataStoreStub(streamer).OpenSession(
            pb.OpenSessionRequest(
                dataset_path=str(fast), seed=3, global_batch=4, world_size=1, shuffle=True
            ),
            timeout=5,
        )
        request = pb.StreamBatchesRequest(
            session_id=opened.session_id, rank=0, epoch=0, transport=pb.TRANSPORT_INLINE
        )
        batches = RemoteBatches(stream_batches(streamer), request)
        first = next(iter(batches))
        batches.close()
        assert not slow_call.done(), "the slow call returned first: it proves nothing"
        assert (first.header.step, first.header.epoch) == (0, 0)
        assert list(first.header.sample_indices) == want["idx"].tolist()
        assert first.arrays.keys() == want.keys()
        for name, a in want.items():
            assert first.arrays[name].tobytes() == a.tobytes(), name
        assert opened.num_samples == SAMPLES
        # the slow call then succeeds, with every member
        reply = slow_call.result()
        got = reply.dataset.num_samples if call == "LoadDataset" else reply.num_samples
        assert got == SLOW_SAMPLES
        listed = {d.path: d.num_samples for d in ds.Status(pb.StatusRequest(), timeout=10).datasets}
        assert listed == {resident: SAMPLES, os.path.realpath(slow): SLOW_SAMPLES}
    finally:
        for ch in (opener, watcher, streamer):
            ch.close()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_stream_cut_by_its_session_closing_is_an_error_not_a_short_epoch(
    start, tmp_path, transport
):
    """The session is closed under an open stream (as its expiry or a shutdown would): the
    client gets ABORTED naming the cause, never an epoch that simply ends early."""
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    start("--socket", str(sock))
    loader = DataStoreLoader(
        str(path), batch_size=1, service=ServiceOptions(str(sock), transport=transport)
    )
    it = iter(loader)
    next(it)
    with grpc.insecure_channel(target_of(sock)) as ch:
        stub = pb_grpc.DataStoreStub(ch)
        stub.CloseSession(pb.CloseSessionRequest(session_id=loader.session_id), timeout=10)
    with pytest.raises(DataStoreError, match=r"ABORTED.*stopped before its last batch") as err:
        for _ in range(SAMPLES):
            next(it)
    assert err.value.grpc_status == grpc.StatusCode.ABORTED
    assert "the session was closed" in err.value.grpc_details
    loader.close()


def test_a_stream_cut_by_sigterm_ends_aborted_naming_the_shutdown(start, tmp_path):
    """SIGTERM while a stream is open: its client got gRPC's own CANCELLED ('Cancelling all
    calls', as ServiceUnavailable): the streams were ended one second after the grace, when
    gRPC had cancelled them already."""
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--grace", "1")
    loader = DataStoreLoader(str(path), batch_size=1, service=ServiceOptions(str(sock)))
    it = iter(loader)
    next(it)  # the stream holds its slots: it waits for the client, who reads no more
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(2)  # past the grace
    with pytest.raises(DataStoreError) as err:
        for _ in range(SAMPLES):
            next(it)
    assert err.value.grpc_status == grpc.StatusCode.ABORTED, err.value
    assert "stopped before its last batch" in err.value.grpc_details
    loader.close()
    assert s.proc.wait(15) == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--tcp", "127.0.0.1:99999"], "--tcp: the port must be 0..65535"),
        (["--tcp", "127.0.0.1:abc"], "--tcp wants HOST:PORT"),
        (["--metrics", "127.0.0.1:99999"], "--metrics: the port must be 0..65535"),
        (["--metrics", "127.0.0.1:-1"], "--metrics wants HOST:PORT"),
        (["--memory-budget", "0"], "argument --memory-budget: must be >= 1, got '0'"),
    ],
    ids=["tcp-over-65535", "tcp-not-a-number", "metrics-over-65535", "metrics-negative",
         "budget-0"],
)  # fmt: skip
def test_a_port_out_of_range_stops_serve_at_start(tmp_path, env, args, says):
    """A --tcp or --metrics port that is not 0..65535 is exit 2 naming the option: gRPC took
    --tcp 127.0.0.1:99999 as port 34463 and listened there; --metrics was an internal error.
    So is a memory budget of 0 (an empty variable): it held nothing, shown as "no limit"."""
    token = tmp_path / "token"
    token.write_text("secret")
    token.chmod(0o600)
    cmd = ["serve", "--socket", str(tmp_path / "p.sock"), "--token-file", str(token), *args]
    r = cli(*cmd, env=env)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "p.sock").exists()


@pytest.mark.parametrize(
    "metrics, says",
    [
        ("0.0.0.0:47533", "--metrics 0.0.0.0:47533 is the port of --tcp 127.0.0.1:47533"),
        ("127.0.0.1:47535", "--metrics 127.0.0.1:47535 is the port of --data-port 47535"),
        ("127.0.0.2:47533", None),  # another host: both bind
        ("127.0.0.1:0", None),  # any free port
    ],
)
def test_metrics_on_the_port_of_tcp_or_data_port_is_bad_usage(tmp_path, metrics, says):
    """``--metrics`` on the ``--tcp`` (or ``--data-port``) port started, then stopped with exit 1
    "Address already in use": a conflict the arguments show, refused before binding (exit 2)."""
    peers = ("127.0.0.1:47533", "127.0.0.1:47534")
    args = dict(socket=tmp_path / "s.sock", tcp=peers[0], token_file=tmp_path / "t", peers=peers)
    if says is None:
        assert ServeConfig(node=0, data_port=47535, metrics=metrics, **args).metrics == metrics
        return
    with pytest.raises(ValueError, match=f"^{re.escape(says)}: give each its own$"):
        ServeConfig(node=0, data_port=47535, metrics=metrics, **args)


@pytest.mark.parametrize("option", ["session_idle_s", "peer_timeout_s"])
@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 0.0])
def test_a_session_idle_or_peer_timeout_not_finite_is_refused_naming_it(tmp_path, option, seconds):
    """``--session-idle nan`` passed the check ``<= 0`` (sessions then never expired) and
    ``--session-idle -1`` was refused as "the session idle time must be > 0", no option named."""
    flag = "--" + option.removesuffix("_s").replace("_", "-")
    says = f"^{flag} must be a finite number of seconds > 0, got {seconds}$"
    with pytest.raises(ValueError, match=says):
        ServeConfig(socket=tmp_path / "s.sock", **{option: seconds})


def test_a_peer_timeout_over_a_day_is_refused(tmp_path):
    """``--peer-timeout 1e10`` was taken, and every session's opening then failed at once,
    "node 1 did not answer Describe within 1e+10 s" (gRPC's deadline overflowed)."""
    config = ServeConfig(socket=tmp_path / "s.sock", peer_timeout_s=86400.0)
    assert config.peer_timeout_s == 86400.0
    says = r"^--peer-timeout must be at most 86400 seconds \(a day\), got 1e\+10$"
    with pytest.raises(ValueError, match=says):
        ServeConfig(socket=tmp_path / "s.sock", peer_timeout_s=1e10)


@pytest.mark.parametrize("option", ["--allow", "--socket", "--state-file", "--token-file"])
def test_an_empty_path_option_is_refused(option, capsys, tmp_path):
    """``--allow ""`` (an unset variable) was taken as the working directory: a service
    started in ``/`` served any dataset it was asked for, where a root was meant."""
    from datastore.cli import parser

    with pytest.raises(SystemExit) as stopped:
        parser().parse_args(["serve", "--socket", str(tmp_path / "s.sock"), option, ""])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"datastore serve: error: argument {option}: an empty path (see datastore serve --help)\n"
    )


UNITS = "; a plain number is bytes and K, M, G, T are powers of 1024"


@pytest.mark.parametrize(
    "size, said",
    [
        ("0.5", f"--memory-budget must be >= 1, got '0.5'{UNITS}; leave it out for no limit"),
        ("0", f"--memory-budget must be >= 1, got '0'{UNITS}; leave it out for no limit"),
        ("0.5K", 512),
        ("2G", 2 << 30),
    ],
)
def test_a_memory_budget_under_a_byte_names_what_was_given_and_the_units(size, said):
    """``--memory-budget 0.5`` was refused as "must be more than 0 bytes, got 0": neither
    the 0.5 given nor the units (a plain number is bytes) were said."""
    from datastore.service.cli import parse_bytes

    if isinstance(said, int):
        assert parse_bytes(size, "--memory-budget") == said
        return
    with pytest.raises(ValueError) as err:
        parse_bytes(size, "--memory-budget")
    assert str(err.value) == said


def test_a_client_port_out_of_range_is_refused_not_wrapped(tmp_path, env):
    """gRPC takes 127.0.0.1:99999 as 127.0.0.1:34463: a client with such an address would talk
    to whichever service is there. target_of refuses it; `datastore status` is exit 2."""
    with pytest.raises(ValueError, match=r"must be 0\.\.65535"):
        target_of("127.0.0.1:99999")
    assert target_of("127.0.0.1:65535") == "127.0.0.1:65535"
    token = tmp_path / "token"
    token.write_text("secret")
    token.chmod(0o600)
    r = cli("status", "--tcp", "127.0.0.1:99999", "--token-file", str(token), env=env)
    assert r.returncode == 2 and "must be 0..65535" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


def test_shutdown_grace_is_checked_and_kept_with_a_stuck_client(start, tmp_path, env):
    """Shutdown(grace_s=inf, nan, < 0 or > 3600) is INVALID_ARGUMENT and the service serves on
    (so is --grace at start: exit 2); with a client that holds a stream open and reads no more,
    Shutdown(grace_s=2) ends the service within grace + a few seconds, exit 0."""
    for bad in ("inf", "nan", "-1", "3601"):
        r = cli("serve", "--socket", str(tmp_path / "g.sock"), f"--grace={bad}", env=env)
        said = f"argument --grace: must be 0..3600 seconds, got {bad!r}"
        assert r.returncode == 2 and said in r.stderr, r.stderr
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    with grpc.insecure_channel(target_of(sock)) as ch:
        stub = pb_grpc.DataStoreStub(ch)
        for bad in (float("inf"), float("nan"), -1.0, 3601.0, 1e9):
            with pytest.raises(grpc.RpcError) as err:
                stub.Shutdown(pb.ShutdownRequest(grace_s=bad), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "grace_s must be 0..3600 s" in err.value.details()
        assert s.proc.poll() is None
    stuck = DataStoreLoader(
        str(path), batch_size=1, service=ServiceOptions(str(sock), transport="shm")
    )
    next(iter(stuck))  # the stream stays open, its slots held
    t0 = time.monotonic()
    with grpc.insecure_channel(target_of(sock)) as ch:
        pb_grpc.DataStoreStub(ch).Shutdown(pb.ShutdownRequest(grace_s=2), timeout=10)
    assert s.proc.wait(20) == 0
    assert time.monotonic() - t0 < 2 + 5
    stuck.close()


@pytest.mark.parametrize("stop", ["SIGTERM", "Shutdown"])
def test_stopping_after_streaming_takes_the_grace_and_a_few_seconds(start, tmp_path, stop):
    """After streaming traffic (a whole epoch read, then one stream per transport left open
    by a client that reads no more, inline over the socket and over TCP too), SIGTERM or
    Shutdown with --grace 2 ends the service within grace + a few seconds, exit 0, its socket
    and segments removed; the stuck clients get ABORTED naming the shutdown, not a hang. (An
    inline client, its stream held in gRPC's flow control, got UNAVAILABLE 'Cancelling all
    calls' from gRPC's end of the grace.)"""
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:  # 1 MiB samples: more than gRPC's flow control takes
        f["x"] = np.ones((32, 1, 64, 64, 64), np.float32)
    sock = tmp_path / "s.sock"
    token = tmp_path / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    s = start("--socket", str(sock), "--grace", "2", "--tcp", "127.0.0.1:0", "--token-file",
              str(token))  # fmt: skip
    tcp = s.listening()[1]
    with DataStoreLoader(str(path), batch_size=4, service=ServiceOptions(str(sock))) as job:
        assert len(list(job)) == 32 // 4
    stuck = [
        DataStoreLoader(str(path), batch_size=1, prefetch=1, service=service)
        for service in (
            ServiceOptions(str(sock), transport="shm"),
            ServiceOptions(str(sock), transport="inline"),
            ServiceOptions(tcp, token="s3cret"),
        )
    ]
    its = [iter(loader) for loader in stuck]
    for it in its:
        next(it)
    until(lambda: status(sock).clients == 3, 10, "the three streams open")
    t0 = time.monotonic()
    if stop == "SIGTERM":
        s.proc.send_signal(signal.SIGTERM)
    else:
        with grpc.insecure_channel(target_of(sock)) as ch:
            pb_grpc.DataStoreStub(ch).Shutdown(pb.ShutdownRequest(), timeout=10)
    assert s.proc.wait(20) == 0
    assert time.monotonic() - t0 < 2 + 4
    assert not sock.exists() and segments(s.proc.pid) == []
    logs = s.logs()
    drain = [e["event"] for e in logs].index("draining")
    assert logs[drain]["grace_s"] == 2 and logs[-1]["event"] == "stopped"
    for e in logs[drain + 1 : -1]:  # the streams still open, ended as ABORTED, naming why
        assert (e["event"], e["call"], e["code"]) == ("refused", "StreamBatches", "ABORTED")
        assert e["msg"].endswith("stopped before its last batch: the service is stopping")
    for it, loader in zip(its, stuck, strict=True):
        with pytest.raises(DataStoreError) as err:
            for _ in range(32):
                next(it)
        assert err.value.grpc_status == grpc.StatusCode.ABORTED, err.value
        assert err.value.grpc_details.endswith("before its last batch: the service is stopping")
        loader.close()


def test_shared_memory_rings_count_in_the_memory_budget(start, tmp_path):
    """A budget that holds the dataset and nothing more: a shared-memory stream's ring does
    not fit beside it (RESOURCE_EXHAUSTED, the client raises), an inline stream needs no ring
    and streams; with room for both, shared memory streams too."""
    path = make_dataset(tmp_path / "data.h5")
    dataset_bytes = SAMPLES * 2 * 6 * 6 * 6 * 4 + SAMPLES * 8  # x float32 and idx int64
    sock = tmp_path / "s.sock"
    start("--socket", str(sock), "--memory-budget", str(dataset_bytes))
    shm = DataStoreLoader(
        str(path), batch_size=4, service=ServiceOptions(str(sock), transport="shm")
    )
    with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED.*shared-memory ring"):
        list(shm)
    shm.close()
    with DataStoreLoader(
        str(path), batch_size=4, service=ServiceOptions(str(sock), transport="inline")
    ) as job:
        assert len(list(job)) == SAMPLES // 4
    roomy = tmp_path / "roomy.sock"
    start("--socket", str(roomy), "--memory-budget", str(4 * dataset_bytes))
    with DataStoreLoader(
        str(path), batch_size=4, service=ServiceOptions(str(roomy), transport="shm")
    ) as job:
        assert len(list(job)) == SAMPLES // 4


def test_prometheus_metrics_agree_with_status(start, tmp_path):
    path = make_dataset(tmp_path / "data.h5")
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--metrics", "127.0.0.1:0")
    urls = [x for x in s.listening() if x.startswith("http://")]
    assert len(urls) == 1 and urls[0].startswith("http://127.0.0.1:")

    def scrape() -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(urls[0], timeout=10) as reply:
            text = reply.read().decode()
        return {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text)
            for x in family.samples
        }

    service = ServiceOptions(str(sock), transport="shm", job_id="j1")
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=service) as job:
        it = iter(job)
        next(it)  # streaming now
        m = scrape()
        labels = (("job", "j1"), ("session", job.session_id))
        assert m[("datastore_streams", ())] == m[("datastore_clients", ())] == 1
        assert ("datastore_job_bytes_served_total", labels) in m
        rest = list(it)
        assert len(rest) == SAMPLES // 4 - 1
        # and the next epoch's first prefetch (2) batches, sent ahead over shared memory
        served = SAMPLES // 4 + 2
        until(lambda: status(sock).batches_served == served, 10, "the batches sent ahead")
        m, st = scrape(), status(sock)
        assert m[("datastore_batches_served_total", ())] == st.batches_served == served
        assert m[("datastore_bytes_served_total", ())] == st.bytes_served
        assert m[("datastore_job_bytes_served_total", labels)] == st.sessions[0].bytes_served
        assert st.bytes_served == st.sessions[0].bytes_served > 0
        assert m[("datastore_job_batches_served_total", labels)] == served
        d = st.datasets[0]
        ratio = m[("datastore_dataset_hit_ratio", (("dataset", str(path)),))]
        assert d.hits + d.misses > 0 and ratio == pytest.approx(d.hits / (d.hits + d.misses))
        assert m[("datastore_resident_bytes", ())] == st.bytes_resident
    m = scrape()  # the job's series go with its session
    assert not any(name.startswith("datastore_job_") for name, _ in m)


def _rss(pid: int) -> int:
    """Bytes of the process's resident memory (``VmRSS``)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if "VmRSS" in x)
    return int(line.split()[1]) * 1024


def test_unloading_a_dataset_returns_its_memory_to_the_system(start, tmp_path, env):
    """The service keeps freed heap for its messages (glibc's thresholds raised to 1 GiB), so
    a dataset's arenas, once plain ``np.empty`` arrays there, stayed in the process after
    ``unload``: 512 MiB of RSS stayed of a 512 MiB dataset."""
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:  # 96 MiB of samples that are not zero pages
        f["x"] = np.random.default_rng(0).random((24, 1 << 20), dtype=np.float32)
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    before = _rss(s.proc.pid)
    r = cli("load", str(path), "--wait", "--socket", str(sock), env=env)
    assert r.returncode == 0, r.stderr
    loaded = _rss(s.proc.pid)
    assert loaded - before >= 90 << 20
    r = cli("unload", str(path), "--socket", str(sock), env=env)
    assert r.returncode == 0, r.stderr
    assert _rss(s.proc.pid) - before < 16 << 20


def test_a_dataset_that_fails_to_load_is_reported_and_refused_until_fixed(start, tmp_path, env):
    """A load that failed (a sample of another dtype and shape) was reported as `resident`,
    exit 0, by `datastore load --wait`, and sessions opened on it."""
    path = tmp_path / "samples"
    path.mkdir()
    for i in range(3):
        np.save(path / f"{i}.npy", np.full((4, 8), i, np.float32))
    np.save(path / "1.npy", np.zeros(3, np.int64))
    sock = tmp_path / "s.sock"
    start("--socket", str(sock))
    why = f"{path}/1.npy: field 'data': sample 1 is <i8 (3,), sample 0 is <f4 (4, 8)"
    r = cli("load", str(path), "--wait", "--socket", str(sock), env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert f"DATA_LOSS: {path} could not be read into memory: {why}" in r.stderr
    with Client(str(sock)) as c:
        with pytest.raises(DataStoreError, match="could not be read into memory") as err:
            c.load(str(path))  # asked again without waiting: refused at once
        assert err.value.grpc_status == grpc.StatusCode.DATA_LOSS
        assert [x.load_error for x in c.status().datasets] == [why]
    r = cli("status", "--socket", str(sock), env=env)
    assert f"  {path}: {why}" in r.stdout.splitlines()
    with pytest.raises(DataStoreError, match="could not be read into memory") as err:
        DataStoreLoader(str(path), batch_size=1, service=ServiceOptions(str(sock)))
    assert err.value.grpc_status == grpc.StatusCode.DATA_LOSS
    np.save(path / "1.npy", np.full((4, 8), 1, np.float32))  # fixed: read again
    time.sleep(1.2)  # (the files are compared at most once a second)
    with Client(str(sock)) as c:
        assert c.load(str(path), wait=True).dataset.load_error == ""
    with DataStoreLoader(
        str(path), batch_size=1, shuffle=False, service=ServiceOptions(str(sock))
    ) as job:
        assert [int(b["data"][0, 0, 0]) for b in job] == [0, 1, 2]


def test_ranks_given_without_a_launcher_are_warned_that_nothing_checks_them(start, tmp_path):
    """Ranks with rank=/world= given and no MPI or process group cannot compare their seeds: two
    such ranks of different seeds got 13 samples twice between them, and nothing said so (the
    embedded loader warns)."""
    path = make_dataset(tmp_path / "a.h5")
    sock = tmp_path / "s.sock"
    start("--socket", str(sock))
    with pytest.warns(UserWarning, match="the ranks cannot check that they agree on the seed"):
        job = DataStoreLoader(
            str(path), batch_size=2, rank=1, world=2, service=ServiceOptions(str(sock))
        )
    job.close()


def test_a_ring_over_the_room_left_streams_inline_when_the_transport_is_the_services(
    start, tmp_path
):
    """A job whose shared-memory ring did not fit beside a partly resident dataset was
    refused RESOURCE_EXHAUSTED, though it had asked for no transport (the default over the
    Unix socket); asked for, shared memory is still refused."""
    n = 480
    path = make_dataset(tmp_path / "a.h5", n=n)
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--memory-budget", str(n * SAMPLE_BYTES // 2))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))):
        pass  # the dataset takes 7/8 of the budget; a ring of 18 slots of 4 needs more
    kw = {"batch_size": 4, "seed": 3, "prefetch": 8}
    with DataStoreLoader(str(path), **kw, service=ServiceOptions(str(sock))) as job:
        got = [(0, i, digest(x)) for i, x in enumerate(job)]
    assert got == embedded_hashes(path)
    told = [x for x in s.logs() if x["event"] == "streaming_inline"]
    assert len(told) == 1 and "RESOURCE_EXHAUSTED" not in told[0]["msg"]
    assert "does not fit under the memory budget" in told[0]["msg"]
    shm = ServiceOptions(str(sock), transport="shm")
    refused = pytest.raises(DataStoreError, match="does not fit under the memory budget")
    with DataStoreLoader(str(path), **kw, service=shm) as job, refused:
        next(iter(job))
