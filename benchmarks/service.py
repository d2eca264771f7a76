"""Benchmark ``datastore serve``'s delivery against the embedded loader and a bare gRPC stream.

What is measured
----------------
One HDF5 file written by h5py under ``--dir`` (default ``./bench-data/service``): ``--samples``
N (default 256) samples of ``x`` float32 (4, S, S, S), S = ``--side`` (default 64, 4 MiB a
sample), one chunk per sample. A batch is ``--batch`` B samples (default 8: 32 MiB). One
``datastore serve --socket SOCK`` subprocess (fresh ``XDG_RUNTIME_DIR``/``XDG_STATE_HOME``)
serves it; every client below is a separate Python process. All cases run in one run:

1. **Delivery to 1, 2 and 4 concurrent clients.** The n clients are the n ranks of one job
   (``rank=r, world=n``, global batch n x B, so each rank gets B samples a step and the job
   sees the whole dataset once per epoch), for

   a. shared memory: ``DataStoreLoader(path, batch_size=B, rank=r, world=n, seed=0,
      service=ServiceOptions(SOCK, transport="shm"))``;
   b. gRPC inline bytes: the same with ``transport="inline"``;
   c. embedded: ``DataStoreLoader(path, batch_size=B, rank=r, world=n, seed=0,
      exchange=ExchangeOptions(enabled=False))`` in each process (each holds its own
      preloaded copy);
   d. bare gRPC: each client streams, from a tiny standalone gRPC server in this file (a
      generic handler, identity bytes serializers, Unix socket, 256 MiB message limits as the
      service), one pre-built ``bytes`` message of one batch's size per step, received as
      ``bytes``: Python gRPC's ceiling for (b). Both of its processes make the malloc setting
      that the service and an inline ``DataStoreLoader(service=...)`` make
      (``datastore.service.wire.keep_large_blocks``), so the ratio compares like with like.

   The dataset is resident in the service first (``LoadDataset(wait=True)``). Each client
   constructs its loader and runs one untimed warm-up epoch, then all start together and run
   ``--epochs`` E (default 2) epochs, touching one element of each batch (so delivery is what
   is timed). Aggregate GB/s = bytes of ``x`` delivered to all clients / (last client's end -
   first client's start); batches/s likewise. Also printed: CPU seconds (user + system) per GB
   of all the clients, and of the server process (the service, or the bare server), from
   ``time.process_time`` and ``/proc/PID/stat``. Every service epoch is a new
   ``StreamBatches`` call (a new shared-memory segment for (a)), as a training loop sees it.
   Ratios: shm / embedded (target >= 0.9x) and inline / bare (target >= 0.8x), per n.
2. **Time to first batch.** Job 1: a fresh service, the dataset not resident, caches dropped
   (``sync; echo 3 > /proc/sys/vm/drop_caches``, after the client's imports); a new client
   process times ``DataStoreLoader(path, batch_size=B, seed=0,
   service=ServiceOptions(SOCK, transport="shm"))`` construction (``OpenSession``) + first
   batch. The service reads on first use and loads the rest in the background: we poll
   ``Status`` until ``datasets[0].loading`` is false and report the load time (from
   ``OpenSession``). Job 2: a new client process on the same service, dataset resident:
   construction + first batch.
   Embedded cold start: caches dropped, a new process times ``DataStoreLoader(...,
   exchange=ExchangeOptions(enabled=False))`` construction (preload of the whole dataset) +
   first batch. Imports are done before the clock starts. Target: job 2 >= 10x faster than job 1.

Repetitions (``--reps``) alternate the order of the cases; medians are reported. The ceiling
printed is the machine's memcpy bandwidth into a reused buffer (``numpy.copyto``, 256 MiB,
median of 5; as ``benchmarks/loader.py``). GB/s are 10^9 bytes of ``x`` per second.

Usage::

    python benchmarks/service.py                 # full run
    python benchmarks/service.py --quick         # smoke run: tiny sizes, 1 rep
    python benchmarks/service.py --samples 128 --reps 1 --out /tmp/service.md
    python benchmarks/service.py --cases 1 --clients 1 --kinds inline,bare   # one comparison
    python benchmarks/service.py --json benchmarks/results/service.json # for benchmarks/report.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import h5py
import numpy as np
from common import (
    TAG,
    PageCache,
    Service,
    cpu_seconds,
    key_ratio,
    machine_info,
    median,
    memcpy_ceiling,
    read_tagged,
    say,
    spread,
    stats,
    timed_epochs,
    verdict,
    write_results,
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MAX_MESSAGE = 256 * MIB  # as datastore serve: a batch is one message
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
BARE_METHOD = "/bench.Bare/Stream"
KINDS = ("shm", "inline", "embedded", "bare")
TARGET_SHM = 0.9  # shm / embedded
TARGET_INLINE = 0.8  # inline / bare
TARGET_FIRST = 10.0  # job 1 cold / job 2
LAYOUT_VERSION = 1
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data/service", help="where the dataset is written")
    p.add_argument("--samples", type=int, default=None, help="samples N (default 256; 32 quick)")
    p.add_argument("--side", type=int, default=None, help="x is (4,S,S,S) (default 64; quick 32)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank B (default 8; 4 quick)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per client (default 2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 quick)")
    p.add_argument("--clients", default="1,2,4", help="concurrent clients, comma separated")
    p.add_argument("--cases", default="1,2", help="cases to run, comma separated")
    p.add_argument("--kinds", default=",".join(KINDS), help="case 1 deliveries, comma separated")
    p.add_argument("--quick", action="store_true", help="smoke run: N=32, S=32, B=4, 1 rep")
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bare-server", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client or args.bare_server:
        return args
    quick = args.quick
    for name, full, small in (("samples", 256, 32), ("side", 64, 32), ("batch", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.reps is None:
        args.reps = 1 if quick else 3
    args.clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    if not args.clients or min(args.clients) < 1:
        p.error("--clients: positive integers, comma separated")
    args.cases = sorted({c.strip() for c in args.cases.split(",") if c.strip()})
    if not args.cases or not set(args.cases) <= {"1", "2"}:
        p.error("--cases: pick from 1,2")
    args.kinds = [k for k in KINDS if k in args.kinds.split(",")]
    if not args.kinds:
        p.error(f"--kinds: pick from {','.join(KINDS)}")
    if args.samples < args.batch * max(args.clients) or args.reps < 1 or args.epochs < 1:
        p.error(f"need --samples >= batch x {max(args.clients)}, --reps >= 1, --epochs >= 1")
    if 4 * args.side**3 * 4 * args.batch > MAX_MESSAGE:
        p.error(f"a batch must fit in one message ({MAX_MESSAGE // MIB} MiB)")
    return args


# ----------------------------------------------------------------------------- the dataset


def ensure_data(work: str, n: int, side: int) -> str:
    """Write ``samples.h5`` (``x``: (n, 4, side, side, side) float32) unless it is there."""
    path = os.path.join(work, "samples.h5")
    stamp = os.path.join(work, "data.json")
    want = {"samples": n, "side": side, "layout": LAYOUT_VERSION}
    try:
        with open(stamp) as f:
            if json.load(f) == want and os.path.exists(path):
                return path
    except (OSError, ValueError):
        pass
    shape = (4, side, side, side)
    need = n * 16 * side**3 + 64 * MIB
    if shutil.disk_usage(work).free < need:
        sys.exit(f"{work}: not enough free disk for {need / GIB:.1f} GiB of data")
    print(f"generating {n} samples x {16 * side**3 / MIB:.1f} MiB under {work} ...", flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (n, *shape), "f4", chunks=(1, *shape))
        buf = np.empty(shape, np.float32)
        for i in range(n):
            rng.random(shape, dtype=np.float32, out=buf)
            x[i] = buf
    os.sync()
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


# ----------------------------------------------------------------------------- bare gRPC


def bare_server(socket: str) -> int:
    """Serve ``BARE_METHOD``: a request ``{"nbytes", "count"}`` (JSON) streams ``count`` times
    one pre-built ``bytes`` message of ``nbytes``. Runs until killed."""
    from datastore.service.wire import keep_large_blocks

    keep_large_blocks()  # as datastore serve does at start
    payloads: dict[int, bytes] = {}

    def stream(request: bytes, context: Any) -> Any:
        ask = json.loads(request)
        n = int(ask["nbytes"])
        if n not in payloads:
            payloads[n] = np.random.default_rng(0).bytes(n)
        msg = payloads[n]
        for _ in range(int(ask["count"])):
            yield msg

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=None
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=MESSAGE_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    print(f"{TAG}ready", flush=True)
    server.wait_for_termination()
    return 0


class BareServer:
    """``bare_server`` in its own process (as the service is)."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="datastore-bare-")
        self.socket = os.path.join(self.tmp, "bare.sock")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-server", self.socket],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        read_tagged(self.proc)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- client processes


