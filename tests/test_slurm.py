"""deploy/campaign.sbatch on a real Slurm: munged, slurmctld and two slurmd on this machine, the
second node in network, mount and UTS namespaces of its own (tests/slurm_cluster.py).

Each campaign is submitted as deploy/README.md tells a user, from the repository root:
``sbatch [OPTIONS] --export=ALL,SRC=... deploy/campaign.sbatch``, with PYTHON (this venv),
JOBS, OUT, PORT and SRUN_JOB_FLAGS in the environment. Each test asserts the job's end state,
that every node's service drained (its log: ``draining`` then ``stopped``), that every job
trained from the services (``"data_source": "service"``), and that nothing is left on either
node: no process, no socket or run directory, no /dev/shm segment of a service. Skipped where
this machine cannot run Slurm (not root, no slurm-wlm or munge, no namespaces).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import KILL_WAIT, NODES, SlurmCluster, free_port, skip_reason

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "deploy" / "configs" / "tiny-cosmoflow.toml"
UNET = ROOT / "deploy" / "configs" / "tiny-unet3d.toml"

# the PyPI MPICH wheel's UCX netmod puts a business card of ~4.5 KB through PMI-1 in segments
# whose lines reach ~1080 bytes, past the one 1024-byte read() of Slurm's pmi2 plugin
# ("mpi/pmi2: invalid client request", MPI_Init aborts or hangs); its OFI netmod's card is 16
# bytes (deploy/README.md, "MPI on a cluster"). What a user of the wheel sets, every job:
WHEEL_ACROSS_NODES = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "MPIR_CVAR_CH4_OFI_ENABLE_DATA_AUTO_PROGRESS": "1",
}
ONE_NODE = "--exact --nodes=1"  # the later campaigns' jobs: one node each
ACROSS = "--exact --ntasks-per-node=1"  # the first campaign's 2-rank jobs: one rank per node

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    reason = skip_reason(ROOT, Path(sys.executable))
    if reason is not None:
        pytest.skip(reason)

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt  # pytest then still tears the cluster down

    previous = signal.signal(signal.SIGTERM, interrupt)  # a CI timeout's SIGTERM
    c = SlurmCluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def src(cluster) -> Iterator[Path]:
    """The dataset on the "parallel filesystem": 16 + 8 samples, one HDF5 file each. What the
    campaigns keep staged on n1 (this machine's /tmp) is removed at the end."""
    path = cluster.shared / "cosmo"
    subprocess.run(
        [sys.executable, "-m", "trainer.cosmology", str(path), "--samples", "16",
         "--val-samples", "8", "--size", "8", "--noise", "0.3", "--per-sample"],
        check=True, capture_output=True, cwd=ROOT,
    )  # fmt: skip
    yield path
    shutil.rmtree(local_dir(cluster, path), ignore_errors=True)


def local_dir(cluster: SlurmCluster, src: Path) -> str:
    """campaign.sbatch's default LOCAL_DIR for ``src``: NAME-HASH under /tmp/USER/datastore."""
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:12]
    return f"/tmp/{cluster.user}/datastore/{src.name}-{digest}"


