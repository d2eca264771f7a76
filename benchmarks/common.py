"""What the benchmark scripts share: finding the venv's tools, the page cache, the machine, the
statistics they print, the JSON results they write (read by ``benchmarks/report.py``), the
memcpy ceiling, simulated compute, a ``datastore serve`` subprocess, and the tuning of a torch
``DataLoader`` peer."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import secrets
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = [
    "TAG",
    "Compute",
    "PageCache",
    "Service",
    "cores",
    "cpu_seconds",
    "free_port",
    "key_ratio",
    "machine_info",
    "median",
    "memcpy_ceiling",
    "memcpy_gbps",
    "parse_counts",
    "read_tagged",
    "say",
    "spread",
    "stats",
    "timed_epochs",
    "venv_tool",
    "write_results",
]

TAG = "@@ "  # a benchmark child's protocol lines on stdout start with this
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MIB = 1 << 20


def venv_tool(name: str) -> str:
    """The executable ``name`` next to this interpreter (the venv's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    exe = here if os.access(here, os.X_OK) else shutil.which(name)
    if not exe:
        sys.exit(f"{name} not found: run with the project venv's python (make bench)")
    return exe


class PageCache:
    """Drops the page cache before cold runs (root only), or remembers and says that it cannot."""

    def __init__(self, warm: bool) -> None:
        self.can_drop = not warm
        self.note = "never dropped (--warm)" if warm else "dropped before every cold run"

    def drop(self) -> None:
        os.sync()
        if not self.can_drop:
            return
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as exc:
            self.can_drop = False
            self.note = f"NOT dropped (not permitted: {exc.strerror}); 'cold' figures are warm"
            print(f"NOTE: cannot drop the page cache ({exc}); cold runs are warm", flush=True)


def machine_info(*extra: str, date: bool = True) -> str:
    """One line: cores, CPU model, kernel, Python, anything in ``extra``, and the date (unless
    ``date`` is false)."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    parts = [
        f"nproc {os.cpu_count()}",
        f"CPU {cpu}",
        f"kernel {platform.release()}",
        f"Python {platform.python_version()}",
        *extra,
    ]
    return ", ".join(parts) + (time.strftime(", date %Y-%m-%d %H:%M:%S %Z") if date else "")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def say(line: str) -> None:
    """A protocol line to the parent benchmark."""
    print(TAG + line, flush=True)


def read_tagged(proc: subprocess.Popen) -> str:
    """The next protocol line of a child (other output passes through)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(TAG):
            return line[len(TAG) :].rstrip("\n")
        sys.stdout.write(line)
    raise SystemExit(f"a benchmark child (pid {proc.pid}) exited with {proc.wait()}")


def timed_epochs(epoch: Callable[[], tuple[int, int]], epochs: int) -> None:
    """A benchmark client's protocol: one warm-up ``epoch()`` (``-> (batches, bytes)``), then
    ``ready``; on the parent's go (a line on stdin) ``epochs`` timed epochs, reported as one
    JSON line (start, end, batches, bytes, CPU seconds of this process)."""
    epoch()
    say("ready")
    sys.stdin.readline()
    batches = nbytes = 0
    cpu, t0 = time.process_time(), time.monotonic()
    for _ in range(epochs):
        nb, n = epoch()
        batches, nbytes = batches + nb, nbytes + n
    t1, cpu = time.monotonic(), time.process_time() - cpu
    say(json.dumps({"t0": t0, "t1": t1, "batches": batches, "bytes": nbytes, "cpu": cpu}))


# ----------------------------------------------------------------------------- statistics


def verdict(ok: bool) -> str:
    """A target's column in the reports."""
    return "PASS" if ok else "MISS"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """The full range of repeats, ``min-max`` (one value alone when there is one)."""
    if not xs:
        return "-"
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}" if len(xs) > 1 else fmt.format(xs[0])


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_counts(text: str, auto: list[int], what: str) -> list[int]:
    """A comma-separated list of counts (``"2,4"``), or ``auto`` for ``"auto"``."""
    if text.strip() == "auto":
        return auto
    try:
        counts = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"{what}: integers, comma separated, or 'auto'; got {text!r}") from None
    if not counts or counts[0] < 0:
        raise SystemExit(f"{what}: non-negative integers, comma separated; got {text!r}")
    return counts