def touch(x: Any) -> None:
    """Read one element, so that the batch is really there."""
    float(x[0, 0, 0, 0, 0])


def make_loader(c: dict[str, Any]) -> Any:
    from datastore import DataStoreLoader
    from datastore.sources.options import ExchangeOptions, ServiceOptions

    common = {"batch_size": c["batch"], "rank": c["rank"], "world": c["world"], "seed": 0}
    if c["kind"] == "embedded":
        return DataStoreLoader(c["path"], exchange=ExchangeOptions(enabled=False), **common)
    return DataStoreLoader(
        c["path"], service=ServiceOptions(c["socket"], transport=c["kind"]), **common
    )


def client(spec: str) -> int:
    """A client process: ``ready`` once set up, then on ``go`` its run, as one JSON line."""
    import torch  # noqa: F401 (imports happen before any clock starts)

    import datastore.loader
    import datastore.service.client  # noqa: F401

    c = json.loads(spec)
    kind = c["kind"]
    if c.get("first"):  # time to first batch: construction + one batch
        say("ready")
        sys.stdin.readline()
        t0 = time.monotonic()
        loader = make_loader(c)
        tc = time.monotonic()
        touch(next(iter(loader))["x"])
        t1 = time.monotonic()
        say(json.dumps({"t0": t0, "tc": tc, "t1": t1}))
        loader.close()
        return 0
    if kind == "bare":
        from datastore.service.wire import keep_large_blocks

        keep_large_blocks()  # as the loader does for inline batches
        ch = grpc.insecure_channel(f"unix://{c['socket']}", options=MESSAGE_OPTIONS)
        call = ch.unary_stream(BARE_METHOD, request_serializer=None, response_deserializer=None)
        ask = json.dumps({"nbytes": c["nbytes"], "count": c["steps"]}).encode()

        def epoch() -> tuple[int, int]:
            nb = nbytes = 0
            for msg in call(ask):
                msg[0]
                nb, nbytes = nb + 1, nbytes + len(msg)
            return nb, nbytes
    else:
        loader = make_loader(c)

        def epoch() -> tuple[int, int]:
            nb = nbytes = 0
            for batch in loader:
                x = batch["x"]
                touch(x)
                nb, nbytes = nb + 1, nbytes + x.nbytes
            return nb, nbytes

    timed_epochs(epoch, c["epochs"])
    if kind == "bare":
        ch.close()
    else:
        loader.close()
    return 0


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, HERE]))}


