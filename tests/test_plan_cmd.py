"""``datastore plan`` as a user runs it: a subprocess, on real files, flags and TOML files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from datastore.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--nodes", "2", "--global-batch", "8", "--step-time", "0.1"]


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("DATASTORE_DEBUG", None)
    cmd = [sys.executable, "-m", "datastore", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def plan_json(*args: str) -> dict:
    proc = plan(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_scale_answers_within_2_gib():
    """10^8 samples on 4,096 ranks, measured in a fresh parent whose only child is the CLI (the
    children's peak RSS of this pytest process would count every earlier test's). Its speed is
    a benchmark's (``benchmarks/scale.py``), not asserted here."""
    probe = (
        "import json, resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps({'rc': p.returncode, 'rss': rss, 'out': p.stdout, 'err': p.stderr}))\n"
    )
    cmd = [sys.executable, "-m", "datastore", "plan", "--samples", "100000000"]
    cmd += ["--shape", "4,128,128,128", "--nodes", "1024", "--ranks-per-node", "4"]
    cmd += ["--global-batch", "512", "--step-time", "0.3", "--halo", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": REPO}
    got = subprocess.run(
        [sys.executable, "-c", probe, *cmd], capture_output=True, text=True, env=env, timeout=60
    )
    r = json.loads(got.stdout)
    assert r["rc"] == 0, r["err"]
    assert r["rss"] < 2 << 30
    out = json.loads(r["out"])
    assert out["machine"]["nodes"] * out["machine"]["ranks_per_node"] == 4096
    assert out["split"]["parts"] == [2, 2, 2]  # 512 samples a step for 4,096 ranks: 8 blocks
    assert out["split"]["local_batch"] == 1
    assert out["recommended"]["shuffle"] == "window:4096"  # 3 PiB: no shard fits in memory


def test_a_dataset_on_disk(tmp_path):
    data = tmp_path / "npy"
    data.mkdir()
    for i in range(8):
        np.save(data / f"s{i}.npy", np.full((2, 8, 8, 8), i, np.float32))
    out = plan_json(str(data), *JOB, "--ranks-per-node", "2", "--gpus-per-node", "0")
    ds = out["dataset"]
    assert (ds["num_samples"], ds["files"], ds["sample_bytes"]) == (8, 8, 4096)
    assert ds["stored_bytes"] == sum(os.path.getsize(data / f"s{i}.npy") for i in range(8))
    assert ds["fields"] == {
        "data": {"dtype": "<f4", "shape": [2, 8, 8, 8], "spatial_axes": [1, 2, 3]}
    }
    shard = next(s for s in out["staging"] if s["mode"] == "shard")
    assert shard["bytes_per_node"] == ds["stored_bytes"] // 2  # 4 of the 8 files
    rec = out["recommended"]
    assert (rec["staging"], rec["shuffle"], rec["source"]) == ("replicate", "global", "serve")
    assert rec["resident_bytes"] == 8 * 4096
    # 4 ranks, 2 samples each a step; the service's rings: 2 ranks x (2 x 2 + 2) batches
    assert rec["buffer_bytes"] == 2 * 6 * 2 * 4096


def test_a_measured_rate_may_be_a_fraction(capsys):
    # plan_check.py passes its measured rates as they are: '5132334976.127276'
    args = ["plan", "--samples", "10", "--sample-bytes", "1M", *JOB, "--json"]
    assert main([*args, "--pfs-read-bw", "5132334976.127276", "--network-bw", "2.5G"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert (machine["pfs_read_bw"], machine["network_bw"]) == (5132334976.127276, 2.5 * 2**30)


def test_layout_of_a_set_of_equal_hdf5_shards(tmp_path, capsys):
    for k in range(2):  # shards of 4 samples, or 2 samples of (4, 2, 4, 4, 4): no file says
        with h5py.File(tmp_path / f"part-{k}.h5", "w") as f:
            f["x"] = np.zeros((4, 2, 4, 4, 4), np.float32)
            f["y"] = np.zeros((4, 3), np.float32)
    args = ["plan", str(tmp_path), "--nodes", "1", "--global-batch", "2", "--step-time", "1"]
    assert main([*args, "--json"]) == 2
    assert "datastore plan --layout" in capsys.readouterr().err  # plan had no --layout
    assert main([*args, "--layout", "shards", "--json"]) == 0
    ds = json.loads(capsys.readouterr().out)["dataset"]
    assert (ds["num_samples"], ds["files"], ds["sample_bytes"]) == (8, 2, 512 + 12)
    assert main([*args, "--layout", "per-sample", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"]["num_samples"] == 2


def test_the_machine_file_and_flags_over_defaults(tmp_path):
    machine = tmp_path / "m.toml"
    machine.write_text(
        'nodes = 4\nranks_per_node = 1\nnetwork_bw = "1G/s"\nglobal_batch = 8\n'
        'step_time = "250ms"\nspatial = [[2, 1, 1], [1, 1, 1]]\nhalo = 1\n'
    )
    out = plan_json(
        "--samples", "64", "--shape", "8,8,8", "--machine", str(machine), "--nodes", "2"
    )
    assert out["machine"]["nodes"] == 2  # the flag beats the file
    assert out["machine"]["network_bw"] == 1 << 30
    assert out["job"]["step_time"] == 0.25
    assert [s["parts"] for s in out["splits"]] == [[1, 1, 1], [2, 1, 1]]
    assert out["origin"]["nodes"] == "flag"
    assert out["origin"]["network_bw"] == str(machine)
    assert out["origin"]["pfs_read_bw"] == "default"
    assert (out["machine"]["exchange_bw"], out["origin"]["exchange_bw"]) == (1 << 30, "default")
    whole = out["splits"][0]
    assert whole["rank_sample_bytes"] == 10 * 10 * 10 * 4  # (8 + 2 halo)^3 float32


def test_the_text_tables():
    proc = plan("--samples", "1000", "--sample-bytes", "1M", *JOB, "--memory-per-node", "768M")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "staging (datastore stage; the busiest node)" in text
    assert "replicate  1000.0 MiB" in text
    lines = text.splitlines()
    rec = lines.index(next(ln for ln in lines if ln.startswith("recommended:")))
    assert lines[rec] == (
        "recommended: datastore stage --mode shard; shuffle='global'; whole samples; via "
        "datastore serve"
    )
    assert lines[rec + 1] == "  - replicate does not fit in memory (1.0 GiB a node)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "missing the dataset: a DATASET path, or --samples"),
        (("--samples", "-5", "--sample-bytes", "10", *JOB),
         "argument --samples: must be a whole number"),
        (("--samples", "10", "--sample-bytes", "1M", "--files", "20", *JOB),
         "--files 20 is more than the 10 samples"),
        (("--samples", "10", "--sample-bytes", "10", "--global-batch", "8", "--step-time", "1"),
         "missing --nodes (or nodes = ... in the --machine file)"),
        (("--samples", "10", "--sample-bytes", "-1", *JOB),
         "argument --sample-bytes: must be >= 1, got '-1'"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--memory-per-node=-1G"),
         "argument --memory-per-node: must be >= 1, got '-1G'"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--memory-per-node", "-5G"),
         "argument --memory-per-node: must be >= 1, got '-5G'"),  # was 'expected one argument'
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--memory-per-node", "0"),
         "argument --memory-per-node: must be >= 1, got '0'"),  # was planned: serve refuses 0
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--gpu-memory", "-.5G"),
         "argument --gpu-memory: must be >= 0, got '-.5G'"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--pfs-read-bw", "-inf"),
         "argument --pfs-read-bw: must be a number > 0, got -inf"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--network-bw", "0"),
         "argument --network-bw: must be a number > 0"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--network-bw", "25Gb/s"),
         "argument --network-bw: takes bytes per second, got '25Gb/s': bits"),  # was 25 GiB/s
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--network-bw", "100Gbps"),
         "argument --network-bw: takes bytes per second, got '100Gbps': bits"),
        (("--samples", "10", "--shape", "4,2,8,8", *JOB, "--spatial", "3,1,1"),
         "parts[0]=3 > shape[0]=2: cannot split an axis of size 2 into 3 parts"),
        (("--samples", "10", "--shape", "4,8,8,8", *JOB, "--spatial", "2,1"),
         "spatial['parts'] (2, 1) has 2 axes, the volume (8, 8, 8) has 3"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--spatial", "2,1,1"),
         "no delivered field has spatial axes"),
        (("--samples", "10", "--sample-bytes", "1M", "--nodes", "3", "--global-batch", "8",
          "--step-time", "1"), "the global batch 8 is not divisible by the 12 ranks"),
        (("--samples", "10", "--sample-bytes", "1M", "--nodes", "1", "--global-batch", "16",
          "--step-time", "1"), "the global batch 16 is more than the dataset's 10 samples"),
        (("--samples", "10", "--shape", "4,8,8", "--dtype", "floaty", *JOB),
         "--dtype: not a numpy dtype"),
        (("--samples", "10", "--shape", "4,8,8", "--dtype", "object", *JOB),
         "--dtype 'object': not a numeric dtype"),
        (("--samples", "10", "--shape", "4,8,8", "--dtype", "S8", *JOB),
         "--dtype 'S8': not a numeric dtype"),
        (("/no/such/data.h5", *JOB), "/no/such/data.h5"),
        (("/no/such/data.h5", "--samples", "3", *JOB), "give a DATASET path or its sizes"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--machine", "/no/m.toml"),
         "--machine /no/m.toml: No such file or directory"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["plan", *args]) == 2  # in-process: the subprocess case is the one below
    err = capsys.readouterr().err
    assert err.startswith("datastore plan: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_bad_input_in_a_process_has_no_traceback():
    proc = plan("--samples", "10", "--shape", "4,8,8,8", *JOB, "--spatial", "2,1", "--halo", "x")
    assert proc.returncode == 2
    assert proc.stderr == (
        "datastore plan: error: argument --halo: needs whole numbers, got 'x' "
        "(see datastore plan --help)\n"
    )


def test_bad_machine_files(tmp_path, capsys):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("nodes = 2\nnetwork_gbps = 5\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("nodes = \n")
    negative = tmp_path / "negative.toml"
    negative.write_text('nodes = 2\nnvme_per_node = "-3T"\n')
    fraction = tmp_path / "fraction.toml"
    fraction.write_text("nodes = 2\nmemory_per_node = 1.5\n")  # was 1 byte: nothing fit
    base = ["--samples", "10", "--sample-bytes", "1M", "--global-batch", "8"]
    base += ["--step-time", "1", "--machine"]
    for path, message in (
        (unknown, "unknown key(s) network_gbps; the keys are nodes, "),
        (broken, "not valid TOML"),
        (negative, f"{negative}: nvme_per_node must be >= 0, got '-3T'"),
        (fraction, f"{fraction}: memory_per_node must be whole bytes or a size like '1.5G'"),
    ):
        assert main(["plan", *base, str(path)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--samples", "10", "--sample-bytes", "1e400", *JOB),
         "argument --sample-bytes: must be a finite"),
        (("--samples", "10", "--sample-bytes", "nan", *JOB),
         "argument --sample-bytes: must be a finite"),
        (("--samples", "10", "--sample-bytes", "1M", *JOB, "--pfs-read-bw", "infG"),
         "argument --pfs-read-bw: must be a finite"),
        (("--samples", "10", "--shape", "4,,8", *JOB),
         "argument --shape: needs whole numbers, got '4,,8'"),
    ],
)  # fmt: skip
def test_odd_numbers_are_bad_input(args, message, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("datastore plan: error: ")
    assert message in err


def test_a_machine_file_that_is_not_text_is_named(tmp_path, capsys):
    binary = tmp_path / "m.toml"
    binary.write_bytes(b"\x89HDF\r\n")
    assert (
        main(["plan", "--samples", "10", "--sample-bytes", "1M", *JOB, "--machine", str(binary)])
        == 2
    )
    assert f"--machine {binary}: not valid TOML" in capsys.readouterr().err


def test_a_huge_sample_is_never_negative_bytes():
    shape = "99999999,99999999,99999999"
    out = plan_json("--samples", "100", "--shape", shape, *JOB)
    assert all(s["gpu_bytes"] > 0 for s in out["splits"]), out["splits"]


def test_shards_on_disk_are_planned_where_the_stage_puts_them(tmp_path, capsys):
    """HDF5 shards of 16, 16, 16 and 8 samples on 2 nodes: ``stage --mode shard`` puts 32
    samples on one node, 24 on the other (its own placement, below). The plan took 2 of 4
    equal files, 28 samples a node."""
    from staging.plan import assign, build_plan

    src = tmp_path / "ds"
    src.mkdir()
    for k, n in enumerate((16, 16, 16, 8)):
        with h5py.File(src / f"part-{k}.h5", "w") as f:
            f["x"] = np.zeros((n, 2, 4, 4, 4), np.float32)
            f["y"] = np.zeros((n, 3), np.float32)
    args = ["plan", str(src), *JOB, "--ranks-per-node", "1", "--gpus-per-node", "0"]
    assert main([*args, "--layout", "shards", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    nodes = assign(build_plan([str(src)]), 2)
    staged = [sum(i.size for g in node for i in g.items) for node in nodes]
    shard = next(s for s in out["staging"] if s["mode"] == "shard")
    assert shard["bytes_per_node"] == max(staged)
    held = next(r for r in out["layouts"] if (r["staging"], r["shuffle"]) == ("shard", "shard"))
    assert held["resident_bytes"] == 32 * (512 + 12)
