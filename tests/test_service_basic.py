"""``datastore serve`` / ``datastore status``: a real gRPC server in a subprocess.

Every server is started as ``python -m datastore serve`` and waited for until the standard
``grpc.health.v1`` check answers SERVING; the fixture kills whatever is left by its pid.
"""

from __future__ import annotations

import contextlib
import filecmp
import http.client
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import h5py
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.calls import CallCounter, Refusing

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-t0ken"


class Server:
    """One ``datastore serve`` subprocess, its output files and how to reach it."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        n = len(list(workdir.glob("out-*")))
        self.out_path, self.err_path = workdir / f"out-{n}", workdir / f"err-{n}"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "datastore", "serve", *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
            )

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.stderr.splitlines() if line.strip()]

    def listening(self, timeout: float = 10.0) -> list[str]:
        """The addresses printed at start-up, once they are all printed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [
                ln.split(" on ", 1)[1]
                for ln in self.stdout.splitlines()
                if ln.startswith("datastore serve: listening on ")
            ]
            if lines and self.proc.poll() is None:
                return lines
            assert self.proc.poll() is None, f"serve exited: {self.stderr}"
            time.sleep(0.05)
        raise AssertionError(f"serve printed no address in {timeout} s: {self.stderr}")


def health_status(target: str, metadata=None, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2, metadata=metadata
        )
    return reply.status