def spawn(spec: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--client", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def finish(procs: list[subprocess.Popen]) -> list[dict[str, Any]]:
    out = [json.loads(read_tagged(p)) for p in procs]
    for p in procs:
        if p.wait(60) != 0:
            raise SystemExit(f"a client exited with {p.returncode}")
    return out


# ----------------------------------------------------------------------------- case 1


@dataclass
class Delivery:
    """One (kind, clients) case over the reps: aggregate GB/s and batches/s, medians."""

    kind: str
    clients: int
    gbps: list[float] = field(default_factory=list)
    bps: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)  # CPU s per GB, all clients
    server_cpu: list[float] = field(default_factory=list)  # CPU s per GB, the server

    @property
    def gb_s(self) -> float:
        return median(self.gbps)

    @property
    def batches_s(self) -> float:
        return median(self.bps)


def run_delivery(
    kind: str, n: int, args: argparse.Namespace, path: str, service: Service, bare: BareServer
) -> tuple[float, float, float, float]:
    """n clients of ``kind`` at once: aggregate GB/s and batches/s, then the CPU seconds per GB
    of the clients and of the server process (0 for the embedded loader)."""
    steps = args.samples // (args.batch * n)  # per rank per epoch (drop_last)
    nbytes = args.batch * 16 * args.side**3
    procs = []
    try:
        for r in range(n):
            spec = {
                "kind": kind,
                "path": path,
                "socket": bare.socket if kind == "bare" else service.socket,
                "batch": args.batch,
                "rank": r,
                "world": n,
                "epochs": args.epochs,
                "steps": steps,
                "nbytes": nbytes,
            }
            procs.append(spawn(spec))
        for p in procs:
            if read_tagged(p) != "ready":
                raise SystemExit(f"{kind}: a client did not get ready")
        server = {"bare": bare.proc.pid, "embedded": None}.get(kind, service.proc.pid)
        cpu0 = cpu_seconds(server) if server else 0.0
        go(procs)
        res = finish(procs)
        server_cpu = cpu_seconds(server) - cpu0 if server else 0.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    want = steps * args.epochs
    if any(r["batches"] != want for r in res):
        raise SystemExit(f"{kind} x{n}: batches {[r['batches'] for r in res]}, expected {want}")
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    gb = sum(r["bytes"] for r in res) / 1e9
    batches = sum(r["batches"] for r in res)
    return gb / wall, batches / wall, sum(r["cpu"] for r in res) / gb, server_cpu / gb


