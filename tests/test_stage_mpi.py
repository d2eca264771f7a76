"""``datastore stage`` under real ``mpiexec``: replicate, shard, and a failing rank."""

from __future__ import annotations

import glob
import io
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
from helpers import MPIEXEC

pytestmark = pytest.mark.mpi


def files_of(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".datastore"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture
def dataset(tmp_path):
    """A tree of 40 files of uneven sizes (1 KiB .. 600 KiB) in 4 directories."""
    rng = __import__("random").Random(7)
    src = tmp_path / "src"
    for d in range(4):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(10):
            (src / f"d{d}" / f"s{i}.bin").write_bytes(rng.randbytes(rng.randint(1, 600) * 1024))
    return src


def mpirun(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "datastore", "stage", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def summary(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0])


def manifest(dest) -> dict:
    with open(os.path.join(dest, ".datastore", "manifest.json")) as f:
        return json.load(f)


def test_replicate_two_ranks_one_node(dataset, tmp_path):
    dest = tmp_path / "dest"
    proc = mpirun(2, str(dataset), "--to", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    s = summary(proc)
    assert (s["ranks"], s["nodes"], s["files"]) == (2, 1, 40)
    assert files_of(dest / "src") == files_of(dataset)
    assert manifest(dest)["shard"] == {"mode": "replicate", "node": 0, "nodes": 1}
    again = summary(mpirun(2, str(dataset), "--to", str(dest), "--json"))
    assert (again["files"], again["skipped"]) == (0, 40)


def test_replicate_every_node_gets_everything(dataset, tmp_path):
    proc = mpirun(
        2, str(dataset), "--to", str(tmp_path / "node{node}"), "--ranks-per-node", "1", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert summary(proc)["nodes"] == 2
    for node in (0, 1):
        assert files_of(tmp_path / f"node{node}" / "src") == files_of(dataset)


@pytest.mark.parametrize("nodes", [2, 4])
def test_shard_partitions_by_bytes(dataset, tmp_path, nodes):
    proc = mpirun(
        nodes,
        str(dataset),
        "--to",
        str(tmp_path / "node{node}"),
        "--mode",
        "shard",
        "--ranks-per-node",
        "1",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    source = {os.path.join("src", k): v for k, v in files_of(dataset).items()}
    shares = [files_of(tmp_path / f"node{k}") for k in range(nodes)]
    union: dict[str, bytes] = {}
    for share in shares:
        assert not set(share) & set(union), "a file landed on two nodes"
        union.update(share)
    assert union == source
    loads = [sum(len(v) for v in share.values()) for share in shares]
    assert max(loads) - min(loads) <= max(len(v) for v in source.values())
    for k in range(nodes):
        m = manifest(tmp_path / f"node{k}")
        assert m["shard"] == {"mode": "shard", "node": k, "nodes": nodes}
        files = {p for p, e in m["entries"].items() if e["kind"] == "file"}
        assert files == set(shares[k])


def test_a_shard_rerun_after_the_source_changed_leaves_each_node_its_new_share_only(
    dataset, tmp_path
):
    """The shares move when the sources change (a file removed, others rewritten): a re-run
    removes from each node the files its share no longer has. Before, a node kept its old
    share beside its new one, so both nodes held files, one copy stale, and the store read
    node 0's (a rewritten file served as it was, a removed one still served)."""
    args = [str(dataset), "--to", str(tmp_path / "node{node}"), "--mode", "shard"]
    args += ["--ranks-per-node", "1", "--json"]
    assert mpirun(2, *args).returncode == 0
    first = [set(files_of(tmp_path / f"node{k}")) for k in range(2)]
    names = sorted(glob.glob(str(dataset / "d*" / "*.bin")))
    os.remove(names[0])
    for i, name in enumerate(names[1:]):  # new bytes and sizes: every share moves
        with open(name, "wb") as f:
            f.write(bytes([i % 256]) * (1024 * (i + 1)))
    proc = mpirun(2, *args)
    assert proc.returncode == 0, proc.stderr
    source = {os.path.join("src", k): v for k, v in files_of(dataset).items()}
    shares = [files_of(tmp_path / f"node{k}") for k in range(2)]
    assert not set(shares[0]) & set(shares[1]), "a file is on both nodes"
    assert {**shares[0], **shares[1]} == source  # every byte the source's, nothing removed kept
    assert first[0] - set(shares[0]), "the shares did not move: the test tests nothing"
    for k in range(2):
        m = manifest(tmp_path / f"node{k}")
        assert {p for p, e in m["entries"].items() if e["kind"] == "file"} == set(shares[k])


def test_a_sharded_archive_stays_on_one_node_each_across_reruns(tmp_path):
    """Each node's manifest records only its members of an archive: a re-run planned from node
    0's record, so an unchanged archive of 6 members was staged as 1 ("skipped 1 unchanged"),
    and once the archive changed, members moved between nodes were left on the old one too
    (4 stale copies of 6 members on 2 nodes)."""
    arc = tmp_path / "x.tar"

    def make(sizes: dict[str, int]) -> dict[str, bytes]:
        members = {name: os.urandom(n) for name, n in sizes.items()}
        with tarfile.open(arc, "w") as tf:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return members

    args = [str(arc), "--to", str(tmp_path / "node{node}"), "--mode", "shard"]
    args += ["--ranks-per-node", "1", "--json"]
    make({f"m{i}": 1000 * (i + 1) for i in range(6)})
    assert mpirun(2, *args).returncode == 0
    again = mpirun(2, *args)
    assert (summary(again)["files"], summary(again)["skipped"]) == (0, 6), again.stderr
    members = make({f"m{i}": 1000 * (7 - i) + 50_000 * (i == 0) for i in range(5)})
    assert mpirun(2, *args).returncode == 0
    shares = [files_of(tmp_path / f"node{k}") for k in range(2)]
    assert not set(shares[0]) & set(shares[1]), "a member is on both nodes"
    assert {**shares[0], **shares[1]} == members


def test_a_dry_run_under_mpi_plans_node_0s_share_of_every_node(dataset, tmp_path):
    """``--dry-run --mode shard`` on 2 nodes planned node 0 as the only node: after a full
    shard stage it said node 0 would copy node 1's files (``would stage 20 files``, where the
    run copies none); a changed source showed nothing that would go to node 1."""
    args = [str(dataset), "--to", str(tmp_path / "node{node}"), "--mode", "shard"]
    args += ["--ranks-per-node", "1", "--json"]
    assert mpirun(2, *args).returncode == 0
    mine = {p for p, e in manifest(tmp_path / "node0")["entries"].items() if e["kind"] == "file"}
    dry = summary(mpirun(2, *args, "--dry-run"))
    assert (dry["files"], dry["skipped"], dry["removed"]) == (0, len(mine), [])


def test_failing_rank_ends_all_ranks_quickly(dataset, tmp_path):
    (tmp_path / "node1").write_text("a file where node 1's DEST should be")
    proc = mpirun(
        2,
        str(dataset),
        "--to",
        str(tmp_path / "node{node}" / "dest"),
        "--ranks-per-node",
        "1",
        timeout=60,
    )  # a rank left waiting fails here
    assert proc.returncode == 1
    assert "node1/dest: cannot prepare destination (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "case", ["no source", "a node's DEST", "verify, nothing staged", "serve, no socket dir"]
)
def test_a_refusal_every_rank_makes_ends_mpi_without_abort(dataset, tmp_path, case):
    """Under ``python -m mpi4py`` a non-zero exit used to end in ``MPI_Abort``: an abort line
    per job and, under MPICH, a 2 MiB segment left in /dev/shm for good. A code every rank
    reached together (after the collective that decided it) now ends MPI with MPI_Finalize."""
    (tmp_path / "node1").write_text("a file where node 1's DEST should be")
    args, code, message = {
        "no source": (
            ["stage", str(tmp_path / "none"), "--to", str(tmp_path / "d")], 2,
            "source not found or unreadable",
        ),
        "a node's DEST": (
            ["stage", str(dataset), "--to", str(tmp_path / "node{node}" / "dest"),
             "--ranks-per-node", "1"], 1, "node1/dest: cannot prepare destination",
        ),
        "verify, nothing staged": (
            ["stage", "--verify", "--to", str(tmp_path / "d")], 1, "no manifest",
        ),
        "serve, no socket dir": (
            ["serve", "--socket", str(tmp_path / "node1" / "s{rank}.sock")], 1,
            "Not a directory",
        ),
    }[case]  # fmt: skip
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "datastore", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Abort" not in proc.stderr and "ABORT" not in proc.stderr, proc.stderr


def test_a_node_out_of_space_leaves_no_dest_on_any_node(dataset, tmp_path):
    """Node 0's DEST lies on a 4 MiB tmpfs: it refuses (exit 3), and node 1, which had made its
    DEST and the plan's directories, removes them too (both used to stay behind)."""
    for k in (0, 1):
        (tmp_path / f"m{k}").mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(tmp_path / "m0")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(mount.stderr + mount.stdout).strip()}")
    try:
        dest = str(tmp_path / "m{node}" / "dest")
        proc = mpirun(2, str(dataset), "--to", dest, "--ranks-per-node", "1", timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert "m0/dest: not enough space: need" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert os.listdir(tmp_path / "m0") == []
        assert os.listdir(tmp_path / "m1") == []
    finally:
        subprocess.run(["umount", str(tmp_path / "m0")], check=True, timeout=30)


def test_killed_rank_ends_the_job(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20) * 400)
    cmd = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "datastore",
        "stage",
        str(big),
        "--to",
        str(tmp_path / "node{node}"),
        "--ranks-per-node",
        "1",
        "--streams",
        "1",
        "--checksum",
        "blake2b",
        "--quiet",
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not glob.glob(str(tmp_path / "node1" / ".datastore" / "tmp" / "*" / "*.part")):
        assert time.monotonic() < deadline and job.poll() is None, "rank 1 never started copying"
        time.sleep(0.01)
    ranks = rank_pids(str(big))
    assert len(ranks) == 2
    os.kill(max(ranks), 9)
    job.communicate(timeout=60)
    assert job.returncode != 0
    time.sleep(0.5)
    assert rank_pids(str(big)) == [], "ranks left running after one was killed"


def rank_pids(marker: str) -> list[int]:
    """Pids of the Python ranks (not the launcher) whose command line holds ``marker``."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and marker.encode() in argv:
            pids.append(int(pid))
    return pids
