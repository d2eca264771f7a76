"""Benchmark the multi-node store's exchange: services peering over MPI vs over gRPC vs one node.

What is measured
----------------
A directory of ``--samples`` N (default 64) ``.npy`` files, each float32 (4, S, S, S), S =
``--side`` (default 64: 4 MiB a sample), is written under ``--dir`` (default
``./bench-data/peers``) and staged sharded over two "nodes" on this host with the real
``mpiexec -n 2 datastore stage SRC --to DIR/node{node} --mode shard --ranks-per-node 1``: node k
holds about half of the files under ``DIR/node{k}/src``. Three kinds of store, one after the
other, each in fresh ``XDG_RUNTIME_DIR``/``XDG_STATE_HOME`` directories:

- **mpi**: ``mpiexec -n 2 python -m mpi4py -m datastore serve --socket TMP/s{rank}.sock``; the
  two services peer over MPI (:class:`datastore.service.mpi_peers.MpiPeers`).
- **grpc**: two plain ``datastore serve --socket TMP/g{k}.sock --tcp 127.0.0.1:P_k --token-file
  F --peers P_0,P_1 --node k`` processes; they peer over gRPC on TCP
  (:class:`datastore.service.grpc_peers.GrpcPeers`), the blocks over the data connection
  beside it (:mod:`datastore.service.data_link`, ``--data-port`` any free port). With
  ``--tls``, both talk TLS (``--tls-cert/--tls-key``, a self-signed certificate made here with
  ``openssl``), gRPC and the data connection alike.
- **local**: one ``datastore serve --socket TMP/l.sock`` over the unsharded source directory:
  every sample is local, no exchange (the ceiling of the two above).

On each store one job of 2 ranks runs per layout (``--layouts``): ``whole`` samples, and
``blocks`` (``spatial={"parts": (2, 1, 1), "halo": (1, 1, 1)}``: both ranks get the same
samples, each one half-block with its halo). Rank k is a separate client process streaming
from service k (for ``local``, both from the one service): ``DataStoreLoader(DIR/node{node}/src,
global_batch_size=2B, rank=k, world=2, seed=0, spatial=...,
service=ServiceOptions(SOCK, transport="shm"))``,
B = ``--batch`` (default 4). Each client runs one untimed warm-up epoch (which makes the
dataset resident; the benchmark then waits until no service is still loading), then both
start together and run ``--epochs`` E (default 10) epochs, touching one element of each batch.

Reported per kind and layout: batches/s (both ranks) and delivered GB/s (aggregate bytes of
``data`` to both ranks / (last rank's end - first rank's start)); bytes exchanged (the growth of
``Status().bytes_exchanged`` summed over the services during the timed epochs) and exchange
GB/s = those bytes / the same time; the services' CPU seconds (``/proc/PID/stat`` of
``Status().pid``) and their sessions' ``stall_s`` (time streams waited for a batch to be
prepared) over the timed epochs. Ratios: grpc/mpi, mpi/local and grpc/local of batches/s, and
grpc/mpi of exchange GB/s. Repetitions (``--reps``, default 3) alternate the order of the
kinds; medians. Also measured once the jobs are done: the services' CPU use while idle (1 s,
dataset resident, no client), as a fraction of one core.

The link itself: every service runs with ``DATASTORE_PEER_STATS`` (its fetches' spans in
flight and message sizes, :class:`datastore.service.peer_stats.ExchangeStats`). Reported per job:
**exchange GB/s in flight** = the fetches' bytes (both services) / the time at least one fetch
of either service was in flight during the timed epochs (request sent to last byte in), and
**per epoch time** = the same bytes / the timed wall time (in which batches are also filled
and read). Right after each ``mpi`` job, two fresh ``mpiexec -n 2`` ranks
(``benchmarks/peers_link.py``) replay that job's fetches, ``LINK_REPS`` times each way
(``LINK_PASSES`` passes over them a replay), alternating, in the same two processes:
**bare** mpi4py (each fetch's messages, of the sizes the services sent, into contiguous
buffers), **typed** (bare mpi4py moving each sample's part
from the owner's resident sample into the asker's batch slot amid its halo, a subarray
datatype on each side: the same job as the link, done the MPI way) and **the link** (each
rank builds what ``datastore serve`` builds on an
MPI node, less its gRPC server, and fetches the same samples through the services' code:
``Resident.start_fetch``, ``MpiPeers``, the owner answering from its resident samples, the
asker's copies). Both run both directions at once, ``FETCH_AHEAD`` fetches in flight each
way, into buffers cycling through up to 256 MiB; GB/s = all bytes / time. Issue 24's target,
the peers' exchange rate >= 0.8x of bare mpi4py on the same bytes, pattern and processes, is
judged on link / bare, and for blocks also on link / typed. In flight / bare and per epoch /
bare are also printed: the link as the job's ranks paced it, on cores it shared with them and
the streams.
**Per fetch**: each fetch's time from asked to its reply's envelope in (the request's way,
the owner's answer, the envelope's way back), then to its last byte in, median and 90th
percentile over the timed epochs' fetches (MPI peers; the legs the services record).

With ``--node-cpus A/B`` each node gets its own CPUs (``taskset``): node k's service, rank k
and bare rank k run on CPUs A (k = 0) or B (k = 1), and the one-node reference ``local`` is
then the whole dataset on each node (two services over the unsharded directory, rank k
streaming from node k's): the same processes, cores and pinning as the sharded stores, only
without the exchange. Unpinned (the default), the stores share this host's cores.

Every service is shut down at the end; the run checks that no socket and no shared-memory
segment of its services is left (``/dev/shm/datastore.<uid>.<pid>.*``) and says so.

Usage::

    python benchmarks/peers.py                   # full run (about 2 min on 2 cores)
    python benchmarks/peers.py --quick           # smoke run: N=16, S=32, B=2, 1 rep
    python benchmarks/peers.py --kinds mpi,grpc --layouts whole --json /tmp/peers.json
    python benchmarks/peers.py --node-cpus 0/1   # a core per node
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from common import (
    cpu_seconds,
    free_port,
    key_ratio,
    machine_info,
    median,
    read_tagged,
    spread,
    stats,
    timed_epochs,
    venv_tool,
    verdict,
    write_results,
)

from datastore.service.peer_stats import STATS_ENV, read_stats
from datastore.service.session import FETCH_AHEAD
from staging.cluster import LAUNCH_ENV

MIB = 1 << 20
KINDS = ("mpi", "grpc", "local")
LAYOUTS = {"whole": None, "blocks": {"parts": (2, 1, 1), "halo": (1, 1, 1)}}
LAYOUT_VERSION = 1
BARE = {"mpi": "bare mpi4py", "grpc": "bare TCP sockets"}  # each link's bare peer
INTO = {"mpi": "typed into the slots", "grpc": "copied into the slots"}  # ...doing its job
LINK_REPS = 3  # replays each of the bare transfers and the link, after each mpi and grpc job
# passes over the job's fetches in one replay: one pass took 50 ms (MPI whole), as short as the
# scheduler's and the barrier's jitter, and each replay paid the pipeline's fill and drain
LINK_PASSES = 4
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOKEN = "peers-benchmark"

__all__ = ["main"]


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data/peers", help="where the dataset is written")
    p.add_argument("--samples", type=int, default=None, help="samples N (default 64; 16 quick)")
    p.add_argument("--side", type=int, default=None, help="a sample is (4,S,S,S) (default 64)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank B (default 4; 2 quick)")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs (default 10; 5 quick)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 quick)")
    p.add_argument("--kinds", default=",".join(KINDS), help="stores, comma separated")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="whole,blocks")
    p.add_argument("--quick", action="store_true", help="smoke run: N=16, S=32, B=2, 1 rep")
    p.add_argument(
        "--tls", action="store_true", help="the grpc store's peers talk TLS (a self-signed cert)"
    )
    p.add_argument(
        "--node-cpus",
        default=None,
        metavar="A/B",
        help="pin node 0's processes to CPUs A and node 1's to B (taskset lists, e.g. 0/1); "
        "one node is then the whole dataset on each node",
    )
    p.add_argument(
        "--json", "--out", default=None, metavar="FILE", help="also write the results as JSON"
    )
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return args
    for name, full, small in (("samples", 64, 16), ("side", 64, 32), ("batch", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name, full, small in (("epochs", 10, 5), ("reps", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.kinds = [k for k in KINDS if k in args.kinds.split(",")]
    args.layouts = [k for k in LAYOUTS if k in args.layouts.split(",")]
    if not args.kinds or not args.layouts:
        p.error(f"--kinds: pick from {','.join(KINDS)}; --layouts: from {','.join(LAYOUTS)}")
    if args.samples < 4 * args.batch or min(args.reps, args.epochs, args.batch) < 1:
        p.error("need --samples >= 4 x --batch (two steps an epoch), --reps, --epochs >= 1")
    if args.side < 4:
        p.error("--side must be >= 4")
    if args.node_cpus is not None:
        args.node_cpus = args.node_cpus.split("/")
        have = os.sched_getaffinity(0)
        sets = [cpu_list(c) for c in args.node_cpus]
        if len(sets) != 2 or not all(cpus and cpus <= have for cpus in sets):
            p.error(f"--node-cpus: two CPU lists A/B among this process's {sorted(have)}")
    return args


def cpu_list(text: str) -> set[int]:
    """The CPUs of a taskset list (``0``, ``0,2``, ``0-3``); empty where it is malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or not (hi if dash else lo).isdigit():
            return set()
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` run on the CPUs ``cpus`` (a taskset list), or as it is where ``None``."""
    return cmd if cpus is None else ["taskset", "-c", cpus, *cmd]


# ----------------------------------------------------------------------------- the dataset


def clean_env(tmp: str) -> dict[str, str]:
    """This process's environment without launcher variables, with private XDG directories."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    runtime = os.path.join(tmp, "runtime")
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    env.update(XDG_RUNTIME_DIR=runtime, XDG_STATE_HOME=os.path.join(tmp, "state"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ensure_data(work: str, n: int, side: int) -> str:
    """Write ``src/s0000.npy...`` (float32 (4, side, side, side) each) unless they are there."""
    src = os.path.join(work, "src")
    stamp = os.path.join(work, "data.json")
    want = {"samples": n, "side": side, "layout": LAYOUT_VERSION}
    with contextlib.suppress(OSError, ValueError), open(stamp) as f:
        if json.load(f) == want and len(os.listdir(src)) == n:
            return src
    print(f"generating {n} samples x {16 * side**3 / MIB:.1f} MiB under {src} ...", flush=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp)
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    rng = np.random.default_rng(0)
    buf = np.empty((4, side, side, side), np.float32)
    for i in range(n):
        rng.random(buf.shape, dtype=np.float32, out=buf)
        np.save(os.path.join(src, f"s{i:04d}.npy"), buf)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return src


def stage_shards(work: str, src: str) -> tuple[str, float, list[int]]:
    """Stage ``src`` sharded to ``work/node{node}`` with the real CLI under ``mpiexec -n 2``:
    the dataset template, the seconds it took and how many files each node holds."""
    for k in range(2):
        shutil.rmtree(os.path.join(work, f"node{k}"), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="datastore-peers-stage-")
    try:
        cmd = [venv_tool("mpiexec"), "-n", "2", sys.executable, "-m", "datastore", "stage", src]
        cmd += ["--to", os.path.join(work, "node{node}"), "--mode", "shard"]
        cmd += ["--ranks-per-node", "1", "-q"]
        t0 = time.monotonic()
        r = subprocess.run(cmd, env=clean_env(tmp), capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if r.returncode != 0:
        sys.exit(f"datastore stage failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    shares = [set(os.listdir(os.path.join(work, f"node{k}", "src"))) for k in range(2)]
    if shares[0] & shares[1] or shares[0] | shares[1] != set(os.listdir(src)):
        sys.exit("the staged shards do not split the dataset")
    return os.path.join(work, "node{node}", "src"), seconds, [len(s) for s in shares]


# ----------------------------------------------------------------------------- the stores


def self_signed(where: str) -> list[str]:
    """``serve`` options for TLS with a fresh self-signed certificate for 127.0.0.1 (the
    peers check each other against it: ``--peer-ca`` defaults to ``--tls-cert``)."""
    cert, key = os.path.join(where, "cert.pem"), os.path.join(where, "key.pem")
    if not os.path.exists(cert):
        openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        openssl += ["-keyout", key, "-out", cert, "-subj", "/CN=localhost"]
        openssl += ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        subprocess.run(openssl, check=True, capture_output=True)
    return ["--tls-cert", cert, "--tls-key", key]


class Store:
    """The services of one kind of store, started as subprocesses in a fresh directory.

    Attributes:
        sockets: the Unix socket rank k streams from, for k = 0, 1.
        path: the dataset path clients name.
    """

    def __init__(
        self, kind: str, template: str, src: str, tls: bool = False, cpus: list[str] | None = None
    ) -> None:
        from datastore.service.client import Client

        self.kind, self.cpus = kind, cpus
        self.tmp = tempfile.mkdtemp(prefix=f"datastore-peers-{kind}-")
        self.env = clean_env(self.tmp)
        self.env[STATS_ENV] = os.path.join(self.tmp, "peer{node}.jsonl")  # the link's spans
        self.procs: list[subprocess.Popen] = []
        serve = [sys.executable, "-m", "datastore", "serve"]
        if kind == "mpi":
            self.path = template
            self.sockets = [f"{self.tmp}/s0.sock", f"{self.tmp}/s1.sock"]
            rank = [sys.executable, "-m", "mpi4py", *serve[1:], "--socket"]
            self._start(mpmd([[*rank, sock] for sock in self.sockets], cpus))
        elif kind == "grpc":
            self.path = template
            token = os.path.join(self.tmp, "token")
            with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(TOKEN)
            peers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
            self.sockets = [f"{self.tmp}/g{k}.sock" for k in range(2)]
            for k in range(2):
                cmd = [*serve, "--socket", self.sockets[k], "--tcp", peers[k]]
                cmd += ["--token-file", token, "--peers", ",".join(peers), "--node", str(k)]
                cmd += self_signed(self.tmp) if tls else []
                self._start(pinned(cmd, cpus and cpus[k]))
        elif cpus is None:
            self.path = src
            self._start([*serve, "--socket", f"{self.tmp}/l.sock"])
            self.sockets = [f"{self.tmp}/l.sock"] * 2
        else:  # pinned nodes: the whole dataset on each node, each rank on its own node
            self.path = src
            self.sockets = [f"{self.tmp}/l{k}.sock" for k in range(2)]
            for k in range(2):
                self._start(pinned([*serve, "--socket", self.sockets[k]], cpus[k]))
        self.services = sorted(set(self.sockets))
        deadline = time.monotonic() + 90
        while not all(os.path.exists(s) for s in self.services):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                sys.exit(f"{kind}: the services did not start:\n{log}")
            time.sleep(0.1)
        self.clients = [Client(s, timeout_s=30) for s in self.services]
        self.pids = [c.status().pid for c in self.clients]

    def _start(self, cmd: list[str]) -> None:
        log = open(os.path.join(self.tmp, f"serve{len(self.procs)}.log"), "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log, start_new_session=True)
        )
        log.close()  # the child holds it

    def log(self) -> str:
        out = []
        for i in range(len(self.procs)):
            with open(os.path.join(self.tmp, f"serve{i}.log"), errors="replace") as f:
                out.append(f.read()[-3000:])
        return "\n".join(out)

    def statuses(self) -> list[Any]:
        return [c.status() for c in self.clients]

    def wait_resident(self, timeout: float = 300.0) -> None:
        """Until no service is still reading its share of a dataset."""
        deadline = time.monotonic() + timeout
        while any(d.loading for s in self.statuses() for d in s.datasets):
            if time.monotonic() > deadline:
                sys.exit(f"{self.kind}: the dataset was not resident after {timeout} s")
            time.sleep(0.05)

    def cpu(self) -> float:
        """User + system CPU seconds of the services so far."""
        return sum(cpu_seconds(p) for p in self.pids)

    def stop(self) -> list[str]:
        """Shut every service down (killing what does not stop); what they left behind."""
        for c in getattr(self, "clients", []):
            with contextlib.suppress(Exception):
                c.shutdown(reason="benchmark")
            c.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the group we started it in
                p.wait()
        left = [s for s in getattr(self, "sockets", []) if os.path.exists(s)]
        shm = "/dev/shm"
        if os.path.isdir(shm):
            mine = {f"datastore.{os.getuid()}.{pid}." for pid in getattr(self, "pids", [])}
            left += [f"{shm}/{n}" for n in os.listdir(shm) if any(n.startswith(m) for m in mine)]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return sorted(set(left))


# ----------------------------------------------------------------------------- client processes


def client(spec: str) -> int:
    """One rank, for each layout in turn: ``ready`` after a warm-up epoch, then on ``go`` its
    timed epochs as one JSON line; its session stays open until ``next``."""
    import torch  # noqa: F401 (imports happen before any clock starts)

    from datastore import DataStoreLoader, ServiceOptions

    c = json.loads(spec)
    for layout in c["layouts"]:
        loader = DataStoreLoader(
            c["path"],
            global_batch_size=c["global_batch"],
            rank=c["rank"],
            world=2,
            seed=0,
            spatial=LAYOUTS[layout],
            service=ServiceOptions(c["socket"], transport="shm"),
        )

        def epoch(loader: Any = loader) -> tuple[int, int]:
            nb = nbytes = 0
            for batch in loader:
                x = batch["data"]
                float(x.reshape(-1)[0])  # the batch is really there
                nb, nbytes = nb + 1, nbytes + x.nbytes
            return nb, nbytes

        timed_epochs(epoch, c["epochs"])  # the warm-up makes the dataset resident on every node
        sys.stdin.readline()  # the session stays open until the benchmark has read the Status
        loader.close()
    return 0


def mpmd(ranks: list[list[str]], cpus: list[str] | None) -> list[str]:
    """``mpiexec`` running ``ranks[k]`` as rank k, on the CPUs ``cpus[k]`` where given."""
    cmd = [venv_tool("mpiexec")]
    for k, argv in enumerate(ranks):
        cmd += [":"] if k else []
        cmd += ["-n", "1", *pinned(argv, cpus and cpus[k])]
    return cmd


def run_link(
    fetches: list[list[list[int]]], layout: str, template: str, store: Store
) -> dict[str, list[float]]:
    """GB/s of bare transfers and of the services' link (``benchmarks/peers_link.py``),
    ``LINK_REPS`` replays each of ``fetches`` (node k's fetches, each its message sizes; a
    replay goes over them ``LINK_PASSES`` times) alternating in the same two fresh processes:
    both directions' bytes / time, per replay.
    Over MPI (``store.kind == "mpi"``): two ``mpiexec`` ranks, bare mpi4py (and typed);
    over gRPC: two plain processes, bare TCP sockets."""
    fetches = [node * LINK_PASSES for node in fetches]
    spec = {
        "via": store.kind,
        "fetches": fetches,
        "depth": FETCH_AHEAD,
        "template": template,
        "spatial": LAYOUTS[layout],
        "reps": LINK_REPS,
        "tmp": store.tmp,
    }
    if store.kind == "grpc":
        spec["peers"] = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        spec["control"] = free_port()
        spec["token_file"] = os.path.join(store.tmp, "token")
    path = os.path.join(store.tmp, "link.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    script = os.path.join(HERE, "peers_link.py")
    env = {k: v for k, v in store.env.items() if k != STATS_ENV}
    if store.kind == "mpi":
        cmd = mpmd([[sys.executable, "-m", "mpi4py", script, path]] * 2, store.cpus)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        done = [(r.returncode, r.stdout, r.stderr)]
    else:
        procs = [
            subprocess.Popen(
                pinned([sys.executable, script, path, str(k)], store.cpus and store.cpus[k]),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for k in range(2)
        ]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        done = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    if any(code for code, _, _ in done):
        told = "".join(out + err for _, out, err in done)
        raise SystemExit(f"the {store.kind} link against bare transfers failed:\n{told}")
    seconds = json.loads(done[0][1].strip().splitlines()[-1])
    moved = sum(m for node in fetches for f in node for m in f)
    return {name: [moved / s / 1e9 for s in runs] for name, runs in seconds.items()}


def peer_stats(store: Store) -> list[dict[str, Any]]:
    """Each service's :class:`~datastore.service.peer_stats.ExchangeStats` so far."""
    return [read_stats(os.path.join(store.tmp, f"peer{k}.jsonl")) for k in range(2)]


def in_flight(spans: list[list[float]], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1]`` in which at least one of ``spans`` (``[start, end]``) was."""
    total, reach = 0.0, t0
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def spawn(spec: dict[str, Any], env: dict[str, str], cpus: str | None) -> subprocess.Popen:
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, HERE]))}
    return subprocess.Popen(
        pinned([sys.executable, __file__, "--client", json.dumps(spec)], cpus),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def tell(procs: list[subprocess.Popen], word: str) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(word + "\n")
        p.stdin.flush()


# ----------------------------------------------------------------------------- one job


@dataclass
class Job:
    """One (kind, layout) case over the reps, one entry per rep."""

    kind: str
    layout: str
    seconds: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)  # bytes of ``data``, both ranks
    exchanged: list[int] = field(default_factory=list)  # bytes, summed over the services
    server_cpu: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)  # sessions' stall_s, summed
    bare_gb_s: list[float] = field(default_factory=list)  # bare (BARE[kind]), same bytes
    typed_gb_s: list[float] = field(default_factory=list)  # bare into the slots (see peers_link)
    link_gb_s: list[float] = field(default_factory=list)  # the services' link, beside bare
    link_bytes: list[int] = field(default_factory=list)  # the fetches' bytes, both services
    in_flight_s: list[float] = field(default_factory=list)  # a fetch of either in flight
    fetches: list[list[list[list[int]]]] = field(default_factory=list)  # per node, per fetch
    legs: list[list[list[float]]] = field(default_factory=list)  # per fetch (envelope, bytes) s

    def rate(self, values: list[int] | list[float]) -> float:
        return median([v / s for v, s in zip(values, self.seconds, strict=True)])

    @property
    def batches_s(self) -> float:
        return self.rate(self.batches)

    @property
    def gb_s(self) -> float:
        return self.rate(self.delivered) / 1e9

    @property
    def exchange_gb_s(self) -> float:
        return self.rate(self.exchanged) / 1e9

    @property
    def in_flight_rates(self) -> list[float]:
        """The fetches' bytes / the time one was in flight, per rep (GB/s)."""
        return [b / t / 1e9 for b, t in zip(self.link_bytes, self.in_flight_s, strict=True) if t]

    @property
    def in_flight_gb_s(self) -> float | None:
        return median(self.in_flight_rates) if self.in_flight_rates else None

    @property
    def depth(self) -> float | None:
        """Fetches in flight at once, on average while one was (their times summed / the time
        in flight), median over the reps; ``None`` where the link does not time its legs."""
        reps = zip(self.legs, self.in_flight_s, strict=True)
        per_rep = [sum(a + b for a, b in legs) / t for legs, t in reps if t and legs]
        return median(per_rep) if per_rep and any(per_rep) else None

    def fetch_ms(self) -> dict[str, float] | None:
        """Each fetch's time (ms, every rep's fetches pooled): from asked to the reply's
        envelope in, from there to its last byte in, and the whole, median and 90th
        percentile; ``None`` where the link does not time its legs."""
        legs = [leg for rep in self.legs for leg in rep if any(leg)]
        if not legs:
            return None
        out = {}
        for name, values in (
            ("envelope", [a for a, _ in legs]),
            ("bytes", [b for _, b in legs]),
            ("whole", [a + b for a, b in legs]),
        ):
            out[name] = 1e3 * median(values)
            out[f"{name}_p90"] = 1e3 * float(np.percentile(values, 90))
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "layout": self.layout,
            "batches_per_s": self.batches_s,
            "batches_per_s_reps": stats(
                [b / s for b, s in zip(self.batches, self.seconds, strict=True)]
            ),
            "delivered_gb_per_s": self.gb_s,
            "exchanged_bytes": median(self.exchanged),
            "exchange_gb_per_s": self.exchange_gb_s,
            "server_cpu_s": median(self.server_cpu),
            "client_cpu_s": median(self.client_cpu),
            "stall_s": median(self.stall),
            "bare": BARE.get(self.kind) if self.bare_gb_s else None,
            "bare_gb_per_s": median(self.bare_gb_s) if self.bare_gb_s else None,
            "bare_gb_per_s_reps": self.bare_gb_s,
            "typed_gb_per_s": median(self.typed_gb_s) if self.typed_gb_s else None,
            "typed_gb_per_s_reps": self.typed_gb_s,
            "link_gb_per_s": median(self.link_gb_s) if self.link_gb_s else None,
            "link_gb_per_s_reps": self.link_gb_s,
            "exchange_in_flight_s": median(self.in_flight_s) if self.in_flight_s else None,
            "exchange_gb_per_s_in_flight": self.in_flight_gb_s,
            "exchange_gb_per_s_in_flight_reps": self.in_flight_rates,
            "fetch_ms": self.fetch_ms(),
            "fetches_in_flight": self.depth,
            "reps": {
                "seconds": self.seconds,
                "batches": self.batches,
                "delivered_bytes": self.delivered,
                "exchanged_bytes": self.exchanged,
            },
        }


def stall(statuses: list[Any]) -> float:
    return sum(s.stall_s for st in statuses for s in st.sessions)


def run_jobs(store: Store, args: argparse.Namespace, jobs: dict[tuple[str, str], Job]) -> None:
    """One job of two client processes (rank k on ``store.sockets[k]``) per layout on
    ``store``: a warm-up epoch each, then the timed epochs, into ``jobs``."""
    procs = []
    try:
        for rank in range(2):
            spec = {
                "path": store.path,
                "socket": store.sockets[rank],
                "rank": rank,
                "global_batch": 2 * args.batch,
                "layouts": args.layouts,
                "epochs": args.epochs,
            }
            procs.append(spawn(spec, store.env, store.cpus and store.cpus[rank]))
        for layout in args.layouts:
            for p in procs:
                if read_tagged(p) != "ready":
                    raise SystemExit(f"{store.kind}: a client did not get ready")
            store.wait_resident()
            before, cpu0, link0 = store.statuses(), store.cpu(), peer_stats(store)
            tell(procs, "go")
            res = [json.loads(read_tagged(p)) for p in procs]
            cpu1, after, link1 = store.cpu(), store.statuses(), peer_stats(store)
            tell(procs, "next")
            job = jobs[store.kind, layout]
            record(job, args, res, before, after, cpu1 - cpu0)
            record_link(job, res, link0, link1)
        for p in procs:
            if p.wait(60) != 0:
                raise SystemExit(f"{store.kind}: a client exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def record_link(job: Job, res: list[dict[str, Any]], before: list[dict], after: list[dict]) -> None:
    """The services' fetches in the timed epochs (their link's stats files around them)."""
    if not any(a["fetches"] for a in after):  # one node: no link
        return
    t0, t1 = min(r["t0"] for r in res), max(r["t1"] for r in res)
    job.link_bytes.append(sum(a["bytes"] - b["bytes"] for a, b in zip(after, before, strict=True)))
    job.in_flight_s.append(in_flight([s for a in after for s in a["spans"]], t0, t1))
    job.fetches.append(
        [a["fetches"][len(b["fetches"]) :] for a, b in zip(after, before, strict=True)]
    )
    job.legs.append(
        [leg for a, b in zip(after, before, strict=True) for leg in a["legs"][len(b["legs"]) :]]
    )


def record(
    job: Job,
    args: argparse.Namespace,
    res: list[dict[str, Any]],
    before: list[Any],
    after: list[Any],
    server_cpu: float,
) -> None:
    """One rep of ``job`` from its ranks' results and the services' Status around them."""
    want = args.epochs * (args.samples // (2 * args.batch))
    if any(r["batches"] != want for r in res):
        raise SystemExit(f"{job.kind}/{job.layout}: batches {[r['batches'] for r in res]}")
    job.seconds.append(max(r["t1"] for r in res) - min(r["t0"] for r in res))
    job.batches.append(sum(r["batches"] for r in res))
    job.delivered.append(sum(r["bytes"] for r in res))
    job.exchanged.append(
        sum(a.bytes_exchanged - b.bytes_exchanged for a, b in zip(after, before, strict=True))
    )
    job.server_cpu.append(server_cpu)
    job.client_cpu.append(sum(r["cpu"] for r in res))
    job.stall.append(stall(after) - stall(before))


# ----------------------------------------------------------------------------- the report


def ratios(jobs: dict[tuple[str, str], Job], layouts: list[str]) -> list[dict[str, Any]]:
    out = []
    for layout in layouts:
        for a, b in (("grpc", "mpi"), ("mpi", "local"), ("grpc", "local")):
            if (a, layout) in jobs and (b, layout) in jobs:
                ja, jb = jobs[a, layout], jobs[b, layout]
                r = {"layout": layout, "case": f"{a}/{b}", "batches": ja.batches_s / jb.batches_s}
                if b != "local":
                    r["exchange"] = ja.exchange_gb_s / jb.exchange_gb_s
                out.append(r)
    return out


@dataclass(frozen=True)
class Target:
    """One of issue 24's targets in a run: ``ours / peer >= least``."""

    layout: str
    case: str
    ours: float
    peer: float
    unit: str
    of: str
    least: float


def targets(jobs: dict[tuple[str, str], Job], layouts: list[str]) -> list[Target]:
    """Issue 24's targets the run's jobs measure: a store sharded over 2 nodes against one
    node (batches/s, >= 0.6x), and each link against its bare peer in the same processes on
    the same fetches (GB/s, >= 0.8x): the MPI link against bare mpi4py (for blocks also typed
    into the slots, the same job done the MPI way), the gRPC link against bare TCP sockets
    (for blocks also copied into the slots with numpy, the same job done bare)."""
    out = []
    for layout in layouts:
        for kind in ("mpi", "grpc"):
            if (kind, layout) in jobs and ("local", layout) in jobs:
                ours, one = jobs[kind, layout].batches_s, jobs["local", layout].batches_s
                what = f"{kind} sharded / one node"
                out.append(Target(layout, what, ours, one, "batches/s", "batches/s", 0.6))
        for kind in ("mpi", "grpc"):
            j = jobs.get((kind, layout))
            if j is None or not j.link_gb_s or not j.bare_gb_s:
                continue
            peers = [(BARE[kind], j.bare_gb_s)]
            blocks = bool(j.typed_gb_s and LAYOUTS[layout])  # (whole samples: nothing to put)
            peers += [(f"{BARE[kind]} {INTO[kind]}", j.typed_gb_s)] * blocks
            for peer, values in peers:
                what = f"{kind} link / {peer}, same processes and fetches"
                link, bare = median(j.link_gb_s), median(values)
                out.append(Target(layout, what, link, bare, "GB/s", "link / peer GB/s", 0.8))
    return out


def report(args: argparse.Namespace, jobs: dict[tuple[str, str], Job], notes: list[str]) -> str:
    rows = [
        "| store | layout | batches/s | batches/s reps | delivered GB/s | exchanged MiB "
        "| exchange GB/s | server CPU s | client CPU s | stall s | wall s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in args.layouts:
        for kind in args.kinds:
            j = jobs[kind, layout]
            reps = spread([b / s for b, s in zip(j.batches, j.seconds, strict=True)], "{:.1f}")
            rows.append(
                f"| {kind} | {layout} | {j.batches_s:.1f} | {reps} | {j.gb_s:.2f} "
                f"| {median(j.exchanged) / MIB:.0f} | {j.exchange_gb_s:.2f} "
                f"| {median(j.server_cpu):.2f} | {median(j.client_cpu):.2f} "
                f"| {median(j.stall):.2f} | {median(j.seconds):.2f} |"
            )
    ratio_rows = ["| layout | ratio | batches/s | exchange GB/s |", "|---|---|---:|---:|"]
    for r in ratios(jobs, args.layouts):
        ex = f"{r['exchange']:.2f}x" if "exchange" in r else ""
        ratio_rows.append(f"| {r['layout']} | {r['case']} | {r['batches']:.2f}x | {ex} |")
    link_rows = [
        "| store | layout | exchange GB/s in flight (reps) | in flight s | exchange GB/s per "
        "epoch time (reps) | bare GB/s (reps) | in flight / bare | epoch / bare "
        "| per fetch ms: envelope + bytes = whole (p90) | fetches in flight "
        "| bare into the slots GB/s (reps) | link beside bare GB/s (reps) | link / bare "
        "| link / into the slots |",
        "|---|---|---|---:|---|---|---:|---:|---|---:|---|---|---:|---:|",
    ]
    for layout in args.layouts:
        for kind in ("mpi", "grpc"):
            j = jobs.get((kind, layout))
            if j is None or not j.in_flight_rates:
                continue
            epoch = [e / s / 1e9 for e, s in zip(j.link_bytes, j.seconds, strict=True)]
            flight, bare = j.in_flight_rates, j.bare_gb_s
            row = f"| {kind} | {layout} | {median(flight):.2f} ({spread(flight, '{:.2f}')}) "
            row += f"| {median(j.in_flight_s):.3f} | {median(epoch):.2f} "
            row += f"({spread(epoch, '{:.2f}')}) "
            if bare:
                row += f"| {median(bare):.2f} ({spread(bare, '{:.2f}')}) "
                row += f"| {median(flight) / median(bare):.2f}x "
                row += f"| {median(epoch) / median(bare):.2f}x "
            else:
                row += "| - | - | - "
            ms = j.fetch_ms()
            if ms:
                legs = [f"{ms[k]:.1f} + {ms['bytes' + p]:.1f} = {ms['whole' + p]:.1f}"
                        for k, p in (("envelope", ""), ("envelope_p90", "_p90"))]  # fmt: skip
                row += f"| {legs[0]} ({legs[1]}) | {j.depth:.1f} "
            else:
                row += "| - | - "
            if j.link_gb_s:
                link, typed = j.link_gb_s, j.typed_gb_s
                row += f"| {median(typed):.2f} ({spread(typed, '{:.2f}')}) " if typed else "| - "
                row += f"| {median(link):.2f} ({spread(link, '{:.2f}')}) "
                row += f"| {median(link) / median(bare):.2f}x "
                row += f"| {median(link) / median(typed):.2f}x |" if typed else "| - |"
            else:
                row += "| - | - | - | - |"
            link_rows.append(row)
    target_rows = ["| issue 24 target | layout | measured | verdict |", "|---|---|---:|---|"]
    for t in targets(jobs, args.layouts):
        x = t.ours / t.peer
        target_rows.append(
            f"| {t.case} >= {t.least}x | {t.layout} | {x:.2f}x | {verdict(x >= t.least)} |"
        )
    mb = 16 * args.side**3 / MIB
    return "\n".join(
        [
            *rows,
            "",
            *ratio_rows,
            "",
            *([*link_rows, ""] if len(link_rows) > 2 else []),
            *([*target_rows, ""] if len(target_rows) > 2 else []),
            "batches/s and delivered GB/s: both ranks together over the timed epochs (last "
            "end - first start); exchanged: growth of Status().bytes_exchanged summed over the "
            "services; exchange GB/s = exchanged / the same time; server CPU s: the services' "
            "user + system CPU over the timed epochs; stall s: the sessions' stall_s (streams "
            "waiting for a batch to be prepared), summed. Exchange GB/s in flight: the bytes "
            "of the services' fetches (both directions) / the time at least one fetch of either "
            "service was in flight (request sent to last byte in); per epoch time: the same "
            "bytes / the timed epochs' wall time. The bare transfers and the link beside them: "
            "two fresh processes, each building its node's service (over MPI without its gRPC "
            "server; over gRPC its TCP server and data listener, no Unix socket), replaying the "
            f"same fetches {LINK_REPS} times each ({LINK_PASSES} passes over them a time), "
            "alternating. Over MPI, bare mpi4py sends each "
            "fetch's messages into contiguous buffers, and typed into the slots sends each "
            "sample's part from the resident sample into the batch slot amid its halo, a "
            "subarray datatype on each side (the MPI idiom for a block amid its halo). Over "
            "gRPC, bare TCP sockets move each fetch's bytes (a 4-byte request, the bytes "
            "answered by sendall, received by recv_into), one connection per fetch in flight, "
            "and, for blocks, copied into the slots puts each sample's part in its slot amid "
            "its halo with numpy (TCP has no datatypes). The link fetches the same samples "
            f"through the services' code (benchmarks/peers_link.py); both directions at once, "
            f"{FETCH_AHEAD} fetches in flight each way, bytes / time. Issue 24's 0.8x target is "
            "judged on link / bare (and, for blocks, link / into the slots: the same job done "
            "bare); in "
            "flight / bare is the link as the services' ranks pace it on shared cores. Per fetch: "
            "from asked to the reply's envelope in, then to its last byte in (median, and 90th "
            "percentile, of every fetch of the timed epochs; the MPI peers' fetches post their "
            "receives with the request, with no envelope before the bytes: 0 + the whole); "
            "fetches in flight: their times summed / the time in flight (both services). Medians "
            "over the reps; reps: the full range (min-max) over them.",
            f"- data: {args.samples} .npy samples x {mb:.1f} MiB (float32 (4, {args.side}, "
            f"{args.side}, {args.side})); global batch {2 * args.batch} "
            f"({2 * args.batch * mb:.0f} MiB); 2 ranks; epochs {args.epochs} timed after 1 "
            f"warm-up; reps {args.reps}",
            *notes,
            "- machine: " + machine_info(),
        ]
    )


def as_json(
    args: argparse.Namespace,
    jobs: dict[tuple[str, str], Job],
    idle: dict[str, list[float]],
    stage_s: float,
    shares: list[int],
    debris: list[str],
    wall: float,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results (every job's rates with their per-rep values, the ratios, idle CPU, what
    was left behind) and the key ratios: gRPC peers vs MPI peers, per layout."""
    results = {
        "args": {k: v for k, v in vars(args).items() if k not in ("client", "json")},
        "jobs": [j.summary() for j in jobs.values()],
        "ratios": ratios(jobs, args.layouts),
        "idle_cores": {k: median(v) for k, v in idle.items()},
        "stage_s": stage_s,
        "shares": shares,
        "debris": debris,
        "wall_s": wall,
    }
    key = [
        key_ratio(
            f"{t.layout}: {t.case}",
            ours=t.ours,
            peer=t.peer,
            unit=t.unit,
            ratio=t.ours / t.peer,
            of=t.of,
            target=f">= {t.least}x",
            ok=t.ours / t.peer >= t.least,
        )
        for t in targets(jobs, args.layouts)
    ]
    for layout in args.layouts:
        if ("grpc", layout) in jobs and ("mpi", layout) in jobs:
            a, b = jobs["grpc", layout].batches_s, jobs["mpi", layout].batches_s
            key.append(
                key_ratio(
                    f"{layout}: services peering over gRPC vs over MPI",
                    ours=a,
                    peer=b,
                    unit="batches/s",
                    ratio=a / b,
                    of="gRPC / MPI batches/s",
                )
            )
    return results, key


def run_store(
    kind: str,
    template: str,
    src: str,
    args: argparse.Namespace,
    rep: int,
    jobs: dict[tuple[str, str], Job],
) -> tuple[float, list[str]]:
    """Start one store, run its jobs, measure it idle, stop it: (idle CPU in cores, debris)."""
    t0 = time.monotonic()
    store = Store(kind, template, src, tls=args.tls, cpus=args.node_cpus)
    started = time.monotonic() - t0
    try:
        run_jobs(store, args, jobs)
        for layout in args.layouts:
            job = jobs[kind, layout]
            wall = job.seconds[-1]
            bare_note = ""
            if job.in_flight_s:
                rate = job.link_bytes[-1] / job.in_flight_s[-1] / 1e9
                bare_note = f"; {rate:.2f} GB/s in flight ({job.in_flight_s[-1]:.2f} s)"
            if kind == "mpi" or (kind == "grpc" and not args.tls):
                drill = run_link(job.fetches[-1], layout, template, store)
                job.bare_gb_s += drill["bare"]
                job.typed_gb_s += drill.get("typed", [])
                job.link_gb_s += drill["link"]
                bare_note += f"; {BARE[kind]} {median(drill['bare']):.2f} GB/s"
                if "typed" in drill:
                    bare_note += f", typed into the slots {median(drill['typed']):.2f}"
                bare_note += f", the link beside them {median(drill['link']):.2f}"
            print(
                f"rep {rep + 1}: {kind:5s} {layout:6s}: {job.batches[-1] / wall:6.1f} batches/s, "
                f"{job.delivered[-1] / wall / 1e9:5.2f} GB/s, exchanged "
                f"{job.exchanged[-1] / MIB:5.0f} MiB ({job.exchanged[-1] / wall / 1e9:.2f} "
                f"GB/s{bare_note}), stall {job.stall[-1]:.2f} s (store up in {started:.1f} s)",
                flush=True,
            )
        cpu0, t_idle = store.cpu(), time.monotonic()
        time.sleep(1.0)
        idle = (store.cpu() - cpu0) / (time.monotonic() - t_idle)
    finally:
        debris = store.stop()
    return idle, debris


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        return client(args.client)
    t_start = time.monotonic()
    work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    src = ensure_data(work, args.samples, args.side)
    template, stage_s, shares = stage_shards(work, src)
    notes = [
        f"- staged with `mpiexec -n 2 datastore stage --mode shard` in {stage_s:.1f} s: "
        f"{shares[0]} + {shares[1]} files on node0 + node1"
    ]
    if args.node_cpus:
        notes.append(
            f"- nodes pinned: node 0's service and rank on CPUs {args.node_cpus[0]}, node 1's on "
            f"{args.node_cpus[1]} (taskset), the bare ranks likewise; one node ('local') is the "
            "whole dataset on each node, rank k streaming from node k's service"
        )
    if args.tls and "grpc" in args.kinds:
        notes.append(
            "- the grpc store's peers talk TLS (`--tls`: a self-signed certificate), its gRPC "
            "and its data connections; no link replay beside bare TCP (that runs without TLS)"
        )
    print(notes[0][2:], flush=True)
    jobs = {(k, lay): Job(k, lay) for k in args.kinds for lay in args.layouts}
    idle: dict[str, list[float]] = {k: [] for k in args.kinds}
    debris: list[str] = []
    for rep in range(args.reps):
        for kind in args.kinds if rep % 2 == 0 else args.kinds[::-1]:
            cores, left = run_store(kind, template, src, args, rep, jobs)
            idle[kind].append(cores)
            debris += left
    notes.append(
        "- the services' CPU while idle (dataset resident, no client; cores): "
        + ", ".join(f"{k} {median(v):.2f}" for k, v in idle.items())
    )
    notes.append(
        "- after every store: no socket and no shared-memory segment left"
        if not debris
        else f"- LEFT BEHIND: {', '.join(debris)}"
    )
    text = report(args, jobs, notes)
    print("\n" + text)
    wall = time.monotonic() - t_start
    print(f"(benchmark wall time {wall:.0f} s)")
    if args.json:
        results, key = as_json(args, jobs, idle, stage_s, shares, debris, wall)
        write_results(args.json, "peers", results, key)
    return 1 if debris else 0


if __name__ == "__main__":
    sys.exit(main())