def run_case1(
    args: argparse.Namespace, path: str, service: Service
) -> dict[tuple[str, int], Delivery]:
    out = {(k, n): Delivery(k, n) for k in args.kinds for n in args.clients}
    bare = BareServer()
    try:
        for rep in range(args.reps):
            kinds = args.kinds if rep % 2 == 0 else args.kinds[::-1]
            for n in args.clients:
                for k in kinds:
                    gbps, bps, ccpu, scpu = run_delivery(k, n, args, path, service, bare)
                    d = out[k, n]
                    d.gbps.append(gbps)
                    d.bps.append(bps)
                    d.client_cpu.append(ccpu)
                    d.server_cpu.append(scpu)
                    print(
                        f"rep {rep + 1}: {k:8s} x{n}: {gbps:6.2f} GB/s, {bps:7.1f} batches/s, "
                        f"CPU s/GB clients {ccpu:.2f} server {scpu:.2f}",
                        flush=True,
                    )
    finally:
        bare.stop()
    return out


# ----------------------------------------------------------------------------- case 2


@dataclass
class FirstBatch:
    """Seconds to the first batch per rep: ``total[job]`` (construction + first batch) and
    ``construct[job]`` (construction alone), for the jobs in ``JOBS``."""

    total: dict[str, list[float]] = field(default_factory=lambda: {j: [] for j in JOBS})
    construct: dict[str, list[float]] = field(default_factory=lambda: {j: [] for j in JOBS})
    load: list[float] = field(default_factory=list)  # job 1's dataset: OpenSession to resident

    def add(self, job: str, r: dict[str, float]) -> None:
        self.total[job].append(r["t1"] - r["t0"])
        self.construct[job].append(r["tc"] - r["t0"])


JOBS = {
    "cold": "job 1 (fresh service, cold)",
    "warm": "job 2 (dataset resident)",
    "embedded": "embedded (cold, preload)",
}


def first_batch(
    spec: dict[str, Any], cache: PageCache | None, service: Service | None = None
) -> dict[str, Any]:
    """One client timing construction + first batch (caches dropped first if ``cache``); with
    ``service``, also ``resident``: seconds from the client's start until the dataset is."""
    p = spawn({**spec, "first": True})
    try:
        if read_tagged(p) != "ready":
            raise SystemExit("a first-batch client did not get ready")
        if cache is not None:
            cache.drop()
        go([p])
        r = json.loads(read_tagged(p))
        if service is not None:
            r["resident"] = resident_after(service, r["t0"])
        if p.wait(60) != 0:
            raise SystemExit(f"a first-batch client exited with {p.returncode}")
        return r
    finally:
        if p.poll() is None:
            p.kill()


def resident_after(service: Service, since: float, timeout: float = 600.0) -> float:
    """Seconds from ``since`` until the service's dataset is loaded (polling ``Status``)."""
    deadline = time.monotonic() + timeout
    while True:
        ds = service.status().datasets
        if ds and not ds[0].loading:
            return time.monotonic() - since
        if time.monotonic() > deadline:
            raise SystemExit(f"the dataset was not resident after {timeout} s")
        time.sleep(0.01)