def wait_serving(target: str, proc: subprocess.Popen, metadata=None, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "serve exited before it answered"
        try:
            if health_status(target, metadata) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"{target} did not answer health in {timeout} s"
        time.sleep(0.05)


def stub(target: str) -> tuple[grpc.Channel, pb_grpc.DataStoreStub]:
    ch = grpc.insecure_channel(target)
    return ch, pb_grpc.DataStoreStub(ch)


@pytest.fixture
def env(short_tmp):
    e = {k: v for k, v in os.environ.items() if k != "DATASTORE_ADDRESS"}
    # never the real default directory; a short one: the default socket's path must fit
    e["XDG_RUNTIME_DIR"] = str(short_tmp)
    # segments of their own: a service another test killed leaves some in /dev/shm, and the
    # first service to start then warns `removed_stale_segments`, a line the tests here count
    shm = tempfile.mkdtemp(prefix="basic-", dir="/dev/shm")
    e["DATASTORE_SHM_DIR"] = shm
    yield e
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def start(tmp_path, env):
    """``start(*args, wait=True)``: a ``datastore serve`` subprocess, killed at teardown."""
    started: list[Server] = []

    def _start(*args: str, wait: bool = True, env_over: dict[str, str] | None = None) -> Server:
        s = Server(tmp_path / "logs", list(args), {**env, **(env_over or {})})
        started.append(s)
        if wait:
            target = s.listening()[0]
            wait_serving(target, s.proc)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "datastore", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_health_reflection_status_and_shutdown(start, tmp_path, env):
    sock = tmp_path / "run" / "s.sock"
    s = start("--socket", str(sock))
    target = f"unix://{sock}"
    assert s.listening() == [target]
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700  # created by serve
    assert (
        health_status(target, service="datastore.v1.DataStore")
        == health_pb2.HealthCheckResponse.SERVING
    )

    with grpc.insecure_channel(target) as ch:
        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {x.name for r in replies for x in r.list_services_response.service}
    assert {"datastore.v1.DataStore", "grpc.health.v1.Health"} <= names

    ch, ds = stub(target)
    with ch:
        st = ds.Status(pb.StatusRequest(), timeout=5)
        assert st.pid == s.proc.pid and list(st.listen) == [target]
        assert st.uptime_s > 0 and st.calls_served >= 1 and st.version
        with pytest.raises(grpc.RpcError) as err:
            ds.OpenSession(pb.OpenSessionRequest(dataset_path="/x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no dataset at '/x'" in err.value.details()

        table = cli("status", "--socket", str(sock), env=env)
        assert table.returncode == 0, table.stderr
        assert "service" in table.stdout and f"pid {s.proc.pid}" in table.stdout
        assert target in table.stdout
        as_json = cli("status", "--socket", str(sock), "--json", env=env)
        assert as_json.returncode == 0, as_json.stderr
        d = json.loads(as_json.stdout)
        assert d["pid"] == s.proc.pid and d["sessions"] == [] and d["listen"] == [target]

        assert ds.Shutdown(pb.ShutdownRequest(reason="test"), timeout=5).accepted
    assert s.proc.wait(10) == 0  # the hang guard
    assert not sock.exists() and not sock.with_name("s.sock.lock").exists()
    assert not sock.parent.exists()  # serve created it, so serve removed it
    logs = s.logs()  # every stderr line is one JSON object
    events = [x["event"] for x in logs]
    assert events[0] == "listening" and "shutdown_requested" in events and events[-1] == "stopped"


def test_sigterm_drains_and_removes_default_socket(start, env):
    s = start()  # the default path: $XDG_RUNTIME_DIR/datastore/datastore.sock
    sock = Path(env["XDG_RUNTIME_DIR"]) / "datastore" / "datastore.sock"
    assert s.listening() == [f"unix://{sock}"]
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert cli("status", env=env).returncode == 0
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0
    assert not sock.exists() and not sock.parent.exists()
    assert s.logs()[-1]["event"] == "stopped" and s.logs()[-1]["why"] == "SIGTERM"


def test_kill9_leaves_stale_socket_next_serve_starts(start, tmp_path, env):
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock))
    s.proc.kill()
    s.proc.wait(10)
    assert sock.exists()  # stale: nothing answers on it

    r = cli("status", "--socket", str(sock), "--timeout", "2", env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert "no service answers" in r.stderr and str(sock) in r.stderr

    s2 = start("--socket", str(sock))
    assert any(x["event"] == "removed_stale_socket" for x in s2.logs())
    assert cli("status", "--socket", str(sock), env=env).returncode == 0
    s2.proc.send_signal(signal.SIGTERM)
    assert s2.proc.wait(10) == 0 and not sock.exists()
    assert tmp_path.exists()  # a directory serve did not create stays


def test_refuses_a_path_served_by_a_live_server(start, tmp_path):
    sock = tmp_path / "s.sock"
    first = start("--socket", str(sock))
    second = start("--socket", str(sock), wait=False)
    assert second.proc.wait(10) == 1
    err = second.logs()[-1]
    assert err["level"] == "error" and "live server" in err["msg"]
    assert health_status(f"unix://{sock}") == health_pb2.HealthCheckResponse.SERVING
    assert first.proc.poll() is None


def test_tcp_needs_the_token_on_every_call(start, tmp_path, env):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sock = tmp_path / "s.sock"
    s = start("--socket", str(sock), "--tcp", "127.0.0.1:0", "--token-file", str(token_file))
    unix, tcp = s.listening()
    assert unix == f"unix://{sock}" and tcp.startswith("127.0.0.1:")
    good = (("authorization", f"Bearer {TOKEN}"),)
    wait_serving(tcp, s.proc, metadata=good)

    ch, ds = stub(tcp)
    with ch:
        assert ds.Status(pb.StatusRequest(), timeout=5, metadata=good).pid == s.proc.pid
        for metadata in (None, (("authorization", "Bearer nope"),), (("authorization", TOKEN),)):
            for call in (
                lambda m: ds.Status(pb.StatusRequest(), timeout=5, metadata=m),
                lambda m: health_status(tcp, metadata=m),
                lambda m: list(
                    ds.StreamBatches(iter([pb.StreamBatchesRequest()]), timeout=5, metadata=m)
                ),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert any(x["event"] == "unauthenticated" for x in s.logs())
    open_paths = [x for x in s.logs() if x["event"] == "tcp_without_allow"]
    assert [(x["level"], x["msg"]) for x in open_paths] == [
        (
            "warning",
            "--tcp 127.0.0.1:0 without --allow: any client with the token may read every "
            "dataset and stage any tree this user can read, to any place it can write; confine "
            "them with --allow DIR",
        )
    ]

    ok = cli("status", "--tcp", tcp, "--token-file", str(token_file), "--json", env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["pid"] == s.proc.pid
    via_env = {**env, "DATASTORE_ADDRESS": tcp}  # HOST:PORT from the environment
    ok = cli("status", "--token-file", str(token_file), "--json", env=via_env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["pid"] == s.proc.pid, ok.stderr
    bad = cli("status", "--tcp", tcp, env=env)
    assert bad.returncode == 1 and "refused: UNAUTHENTICATED: missing token" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0 and not sock.exists()


@pytest.mark.parametrize(
    ("budget", "why"),
    [
        ("-5G", "must be >= 1, got '-5G'"),
        ("-.5G", "must be >= 1, got '-.5G'"),
        ("0.5", "must be >= 1, got '0.5'"),
        ("5Q", "must be bytes or a size like '512M' or '64G', got '5Q'"),
        ("nan", "must be a finite size like '512M' or '64G', got 'nan'"),
        ("1.5", "must be whole bytes or a size like '1.5G', got '1.5'"),
    ],
)
def test_a_bad_memory_budget_is_one_line_naming_it_and_exit_2(tmp_path, capsys, budget, why):
    """argparse's usage (11 lines) came above the error; one line, as ``datastore plan
    --memory-per-node -5G`` says."""
    from datastore.cli import main

    assert main(["serve", "--socket", str(tmp_path / "s.sock"), "--memory-budget", budget]) == 2
    units = "a plain number is bytes and K, M, G, T are powers of 1024"
    assert capsys.readouterr().err == (
        f"datastore serve: error: argument --memory-budget: {why}; {units}; leave it out for "
        "no limit (see datastore serve --help)\n"
    )
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("--workers", "x", "must be a whole number >= 1, got 'x'"),
        ("--workers", "1.5", "must be a whole number >= 1, got '1.5'"),
        ("--workers", "0", "must be a whole number >= 1, got '0'"),
        ("--node", "x", "must be a whole number >= 0, got 'x'"),
        ("--node", "-1", "must be a whole number >= 0, got '-1'"),
        ("--data-port", "x", "must be a whole number 0..65535, got 'x'"),
        ("--data-port", "65536", "must be a whole number 0..65535, got '65536'"),
        ("--grace", "x", "not a number of seconds: 'x'"),
        ("--grace", "-1", "must be 0..3600 seconds, got '-1'"),
        ("--grace", "nan", "must be 0..3600 seconds, got 'nan'"),
        ("--session-idle", "x", "not a number of seconds: 'x'"),
        ("--session-idle", "0", "must be a finite number of seconds > 0, got '0'"),
        ("--peer-timeout", "inf", "must be a finite number of seconds > 0, got 'inf'"),
        ("--peer-timeout", "1e10", "must be at most 86400 seconds, got '1e10'"),
    ],
)
def test_a_bad_number_is_one_line_naming_its_option_and_exit_2(
    tmp_path, capsys, option, value, why
):
    """A value of serve's numeric options that is not a number, or out of its range: one line
    naming the option, exit 2 (argparse's usage, 9 lines, came above ``argument --workers:
    invalid int value: 'x'``)."""
    from datastore.cli import main

    assert main(["serve", "--socket", str(tmp_path / "s.sock"), option, value]) == 2
    assert capsys.readouterr().err == (
        f"datastore serve: error: argument {option}: {why} (see datastore serve --help)\n"
    )
    assert not (tmp_path / "s.sock").exists()


def test_tcp_without_token_file_is_refused(tmp_path, env):
    r = cli("serve", "--socket", str(tmp_path / "s.sock"), "--tcp", "127.0.0.1:0", env=env)
    assert r.returncode == 2 and "--token-file" in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_a_tcp_host_that_does_not_resolve_is_one_line_naming_it(tmp_path, env):
    """``--tcp`` on a host name that does not resolve: exit 1, the service's one line naming
    the host (gRPC printed its C-core 'E1129 ... add_port.cc' line first)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    tcp = "no-such-host.invalid:0"
    r = cli("serve", "--socket", str(tmp_path / "s.sock"), "--tcp", tcp, "--token-file",
            str(token_file), env=env)  # fmt: skip
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "cannot_listen" in line, line
    assert f"cannot bind {tcp}: host 'no-such-host.invalid' does not resolve" in line, line
    assert not (tmp_path / "s.sock").exists()


def test_a_metrics_port_in_use_is_one_line_naming_it_and_why(tmp_path, env):
    """Another server holds the ``--metrics`` port: exit 1, one line saying the address and
    why, and no ``listening`` line before it (it said only '[Errno 98] Address already in
    use', after a line saying the service listened)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        metrics = f"127.0.0.1:{taken.getsockname()[1]}"
        r = cli("serve", "--socket", str(tmp_path / "s.sock"), "--metrics", metrics, env=env)
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "cannot_listen" in line, line
    assert f"--metrics {metrics}: cannot listen: [Errno 98] Address already in use" in line
    assert not (tmp_path / "s.sock").exists()


def test_metrics_are_served_on_their_path_alone_to_get_and_head():
    """``/metrics`` answers GET with the metrics and HEAD with their headers; another path is
    404 and another method 405 (every path, ``/foo`` and ``/metrics/../x`` included, got 200
    and the metrics, and HEAD got 405)."""
    from datastore.service.metrics import serve_metrics

    server, port = serve_metrics("127.0.0.1:0", lambda: pb.StatusResponse(batches_served=7))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

        def ask(method: str, path: str) -> tuple[int, bytes, str | None]:
            conn.request(method, path)
            reply = conn.getresponse()
            return reply.status, reply.read(), reply.getheader("Content-Length")

        code, body, length = ask("GET", "/metrics")
        assert code == 200 and b"datastore_batches_served_total 7.0" in body
        assert int(length) == len(body)
        assert ask("HEAD", "/metrics") == (200, b"", length)
        for path in ("/", "/foo", "/metrics/", "/metrics/../x", "/metricsx", "/favicon.ico"):
            assert ask("GET", path)[0] == 404, path
        assert ask("GET", "/metrics?name[]=datastore_calls_total")[0] == 200
        assert [ask(m, "/metrics")[0] for m in ("POST", "PUT", "OPTIONS")] == [405] * 3
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_metrics_listen_on_a_bracketed_ipv6_host():
    """``--metrics [::1]:PORT``, written as ``--tcp`` takes it, listens there (it stopped the
    service: "cannot listen: [Errno -2] Name or service not known")."""
    from datastore.service.metrics import serve_metrics

    server, port = serve_metrics("[::1]:0", lambda: pb.StatusResponse(batches_served=3))
    try:
        conn = http.client.HTTPConnection("::1", port, timeout=10)
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        assert reply.status == 200 and b"datastore_batches_served_total 3.0" in reply.read()
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_tcp_port_in_use_is_one_line_naming_it_and_why(tmp_path, env):
    """Another server holds the ``--tcp`` port: exit 1, one line (the service's own, saying
    the address and why), none of gRPC's (it printed a C-core 'E1128 ... add_port.cc' line
    first, and its message hid the reason behind GRPC_VERBOSITY=debug)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        tcp = f"127.0.0.1:{taken.getsockname()[1]}"
        r = cli("serve", "--socket", str(tmp_path / "s.sock"), "--tcp", tcp, "--token-file",
                str(token_file), env=env)  # fmt: skip
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "cannot_listen" in line and f"cannot bind {tcp}: Address already in use" in line
    assert not (tmp_path / "s.sock").exists()


def test_a_token_file_others_can_read_is_refused(tmp_path, env):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    sock = tmp_path / "s.sock"
    r = cli("serve", "--socket", str(sock), "--tcp", "127.0.0.1:0", "--token-file",
            str(token_file), env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "readable by others: chmod 600 it" in r.stderr
    assert not sock.exists()


def test_a_state_file_that_is_a_directory_is_refused_at_start(tmp_path, env):
    sock = tmp_path / "s.sock"
    r = cli("serve", "--socket", str(sock), "--state-file", str(tmp_path), env=env)
    assert r.returncode == 2, r.stderr
    assert f"--state-file {tmp_path} is a directory" in r.stderr
    assert "internal error" not in r.stderr and not sock.exists()


def test_an_allowed_root_that_does_not_exist_is_refused_at_start(tmp_path, env):
    sock, missing = tmp_path / "s.sock", tmp_path / "no-such-root"
    r = cli("serve", "--socket", str(sock), "--allow", str(tmp_path), "--allow", str(missing),
            env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"--allow {missing}: no such directory" in r.stderr and not sock.exists()


def test_only_a_tcp_service_without_allowed_roots_warns_of_it(tmp_path):
    """``--tcp`` without ``--allow`` said nothing: any token holder names any path."""
    from datastore.service.config import ServeConfig
    from datastore.service.server import _tcp_without_allow

    token = tmp_path / "token"
    tcp = {"tcp": "127.0.0.1:0", "token_file": token}
    cases = [{}, {"allowed_roots": (tmp_path,)}, tcp, {**tcp, "allowed_roots": (tmp_path,)}]
    warned = [_tcp_without_allow(ServeConfig(tmp_path / "s.sock", **kw)) for kw in cases]
    assert [w is not None for w in warned] == [False, False, True, False]


def test_status_when_nothing_listens(tmp_path, env):
    r = cli("status", "--socket", str(tmp_path / "none.sock"), "--timeout", "2", env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "no service answers" in r.stderr


@pytest.mark.parametrize("timeout", ["-1", "nan", "0"])
def test_a_timeout_that_waits_for_nothing_is_bad_usage(tmp_path, env, timeout):
    r = cli("status", "--socket", str(tmp_path / "none.sock"), "--timeout", timeout, env=env)
    assert r.returncode == 2, r.stderr
    assert (
        f"argument --timeout: must be a finite number of seconds > 0, got {timeout!r}" in r.stderr
    )
    assert "no service answers" not in r.stderr


@pytest.mark.parametrize("command", ["load", "unload"])
def test_a_path_that_is_not_utf8_is_bad_usage(tmp_path, env, command):
    path = str(tmp_path / os.fsdecode(b"x\xff.h5"))
    r = subprocess.run(
        [sys.executable, "-m", "datastore", command, path, "--socket", str(tmp_path / "s.sock")],
        cwd=REPO, env=env, capture_output=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert b"not a UTF-8 path, which the service cannot be sent" in r.stderr
    assert b"internal error" not in r.stderr


def test_a_socket_in_a_missing_directory_cannot_listen(tmp_path, env):
    sock = tmp_path / "no" / "such" / "s.sock"
    r = cli("serve", "--socket", str(sock), env=env)
    assert r.returncode == 1, r.stderr
    assert "cannot_listen" in r.stderr and str(sock.parent) in r.stderr
    assert "internal error" not in r.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_generated_code_is_up_to_date(tmp_path):
    """`make protos` into a temporary directory gives the committed files, byte for byte."""
    r = subprocess.run(
        ["make", "-s", "protos", f"PROTO_OUT={tmp_path}", f"BIN={Path(sys.executable).parent}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    fresh = tmp_path / "datastore" / "service" / "_pb" / "v1"
    committed = REPO / "datastore" / "service" / "_pb" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == ["datastore_pb2.py", "datastore_pb2.pyi", "datastore_pb2_grpc.py"]
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, names, shallow=False)
    assert not mismatch and not errors, f"stale generated code {mismatch + errors}: run make protos"


def _self_signed(cert: Path, key: Path) -> None:
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    subprocess.run([*openssl, "-addext", "subjectAltName=DNS:localhost"], check=True)


def test_tcp_over_tls(start, tmp_path, env):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    other, other_key = tmp_path / "other.pem", tmp_path / "other-key.pem"
    _self_signed(cert, key)
    _self_signed(other, other_key)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    s = start(
        "--socket", str(tmp_path / "s.sock"), "--tcp", "localhost:0",
        "--token-file", str(token_file), "--tls-cert", str(cert), "--tls-key", str(key),
    )  # fmt: skip
    tcp = s.listening()[1]
    secret = ("--tcp", tcp, "--token-file", str(token_file))
    deadline = time.monotonic() + 30
    while (ok := cli("status", *secret, "--tls-ca", str(cert), "--json", env=env)).returncode:
        assert time.monotonic() < deadline, ok.stderr
        time.sleep(0.2)
    assert json.loads(ok.stdout)["pid"] == s.proc.pid
    plain = cli("status", *secret, "--timeout", "2", env=env)  # plaintext to a TLS port
    assert plain.returncode == 1 and len(plain.stderr.strip().splitlines()) == 1
    assert "a service started with --tls-cert needs --tls-ca" in plain.stderr
    # the wrong CA: the handshake's reason, not "is `datastore serve` running?"
    wrong = cli("status", *secret, "--tls-ca", str(other), "--timeout", "2", env=env)
    last = wrong.stderr.strip().splitlines()[-1]  # (gRPC's own I-line may come first)
    assert wrong.returncode == 1 and f"no TLS connection to {tcp}" in last, wrong.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in last and "running?" not in last
    # `datastore stage --service` over TLS stages, and without --tls-ca is told why not
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"tls" * 1000)
    stage = ("stage", str(src), "--to", str(tmp_path / "dst"), "--service", tcp, "--token-file",
             str(token_file))  # fmt: skip
    reached = cli(*stage, "--tls-ca", str(cert), env=env)
    assert reached.returncode == 0, reached.stderr
    assert (tmp_path / "dst" / "src" / "a.bin").read_bytes() == b"tls" * 1000
    unreached = cli(*stage, env=env)
    assert unreached.returncode == 1 and "needs --tls-ca" in unreached.stderr
    assert "pass --service ADDRESS" in unreached.stderr
    alone = cli("stage", str(src), "--to", str(tmp_path / "dst"), "--tls-ca", str(cert), env=env)
    assert alone.returncode == 2 and "--tls-ca needs --service" in alone.stderr
    not_a_ca = cli("status", *secret, "--tls-ca", str(key), env=env)
    assert not_a_ca.returncode == 2 and "no PEM certificate in it" in not_a_ca.stderr
    half = cli("serve", "--socket", str(tmp_path / "t.sock"), "--tls-cert", str(cert), env=env)
    assert half.returncode == 2 and "--tls-key" in half.stderr
    pair = ("--tls-cert", str(cert), "--tls-key", str(other_key))  # not its key
    bad = cli("serve", "--socket", str(tmp_path / "u.sock"), "--tcp", "localhost:0",
              "--token-file", str(token_file), *pair, env=env)  # fmt: skip
    [line] = bad.stderr.strip().splitlines()  # (no gRPC C-core lines, no "cannot bind")
    assert bad.returncode == 2 and "bad_tls_files" in line and "KEY_VALUES_MISMATCH" in line


def test_version(env):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    r = cli("--version", env=env)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"datastore {version}\n", "")


def make_dataset(path: Path, n: int = 8) -> str:
    """``n`` samples of 64 float32 (256 bytes each) in one HDF5 file; its real path."""
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(n * 64, dtype=np.float32).reshape(n, 4, 4, 4)
    return os.path.realpath(path)


def test_status_json_writes_integers_as_numbers(start, tmp_path, env):
    data = make_dataset(tmp_path / "d.h5")
    sock = str(tmp_path / "s.sock")
    start("--socket", sock, "--memory-budget", "64M")
    loaded = cli("load", data, "--wait", "--address", sock, env=env)
    assert loaded.returncode == 0, loaded.stderr
    r = cli("status", "--address", sock, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert '"memory_budget": 67108864,' in r.stdout  # a number, not the string "67108864"
    d = json.loads(r.stdout)
    [x] = d["datasets"]
    assert (x["path"], x["num_samples"], x["bytes_total"], x["bytes_resident"]) == (
        data, 8, 8 * 256, 8 * 256,
    )  # fmt: skip
    assert (d["memory_budget"], d["bytes_resident"], d["nodes"]) == (64 << 20, 8 * 256, 1)
    numbers = [d[k] for k in ("pid", "clients", "batches_served", "bytes_served",
                              "calls_served", "bytes_exchanged", "node")]  # fmt: skip
    numbers += [x[k] for k in ("sessions", "hits", "misses", "local_samples")]
    assert all(type(v) is int for v in numbers)
    assert type(d["uptime_s"]) is float and type(x["loading"]) is bool


def test_client_commands_take_the_address_from_the_environment(start, tmp_path, env):
    data = make_dataset(tmp_path / "d.h5")
    sock = str(tmp_path / "s.sock")
    s = start("--socket", sock)  # not the default socket: that one stays absent
    via_env = {**env, "DATASTORE_ADDRESS": sock}
    st = cli("status", "--json", env=via_env)
    assert st.returncode == 0 and json.loads(st.stdout)["pid"] == s.proc.pid, st.stderr
    ld = cli("load", data, "--wait", env=via_env)
    assert ld.returncode == 0 and ld.stdout.startswith(f"{data}: resident, "), ld.stderr
    un = cli("unload", data, env=via_env)
    assert un.returncode == 0 and un.stdout.startswith(f"{data}: unloaded, "), un.stderr
    # --address (or --socket) wins over the environment
    elsewhere = {**env, "DATASTORE_ADDRESS": str(tmp_path / "none.sock")}
    assert cli("status", "--address", sock, env=elsewhere).returncode == 0
    assert cli("status", "--socket", sock, env=elsewhere).returncode == 0
    # neither, and nothing at the default socket: one line naming both ways, exit 1
    default = Path(env["XDG_RUNTIME_DIR"]) / "datastore" / "datastore.sock"
    stage = ["stage", data, "--to", str(tmp_path / "dest"), "--service"]
    for args in (["status"], ["load", data], ["unload", data], stage):
        r = cli(*args, env=env)
        option = "--service" if args[0] == "stage" else "--address"
        assert (r.returncode, r.stdout) == (1, "")
        assert r.stderr == (
            f"datastore {args[0]}: no service named ({option} ADDRESS or $DATASTORE_ADDRESS) "
            f"and none at the default socket {default} (is `datastore serve` running?)\n"
        )
    assert not (tmp_path / "dest").exists()


def test_clients_are_the_open_sessions_streaming_or_not(start, tmp_path, env):
    """``StatusResponse.clients``: clients with an open session (the proto), not streams."""
    data = make_dataset(tmp_path / "d.h5")
    sock = str(tmp_path / "s.sock")
    start("--socket", sock)

    def clients_and_streams() -> tuple[int, list[int]]:
        r = cli("status", "--address", sock, "--json", env=env)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        return d["clients"], [x["streams"] for x in d["sessions"]]

    assert clients_and_streams() == (0, [])
    ch, ds = stub(f"unix://{sock}")
    with ch:
        opened = [
            ds.OpenSession(pb.OpenSessionRequest(dataset_path=data, global_batch=2), timeout=10)
            for _ in range(2)
        ]
        assert clients_and_streams() == (2, [0, 0])  # two sessions, neither streaming
        first = pb.StreamBatchesRequest(
            session_id=opened[0].session_id, transport=pb.TRANSPORT_INLINE
        )
        assert len(list(ds.StreamBatches(iter([first]), timeout=10))) == 4  # a whole epoch
        assert clients_and_streams() == (2, [0, 0])  # its stream ended, its session is open
        ds.CloseSession(pb.CloseSessionRequest(session_id=opened[0].session_id), timeout=10)
        assert clients_and_streams() == (1, [0])
        ds.CloseSession(pb.CloseSessionRequest(session_id=opened[1].session_id), timeout=10)
        assert clients_and_streams() == (0, [])


def test_a_stopping_service_refuses_new_work_and_answers_the_rest(tmp_path):
    """While a stopping service drains (its servers stop only after its streams ended), new
    work is ``UNAVAILABLE`` ('the service is stopping'); ``Status``, ``CloseSession``,
    ``Shutdown``, health checks and other services are still answered."""
    stopping = threading.Event()
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[Refusing(stopping.is_set)])
    names = ("OpenSession", "LoadDataset", "Status", "CloseSession", "Shutdown")
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("datastore.v1.DataStore", dict.fromkeys(names, echo)),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": echo}),
    ])  # fmt: skip
    target = f"unix://{tmp_path}/refusing.sock"
    server.add_insecure_port(target)
    server.start()

    def answers(method: str) -> str:
        try:
            return ch.unary_unary(f"/{method}")(b"", timeout=10).decode()
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    methods = [f"datastore.v1.DataStore/{n}" for n in names] + ["grpc.health.v1.Health/Check"]
    with grpc.insecure_channel(target) as ch:
        assert [answers(m) for m in methods] == ["ok"] * 6
        stopping.set()
        refused = "UNAVAILABLE: the service is stopping"
        assert [answers(m) for m in methods] == [refused, refused, "ok", "ok", "ok", "ok"]
    server.stop(None)


def test_calls_in_flight_count_as_clients_but_not_the_asker(tmp_path):
    """A real gRPC server with :class:`CallCounter`: a ``LoadDataset`` and a ``Stage`` in
    flight are clients; a session's ``StreamBatches`` is not (its session is), nor is the
    ``Status`` call asking; a call counts until it ends, cancelled or not."""
    counter = CallCounter()
    entered, release = threading.Semaphore(0), threading.Event()

    def held(request, context):
        entered.release()
        release.wait(30)
        return b""

    def held_stream(requests, context):
        yield held(requests, context)

    handlers = {
        "LoadDataset": grpc.unary_unary_rpc_method_handler(held),
        "Stage": grpc.unary_stream_rpc_method_handler(held_stream),
        "StreamBatches": grpc.stream_stream_rpc_method_handler(held_stream),
        "Status": grpc.unary_unary_rpc_method_handler(
            lambda request, context: str(counter.in_flight).encode()
        ),
    }
    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[counter])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("datastore.v1.DataStore", handlers)]
    )
    target = f"unix://{tmp_path}/calls.sock"
    server.add_insecure_port(target)
    server.start()
    ch = grpc.insecure_channel(target)

    def method(name: str, kind: str = "unary_unary"):
        return getattr(ch, kind)(f"/datastore.v1.DataStore/{name}")

    def asked() -> int:
        return int(method("Status")(b"", timeout=10))

    def until(n: int) -> None:  # a call's end reaches the counter just after its client
        deadline = time.monotonic() + 10
        while (got := asked()) != n:
            assert time.monotonic() < deadline, f"{got} clients, not {n}"
            time.sleep(0.05)

    try:
        assert asked() == 0
        load = method("LoadDataset").future(b"", timeout=30)
        stage = method("Stage", "unary_stream")(b"", timeout=30)
        stream = method("StreamBatches", "stream_stream")(iter([b""]), timeout=30)
        for _ in range(3):
            assert entered.acquire(timeout=10)
        assert asked() == 2  # LoadDataset and Stage
        stage.cancel()
        until(1)
        release.set()
        assert load.result() == b"" and list(stream) == [b""]
        until(0)
        assert counter.in_flight == 0 and counter.served >= 6
    finally:
        release.set()
        ch.close()
        server.stop(None)
