"""Benchmark ``datastore stage`` against the standard tools on the same input.

What is measured
----------------
Three cases, each timed for ours and for the peer on the same input and filesystem:

  a. a tree of 2,000 files x 512 KiB in 20 subdirectories
     ``datastore stage DIR --to OUT --quiet``  vs  ``cp -r DIR OUT``         target >= 0.95x
     (from a network filesystem, ``--netfs`` / ``--source-dir``: target >= 1.5x)
  b. one 2 GiB file
     ``datastore stage FILE --to OUT --quiet`` vs  ``cp FILE OUT/``          target >= 0.95x
     (ours checksums every byte while copying; cp does not)
  c. a plain ``.tar`` of (a), made with ``tar -cf``
     ``datastore stage X.tar --to OUT --quiet`` vs ``mkdir OUT && tar -xf X.tar -C OUT``
                                                                              target >= 1.3x

The ratio is peer_time / ours_time, so > 1 means we are faster.

How
---
* Every command is timed as ``sh -c 'CMD && sync'``: staged data must be durable, so the
  time includes writing it back to the device.
* Before each timed command (untimed): the previous output dir is removed, ``sync`` runs, and
  the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``) so that ours and the peer
  both start cold. Where that is not permitted (not root, read-only /proc) the script says so
  once and runs warm; ``--warm`` skips dropping on purpose.
* Each repetition runs ours and the peer back to back, swapping which goes first every other
  repetition; medians, min and max over ``--reps`` are reported.
* After each run (untimed) the output is checked: exit code 0, and the number of regular files
  and their total bytes equal the input's (``DEST/.datastore`` is not counted).
* The device's raw sequential write bandwidth (``dd ... oflag=direct conv=fdatasync``) is
  printed as the physical limit. MB/s are 10^6 bytes per second of payload.
* Inputs are generated once under ``--dir`` (default ``./bench-data``) and reused while they
  have the right size; outputs go to the same directory, hence the same filesystem.
* ``--source-dir DIR`` puts the inputs in DIR instead (e.g. on a parallel filesystem), the
  outputs staying under ``--dir``. ``--netfs`` puts them on a real network filesystem:
  a one-brick GlusterFS volume on this host, served over TCP and mounted over FUSE
  (``benchmarks/netfs.sh up``); before every timed command the volume is unmounted and mounted
  again (a cold client: GlusterFS caches in the client process, which ``drop_caches`` does not
  reach) and then the page cache is dropped (the brick's disk and the FUSE mount alike). The
  volume keeps GlusterFS's default options, what a client of a real cluster gets. Where
  GlusterFS cannot run (not root, no FUSE, packages missing), the run is skipped with the
  reason, exit 0. For a source elsewhere the floor is the source's instead of the device's:
  reading every input byte, 8 files (or 8 MiB pieces of the tar) at a time, into the page
  cache and no further (``sendfile`` to ``/dev/null``), writing nothing.
* The load average (``/proc/loadavg``, 1 min) is recorded before every repetition.
* Around every timed command the CPU time is recorded: the command's own (user + system of
  ``sh -c 'CMD && sync'`` and all it ran), the GlusterFS daemons' (``--netfs``: the client,
  the brick server and glusterd, from ``/proc``), and how busy the machine's cores were
  (``/proc/stat``): on a machine whose cores are busy the time is the CPU's, not the I/O's.

Usage::

    python benchmarks/stage.py                       # full size, 5 reps, cold cache
    python benchmarks/stage.py --scale 0.05 --reps 2 # quick smoke run
    python benchmarks/stage.py --cases a,c --streams 16 --out /tmp/bench.md
    python benchmarks/stage.py --json benchmarks/results/stage.json  # for benchmarks/report.py
    python benchmarks/stage.py --netfs --scale 0.5 --cases a,c       # source on GlusterFS
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from common import PageCache, key_ratio, machine_info, stats, venv_tool, write_results

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SMALL_FILES, SMALL_SIZE, SUBDIRS = 2000, 512 * KIB, 20
BIG_SIZE = 2 * GIB
DD_BYTES = 1 * GIB
DD_BS = 4 * MIB
META = ".datastore"  # datastore's bookkeeping inside DEST, not part of the payload
TARGETS = {"a": (0.95, "cp -r"), "b": (0.95, "cp"), "c": (1.3, "tar -xf")}
# issue 21: from a network filesystem a tree is >= 1.5x cp -r (on the local disk >= 0.95x)
REMOTE_TARGETS = {**TARGETS, "a": (1.5, "cp -r")}
TITLES = {"a": "tree of small files", "b": "one big file", "c": "plain .tar of (a)"}
NETFS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netfs.sh")


@dataclass
class Case:
    """One benchmark case: the input, its payload, and the two shell commands to compare."""

    key: str
    title: str
    ours: str
    peer: str
    files: int
    nbytes: int
    pre_peer: str = ""  # untimed setup before the peer (e.g. creating OUT for ``cp FILE OUT/``)
    floor: str = ""  # benchmarks/floor.py on the same input: what the device allows
    read_floor: str = ""  # else the input, read only: what the source allows
    remote: bool = False  # the input is on another filesystem (REMOTE_TARGETS)
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"ours": [], "peer": [], "floor": []}
    )
    load: list[float] = field(default_factory=list)  # 1-min load average before each rep
    cpu: dict[str, list[Cpu]] = field(default_factory=lambda: {"ours": [], "peer": []})


@dataclass(frozen=True)
class Cpu:
    """CPU around one timed command: seconds of the command itself (user + system), of the
    GlusterFS daemons, and the share of the machine's cores that were busy."""

    own: float
    netfs: float
    busy: float


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data", help="work dir for inputs and outputs")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="scale file counts and the big file size (e.g. 0.05 for a smoke run)",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per case (default 5)")
    p.add_argument("--cases", default="a,b,c", help="cases to run, comma separated (a,b,c)")
    p.add_argument(
        "--streams",
        type=int,
        default=None,
        metavar="N",
        help="passed through to datastore stage --streams",
    )
    p.add_argument(
        "--io", default="auto", help="passed through to datastore stage --io (default auto)"
    )
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    p.add_argument(
        "--source-dir",
        default=None,
        metavar="DIR",
        help="generate and read the inputs here (default: --dir); outputs stay under --dir",
    )
    p.add_argument(
        "--netfs",
        action="store_true",
        help="inputs on a one-host GlusterFS volume over FUSE (benchmarks/netfs.sh), "
        "remounted before every timed command",
    )
    p.add_argument(
        "--verify-stage",
        action="store_true",
        help="add --verify to ours (re-hash DEST against the manifest, timed)",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in TARGETS]
    if bad or not args.cases:
        p.error(f"--cases: unknown case(s) {bad}; pick from a,b,c")
    if args.scale <= 0 or args.reps < 1:
        p.error("--scale must be > 0 and --reps >= 1")
    if args.netfs and args.source_dir:
        p.error("--netfs chooses the source dir itself; give one of --netfs, --source-dir")
    return args