class Campaign:
    """One submitted campaign: its id, end state, output (campaign-ID.out) and OUT."""

    def __init__(self, cluster: SlurmCluster, name: str, jobs: list[str]) -> None:
        self.cluster, self.name = cluster, name
        self.out = cluster.shared / name
        self.jobs = cluster.shared / f"{name}.jobs"
        lines = [line.replace("CONFIG", str(TINY)).replace("UNET", str(UNET)) for line in jobs]
        self.jobs.write_text("".join(f"{line}\n" for line in lines))
        self.id = 0
        self.state: dict[str, str] = {}
        self.output = ""

    def submit(self, src: Path, options: list[str] = (), **env: str) -> None:
        """``sbatch OPTIONS --export=ALL,SRC=SRC deploy/campaign.sbatch`` from the repository."""
        env = {"PYTHON": sys.executable, "JOBS": str(self.jobs), "OUT": str(self.out),
               "PORT": str(free_port()), "SRUN_JOB_FLAGS": ONE_NODE, **WHEEL_ACROSS_NODES,
               **env}  # fmt: skip
        self.id = self.cluster.sbatch(
            [*options, f"--export=ALL,SRC={src}", "deploy/campaign.sbatch"], env, ROOT
        )

    def wait_output(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.read_output():
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output}"
            time.sleep(0.2)

    def read_output(self) -> str:
        path = ROOT / f"campaign-{self.id}.out"
        self.output = path.read_text() if path.exists() else ""
        return self.output

    def finish(self, timeout: float = 150) -> None:
        """Wait for the end; keep its output and remove the file from the repository."""
        try:
            self.state = self.cluster.wait_job(self.id, timeout)
        except RuntimeError as exc:
            raise AssertionError(f"{self.read_output()}\n{self.logs()}\n{exc}") from None
        finally:
            self.read_output()
            (ROOT / f"campaign-{self.id}.out").unlink(missing_ok=True)

    def logs(self) -> str:
        """The campaign's output and every log under OUT, for a failure's message."""
        logs = [f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(self.out.rglob("*.log"))]
        return "\n".join([self.output, *logs])

    def log(self, job: str) -> list[dict]:
        path = self.out / "jobs" / job / "log.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def serve_log(self, node: str) -> list[dict]:
        text = (self.out / "logs" / f"serve-{node}.log").read_text()
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def local_dir(self) -> str:
        return re.search(r"to (\S+)/data on every node", self.output)[1]

    def assert_drained_and_nothing_left(self) -> None:
        """Every node's service drained and stopped; no process, run directory (socket) or
        /dev/shm segment of a service is left on any node. Judged once the job's processes
        are gone: a cancelled job's steps finish their exit (the wrapper removes the run
        directory after its service) within KillWait of the job's end."""
        run_dir = f"{self.local_dir()}/run-{self.id}"
        assert self.cluster.leftover_processes(wait=KILL_WAIT + 10) == [], self.output
        for node in NODES:
            events = self.serve_log(node)
            names = [e["event"] for e in events]
            assert names.index("draining") < names.index("stopped"), (node, names, self.output)
            assert [e["why"] for e in events if e["event"] == "stopped"] == ["SIGTERM"]
            (pid,) = [e["pid"] for e in events if e["event"] == "listening"]
            shm = self.cluster.node_path(node, "/dev/shm")
            assert sorted(shm.glob(f"datastore.*.{pid}.*")) == [], node
            log = (self.out / "logs" / f"serve-{node}.log").read_text()[-4000:]
            assert not self.cluster.node_path(node, run_dir).exists(), (node, log, self.output)
        assert not (self.out / "token").exists()


def _trained_from_the_service(campaign: Campaign, job: str, world: int) -> None:
    assert (campaign.out / "jobs" / job / "log.jsonl").exists(), campaign.logs()
    start = campaign.log(job)[0]
    assert (start["event"], start["data_source"], start["world"]) == ("start", "service", world)


@pytest.fixture(scope="module")
def first(cluster, src) -> Campaign:
    """The default campaign on 2 nodes: two jobs at once, then a 2-way spatial split; each
    2-rank job has one rank on each node (MPI across the nodes)."""
    jobs = ["1 2 dp CONFIG", "1 1 unet UNET", "2 2 split CONFIG spatial_parts=[2,1,1]"]
    c = Campaign(cluster, "first", jobs)
    c.submit(src, SRUN_JOB_FLAGS=ACROSS)
    c.finish()
    return c


def test_a_campaign_on_two_nodes_stages_serves_trains_and_drains(cluster, first):
    out = first.output
    assert (first.state["JobState"], first.state["ExitCode"]) == ("COMPLETED", "0:0"), out
    # once per node: one rank per node staged, one service per node (no 'can't honor')
    assert "on 2 node(s), 2 rank(s)" in out and "can't honor" not in out, out
    assert "srun --mpi=pmi2" in out  # SRUN_MPI=auto: the MPICH wheel speaks PMI-2
    assert first.local_dir() == local_dir(cluster, cluster.shared / "cosmo")
    for job, world in (("dp", 2), ("unet", 1), ("split", 2)):
        _trained_from_the_service(first, job, world)
        assert [e["step"] for e in first.log(job) if "loss" in e] == [1, 2, 3, 4]
        assert "can't run" not in (first.out / "jobs" / job / "output.log").read_text()
    for k, node in enumerate(NODES):  # each 2-rank job's rank k read from node k's service
        status = (first.out / f"status-{node}.txt").read_text()
        assert f"store          node {k} of 2" in status
        assert int(re.search(r"served +(\d+) batches", status)[1]) > 0, (node, status)
    assert "datastore serve stopped on every node (srun exit 0)" in out, first.logs()
    assert "every job succeeded" in out and "error" not in out, out
    first.assert_drained_and_nothing_left()
    # the staged data stays, a share on each node, for the next campaign on this dataset
    shares = [
        {p.name for p in cluster.node_path(n, f"{first.local_dir()}/data/cosmo/train").iterdir()}
        for n in NODES
    ]
    assert len(shares[0]) + len(shares[1]) == 16 and not shares[0] & shares[1]