def run_case2(args: argparse.Namespace, path: str, cache: PageCache) -> FirstBatch:
    out = FirstBatch()
    spec = {"path": path, "batch": args.batch, "rank": 0, "world": 1}
    for rep in range(args.reps):
        embedded_first = rep % 2 == 1
        if embedded_first:
            out.add("embedded", first_batch({**spec, "kind": "embedded"}, cache))
        service = Service()
        try:
            s = {**spec, "kind": "shm", "socket": service.socket}
            r = first_batch(s, cache, service)
            out.add("cold", r)
            out.load.append(r["resident"])
            out.add("warm", first_batch(s, None))
        finally:
            service.stop()
        if not embedded_first:
            out.add("embedded", first_batch({**spec, "kind": "embedded"}, cache))
        print(
            f"rep {rep + 1}: first batch: "
            + ", ".join(
                f"{j} {out.total[j][-1]:.3f} s (construct {out.construct[j][-1]:.3f})" for j in JOBS
            )
            + f"; job 1's dataset resident after {out.load[-1]:.2f} s",
            flush=True,
        )
    return out


# ----------------------------------------------------------------------------- the report

COMPARE = (  # case 1's ratios: (case, ours, peer, target)
    ("1a shm vs embedded", "shm", "embedded", TARGET_SHM),
    ("1b inline vs bare gRPC", "inline", "bare", TARGET_INLINE),
)


