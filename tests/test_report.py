"""``benchmarks/report.py``'s rendering, from results files written by the benchmarks' own
``as_json`` and ``common.write_results`` on small made-up figures (no benchmark runs): the PNGs,
the generated blocks between the markers of the page and the README, and nothing else of them
touched. And the real README: its benchmark figures are the generated ones of
``benchmarks/results``, and none stands outside the generated block."""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import struct
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="benchmarks/report.py needs matplotlib ('.[bench]')")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
MODULES = (
    *("common", "stage", "loader", "service", "peers", "shuffle", "train_step", "gpu_feed"),
    "plan_check",
)
MIB = 1 << 20
BEFORE = "# Benchmarks\n\nHand-written intro, kept — byte for byte.\n\n"
AFTER = "\n\n## Earlier runs\n\n| a | b |\n|---|---|\n| 1 | 2 |\ntrailing text without newline"
PAGE = f"{BEFORE}<!-- report:begin -->\nold generated text\n<!-- report:end -->{AFTER}"
PNGS = ["staging", "loader_epochs", "block_reads", "service_clients", "training", "gpu_feed"]
README = f"# Project\n\n## Benchmarks\n\n<!-- report:begin -->\nold\n<!-- report:end -->{AFTER}"


@pytest.fixture(scope="module")
def bench():
    """The benchmark scripts and ``report`` as modules (``benchmarks/`` on ``sys.path`` for the
    module's tests only)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in (*MODULES, "report", "figures")}
    finally:
        sys.path.remove(str(BENCH))
        for name in (*MODULES, "report", "figures"):
            sys.modules.pop(name, None)


def write_all(bench: dict, folder: Path, cuda: bool = True) -> None:
    """One results file per benchmark, made by its ``as_json`` from made-up figures."""
    common = bench["common"]
    cache = common.PageCache(True)

    def write(name: str, made: tuple) -> None:
        common.write_results(str(folder / f"{name}.json"), name, *made)

    stage = bench["stage"]
    cases = []
    for key, peer in (("a", "cp -r"), ("b", "cp"), ("c", "tar -xf")):
        c = stage.Case(key, stage.TITLES[key], "datastore stage S --to O", f"{peer} S O", 4, MIB)
        c.times["ours"] += [1.0, 1.2, 1.1]
        c.times["peer"] += [2.0, 2.4, 2.2]
        c.times["floor"] += [0.8, 0.9] if key != "b" else []
        cases.append(c)
    args = argparse.Namespace(reps=3, scale=0.05, streams=None, io="auto", verify_stage=False)
    write("stage", stage.as_json(cases, args, "/work", cache, "900 MB/s", "local disk"))

    loader = bench["loader"]
    c1 = []
    for fmt in ("hdf5", "npy"):
        runs = loader.LoaderRuns(fmt, ["ours", "disk/2", "memory/0"])
        for side, base in (("ours", 0.1), ("disk/2", 1.0), ("memory/0", 0.4)):
            t = runs.times[side]
            t["epoch1"] += [8 * base, 10 * base]
            t["construct"] += [base, base]
            t["cold"] += [base, 1.2 * base, 1.1 * base]
            t["warm"] += [0.9 * base, base, 0.8 * base]
        c1.append(runs)
    c2 = [
        loader.BlockRuns(fmt, "note", [1.0, 1.2], {2: [0.6, 0.7], 4: [0.35, 0.4], 8: [0.2, 0.3]})
        for fmt in ("hdf5 (1 chunk/sample)", "npy")
    ]
    args = argparse.Namespace(samples=48, halo=2, epochs=3, reps=2)
    write("loader", loader.as_json(args, 12.0, cache, c1, c2, {}, None, "/work"))

    service = bench["service"]
    c1 = {}
    for n in (1, 2):
        for i, kind in enumerate(service.KINDS):
            gbps = [(i + 1) * n, (i + 1.5) * n]
            c1[kind, n] = service.Delivery(kind, n, gbps, [10.0, 12.0], [0.1, 0.2], [0.0, 0.1])
    first = service.FirstBatch(load=[1.0, 1.5])
    for job, secs in (("cold", [0.5, 0.7]), ("warm", [0.05, 0.04]), ("embedded", [0.4, 0.5])):
        first.total[job] += secs
        first.construct[job] += [s / 2 for s in secs]
    args = argparse.Namespace(
        samples=32, side=32, batch=4, epochs=2, reps=2, clients=[1, 2], kinds=list(service.KINDS)
    )
    write("service", service.as_json(args, 12.0, cache, c1, first, "/work"))

    peers = bench["peers"]
    jobs = {
        (kind, "whole"): peers.Job(
            kind, "whole", [1.0, 2.0], [100, 100], [MIB, MIB], [MIB, MIB], [1, 1], [1, 1], [0, 0]
        )
        for kind in ("mpi", "grpc")
    }
    args = argparse.Namespace(kinds=["mpi", "grpc"], layouts=["whole"], client=None, json="x")
    idle = {"mpi": [0.02], "grpc": [0.0]}
    write("peers", peers.as_json(args, jobs, idle, 1.0, [8, 8], [], 10.0))

    shuffle = bench["shuffle"]
    real = {
        "global": {"epoch_s": 0.2, "pairs": 1.0, "sent_mib": 11.8},
        "shard": {"epoch_s": 0.05, "pairs": 3.5, "sent_mib": 0.0},
    }
    write("shuffle", shuffle.as_json(argparse.Namespace(real_ranks=4), {}, real))

    train = bench["train_step"]
    runs = {"DataStoreLoader": [(0.1, 0.01), (0.12, 0.02)]}
    runs["DataLoader(num_workers=2)"] = [(0.12, 0.14), (0.13, 0.15)]
    args = argparse.Namespace(side=32, batch=8, width=4, json="x")
    write("train_step", train.as_json(args, runs, "DataLoader(num_workers=2)", {"halo": {}}))

    import torch

    feed = bench["gpu_feed"]
    feeds = [feed.Feed("a", rates=[200.0, 210.0]), feed.Feed("b", rates=[190.0, 196.0])]
    feeds += [feed.Feed("c", rates=[180.0, 185.0]), feed.Feed("e", 4, rates=[90.0, 120.0])]
    gather = [feed.Gather(1, [10.0, 11.0], [9.0, 9.5])]
    args = argparse.Namespace(size=32, json="x")
    results, ratios = feed.as_json(args, torch.device("cpu"), feeds, {1: [10.0]}, {}, gather, False)
    results["cuda"] = cuda  # made up: as if the feeds ran on a GPU
    common.write_results(str(folder / "gpu_feed.json"), "gpu_feed", results, ratios)


def render(bench: dict, tmp_path: Path) -> tuple[Path, Path]:
    page, img = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img"
    readme = tmp_path / "README.md"
    if not readme.exists():
        readme.write_text(README)
    argv = ["--skip-run", "--results", str(tmp_path / "results"), "--doc", str(page)]
    assert bench["report"].main([*argv, "--img", str(img), "--readme", str(readme)]) == 0
    return page, img


def generated(text: str) -> str:
    return text.split("<!-- report:begin -->\n", 1)[1].split("\n<!-- report:end -->", 1)[0]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_render_writes_plots_and_only_the_block(bench, tmp_path):
    (tmp_path / "results").mkdir()
    write_all(bench, tmp_path / "results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_bytes(PAGE.encode())
    page, img = render(bench, tmp_path)

    assert sorted(p.name for p in img.iterdir()) == sorted(f"bench-{n}.png" for n in PNGS)
    for name in PNGS:
        w, h = png_size(img / f"bench-{name}.png")
        assert w > 400 and h > 300
    raw = page.read_bytes()
    begin, end = raw.index(b"<!-- report:begin -->\n"), raw.index(b"\n<!-- report:end -->")
    assert raw[:begin] == BEFORE.encode()
    assert raw[end + len(b"\n<!-- report:end -->") :] == AFTER.encode()

    block = generated(raw.decode())
    assert "old generated text" not in block
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", block)
    assert links == [f"img/bench-{name}.png" for name in PNGS]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert collections.Counter(r.split(" | ")[0][2:] for r in rows) == {
        "stage": 3,
        "loader": 8,
        "service": 3,
        "peers": 1,
        "shuffle": 1,
        "train_step": 2,
        "gpu_feed": 1,
    }
    assert (
        "| stage | a: tree of small files (4 files, 1 MiB) vs `cp -r` | 1.10 s | 2.20 s "
        "| 2.00x (peer time / ours) | >= 0.95x: PASS |" in rows
    )
    assert (
        "- **stage**: `python " in block and "**gpu_feed**: GPU figures not measured" not in block
    )

    assert render(bench, tmp_path)[0].read_bytes() == raw  # its own block replaced alike

    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# Project\n\n## Benchmarks\n\n<!-- report:begin -->\n")
    assert readme.endswith(f"\n<!-- report:end -->{AFTER}")
    front = generated(readme)
    shown = [r for r in rows if r.split(" | ")[0][2:] in bench["report"].README_BENCHMARKS]
    assert [ln for ln in front.splitlines() if ln.startswith("| ")][1:] == shown
    assert len(shown) == 3 + 8 + 3 + 1 + 1 + 2  # plan_check and gpu_feed left to the page
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", front) == ["docs/img/bench-loader_epochs.png"]
    assert "Runs: stage " in front and "[docs/benchmarks.md](docs/benchmarks.md)" in front


def test_gpu_figures_only_from_a_gpu_run(bench, tmp_path):
    (tmp_path / "results").mkdir()
    write_all(bench, tmp_path / "results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(PAGE)
    page, img = render(bench, tmp_path)
    assert (img / "bench-gpu_feed.png").exists()

    write_all(bench, tmp_path / "results", cuda=False)
    page, img = render(bench, tmp_path)
    assert not (img / "bench-gpu_feed.png").exists()
    block = generated(page.read_text())
    assert "img/bench-gpu_feed.png" not in block
    assert (
        "- **gpu_feed**: GPU figures not measured: no results from a GPU run; the stored " in block
    )

    (tmp_path / "results" / "gpu_feed.json").unlink()
    (tmp_path / "results" / "peers.json").unlink()
    block = generated(render(bench, tmp_path)[0].read_text())
    assert "- **peers**: no results yet (`python benchmarks/peers.py --json " in block
    assert "| peers |" not in block
    assert "- **gpu_feed**: GPU figures not measured: no results from a GPU run (`python " in block


def test_smoke_runs_are_marked(bench, tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    stage = next(b for b in bench["report"].BENCHMARKS if b.name == "stage")
    quick = stage.command(True, bench["report"].results_file(tmp_path / "results", stage))
    monkeypatch.setattr(sys, "argv", [str(BENCH.parent / quick[0]), *quick[1:]])
    write_all(bench, tmp_path / "results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(PAGE)
    block = generated(render(bench, tmp_path)[0].read_text())
    rows = [ln.split(" | ")[0] for ln in block.splitlines() if ln.startswith("| stage")]
    assert rows == ["| stage (smoke size)"] * 3
    runs = [ln for ln in block.splitlines() if ln.startswith("- **stage**: `python ")]
    assert len(runs) == 1 and runs[0].endswith("a check that the run works, not a measurement.")
    assert "`python benchmarks/stage.py --scale 0.05 --reps 2 --dir " in runs[0]


def test_run_goes_on_after_a_failure(bench, tmp_path):
    """Benchmarks run in order, each to its results file; a failed one is named, the rest run."""
    script = tmp_path / "fake.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "from common import write_results\n"
        "name, out = sys.argv[1], sys.argv[3]\n"
        f"open({str(tmp_path / 'order')!r}, 'a').write(name + '\\n')\n"
        "if name == 'bad':\n"
        "    sys.exit(3)\n"
        "write_results(out, name, {'n': 1}, [])\n"
    )
    report = bench["report"]
    fakes = [
        report.Benchmark(name, f"{script} {name} --json {{json}}", "unused")
        for name in ("one", "bad", "two")
    ]
    assert report.run(fakes, False, tmp_path / "results") == ["bad"]
    assert (tmp_path / "order").read_text() == "one\nbad\ntwo\n"
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["one.json", "two.json"]
    doc = report.load(tmp_path / "results" / "two.json", "two")
    assert doc["results"] == {"n": 1} and doc["ratios"] == []
    assert (
        doc["command"]
        == f"python {script} two --json {report.results_file(tmp_path / 'results', fakes[2])}"
    )


def test_bad_page_or_results_fail_naming_the_file(bench, tmp_path):
    (tmp_path / "results").mkdir()
    write_all(bench, tmp_path / "results")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "benchmarks.md"
    for text in ("# no markers\n", "<!-- report:end -->\n<!-- report:begin -->\n"):
        page.write_text(text)
        with pytest.raises(SystemExit, match=re.escape(f"{page}: needs one <!-- report:begin -->")):
            render(bench, tmp_path)
        assert page.read_text() == text
        assert not (tmp_path / "docs" / "img").exists()

    page.write_text(PAGE)
    bad = tmp_path / "results" / "service.json"
    doc = json.loads(bad.read_text())
    bad.write_text(json.dumps({**doc, "benchmark": "loader"}))
    with pytest.raises(SystemExit, match=re.escape(f"{bad}: holds results of 'loader'")):
        render(bench, tmp_path)
    del doc["ratios"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=re.escape(f"{bad}: not a results file")):
        render(bench, tmp_path)
    bad.write_text("{")
    with pytest.raises(SystemExit, match=re.escape(f"{bad}: not a readable results file")):
        render(bench, tmp_path)
    assert page.read_text() == PAGE

    with pytest.raises(SystemExit) as exc:  # argparse: exit 2, the names to pick from
        bench["report"].main(["--skip-run", "--only", "stage,nope"])
    assert exc.value.code == 2


def test_the_readmes_figures_are_the_generated_results(bench):
    """The README's generated block is what ``benchmarks/report.py`` makes of the results in
    ``benchmarks/results`` (rerun ``python benchmarks/report.py --skip-run`` after a run), and
    its Benchmarks section holds no measured figure outside that block."""
    report = bench["report"]
    results = BENCH / "results"
    docs = {
        b.name: report.load(results / f"{b.name}.json", b.name)
        for b in report.BENCHMARKS
        if (results / f"{b.name}.json").exists()
    }
    readme = REPO / "README.md"
    figure = REPO / "docs" / "img" / f"bench-{report.README_FIGURE}.png"
    text = readme.read_text()
    want = report.readme_block(list(report.BENCHMARKS), docs, results, figure, readme)
    assert generated(text) == want, "README.md: rerun python benchmarks/report.py --skip-run"

    section = text.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    outside = section.replace(generated(text), "")
    figures = re.findall(r"\d[\d.,]*\s*(?:x\b|GB/s|MB/s|MiB/s|ms\b|%)", outside)
    assert figures == [], "README.md's Benchmarks section: figures outside the generated block"


def test_peers_node_cpus_takes_two_cpu_lists_of_this_process(bench, capsys):
    """``benchmarks/peers.py --node-cpus A/B``: taskset lists, each non-empty and among the
    CPUs this process may use; anything else is refused naming the option."""
    peers = bench["peers"]
    assert peers.cpu_list("0") == {0}
    assert peers.cpu_list("0,2-4") == {0, 2, 3, 4}
    assert peers.cpu_list("a") == peers.cpu_list("0-") == peers.cpu_list("") == set()
    have = sorted(peers.os.sched_getaffinity(0))
    one = str(have[0])
    assert peers.parse_args(["--node-cpus", f"{one}/{one}"]).node_cpus == [one, one]
    assert peers.parse_args([]).node_cpus is None
    for bad in ("a/0", f"{one}-/{one}", one, f"{one}/{max(have) + 1}", f"{one}/{one}/{one}"):
        with pytest.raises(SystemExit) as e:
            peers.parse_args(["--node-cpus", bad])
        assert e.value.code == 2
        assert "--node-cpus: two CPU lists A/B" in capsys.readouterr().err


def test_plan_check_calibrates_no_rate_from_no_added_time(bench):
    """A sharded job no slower than the replicated one (noise on a busy machine) gave the
    store's exchange rate over a floor of 1 us: '4227.07 GB/s', printed as calibrated and
    passed to datastore plan as --exchange-bw."""
    plan_check = bench["plan_check"]
    assert plan_check.calibrated_rate(4 * MIB, 0.002) == 2 * MIB / 0.001
    assert plan_check.calibrated_rate(4 * MIB, 0.0) is None
    assert plan_check.calibrated_rate(4 * MIB, -0.0005) is None
