"""``datastore serve`` and the processes of its clients: a session ends when the process that
opened it does (killed, or exited without ``close()``), its stream and shared-memory ring freed at
once; ``datastore status`` names each session's job; ``datastore shutdown`` stops the service.

A real server subprocess on a Unix socket, real client processes (``DataStoreLoader(...,
service=ServiceOptions(socket))``), ``SIGKILL``; ``ProcessWatch`` on real child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from datastore.errors import ServiceUnavailable
from datastore.service.client import Client, job_identity
from datastore.service.commands import _stopped
from datastore.service.paths import claim_socket
from datastore.service.watch import ProcessWatch, boot_id, running, start_ticks, this_process
from tests.test_service_basic import REPO, Server, cli, wait_serving

CHILD = """
import os, sys, time
from datastore import DataStoreLoader, ServiceOptions
service = ServiceOptions({sock!r}, transport="shm")
r = DataStoreLoader({path!r}, batch_size=2, seed=3, service=service)
for i, b in enumerate(r):
    print("got", i, flush=True)
    if sys.argv[1] == "exit":
        os._exit(0)  # no close(), no finalizer: the process just ends
    time.sleep(60)
"""


@pytest.fixture
def served(tmp_path):
    """``(dataset, socket, server)``: a fresh service for the test, killed at the end."""
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(64 * 2 * 4 * 4 * 4, dtype=np.float32).reshape(64, 2, 4, 4, 4)
        f["idx"] = np.arange(64, dtype=np.int64)
    (tmp_path / "runtime").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DATASTORE_ADDRESS"}
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "runtime"), XDG_STATE_HOME=str(tmp_path / "state"))
    sock = tmp_path / "s.sock"
    s = Server(tmp_path / "logs", ["--socket", str(sock)], env)
    wait_serving(s.listening(30)[0], s.proc, timeout=30)
    s.env = env
    yield path, sock, s
    if s.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)


def client_env(**extra: str) -> dict[str, str]:
    """This environment without any job id, plus ``extra``."""
    drop = ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID",
            "TORCHELASTIC_RUN_ID", "DATASTORE_ADDRESS")  # fmt: skip
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def start_client(path: Path, sock: Path, mode: str, env: dict[str, str]) -> subprocess.Popen:
    script = textwrap.dedent(CHILD.format(path=str(path), sock=str(sock)))
    child = subprocess.Popen([sys.executable, "-c", script, mode], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout.readline().startswith("got 0")
    return child


def segments_mapped(pid: int) -> set[str]:
    """The service's shared-memory segments still mapped in process ``pid``."""
    prefix = f"datastore.{os.getuid()}.{pid}."
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {ln.split()[-2] if ln.endswith("(deleted)") else ln.split()[-1]
            for ln in lines if prefix in ln}  # fmt: skip


def wait_for(what, deadline_s: float = 10.0):
    """``what()`` once it is truthy; its last value after ``deadline_s`` (a hang guard, not a
    speed check)."""
    deadline = time.monotonic() + deadline_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_a_killed_client_ends_its_session_and_frees_its_ring_at_once(served):
    path, sock, s = served
    child = start_client(path, sock, "sleep", client_env(SLURM_JOB_ID="4242"))
    try:
        with Client(sock) as c:
            st = c.status()
            assert st.clients == 1
            assert [(x.job_id, x.streams) for x in st.sessions] == [("4242", 1)]
            assert len(segments_mapped(st.pid)) == 1  # the session's shared-memory ring
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            assert wait_for(lambda: c.status().clients == 0)
            st = c.status()
            assert list(st.sessions) == []  # not left to expire after --session-idle (600 s)
            assert wait_for(lambda: not segments_mapped(st.pid))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    ended = [x for x in s.logs() if x.get("event") == "session_client_ended"]
    assert [x["pid"] for x in ended] == [child.pid]


def test_a_client_that_exits_without_close_ends_its_session(served):
    path, sock, s = served
    child = start_client(path, sock, "exit", client_env())
    assert child.wait(30) == 0
    with Client(sock) as c:
        assert wait_for(lambda: c.status().clients == 0)
        assert list(c.status().sessions) == []
    opened = [x for x in s.logs() if x.get("event") == "session_opened"]
    assert [x["job_id"] for x in opened] == [f"{socket.gethostname()}:{child.pid}"]