# ----------------------------------------------------------------------------- inputs


def sizes_for(scale: float) -> tuple[int, int]:
    """(number of small files, big file bytes) at ``scale``; the big file is whole MiBs."""
    n = max(1, round(SMALL_FILES * scale))
    big = max(1, round(BIG_SIZE * scale / MIB)) * MIB
    return n, big


def small_paths(root: str, n: int) -> list[str]:
    return [os.path.join(root, f"d{i % SUBDIRS:02d}", f"f{i:05d}.bin") for i in range(n)]


def tree_stats(root: str) -> tuple[int, int]:
    """(regular files, total bytes) under ``root``, skipping datastore's metadata dir."""
    files = nbytes = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if META in dirnames:
            dirnames.remove(META)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            nbytes += st.st_size
    return files, nbytes


def write_random(path: str, size: int, chunk: int = 4 * MIB) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n


def ensure_tree(root: str, n: int) -> bool:
    """Make the small-file tree unless it is there with the right sizes; True if (re)made."""
    paths = small_paths(root, n)
    if (
        os.path.isdir(root)
        and tree_stats(root) == (n, n * SMALL_SIZE)
        and all(os.path.isfile(p) and os.path.getsize(p) == SMALL_SIZE for p in paths)
    ):
        return False
    print(f"generating {n} x {SMALL_SIZE // KIB} KiB files in {root} ...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    for p in paths:
        write_random(p, SMALL_SIZE)
    return True


def ensure_big(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    print(f"generating {size / MIB:.0f} MiB file {path} ...", flush=True)
    write_random(path, size)


def ensure_tar(tar: str, tree: str, remade_tree: bool) -> None:
    """``tar -cf`` the tree; reuse the archive if a stamp says it matches the current tree."""
    stamp = tar + ".stamp"
    want = f"{tree_stats(tree)}"
    if not remade_tree and os.path.exists(tar) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == f"{want} {os.path.getsize(tar)}":
                return
    print(f"creating {tar} with tar -cf ...", flush=True)
    parent = os.path.dirname(tree)
    subprocess.run(["tar", "-cf", tar, "-C", parent, os.path.basename(tree)], check=True)
    with open(stamp, "w") as f:
        f.write(f"{want} {os.path.getsize(tar)}")


def check_space(work: str, src: str, n: int, big: int) -> None:
    """Exit early when the filesystems cannot hold the inputs (in ``src``), one output and
    dd's file (in ``work``)."""
    inputs = n * SMALL_SIZE * 2 + big
    output = max(n * SMALL_SIZE, big) + 256 * MIB
    same = os.stat(work).st_dev == os.stat(src).st_dev
    wants = [(work, inputs + output)] if same else [(src, inputs), (work, output)]
    for where, need in wants:
        have = shutil.disk_usage(where).free
        if have < need:
            sys.exit(
                f"{where}: {have / GIB:.1f} GiB free, the benchmark needs about "
                f"{need / GIB:.1f} GiB (lower --scale)"
            )


# ----------------------------------------------------------------------------- cache, timing


def remove(path: str) -> None:
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def timed(cmd: str) -> tuple[float, subprocess.CompletedProcess]:
    """Wall time of ``sh -c 'CMD && sync'``."""
    t0 = time.perf_counter()
    proc = subprocess.run(["sh", "-c", f"{cmd} && sync"], capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def verify(case: Case, side: str, out: str, proc: subprocess.CompletedProcess) -> None:
    """Exit code 0 and the same file count and bytes as the input; exits on a mismatch."""
    got = tree_stats(out) if os.path.isdir(out) else (0, 0)
    if proc.returncode == 0 and got == (case.files, case.nbytes):
        return
    cmd = {"ours": case.ours, "peer": case.peer, "floor": case.floor}[side]
    sys.exit(
        f"case {case.key} ({side}) produced a wrong result: exit {proc.returncode}, "
        f"{got[0]} files / {got[1]} bytes, want {case.files} / {case.nbytes}\n"
        f"command: {cmd}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
    )


def _cpu_now() -> tuple[float, float, int, int]:
    """(CPU seconds of this process's finished children, of the GlusterFS daemons, busy and
    total jiffies of the machine)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    netfs, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:
            continue  # gone meanwhile
        if name.split("(", 1)[1].startswith("gluster"):
            fields = rest.split()
            netfs += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:9]]
    idle = jiffies[3] + jiffies[4]  # idle, iowait
    return ru.ru_utime + ru.ru_stime, netfs, sum(jiffies) - idle, sum(jiffies)


def load1() -> float:
    """The 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class Cold:
    """Makes the next command start cold: the network filesystem remounted (``--netfs``),
    then the page cache dropped."""

    def __init__(self, cache: PageCache, netfs: bool):
        self.cache, self.netfs = cache, netfs

    def __call__(self) -> None:
        if self.netfs and not self.cache.can_drop:
            return  # --warm: keep the client's caches too
        if self.netfs:
            subprocess.run([NETFS, "remount"], check=True)
        self.cache.drop()


def run_one(case: Case, side: str, out: str, cold: Cold) -> float:
    remove(out)
    if side == "peer" and case.pre_peer:
        subprocess.run(["sh", "-c", case.pre_peer], check=True)
    cold()
    before = _cpu_now()
    secs, proc = timed(case.ours if side == "ours" else case.peer)
    after = _cpu_now()
    verify(case, side, out, proc)
    own, netfs, busy, total = (b - a for a, b in zip(before, after, strict=True))
    case.cpu[side].append(Cpu(own, netfs, busy / total if total else 0.0))
    return secs


def read_all(path: str, threads: int = 8) -> float:
    """Seconds to read every byte of the file or tree ``path`` into the page cache (``sendfile``
    to /dev/null), ``threads`` files or 8 MiB pieces at a time."""
    files = [path] if os.path.isfile(path) else small_paths(path, tree_stats(path)[0])
    null = os.open(os.devnull, os.O_WRONLY)

    def pull(job: tuple[str, int, int]) -> None:
        name, off, length = job
        fd = os.open(name, os.O_RDONLY)
        try:
            while length > 0 and (n := os.sendfile(null, fd, off, length)) > 0:
                off, length = off + n, length - n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    jobs = [(f, off, 8 * MIB) for f in files for off in range(0, os.path.getsize(f), 8 * MIB)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(pull, jobs))
    secs = time.perf_counter() - t0
    os.close(null)
    return secs


def run_floor(case: Case, out: str, cold: Cold) -> float:
    """The device floor for the case's input (benchmarks/floor.py), as it times itself; or,
    for a source elsewhere, the time to read the input (:func:`read_all`)."""
    remove(out)
    cold()
    if case.read_floor:
        return read_all(case.read_floor)
    proc = subprocess.run(["sh", "-c", case.floor], capture_output=True, text=True)
    verify(case, "floor", out, proc)
    return float(proc.stdout.strip().rsplit("=", 1)[1])


def run_case(case: Case, out: str, reps: int, cold: Cold) -> None:
    print(f"\n[{case.key}] {case.title}: {plural(case.files)}, {case.nbytes / MIB:.0f} MiB")
    print(f"  ours: {case.ours}\n  peer: {case.peer}", flush=True)
    for rep in range(reps):
        case.load.append(load1())
        order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
        for side in order:
            case.times[side].append(run_one(case, side, out, cold))
        floor = ""
        if case.floor or case.read_floor:
            case.times["floor"].append(run_floor(case, out, cold))
            floor = f", floor {case.times['floor'][-1]:.3f} s"
        print(
            f"  rep {rep + 1}/{reps}: ours {case.times['ours'][-1]:.3f} s, "
            f"peer {case.times['peer'][-1]:.3f} s{floor} (load {case.load[-1]:.2f})",
            flush=True,
        )
    remove(out)


# ----------------------------------------------------------------------------- cases


def build_cases(args: argparse.Namespace, src: str, out: str) -> list[Case]:
    n, big = sizes_for(args.scale)
    tree, big_file, tar = (os.path.join(src, x) for x in ("files", "big.bin", "files.tar"))
    remade = False
    if {"a", "c"} & set(args.cases):
        remade = ensure_tree(tree, n)
    if "b" in args.cases:
        ensure_big(big_file, big)
    if "c" in args.cases:
        ensure_tar(tar, tree, remade)
    ds = shlex.quote(venv_tool("datastore"))
    streams = f" --streams {args.streams}" if args.streams else ""
    streams += f" --io {args.io}" if args.io != "auto" else ""
    streams += " --verify" if args.verify_stage else ""
    q = shlex.quote
    o = q(out)
    specs = {
        "a": (
            f"{ds} stage {q(tree)} --to {o} --quiet{streams}",
            f"cp -r {q(tree)} {o}",
            n,
            n * SMALL_SIZE,
            "",
        ),
        "b": (
            f"{ds} stage {q(big_file)} --to {o} --quiet{streams}",
            f"cp {q(big_file)} {o}/",
            1,
            big,
            f"mkdir {o}",
        ),
        "c": (
            f"{ds} stage {q(tar)} --to {o} --quiet{streams}",
            f"mkdir {o} && tar -xf {q(tar)} -C {o}",
            n,
            n * SMALL_SIZE,
            "",
        ),
    }
    floor = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor.py")
    floors = {
        k: f"{q(sys.executable)} {q(floor)} {q(path)} {o}"
        for k, path in (("a", tree), ("c", tar))
        if src == os.path.abspath(args.dir)  # the floor is of one disk: not for a remote source
    }
    remote = {"a": tree, "c": tar} if src != os.path.abspath(args.dir) else {}
    return [
        Case(
            k,
            TITLES[k],
            *specs[k],
            floor=floors.get(k, ""),
            read_floor=remote.get(k, ""),
            remote=src != os.path.abspath(args.dir),
        )
        for k in args.cases
    ]


# ----------------------------------------------------------------------------- raw disk


def disk_bandwidth(work: str, scale: float) -> str:
    """Raw sequential write bandwidth of the work dir's device, by ``dd`` with O_DIRECT."""
    count = max(1, round(DD_BYTES * scale / DD_BS))
    path = os.path.join(work, "dd.tmp")
    cmd = [
        "dd",
        "if=/dev/zero",
        f"of={path}",
        f"bs={DD_BS // MIB}M",
        f"count={count}",
        "oflag=direct",
        "conv=fdatasync",
    ]
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    remove(path)
    if proc.returncode != 0:
        return f"dd failed ({proc.stderr.strip().splitlines()[-1:]}); raw bandwidth unknown"
    mbs = count * DD_BS / secs / 1e6
    shown = " ".join(cmd).replace(path, "FILE")
    return f"{mbs:.0f} MB/s raw sequential write ({count * DD_BS / MIB:.0f} MiB, `{shown}`)"


# ----------------------------------------------------------------------------- report


def summarize(case: Case) -> dict[str, float | str]:
    ours, peer = statistics.median(case.times["ours"]), statistics.median(case.times["peer"])
    target, name = target_of(case)
    ratio = peer / ours
    return {
        "ours": ours,
        "peer": peer,
        "ratio": ratio,
        "ours_mbs": case.nbytes / ours / 1e6,
        "peer_mbs": case.nbytes / peer / 1e6,
        "target": f">= {target:g}x vs {name}",
        "verdict": "PASS" if ratio >= target else "MISS",
    }


def target_of(case: Case) -> tuple[float, str]:
    """(least ratio, peer's name) for ``case``: its source decides which targets apply."""
    return (REMOTE_TARGETS if case.remote else TARGETS)[case.key]


def plural(files: int) -> str:
    return f"{files} file" + ("" if files == 1 else "s")


def report(
    cases: list[Case], args: argparse.Namespace, work: str, cache: PageCache, disk: str, source: str
) -> str:
    lines = [
        "| case | ours median s | peer median s | ours MB/s | peer MB/s | ratio | target | |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    spread = []
    for c in cases:
        s = summarize(c)
        spread_cpu = cpu_line(c)
        lines.append(
            f"| {c.key}: {c.title} ({plural(c.files)}, {c.nbytes / MIB:.0f} MiB) "
            f"| {s['ours']:.3f} | {s['peer']:.3f} | {s['ours_mbs']:.0f} | {s['peer_mbs']:.0f} "
            f"| {s['ratio']:.2f}x | {s['target']} | {s['verdict']} |"
        )
        t = c.times
        spread.append(
            f"- {c.key}: ours min/max {min(t['ours']):.3f}/{max(t['ours']):.3f} s, "
            f"peer min/max {min(t['peer']):.3f}/{max(t['peer']):.3f} s; load average "
            f"(1 min) before each rep: {', '.join(f'{x:.2f}' for x in c.load)}"
        )
        spread.append(spread_cpu)
        if t["floor"] and c.read_floor:
            floor = statistics.median(t["floor"])
            spread.append(
                f"  - source floor (every input byte read into the page cache, 8 files or 8 MiB "
                f"pieces at a time, nothing written): median {floor:.3f} s "
                f"({min(t['floor']):.3f}-{max(t['floor']):.3f}), so at best "
                f"{s['peer'] / floor:.2f}x vs the peer; ours is {s['ours'] / floor:.2f}x the floor"
            )
        elif t["floor"]:
            floor = statistics.median(t["floor"])
            spread.append(
                f"  - device floor (benchmarks/floor.py: bare parallel direct copy, no checksum, "
                f"no manifest, index untimed): median {floor:.3f} s, so at best "
                f"{s['peer'] / floor:.2f}x vs the peer; ours is {s['ours'] / floor:.2f}x the floor"
            )
    streams = args.streams or "default"
    return (
        "\n".join(
            [
                *lines,
                "",
                "ratio = peer time / ours time (> 1: we are faster); times include a final sync.",
                *spread,
                "",
                f"- disk: {disk}",
                f"- page cache: {cache.note}",
                f"- reps {args.reps}, scale {args.scale:g}, streams {streams}, --io {args.io}, "
                f"work dir {work}, source {source}",
                f"- machine: {machine_info()}",
            ]
        )
        + "\n"
    )


def cpu_line(case: Case) -> str:
    """The CPU seconds of both sides (and the GlusterFS daemons'), medians over the reps."""

    def side(name: str) -> str:
        runs = case.cpu[name]
        own = statistics.median(r.own for r in runs)
        netfs = statistics.median(r.netfs for r in runs)
        busy = statistics.median(r.busy for r in runs)
        daemons = f" + GlusterFS daemons {netfs:.2f}" if case.remote else ""
        return f"{name} {own:.2f}{daemons} (cores {busy:.0%} busy)"

    return f"  - CPU seconds per run, medians: {side('ours')}; {side('peer')}"


def as_json(
    cases: list[Case], args: argparse.Namespace, work: str, cache: PageCache, disk: str, source: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results (per case: the commands, seconds of each side with their ranges, MB/s, the
    ratio and the target) and the key ratios, for :func:`common.write_results`."""
    results: dict[str, Any] = {
        "cases": {},
        "disk": disk,
        "page_cache": cache.note,
        "reps": args.reps,
        "scale": args.scale,
        "streams": args.streams,
        "io": args.io,
        "work_dir": work,
        "source": source,
        "verify_stage": args.verify_stage,
    }
    ratios = []
    for c in cases:
        s = summarize(c)
        target, peer = target_of(c)
        results["cases"][c.key] = {
            "title": c.title,
            "files": c.files,
            "bytes": c.nbytes,
            "ours_command": c.ours,
            "peer_command": c.peer,
            "peer_name": peer,
            "seconds": {side: stats(c.times[side]) for side in ("ours", "peer", "floor")},
            "load": c.load,
            "cpu_seconds": {
                side: {
                    "own": stats([r.own for r in c.cpu[side]]),
                    "netfs_daemons": stats([r.netfs for r in c.cpu[side]]),
                    "cores_busy": stats([r.busy for r in c.cpu[side]]),
                }
                for side in ("ours", "peer")
            },
            "ours_mbs": s["ours_mbs"],
            "peer_mbs": s["peer_mbs"],
            "ratio": s["ratio"],
            "target": target,
            "pass": s["verdict"] == "PASS",
        }
        ratios.append(
            key_ratio(
                f"{c.key}: {c.title} ({plural(c.files)}, {c.nbytes / MIB:.0f} MiB) vs `{peer}`",
                ours=s["ours"],
                peer=s["peer"],
                unit="s",
                ratio=s["ratio"],
                of="peer time / ours",
                target=f">= {target:g}x",
                ok=s["verdict"] == "PASS",
            )
        )
    return results, ratios


def netfs_up() -> tuple[str | None, str]:
    """Bring the GlusterFS volume up (``benchmarks/netfs.sh up``): (its mount point, what it
    is), or (None, why not)."""
    proc = subprocess.run([NETFS, "up"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}")
    mnt = os.environ.get("NETFS_MNT", "/mnt/datastore-netfs")
    return os.path.join(mnt, "datastore-bench"), proc.stdout.strip().removeprefix("netfs: ")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    source = "the work dir"
    src = work
    if args.netfs:
        src, source = netfs_up()
        if src is None:
            print(f"SKIPPED: no network filesystem for --netfs: {source}", flush=True)
            return 0
    elif args.source_dir:
        src, source = os.path.abspath(args.source_dir), "--source-dir"
    os.makedirs(src, exist_ok=True)
    n, big = sizes_for(args.scale)
    check_space(work, src, n, big)
    out = os.path.join(work, "out")
    remove(out)
    cases = build_cases(args, src, out)
    cache = PageCache(args.warm)
    disk = disk_bandwidth(work, args.scale)
    print(f"disk: {disk}", flush=True)
    if src != work:
        source = f"{src}: {source}"
        print(f"source: {source}", flush=True)
    cold = Cold(cache, args.netfs)
    for case in cases:
        run_case(case, out, args.reps, cold)
    text = report(cases, args, work, cache, disk, source)
    print("\n" + text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        write_results(args.json, "stage", *as_json(cases, args, work, cache, disk, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