# ----------------------------------------------------------------------------- JSON results


def stats(xs: list[float]) -> dict[str, Any] | None:
    """A repeated measurement as JSON: its median, min, max and every value (``None`` when
    there is none)."""
    if not xs:
        return None
    values = [float(x) for x in xs]
    return {"median": median(values), "min": min(values), "max": max(values), "values": values}


def key_ratio(
    case: str,
    *,
    ours: float,
    peer: float | None,
    unit: str,
    ratio: float | None,
    of: str,
    target: str = "",
    ok: bool | None = None,
) -> dict[str, Any]:
    """One row of the report's summary table: ours vs the peer (medians, in ``unit``), the
    ratio and what it divides (``of``, e.g. ``"peer time / ours"``), and the target (``ok``:
    met or not; ``None`` without a target)."""
    return {
        "case": case,
        "ours": ours,
        "peer": peer,
        "unit": unit,
        "ratio": ratio,
        "of": of,
        "target": target,
        "pass": ok,
    }


def write_results(
    path: str, benchmark: str, results: dict[str, Any], ratios: list[dict[str, Any]], *extra: str
) -> None:
    """Write a benchmark's results as JSON to ``path`` (through a temporary file, renamed: never
    half-written), with what ``benchmarks/report.py`` reads beside them: the benchmark's name,
    the command line that ran it, the machine (``extra`` added to it), the date, and its key
    ``ratios`` (:func:`key_ratio` rows)."""
    script = os.path.abspath(sys.argv[0])
    if script.startswith(REPO + os.sep):
        script = os.path.relpath(script, REPO)
    doc = {
        "benchmark": benchmark,
        "command": shlex.join(["python", script, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine_info(*extra, date=False),
        "ratios": ratios,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- memcpy


def memcpy_gbps(nbytes: int, threads: int = 1, reps: int = 5, pinned: bool = False) -> list[float]:
    """GB/s of ``threads`` threads each copying its disjoint slice of an ``nbytes`` array into a
    preallocated, touched buffer (``numpy.copyto``, which releases the GIL), one figure a rep.
    With ``pinned`` the buffer is page-locked (``torch.empty(pin_memory=True)``; needs CUDA)."""
    src = np.ones(nbytes, np.uint8)
    if pinned:
        import torch

        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    else:
        dst = np.empty(nbytes, np.uint8)
    dst.fill(0)
    edges = [nbytes * i // threads for i in range(threads + 1)]
    slices = [slice(a, b) for a, b in itertools.pairwise(edges)]

    def copy(s: slice) -> None:
        np.copyto(dst[s], src[s])

    out = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, slices))  # the threads exist and have run once
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(copy, slices))
            out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def memcpy_ceiling() -> float:
    """GB/s of one thread's ``numpy.copyto`` of 256 MiB into an existing array, median of 5."""
    return median(memcpy_gbps(256 * MIB))


# ----------------------------------------------------------------------------- compute


class Compute:
    """Simulated compute that burns CPU as a model's step does: a loop of float32 matrix
    products (``torch.mm``), calibrated when created, alone, to take ``ms`` milliseconds. Run
    beside a loader it competes for the cores as a model would, so it then takes longer (which
    ``time.sleep`` would hide).

    Args:
        ms: milliseconds of compute per call, when nothing else runs. ``0``: none.
        iters: the matrix products per call, when already calibrated elsewhere. Default: calibrate.
    """

    SIDE = 192

    def __init__(self, ms: float, iters: int | None = None) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self._a = torch.rand(self.SIDE, self.SIDE, generator=g)
        self._b = torch.rand(self.SIDE, self.SIDE, generator=g)
        self._c = torch.empty(self.SIDE, self.SIDE)
        self.ms = ms
        self.iters = iters if iters is not None else self.calibrate(ms)

    def _run(self, n: int) -> None:
        import torch

        for _ in range(n):
            torch.mm(self._a, self._b, out=self._c)

    def calibrate(self, ms: float) -> int:
        """Matrix products that take ``ms`` milliseconds here now (median of 3 estimates)."""
        if ms <= 0:
            return 0
        self._run(10)
        per = []
        for _ in range(3):
            n, t0 = 0, time.perf_counter()
            while (t := time.perf_counter() - t0) < max(0.05, 2 * ms / 1e3):
                self._run(8)
                n += 8
            per.append(t / n)
        return max(1, round(ms / 1e3 / median(per)))

    def __call__(self) -> float:
        """One step of compute; the seconds it took."""
        t0 = time.perf_counter()
        self._run(self.iters)
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One ``datastore serve`` subprocess on a Unix socket in a fresh temporary directory (with
    its own ``XDG_RUNTIME_DIR``/``XDG_STATE_HOME``); with ``tcp=True`` also on TCP at
    127.0.0.1 (a free port) with a token file (``--tcp``, ``--token-file``).

    Attributes:
        socket: the Unix socket path.
        tcp: ``"127.0.0.1:PORT"``, or ``None`` without ``tcp``.
        token: the shared secret TCP calls carry, or ``None`` without ``tcp``.
        proc: the service process.
    """

    def __init__(self, *, tcp: bool = False) -> None:
        import grpc

        self.tmp = tempfile.mkdtemp(prefix="datastore-bench-")
        runtime = os.path.join(self.tmp, "runtime")
        os.makedirs(runtime, mode=0o700)
        self.socket = os.path.join(self.tmp, "s.sock")
        env = {**os.environ, "XDG_RUNTIME_DIR": runtime, "XDG_STATE_HOME": f"{self.tmp}/state"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "datastore", "serve", "--socket", self.socket]
        self.tcp: str | None = None
        self.token: str | None = None
        if tcp:
            self.token = secrets.token_hex(16)
            token_file = os.path.join(self.tmp, "token")
            with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(self.token)
            self.tcp = f"127.0.0.1:{free_port()}"
            cmd += ["--tcp", self.tcp, "--token-file", token_file]
        self.out = open(os.path.join(self.tmp, "out"), "wb")  # noqa: SIM115 (closed in stop)
        self.err = open(os.path.join(self.tmp, "err"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=self.err)
        self._wait_serving()
        from datastore.service._pb.v1 import datastore_pb2 as pb
        from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc

        self.pb = pb
        limit = 256 * MIB
        self.channel = grpc.insecure_channel(
            f"unix://{self.socket}",
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ],
        )
        self.stub = pb_grpc.DataStoreStub(self.channel)

    def _wait_serving(self, timeout: float = 60.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with open(os.path.join(self.tmp, "out")) as out:
            while "datastore serve: listening on " not in out.read():
                self._check(deadline)
                out.seek(0)
                time.sleep(0.05)
        with grpc.insecure_channel(f"unix://{self.socket}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                self._check(deadline)
                time.sleep(0.05)

    def _check(self, deadline: float) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            with open(os.path.join(self.tmp, "err")) as f:
                sys.exit(f"datastore serve did not start: {f.read()[-2000:]}")

    def load(self, path: str) -> None:
        """Make ``path`` resident now, and wait until it is."""
        self.stub.LoadDataset(self.pb.LoadDatasetRequest(dataset_path=path, wait=True), timeout=600)

    def status(self) -> Any:
        return self.stub.Status(self.pb.StatusRequest(), timeout=10)

    def stop(self) -> None:
        import grpc

        with contextlib.suppress(grpc.RpcError):
            self.stub.Shutdown(self.pb.ShutdownRequest(grace_s=1.0, reason="benchmark"), timeout=5)
        self.channel.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
