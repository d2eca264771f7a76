"""Soak: a campaign with faults for a set time, then check that nothing was lost or left behind.

What runs (all real processes, ``--seconds`` long; default 1800, the tests run 45)
--------------------------------------------------------------------------------
- One ``datastore serve --allow ROOT --session-idle 3`` and ``--clients`` trainer-like clients,
  each ``DataStoreLoader(train.h5, batch_size=4, seed=i, service=ServiceOptions(SOCKET))``
  iterating epochs.
  A client compares every sample it gets, the ``idx`` field and the ``x`` payload bytes,
  with the source file; every ``--save-every`` batches it saves its ``state_dict()`` and the
  keys seen so far this epoch to a state file (written to a temporary file, fsynced and
  renamed: atomic); after each epoch it got to the end of it writes the epoch's keys to its
  log, fsynced.
- Every 1-4 s a random client that has saved its state since it started is killed with
  SIGKILL and started again: it loads its state file (``load_state_dict``, then ``iter()``) and
  must deliver exactly the rest of that epoch. If the time is up with fewer than
  ``--min-kills`` kills (default 3), or before a killed client finished the epoch it resumed (a
  loaded machine: clients slow to start and save), the run goes on, killing only until there
  were enough, until both, for at most as long again (``overtime_s``).
- Half-way the service is stopped with SIGTERM and started again on the same socket (it reloads
  the resident dataset from its state file). A client that loses the service exits with
  ``OUTAGE`` (75) and is started again, resuming from its state file; that exit is expected only
  from the stop until ``OUTAGE_GRACE`` s after the new service answers. Any other client exit
  (an error, a wrong byte, an outage at another time) is counted as unexpected.
- Meanwhile, on a thread of their own, one at once, then one every 20 s, stage rounds into
  fresh destinations under ROOT: one killed with SIGKILL mid-copy then resumed; one run with a
  file-size limit (``RLIMIT_FSIZE``: writes fail, as on a full disk) that must fail cleanly,
  then run again without it; each destination then checked with ``datastore stage --verify``.

Checks at the end (each a line ``ok`` / ``FAILED``; exit 1 if any failed)
-----------------------------------------------------------------------
- every epoch a client finished saw every sample exactly once;
- every sample's bytes equal the source's (and some were checked);
- no client exited unexpectedly;
- killed clients resumed from their saved state, and the epochs they finished that way were
  whole (at least one, when any client was killed);
- every staged destination verifies against its manifest, and holds no temporary file;
- the full-disk stage failed with a non-zero exit and left no partial file under a final name;
- after the clients are gone and their sessions expired, the service's RSS and open file
  descriptors are within 10 % (RSS: 10 % or 8 MiB) of what they were after its restart,
  once warm;
- the service stops on SIGTERM with exit 0 within its grace + 5 s, removing its socket, and no
  ``/dev/shm/datastore.*`` segment of it is left.

``--inject-faults`` proves the checks fire: client 0 crashes once (an exception after its first
batch) and client 1 once finds a byte of a sample changed; the run must then fail exactly on
those two exits and the checks they break.

Usage::

    python benchmarks/soak.py --seconds 1800                          # the documented run
    python benchmarks/soak.py --seconds 45 --inject-faults --json     # what tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

REPO = str(Path(__file__).resolve().parent.parent)
SAMPLES, BATCH, SAMPLE_BYTES = 64, 4, 64 << 10

OUTAGE = 75  # a client's exit status when the service is gone (EX_TEMPFAIL)
STAGE_EVERY_S = 20.0  # s between the starts of two stage rounds
OUTAGE_GRACE = 30.0  # s after a restarted service answers, while its clients may still fail


def client(path: str, address: str, log: str, state_file: str, seed: int, save_every: int) -> int:
    """One trainer-like client (``soak.py --client``): epochs of ``DataStoreLoader``, every
    sample checked against the source, its position saved every ``save_every`` batches and
    resumed from at start. Exit ``OUTAGE`` when the service is gone, 3 on a wrong sample."""
    from datastore import DataStoreLoader
    from datastore.errors import DataStoreError
    from datastore.sources.options import ServiceOptions

    with h5py.File(path, "r") as f:
        source = f["x"][:]
    crash, corrupt = (Path(log).with_suffix(s) for s in (".crash", ".corrupt"))
    try:
        loader = DataStoreLoader(
            path,
            batch_size=BATCH,
            seed=seed,
            timeout=20,
            fields=["idx", "x"],
            service=ServiceOptions(address),
        )
        keys: list[int] = []
        if os.path.exists(state_file):
            with open(state_file) as fh:
                saved = json.load(fh)
            loader.load_state_dict(saved["state"])
            keys = saved["keys"]
        with open(log, "a") as out:
            while True:
                start = loader.state_dict()
                for n, batch in enumerate(loader, 1):
                    idx, x = batch["idx"].tolist(), batch["x"].numpy()
                    if _take(crash):
                        raise RuntimeError("a fault injected by --inject-faults")
                    if _take(corrupt):  # as if the service had sent one wrong byte
                        x = x.copy()
                        x[0, 0] ^= 0xFF
                    wrong = [k for j, k in enumerate(idx) if not np.array_equal(x[j], source[k])]
                    if wrong:
                        print(f"samples {wrong}: bytes differ from the source", file=sys.stderr)
                        return 3
                    keys += idx
                    if n % save_every == 0:
                        _save(state_file, loader.state_dict(), keys)
                record = {"epoch": start["epoch"], "resumed_at": start["step"], "keys": keys}
                out.write(json.dumps(record) + "\n")
                out.flush()
                os.fsync(out.fileno())
                keys = []
                _save(state_file, loader.state_dict(), keys)
    except DataStoreError as exc:
        print(f"service lost: {type(exc).__name__}: {exc}", file=sys.stderr)
        return OUTAGE


def _take(fault: Path) -> bool:
    """Whether a fault of ``--inject-faults`` is due here (once: its file is removed)."""
    try:
        fault.unlink()
    except FileNotFoundError:
        return False
    return True


def _save(state_file: str, state: dict[str, Any], keys: list[int]) -> None:
    """Write the position and the epoch's keys so far, atomically (a kill leaves the old or
    the new file, never half of one)."""
    tmp = f"{state_file}.tmp"
    with open(tmp, "w") as fh:
        json.dump({"state": state, "keys": keys}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, state_file)


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env.update(PYTHONPATH=REPO, XDG_STATE_HOME=str(work / "state"), OMP_NUM_THREADS="1")
    env["XDG_RUNTIME_DIR"] = str(work / "run")
    return env


def _usage(pid: int) -> tuple[int, int]:
    """``(RSS bytes, open file descriptors)`` of process ``pid``."""
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Service:
    """One ``datastore serve`` subprocess."""

    def __init__(self, work: Path, root: Path, grace: float = 2.0) -> None:
        self.work, self.root, self.grace = work, root, grace
        self.socket = work / "run" / "ds.sock"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(self.socket)]
        cmd += ["--allow", str(self.root), "--session-idle", "3", "--grace", str(self.grace)]
        log = open(self.work / "serve.log", "ab")  # noqa: SIM115 (the child holds it)
        self.proc = subprocess.Popen(cmd, env=_env(self.work), stderr=log, stdout=log)
        log.close()
        from datastore.service.paths import socket_answers

        deadline = time.monotonic() + 60
        while not (self.socket.exists() and socket_answers(self.socket)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"datastore serve did not start (see {self.work}/serve.log)")
            time.sleep(0.1)

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM; ``(exit code or None if it had to be killed, seconds it took)``."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(self.grace + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        return code, time.monotonic() - t0


def _write_dataset(path: Path) -> None:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["idx"] = np.arange(SAMPLES, dtype=np.int64)
        f.create_dataset("x", data=rng.integers(0, 255, (SAMPLES, SAMPLE_BYTES), dtype=np.uint8))


def _write_tree(root: Path, files: int = 40, size: int = 256 << 10) -> None:
    rng = np.random.default_rng(1)
    for i in range(files):
        sub = root / f"d{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:03d}.bin").write_bytes(rng.bytes(size))


def _stage(src: Path, dest: Path, env: dict[str, str], *extra: str, wrap: tuple = ()):
    cmd = [*wrap, sys.executable, "-m", "datastore", "stage", str(src), "--to", str(dest), "-q"]
    out = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    return subprocess.Popen([*cmd, *extra], env=env, **out)


# files of at most 100 KiB: a write past it fails with EFBIG (SIGXFSZ ignored). coreutils' env
# and util-linux's prlimit set them before the exec; a preexec_fn would fork this process, whose
# gRPC threads' fork handlers can kill the child
FULL_DISK = ("env", "--ignore-signal=XFSZ", "prlimit", f"--fsize={100 << 10}")


def _stage_round(k: int, src: Path, root: Path, env: dict[str, str], rng: random.Random):
    """A stage killed mid-copy and resumed, and a 'full disk' stage then rerun; the checks."""
    out: dict[str, Any] = {}
    killed = root / f"dest-killed-{k}"
    p = _stage(src, killed, env)
    time.sleep(rng.uniform(0.05, 0.4))
    p.kill()
    p.wait()
    out["resumed"] = _stage(src, killed, env).wait(120)
    full = root / f"dest-full-{k}"
    p = _stage(src, full, env, wrap=FULL_DISK)
    out["full_disk_exit"] = p.wait(120)
    big = [f for f in full.rglob("*.bin") if f.stat().st_size != 256 << 10]
    out["partial_files"] = len(big)
    out["rerun"] = _stage(src, full, env).wait(120)
    for name, dest in (("killed", killed), ("full", full)):
        verify = subprocess.run(
            [sys.executable, "-m", "datastore", "stage", "--to", str(dest), "--verify", "-q"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out[f"verify_{name}"] = verify.returncode
        out[f"tmp_left_{name}"] = len(list((dest / ".datastore" / "tmp").glob("*")))
    return out


class _Stager(threading.Thread):
    """Stage rounds (:func:`_stage_round`) on a thread of their own, beside the kills: one at
    once, then one every :data:`STAGE_EVERY_S` s, until :meth:`stop` (which waits for the round
    under way and returns every round's checks)."""

    def __init__(self, src: Path, root: Path, env: dict[str, str], rng: random.Random, t0: float):
        super().__init__(name="stage-rounds", daemon=True)
        self.args, self.rng, self.t0 = (src, root, env), rng, t0
        self.rounds: list[dict[str, Any]] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        k = 0
        while not self._stopping.is_set():
            self.rounds.append(_stage_round(k, *self.args, self.rng))
            k += 1
            self._stopping.wait(max(0.0, self.t0 + STAGE_EVERY_S * k - time.monotonic()))

    def stop(self) -> list[dict[str, Any]]:
        self._stopping.set()
        self.join()
        return self.rounds


def epochs(logs: list[Path]) -> dict[str, int]:
    """What the clients' logs say: the epochs finished, those without every sample exactly
    once, those resumed mid-epoch from a saved state, and the samples checked (a client
    checks every sample's bytes as it gets it and stops at the first wrong one)."""
    out = {"epochs": 0, "bad_epochs": 0, "resumed_epochs": 0, "samples_checked": 0}
    for log in logs:
        lines = log.read_text().splitlines() if log.exists() else []
        for line in lines:
            rec = json.loads(line)
            out["epochs"] += 1
            out["bad_epochs"] += sorted(rec["keys"]) != list(range(SAMPLES))
            out["resumed_epochs"] += rec["resumed_at"] > 0
            out["samples_checked"] += len(rec["keys"])
    return out


def soak(
    seconds: float,
    clients: int,
    work: Path,
    seed: int = 0,
    save_every: int = 3,
    inject_faults: bool = False,
    min_kills: int = 3,
) -> dict[str, Any]:
    """Run the soak in ``work``; the figures and the checks (module docstring). With
    ``inject_faults`` client 0 crashes once and client 1 once sees a wrong byte."""
    rng = random.Random(seed)
    root = work / "root"
    (work / "run").mkdir(parents=True, mode=0o700)
    root.mkdir()
    data = root / "train.h5"
    _write_dataset(data)
    src = root / "src"
    _write_tree(src)
    env = _env(work)
    service = Service(work, root)
    service.start()
    logs = [work / f"client{i}.jsonl" for i in range(clients)]
    states = [work / f"client{i}.state.json" for i in range(clients)]
    if inject_faults:
        (work / "client0.crash").touch()
        (work / f"client{min(1, clients - 1)}.corrupt").touch()

    started = [0.0] * clients

    def start_client(i: int) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--client", str(data), str(service.socket), str(logs[i])]
        cmd += [str(states[i]), str(i), str(save_every)]
        started[i] = time.time()
        with open(work / f"client{i}.err", "ab") as err:  # the child holds it
            return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def saved_since_start(i: int) -> bool:
        """Whether client ``i`` saved its state since it started: a kill then has something
        to resume (a client killed while it starts would only start again)."""
        return states[i].exists() and states[i].stat().st_mtime > started[i]

    procs = [start_client(i) for i in range(clients)]
    report: dict[str, Any] = {"seconds": seconds, "clients": clients, "save_every": save_every}
    report.update(kills=0, outage_exits=0, unexpected_exits=[])

    def account(outage: tuple[float, float], again: bool = True) -> None:
        """Every client exit we did not cause: expected (the service gone while restarting)
        or unexpected, with the client's stderr; the client started again (resuming)."""
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None:
                continue
            if code == OUTAGE and outage[0] <= time.monotonic() <= outage[1]:
                report["outage_exits"] += 1
            else:
                tail = (work / f"client{i}.err").read_text(errors="replace")[-2000:]
                report["unexpected_exits"].append({"client": i, "exit": code, "stderr": tail})
            if again:
                procs[i] = start_client(i)

    t0 = time.monotonic()
    stager = _Stager(src, root, env, random.Random(seed + 1), t0)
    stager.start()
    restarted = False
    outage: tuple[float, float] = (math.inf, math.inf)  # when a client may lose the service
    baseline: tuple[int, int] | None = None
    next_kill = t0 + rng.uniform(1, 4)
    ends, cap = t0 + seconds, t0 + 2 * seconds
    while True:
        now = time.monotonic()
        # Under load (clients slow to start, so few saved to be killed after) the time may be
        # up with fewer than min_kills kills, or before a killed client finished the epoch it
        # resumed: the run goes on until both, for at most as long again.
        if now >= ends and (
            now >= cap or (report["kills"] >= min_kills and epochs(logs)["resumed_epochs"])
        ):
            break
        if not restarted and now - t0 > seconds / 2:
            code, took = service.stop()
            report["restart_stop"] = {"exit": code, "seconds": round(took, 2)}
            service.start()
            restarted = True
            outage = (now, time.monotonic() + OUTAGE_GRACE)
            baseline_at = time.monotonic() + min(10.0, seconds / 6)  # warm again first
        if restarted and baseline is None and time.monotonic() > baseline_at:
            baseline = _usage(service.proc.pid)  # type: ignore[union-attr]
        account(outage)
        i = rng.randrange(clients)
        # a client that has just exited is accounted for first; one yet to save, later
        killing = now < ends or report["kills"] < min_kills
        if killing and now > next_kill and procs[i].poll() is None and saved_since_start(i):
            procs[i].kill()
            procs[i].wait()
            procs[i] = start_client(i)
            report["kills"] += 1
            next_kill = now + rng.uniform(1, 4)
        time.sleep(0.2)
    report["overtime_s"] = round(max(0.0, time.monotonic() - ends), 1)
    stage_rounds = stager.stop()
    account(outage, again=False)
    for p in procs:
        p.kill()
        p.wait()
    time.sleep(3 + 2.5)  # --session-idle 3: the killed clients' sessions expire
    end = _usage(service.proc.pid)  # type: ignore[union-attr]
    baseline = baseline or end
    pid = service.proc.pid  # type: ignore[union-attr]
    code, took = service.stop()
    report["final_stop"] = {"exit": code, "seconds": round(took, 2)}
    report["usage"] = {"rss_start": baseline[0], "rss_end": end[0], "fds_start": baseline[1],
                       "fds_end": end[1]}  # fmt: skip
    report.update(epochs(logs))
    report["stage_rounds"] = stage_rounds
    segments = glob.glob(f"/dev/shm/datastore.{os.getuid()}.{pid}.*")
    report["checks"] = {
        "every finished epoch had every sample once": report["epochs"] > 0
        and report["bad_epochs"] == 0,
        "every sample's bytes equal the source's": report["samples_checked"] > 0
        and not any(e["exit"] == 3 for e in report["unexpected_exits"]),
        "no client exited unexpectedly": not report["unexpected_exits"],
        "killed clients resumed mid-epoch from their saved state, epochs whole": (
            report["resumed_epochs"] > 0 or report["kills"] == 0
        ),
        "staged destinations verify, no temp files": all(
            r["resumed"] == 0
            and r["rerun"] == 0
            and r["verify_killed"] == 0
            and r["verify_full"] == 0
            and r["tmp_left_killed"] == 0
            and r["tmp_left_full"] == 0
            for r in stage_rounds
        ),
        "a full disk fails the stage, no partial file": all(
            r["full_disk_exit"] != 0 and r["partial_files"] == 0 for r in stage_rounds
        ),
        "RSS and descriptors back within 10 %": (
            end[0] <= max(baseline[0] * 1.1, baseline[0] + (8 << 20))
            and end[1] <= baseline[1] * 1.1
        ),
        "service stops on SIGTERM, exit 0, within grace + 5 s": code == 0
        and report["restart_stop"]["exit"] == 0,
        "socket and shared memory removed": not service.socket.exists() and not segments,
    }
    return report


def main() -> int:
    if sys.argv[1:2] == ["--client"]:  # one of the soak's clients (started by soak())
        path, address, log, state_file, seed, save_every = sys.argv[2:]
        return client(path, address, log, state_file, int(seed), int(save_every))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=1800)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=3, help="batches between a client's saves")
    p.add_argument(
        "--min-kills", type=int, default=3, help="kills the run goes on for past --seconds"
    )
    p.add_argument(
        "--inject-faults",
        action="store_true",
        help="client 0 crashes once and client 1 sees one wrong byte: the run must fail on "
        "exactly these (tests/test_soak.py)",
    )
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args()
    if a.save_every < 1:
        p.error(f"--save-every must be >= 1, got {a.save_every}")
    if a.min_kills < 0:
        p.error(f"--min-kills must be >= 0, got {a.min_kills}")
    if a.dir is not None:
        os.makedirs(a.dir, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="datastore-soak-", dir=a.dir))
    try:
        report = soak(
            a.seconds, a.clients, work, a.seed, a.save_every, a.inject_faults, a.min_kills
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(report))
    else:
        for key in ("seconds", "clients", "save_every", "kills", "outage_exits",
                    "unexpected_exits", "epochs", "bad_epochs", "resumed_epochs",
                    "samples_checked", "restart_stop", "final_stop", "usage"):  # fmt: skip
            print(f"{key}: {report[key]}")
        print(f"stage rounds: {len(report['stage_rounds'])}")
        for name, ok in report["checks"].items():
            print(f"{'ok    ' if ok else 'FAILED'} {name}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