def test_a_failing_job_stops_the_campaign_and_a_resubmission_resumes_staging(cluster, src, first):
    c = Campaign(cluster, "failing", ["1 1 ok CONFIG", "2 1 long CONFIG epochs=200",
                                      "2 1 broken CONFIG lr=-1", "3 1 never CONFIG"])  # fmt: skip
    c.submit(src, CLEANUP="data")
    c.finish()
    out = c.output
    assert (c.state["JobState"], c.state["ExitCode"]) == ("FAILED", "1:0"), out
    assert "staged 0 files" in out and "skipped 24 unchanged" in out, out  # the same LOCAL_DIR
    assert c.local_dir() == first.local_dir()
    _trained_from_the_service(c, "ok", 1)
    assert "job broken failed (exit 2)" in out and "config key 'lr': must be >= 0" in out
    assert "job long done" not in out and not (c.out / "jobs" / "never").exists()
    assert "datastore serve stopped on every node (srun exit 0)" in out, c.logs()
    c.assert_drained_and_nothing_left()
    for node in NODES:  # CLEANUP=data: the staged data is gone too
        assert not cluster.node_path(node, c.local_dir()).exists()


def test_scancel_mid_phase_drains_every_service(cluster, src):
    c = Campaign(cluster, "cancelled", ["1 2 long CONFIG epochs=200", "2 1 never CONFIG"])
    c.submit(src)
    try:
        c.wait_output("job long started")
        deadline = time.monotonic() + 60
        while not (c.out / "jobs" / "long" / "log.jsonl").exists():
            assert time.monotonic() < deadline, c.read_output()
            time.sleep(0.2)
        subprocess.run(["scancel", str(c.id)], env=cluster.env, check=True)
    finally:
        c.finish()
    out = c.output
    assert c.state["JobState"] == "CANCELLED", (c.state, out)
    assert "SIGTERM: shutting down" in out and "phase 2" not in out, out
    _trained_from_the_service(c, "long", 2)
    c.assert_drained_and_nothing_left()


def test_a_time_limit_with_a_signal_drains_every_service_before_it(cluster, src):
    # one rank: the job only has to be training when the signal comes (it trains flat out for
    # 40-70 s, on cores the other tests' jobs share)
    c = Campaign(cluster, "timed", ["1 1 long CONFIG epochs=5000", "2 1 never CONFIG"])
    # slurmctld looks every 30 s and signals once less than @+30 s are left: USR1 40-70 s
    # after the start (the job has begun training), the limit at least 50 s later
    c.submit(src, ["--time=2", "--signal=B:USR1@50"])
    c.finish(timeout=200)
    out = c.output
    assert (c.state["JobState"], c.state["ExitCode"]) == ("FAILED", "138:0"), (c.state, out)
    assert "SIGUSR1 (time limit near): shutting down" in out and "phase 2" not in out, out
    _trained_from_the_service(c, "long", 1)
    assert "datastore serve stopped on every node (srun exit 0)" in out, c.logs()
    c.assert_drained_and_nothing_left()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SRUN_MPI": "nosuch"}, "srun --mpi=nosuch: this Slurm has no such MPI plugin"),
        ({"MEMORY_BUDGET": "lots"}, "a node's service exited before it answered"),
    ],
)
def test_a_bad_pmi_and_a_service_that_dies_at_start_are_noticed_at_once(cluster, src, env, message):
    c = Campaign(cluster, "bad-" + next(iter(env)).lower(), ["1 1 never CONFIG"])
    c.submit(src, SERVE_TIMEOUT="120", **env)
    c.finish(timeout=60)
    assert c.state["JobState"] == "FAILED" and message in c.output, (c.state, c.output)
    assert not (c.out / "jobs" / "never").exists()
    assert cluster.leftover_processes(wait=10) == []