def test_status_shows_the_job_of_each_session(served):
    path, sock, s = served
    child = start_client(path, sock, "sleep", client_env(FLUX_JOB_ID="f7Q2"))
    try:
        proc = cli("status", "--socket", str(sock), env=s.env)
        assert proc.returncode == 0, proc.stderr
        rows = proc.stdout.split("sessions (1)\n", 1)[1].splitlines()
        assert rows[0].split() == ["job", "session", "world", "batch", "streams", "batches",
                                   "bytes", "rate", "stall"]  # fmt: skip
        assert rows[1].split()[0] == "f7Q2"
    finally:
        child.kill()
        child.wait(10)


def test_job_identity_reads_the_launchers_in_order():
    assert job_identity({"SLURM_JOB_ID": "12", "FLUX_JOB_ID": "f1"}) == "12"
    assert job_identity({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "3"}) == "12.3"  # a sweep's step
    assert job_identity({"FLUX_JOB_ID": "f1", "TORCHELASTIC_RUN_ID": "r"}) == "f1"
    assert job_identity({"PBS_JOBID": "7.pbs"}) == "7.pbs"
    assert job_identity({"TORCHELASTIC_RUN_ID": "r9"}) == "torchrun:r9"
    here = f"{os.uname().nodename}:{os.getpid()}"
    assert job_identity({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": " "}) == here


def test_shutdown_drains_and_the_service_exits_0_removing_its_socket(served):
    _, sock, s = served
    proc = cli("shutdown", "--socket", str(sock), "--grace", "2", env=s.env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"datastore serve (pid {s.proc.pid}) stopped\n"
    assert s.proc.wait(10) == 0
    assert not sock.exists()
    asked = [x for x in s.logs() if x.get("event") == "shutdown_requested"]
    assert [(x["reason"], x["grace_s"]) for x in asked] == [("datastore shutdown", 2.0)]


class _Gone:
    """A client of a service that no longer answers."""

    def __init__(self, sock: Path):
        self.target = f"unix://{sock}"

    def status(self):
        raise ServiceUnavailable("no answer")


def test_shutdown_waits_until_the_service_holds_its_socket_no_more(tmp_path):
    """gRPC removes the socket as the drain begins: `datastore shutdown` said "stopped" while
    the service drained for 30 s more, and a service started then was refused (its lock held)."""
    sock = tmp_path / "s.sock"
    claim = claim_socket(sock, private=False)  # a server draining: no socket, its lock held
    try:
        assert not sock.exists() and not _stopped(_Gone(sock), 0.3)
    finally:
        claim.release()
    assert _stopped(_Gone(sock), 0.3)
    (tmp_path / "s.sock.lock").touch()  # left by a killed server: not locked
    assert _stopped(_Gone(sock), 0.3)


def test_a_socket_under_a_missing_directory_names_it_and_creates_nothing(tmp_path):
    """``serve --socket /nonexistent/x/y.sock`` stopped with a bare "[Errno 2] No such file
    or directory: '/nonexistent/x'": which of the two was missing, and what serve creates,
    went unsaid."""
    with pytest.raises(FileNotFoundError) as err:
        claim_socket(tmp_path / "no" / "x" / "y.sock", private=False)
    assert str(err.value) == (
        f"cannot create the socket's directory {tmp_path}/no/x: {tmp_path}/no does not exist "
        "(serve creates only the socket's own directory)"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["status", "shutdown"])
def test_a_service_that_takes_the_connection_but_never_answers_is_said_hung(
    command, tmp_path, capsys
):
    """A service stopped with SIGSTOP (its socket still listening) was reported as "no service
    answers ... DEADLINE_EXCEEDED (is `datastore serve` running? start it ...)"; a socket with
    no process behind it still says start it."""
    from datastore.cli import parser
    from datastore.service.commands import run_shutdown, run_status

    run = {"status": run_status, "shutdown": run_shutdown}[command]
    sock = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as hung:
        hung.bind(str(sock))
        hung.listen()  # the kernel takes the connection; nobody reads it
        args = parser().parse_args([command, "--socket", str(sock), "--timeout", "0.5"])
        assert run(args) == 1
    assert capsys.readouterr().err == (
        f"datastore {command}: the service at unix://{sock} did not answer within 0.5 s: it "
        "may be hung (--timeout waits longer)\n"
    )
    assert run(args) == 1  # the socket file left, no process: not running
    assert "(is `datastore serve` running? start it" in capsys.readouterr().err


def test_shutdown_over_tcp_needs_the_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    env = client_env(XDG_RUNTIME_DIR=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    s = Server(tmp_path / "logs", ["--socket", str(tmp_path / "s.sock"), "--tcp", "127.0.0.1:0",
                                   "--token-file", str(token)], env)  # fmt: skip
    try:
        tcp = s.listening(30)[1]
        bad = cli("shutdown", "--tcp", tcp, env=env)
        assert bad.returncode == 1
        assert "refused: UNAUTHENTICATED: missing token" in bad.stderr
        assert s.proc.poll() is None  # still serving
        ok = cli("shutdown", "--tcp", tcp, "--token-file", str(token), env=env)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout == f"datastore serve (pid {s.proc.pid}) stopped\n"
        assert s.proc.wait(10) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def test_shutdown_with_no_service_or_a_bad_grace(tmp_path):
    env = client_env()
    proc = cli("shutdown", "--socket", str(tmp_path / "none.sock"), env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("datastore shutdown: no service answers at unix://")
    proc = cli("shutdown", "--socket", str(tmp_path / "none.sock"), "--grace", "-1", env=env)
    assert proc.returncode == 2
    assert "--grace: must be 0..3600 seconds, got '-1'" in proc.stderr


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_process_watch_calls_back_once_when_a_watched_process_ends(pidfd):
    ended: list[int] = []
    done = threading.Event()
    watch = ProcessWatch(lambda pid: (ended.append(pid), done.set()), pidfd=pidfd)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = start_ticks(child.pid)
        assert ticks is not None and running(child.pid, ticks)
        assert not watch.watch(child.pid, ticks + 1, boot_id())  # another process, same pid
        assert not watch.watch(child.pid, ticks, "another-kernel")  # another node
        assert watch.watch(child.pid, ticks, boot_id())
        assert watch.watch(child.pid, ticks, boot_id())  # twice: still one pidfd
        assert ended == []
        child.kill()  # not waited for: a zombie has ended too
        assert done.wait(10)
        assert ended == [child.pid]
        assert not running(child.pid, ticks)
    finally:
        watch.close()
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_this_process_describes_itself():
    pid, ticks, boot = this_process()
    assert (pid, ticks, boot) == (os.getpid(), start_ticks(os.getpid()), boot_id())
    assert len(boot) == 36  # a UUID


def test_another_users_socket_is_said_to_be_theirs_not_a_service_to_start():
    """gRPC's detail as another user connects to a 0600 socket: the client said 'is `datastore
    serve` running? start it', though it runs."""
    from datastore.service.commands import unreachable

    details = (
        "failed to connect to all addresses; last error: FAILED_PRECONDITION: unix:/r/s.sock: "
        "connect failed: addr: unix:/r/s.sock error: Permission denied"
    )
    assert unreachable("unix:///r/s.sock", "UNAVAILABLE", details, False) == (
        "no access to unix:///r/s.sock: permission denied (a socket of another user's service: "
        "start your own, or pass --address)"
    )


def test_a_socket_path_grpc_cannot_bind_is_refused_in_one_line(short_tmp):
    """A socket path of 106 bytes passed the check (107, sun_path's) and grpcio 1.85 then
    refused to bind it: `datastore serve: internal error: RuntimeError: Failed to bind`."""
    fits = short_tmp / ("x" * (105 - len(str(short_tmp)) - 1))
    over = short_tmp / ("y" * (106 - len(str(short_tmp)) - 1))
    assert (len(str(fits)), len(str(over))) == (105, 106)
    with pytest.raises(ValueError) as err:
        claim_socket(over, private=False)
    assert str(err.value) == (
        f"socket path is 106 bytes, over the 105-byte limit of a Unix socket: {over}"
    )
    claim_socket(fits, private=False).release()