def report(
    args: argparse.Namespace,
    ceiling: float,
    cache: PageCache,
    c1: dict[tuple[str, int], Delivery],
    c2: FirstBatch | None,
    work: str,
) -> str:
    mb = 16 * args.side**3 / MIB
    rows = [
        "| case | clients | measure | value | reference | ratio | target | |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    notes: list[str] = []
    delivery = [
        "| delivery | clients | GB/s | GB/s reps | batches/s | per client | "
        "CPU s/GB clients | CPU s/GB server |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for n in args.clients if c1 else ():
        for k in args.kinds:
            d = c1[k, n]
            delivery.append(
                f"| {k} | {n} | {d.gb_s:.2f} | {spread(d.gbps)} | {d.batches_s:.1f} "
                f"| {d.batches_s / n:.1f} | {median(d.client_cpu):.2f} "
                f"| {median(d.server_cpu):.2f} |"
            )
        for case, ours, peer, target in COMPARE:
            if (ours, n) in c1 and (peer, n) in c1:
                a, b = c1[ours, n].gb_s, c1[peer, n].gb_s
                rows.append(
                    f"| {case} | {n} | GB/s delivered | {a:.2f} | {b:.2f} | {a / b:.2f}x "
                    f"| >= {target}x | {verdict(a / b >= target)} |"
                )
    if c2 is not None:
        cold, warm, emb = (median(c2.total[j]) for j in JOBS)
        r = cold / warm
        rows.append(
            f"| 2 first batch, job 2 vs job 1 cold | 1 | seconds | {warm:.3f} | {cold:.3f} "
            f"| {r:.1f}x | >= {TARGET_FIRST:.0f}x | {verdict(r >= TARGET_FIRST)} |"
        )
        rows.append(
            f"| 2 first batch, job 2 vs embedded cold | 1 | seconds | {warm:.3f} | {emb:.3f} "
            f"| {emb / warm:.1f}x | | |"
        )
        load = median(c2.load)
        rate = args.samples * mb * MIB / load / 1e9
        for j, name in JOBS.items():
            notes.append(
                f"- 2 {name}: {median(c2.total[j]):.3f} s (reps {spread(c2.total[j], '{:.3f}')}), "
                f"of which construction {median(c2.construct[j]):.3f} s"
            )
        notes.append(
            f"- 2: job 1's dataset was resident {load:.2f} s after its OpenSession "
            f"({rate:.2f} GB/s)"
        )
    return (
        "\n".join(
            [
                *([*delivery, ""] if c1 else []),
                *rows,
                "",
                "ratio: 1a = shm GB/s / embedded GB/s, 1b = inline GB/s / bare GB/s (aggregate "
                "over the n clients, ranks of one job); 2 = job 1 (or embedded) seconds / job 2 "
                "seconds. CPU s/GB: user + system CPU seconds per GB delivered, of all the "
                "clients and of the server process (the service or the bare gRPC server).",
                *notes,
                "",
                f"- ceiling: memcpy into a reused buffer (numpy.copyto, 256 MiB, median of 5): "
                f"{ceiling:.2f} GB/s",
                f"- data: {args.samples} samples x {mb:.1f} MiB (x float32 (4, {args.side}, "
                f"{args.side}, {args.side})), one HDF5 chunk per sample; batch {args.batch} per "
                f"rank ({args.batch * mb:.0f} MiB); epochs {args.epochs} timed after 1 warm-up; "
                f"reps {args.reps}; work dir {work}",
                f"- page cache: {cache.note}",
                "- machine: "
                + machine_info(f"grpcio {grpc.__version__}", f"h5py {h5py.__version__}"),
            ]
        )
        + "\n"
    )


def as_json(
    args: argparse.Namespace,
    ceiling: float,
    cache: PageCache,
    c1: dict[tuple[str, int], Delivery],
    c2: FirstBatch | None,
    work: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results (every delivery's GB/s, batches/s and CPU per GB with their ranges, the
    ratios, the first-batch times) and the key ratios."""
    results: dict[str, Any] = {
        "samples": args.samples,
        "side": args.side,
        "batch": args.batch,
        "epochs": args.epochs,
        "reps": args.reps,
        "clients": args.clients,
        "kinds": args.kinds,
        "memcpy_gbps": ceiling,
        "page_cache": cache.note,
        "work_dir": work,
        "delivery": [
            {
                "kind": d.kind,
                "clients": d.clients,
                "gbps": stats(d.gbps),
                "batches_per_s": stats(d.bps),
                "client_cpu_s_per_gb": stats(d.client_cpu),
                "server_cpu_s_per_gb": stats(d.server_cpu),
            }
            for d in c1.values()
        ],
        "compare": [],
        "first_batch": None,
    }
    ratios = []
    for n in args.clients if c1 else ():
        for case, ours, peer, target in COMPARE:
            if (ours, n) in c1 and (peer, n) in c1:
                a, b = c1[ours, n].gb_s, c1[peer, n].gb_s
                row = {"case": case, "clients": n, "ours": a, "peer": b, "ratio": a / b}
                results["compare"].append(row | {"target": target, "pass": a / b >= target})
                if n == min(args.clients):
                    ratios.append(
                        key_ratio(
                            f"{case}, {n} client{'s' * (n > 1)}",
                            ours=a,
                            peer=b,
                            unit="GB/s",
                            ratio=a / b,
                            of="ours / peer GB/s",
                            target=f">= {target}x",
                            ok=a / b >= target,
                        )
                    )
    if c2 is not None:
        results["first_batch"] = {
            "jobs": {
                j: {
                    "label": name,
                    "total_s": stats(c2.total[j]),
                    "construct_s": stats(c2.construct[j]),
                }
                for j, name in JOBS.items()
            },
            "load_s": stats(c2.load),
            "target": TARGET_FIRST,
        }
        cold, warm = median(c2.total["cold"]), median(c2.total["warm"])
        ratios.append(
            key_ratio(
                "2 first batch: job 2 (dataset resident) vs job 1 (fresh service, cold)",
                ours=warm,
                peer=cold,
                unit="s",
                ratio=cold / warm,
                of="job 1 time / job 2",
                target=f">= {TARGET_FIRST:.0f}x",
                ok=cold / warm >= TARGET_FIRST,
            )
        )
    return results, ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        return client(args.client)
    if args.bare_server:
        return bare_server(args.bare_server)
    t_start = time.perf_counter()
    work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    path = ensure_data(work, args.samples, args.side)
    cache = PageCache(args.warm)
    ceiling = memcpy_ceiling()
    print(f"ceiling: memcpy into a reused buffer {ceiling:.2f} GB/s", flush=True)
    c1: dict[tuple[str, int], Delivery] = {}
    if "1" in args.cases:
        service = Service()
        try:
            service.load(path)
            c1 = run_case1(args, path, service)
        finally:
            service.stop()
    c2 = run_case2(args, path, cache) if "2" in args.cases else None
    text = report(args, ceiling, cache, c1, c2, work)
    print("\n" + text, end="")
    print(f"(benchmark wall time {time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        write_results(
            args.json, "service", *as_json(args, ceiling, cache, c1, c2, work),
            f"grpcio {grpc.__version__}", f"h5py {h5py.__version__}",
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
