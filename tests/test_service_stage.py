"""``Stage`` through ``datastore serve`` and ``datastore stage --progress-json / --service``.

One real ``datastore serve`` subprocess (``--allow`` the test's directory) serves the module;
stages run as real ``datastore stage`` subprocesses of it. The kill-on-cancel logic is tested
in-process with a stand-in child, so no test waits on a large copy.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import ctrl_c_heard, make_tree, random_bytes, run_stage, slow_file, tree_bytes
from test_service_basic import Server, wait_serving

from datastore.service import stage_job
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.errors import ServiceError
from staging.confine import beneath
from staging.manifest import lock_dest, meta_dir
from staging.progress import Progress


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stage-svc")


@pytest.fixture(scope="module")
def env(root) -> dict[str, str]:
    e = dict(os.environ)
    e["XDG_RUNTIME_DIR"] = str(root / "runtime")  # never the real default directory
    (root / "runtime").mkdir()
    return e


@pytest.fixture(scope="module")
def service(root, env):
    """``(socket, server)``: one ``datastore serve --allow ROOT/data`` for the module."""
    sock = root / "s.sock"
    (root / "data").mkdir()
    s = Server(root / "logs", ["--socket", str(sock), "--allow", str(root / "data")], env)
    wait_serving(s.listening()[0], s.proc)
    yield sock, s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(10)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(10)


def stage_call(sock: Path, **fields) -> list:
    fields.setdefault("unpack", True)
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        return list(pb_grpc.DataStoreStub(ch).Stage(pb.StageRequest(**fields), timeout=60))


def cli_stage(*args, env) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datastore", "stage", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def tar_of(path: Path, tree: Path) -> Path:
    import tarfile

    with tarfile.open(path, "w") as tf:
        tf.add(tree, arcname=".")
    return path


# -- --progress-json --------------------------------------------------------------------------
def test_progress_lines_are_ordered_throttled_and_complete():
    out = io.StringIO()
    total = 8 * 1000 * 1024
    with Progress(total, enabled=False, json_lines=True, out=out, interval_s=0.25) as bar:
        threads = [
            threading.Thread(target=lambda: [bar.advance(1024) for _ in range(1000)])
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert all(set(x) == {"event", "bytes_done", "bytes_total"} for x in lines)
    assert all(x["event"] == "progress" and x["bytes_total"] == total for x in lines)
    done = [x["bytes_done"] for x in lines]
    assert done[0] == 0 and done[-1] == total and done == sorted(done)
    assert len(lines) <= 4  # start, end, and at most one per 0.25 s of a fast copy


def test_progress_json_cli_prints_progress_then_the_summary(tmp_path):
    src = make_tree(tmp_path / "src")
    r = run_stage(src, "--to", tmp_path / "dst", "--progress-json", check=0)
    lines = [json.loads(x) for x in r.stdout.splitlines()]  # every line is one object
    progress, summary = lines[:-1], lines[-1]
    assert len(progress) >= 2 and all(x["event"] == "progress" for x in progress)
    done = [x["bytes_done"] for x in progress]
    assert done == sorted(done) and done[-1] == progress[-1]["bytes_total"] == summary["bytes"]
    assert summary["errors"] == [] and summary["files"] > 0
    assert tree_bytes(tmp_path / "dst" / "src") == tree_bytes(src)


# -- Stage through the service ----------------------------------------------------------------
def test_stage_tree_and_tar_through_the_service(service, root):
    sock, _ = service
    data = root / "data"
    tree = make_tree(data / "tree", seed=1)
    (data / "big.bin").write_bytes(random_bytes(3 << 20, 7))
    tar = tar_of(data / "packed.tar", make_tree(data / "packed", seed=2))
    dest = data / "dst"
    msgs = stage_call(sock, sources=[str(tree), str(tar), str(data / "big.bin")], dest=str(dest))
    *progress, last = msgs
    assert last.done and last.exit_code == 0, last.message
    assert progress and not any(m.done for m in progress)
    done = [m.bytes_done for m in progress]
    assert done == sorted(done) and done[-1] == last.bytes_done == last.bytes_total
    summary = json.loads(last.summary_json)
    assert summary["errors"] == [] and summary["bytes"] == last.bytes_total
    assert tree_bytes(dest / "tree") == tree_bytes(tree)
    packed = {k: v for k, v in tree_bytes(dest).items() if not k.startswith(("tree/", "big"))}
    assert packed == tree_bytes(data / "packed")  # the tar was unpacked into DEST
    assert (dest / "big.bin").read_bytes() == (data / "big.bin").read_bytes()


def test_load_makes_dest_resident_once_staged(service, root):
    """``StageRequest.load``: once the stage exits 0, DEST is opened as a dataset and read in,
    as ``datastore load DEST`` would (the last message comes after that)."""
    sock, _ = service
    data = root / "data"
    (data / "samples").mkdir()
    sources = []
    for i in range(4):
        sources.append(str(data / "samples" / f"s{i}.npy"))
        np.save(sources[-1], np.full((2, 3), i, np.float32))
    dest = data / "resident"
    last = stage_call(sock, sources=sources, dest=str(dest), load=True)[-1]
    assert last.done and last.exit_code == 0, last.message
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        reply = pb_grpc.DataStoreStub(ch).Status(pb.StatusRequest(), timeout=10)
    [x] = [x for x in reply.datasets if x.path == str(dest)]
    assert (x.num_samples, x.bytes_total, x.sessions) == (4, 4 * 2 * 3 * 4, 0)


def test_load_makes_each_staged_directory_resident_under_its_name(service, root):
    """A directory source lands under its own name in DEST (as with ``cp -r``): ``load`` makes
    that path resident; a staged directory that is no dataset makes the call end with exit
    code 2 naming it, after the others were loaded, with every file in place and the stage's
    summary (the call was refused, and the client printed no summary: as if nothing had been
    staged)."""
    sock, _ = service
    data = root / "data"
    for name, n in (("cosmo", 3), ("unet", 2)):
        (data / "sets" / name).mkdir(parents=True)
        for i in range(n):
            np.save(data / "sets" / name / f"s{i}.npy", np.full((4,), i, np.int32))
    (data / "sets" / "notes").mkdir()
    (data / "sets" / "notes" / "README.txt").write_text("not samples")
    dest = data / "landed"
    sources = [str(data / "sets" / name) for name in ("cosmo", "unet")]
    last = stage_call(sock, sources=sources, dest=str(dest), load=True)[-1]
    assert last.done and last.exit_code == 0, last.message
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        reply = pb_grpc.DataStoreStub(ch).Status(pb.StatusRequest(), timeout=10)
    got = {x.path: x.num_samples for x in reply.datasets}
    assert (got.get(str(dest / "cosmo")), got.get(str(dest / "unet"))) == (3, 2)
    assert str(dest) not in got

    mixed = [str(data / "sets" / "notes"), str(data / "sets" / "cosmo")]
    last = stage_call(sock, sources=mixed, dest=str(data / "mixed"), load=True)[-1]
    assert last.done and last.exit_code == 2
    assert last.message.startswith(
        f"staged, but not made resident (--load): {data / 'mixed' / 'notes'}: INVALID_ARGUMENT"
    )
    assert json.loads(last.summary_json)["files"] == 4  # README.txt and cosmo's 3
    assert (data / "mixed" / "notes" / "README.txt").read_text() == "not samples"
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        reply = pb_grpc.DataStoreStub(ch).Status(pb.StatusRequest(), timeout=10)
    assert str(data / "mixed" / "cosmo") in {x.path for x in reply.datasets}


def test_cli_load_with_service_makes_the_staged_directory_resident(service, root, env):
    sock, _ = service
    data = root / "data"
    (data / "cli-load" / "samples").mkdir(parents=True)
    for i in range(3):
        np.save(data / "cli-load" / "samples" / f"s{i}.npy", np.full((2,), i, np.int16))
    dest = data / "cli-load-dst"
    r = cli_stage(data / "cli-load" / "samples", "--to", dest, "--service", sock, "--load",
                  env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    status = subprocess.run(
        [sys.executable, "-m", "datastore", "status", "--socket", str(sock), "--json"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    paths = {d["path"]: d["num_samples"] for d in json.loads(status.stdout)["datasets"]}
    assert paths.get(str(dest / "samples")) == 3
    alone = cli_stage(data / "cli-load" / "samples", "--to", data / "x", "--load", env=env)
    assert alone.returncode == 2 and "--load needs --service" in alone.stderr
    assert not (data / "x").exists()


def test_landed_paths_follow_cp_r(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "f.npy").write_bytes(b"")
    (tmp_path / "a.tar").write_bytes(b"")
    srcs = [str(tmp_path / "dir") + "/", str(tmp_path / "f.npy"), str(tmp_path / "a.tar")]
    assert stage_job.landed(srcs, "/d") == ["/d/dir", "/d"]


def test_cli_service_streams_progress_and_exits_with_the_stage_code(service, root, env):
    sock, s = service
    data = root / "data"
    src = make_tree(data / "cli-src", seed=3)
    dest = data / "cli-dst"
    r = cli_stage(src, "--to", dest, "--progress-json", f"--service={sock}", env=env)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["event"] == "progress" and lines[-1]["errors"] == []
    assert lines[-2]["bytes_done"] == lines[-1]["bytes"]
    assert tree_bytes(dest / "cli-src") == tree_bytes(src)
    # again, for people: nothing to copy, the usual summary line
    again = cli_stage(src, "--to", dest, "--service", sock, env={**env})
    assert again.returncode == 0 and again.stdout.startswith("staged 0 files"), again.stderr
    assert "skipped 7 unchanged" in again.stdout
    # DATASTORE_ADDRESS picks the service when --service names none
    via_env = cli_stage(
        src, "--to", dest, "--json", "--service", env={**env, "DATASTORE_ADDRESS": str(sock)}
    )
    assert via_env.returncode == 0 and json.loads(via_env.stdout)["skipped"] == 7
    events = [x["event"] for x in s.logs()]
    assert "stage_started" in events and "stage_done" in events


def test_failing_stage_gives_its_exit_code_and_message(service, root, env):
    sock, _ = service
    data = root / "data"
    missing = data / "no-such-source"
    last = stage_call(sock, sources=[str(missing)], dest=str(data / "fail-dst"))[-1]
    assert last.done and last.exit_code == 2
    assert str(missing) in json.loads(last.summary_json)["errors"][0]
    r = cli_stage(missing, "--to", data / "fail-dst", "--service", sock, env=env)
    assert r.returncode == 2 and f"error: {missing}: source not found" in r.stderr

    dest = data / "locked-dst"  # another stage holds DEST: its lock's error comes back
    os.makedirs(meta_dir(str(dest)))
    fd = lock_dest(str(dest))
    try:
        make_tree(data / "locked-src")
        last = stage_call(sock, sources=[str(data / "locked-src")], dest=str(dest))[-1]
    finally:
        os.close(fd)
    assert last.done and last.exit_code == 1 and last.summary_json == ""
    assert "another 'datastore stage' is writing to this destination" in last.message


def test_paths_outside_the_allowed_roots_are_refused(service, root, env):
    sock, _ = service
    outside = make_tree(root / "outside")
    for fields in (
        {"sources": [str(outside)], "dest": str(root / "data" / "d")},
        {"sources": [str(root / "data")], "dest": str(root / "elsewhere")},
    ):
        with pytest.raises(grpc.RpcError) as err:
            stage_call(sock, **fields)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    link = root / "data" / "sneaky"
    link.symlink_to(outside)  # under the root by name, outside once resolved
    with pytest.raises(grpc.RpcError) as err:
        stage_call(sock, sources=[str(link)], dest=str(root / "data" / "d"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        stage_call(sock, sources=[], dest=str(root / "data" / "d"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = cli_stage(outside, "--to", root / "data" / "d", "--service", sock, env=env)
    assert r.returncode == 2 and "PERMISSION_DENIED" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (root / "data" / "d").exists()


def test_a_symlink_inside_an_allowed_tree_cannot_reach_outside(service, root):
    """A tree under the allowed root holding a link to a file outside it: the file is not
    copied (an error names the link), the rest of the tree is."""
    sock, _ = service
    secret = root / "secret.txt"
    secret.write_text("not for clients")
    tree = root / "data" / "linked"
    tree.mkdir()
    (tree / "ok.txt").write_text("fine")
    (tree / "leak.txt").symlink_to(secret)
    (tree / "inside.txt").symlink_to(tree / "ok.txt")  # a link within the root is followed
    dest = root / "data" / "linked-dst"
    *_, last = stage_call(sock, sources=[str(tree)], dest=str(dest))
    assert last.exit_code != 0
    errors = json.loads(last.summary_json)["errors"]
    assert any("leak.txt: a symlink out of the allowed roots" in e for e in errors), errors
    assert not (dest / "linked" / "leak.txt").exists()
    assert (dest / "linked" / "ok.txt").read_text() == "fine"
    assert (dest / "linked" / "inside.txt").read_text() == "fine"


def test_unreachable_service_is_one_line_naming_the_address(tmp_path, env):
    sock = tmp_path / "nobody.sock"
    r = cli_stage(tmp_path, "--to", tmp_path / "d", f"--service={sock}", env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert "no service answers" in r.stderr and str(sock) in r.stderr


def test_service_option_refuses_what_the_request_cannot_carry(tmp_path, env):
    r = cli_stage(tmp_path, "--to", tmp_path / "d", "--mode", "shard", "--service", env=env)
    assert r.returncode == 2 and "--service does not take --mode" in r.stderr
    for flag in (["--confine", str(tmp_path)], ["--preserve-special-bits"]):  # never silently
        r = cli_stage(tmp_path, "--to", tmp_path / "d", *flag, "--service", env=env)
        assert r.returncode == 2 and f"--service does not take {flag[0]}" in r.stderr
    src = make_tree(tmp_path / "src")  # `--service SRC`: argparse took SRC for the address
    r = cli_stage("--service", src, "--to", tmp_path / "d", env=env)
    assert r.returncode == 2 and "not a socket" in r.stderr


# -- cancelling kills the stage's process group -----------------------------------------------
CHILD = """
import json, os, signal, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(str(os.getpid()))
print(json.dumps({"event": "progress", "bytes_done": 1, "bytes_total": 2}), flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_cancel_kills_the_stage(tmp_path, monkeypatch, kind):
    pid_file = tmp_path / "pid"
    argv = [sys.executable, "-c", CHILD, str(pid_file), kind]
    monkeypatch.setattr(stage_job, "stage_argv", lambda *a: argv)
    monkeypatch.setattr(stage_job, "KILL_AFTER_S", 0.5)
    listening = [True]
    msgs = []
    t0 = time.monotonic()
    for m in stage_job.stream_stage(pb.StageRequest(), lambda: listening[0]):
        msgs.append(m)
        listening[0] = False  # the client goes away after the first message
    assert [(m.bytes_done, m.done) for m in msgs] == [(1, False)]
    assert time.monotonic() - t0 < 5
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_request_validation():
    with pytest.raises(ServiceError) as err:
        stage_job.stage_argv(pb.StageRequest(sources=["rel/path"], dest="/d"))
    assert err.value.code == "INVALID_ARGUMENT"
    argv = stage_job.stage_argv(
        pb.StageRequest(sources=["/a", "/b"], dest="/d", verify=True, streams=3)
    )
    assert argv[3:] == [
        *("stage", "/a", "/b", "--to", "/d", "--progress-json"),
        *("--verify", "--no-unpack", "--streams", "3"),
    ]
    with pytest.raises(ServiceError) as err:
        stage_job.stage_argv(pb.StageRequest(sources=["/a"], dest="/d"), ["/a"])
    assert err.value.code == "PERMISSION_DENIED"
    assert beneath("/a/b", ["/a/"]) and not beneath("/ab", ["/a"])


def test_ctrl_c_cancels_the_stage_on_the_service(service, root, env):
    """SIGINT to the client: exit 130, and the service kills the stage, whose lock frees."""
    sock, s = service
    src = root / "data" / "sparse"
    src.mkdir()
    slow_file(src / "huge", 2 << 30)  # reads fast, takes seconds to write
    dest = root / "data" / "ctrl-c-dst"
    client = subprocess.Popen(
        ctrl_c_heard([
            *(sys.executable, "-m", "datastore", "stage", src, "--to", dest),
            *("--streams", "1", "--progress-json", f"--service={sock}"),
        ]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    first = json.loads(client.stdout.readline())
    assert first == {"event": "progress", "bytes_done": 0, "bytes_total": 2 << 30}
    client.send_signal(signal.SIGINT)
    assert client.wait(10) == 130
    assert "interrupted" in client.stderr.read()
    deadline = time.monotonic() + 30  # (a loaded host took over 10 s)
    while True:  # the stage held DEST's lock until it died
        try:
            os.close(lock_dest(str(dest)))
            break
        except BlockingIOError:
            assert time.monotonic() < deadline, "the stage still runs after the client left"
            time.sleep(0.1)
    assert not (dest / "sparse" / "huge").exists()  # nothing half-written under its name
    while not any(x["event"] == "stage_cancelled" for x in s.logs()):  # logged once it is dead
        assert time.monotonic() < deadline, "the service never logged the cancelled stage"
        time.sleep(0.1)


class _ClientListening:
    """What ``Servicer.Stage`` asks of its gRPC context: the client still listens; ``abort``
    raises, as gRPC's does."""

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"aborted: {code.name}: {details}")


def _stage_servicer(tmp_path) -> tuple[Any, io.StringIO]:
    """The ``Servicer`` that ``datastore serve`` builds, logging into the returned buffer."""
    from datastore.service.config import ServeConfig
    from datastore.service.logs import JsonLog
    from datastore.service.servicer import Counters, Servicer, Stop

    logs = io.StringIO()
    config = ServeConfig(socket=tmp_path / "s.sock")
    servicer = Servicer(
        config=config, listen=[], stop=Stop(), counters=Counters(), log=JsonLog(logs)
    )
    return servicer, logs


def _events(logs: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in logs.getvalue().splitlines()]


def test_a_refused_stage_is_logged_refused_not_cancelled(tmp_path):
    servicer, logs = _stage_servicer(tmp_path)
    replies = servicer.Stage(pb.StageRequest(dest=str(tmp_path / "dst")), _ClientListening())
    with pytest.raises(RuntimeError, match="aborted: INVALID_ARGUMENT: Stage needs at least"):
        next(replies)
    assert _events(logs) == ["stage_started", "refused"]


def test_a_stage_whose_stream_grpc_drops_is_killed_and_logged_cancelled(tmp_path):
    """The client leaves while a progress reply is being sent: gRPC's server then stops
    iterating the response stream and drops it (closes the generator) instead of asking for
    the next reply. The stage is killed at once and the service logs ``stage_cancelled``
    (before, the log line was skipped on that path, and the end-to-end Ctrl-C test failed
    when its client left at that moment). Driven as gRPC's server drives it, on the
    ``Servicer`` that ``datastore serve`` builds."""
    src = tmp_path / "sparse"
    src.mkdir()
    slow_file(src / "huge", 2 << 30)  # reads fast, takes seconds to write
    dest = tmp_path / "dst"
    servicer, logs = _stage_servicer(tmp_path)
    request = pb.StageRequest(sources=[str(src)], dest=str(dest), streams=1)
    replies = servicer.Stage(request, _ClientListening())
    assert not next(replies).done  # a progress reply: the stage runs
    replies.close()
    assert _events(logs) == ["stage_started", "stage_cancelled"]
    os.close(lock_dest(str(dest)))  # the stage died: DEST's lock is free (BlockingIOError if not)
    assert not (dest / "sparse" / "huge").exists()
