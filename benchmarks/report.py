"""Run every benchmark, then redraw the plots and the generated block of docs/benchmarks.md.

Usage::

    python benchmarks/report.py                   # every benchmark at full size (make bench)
    python benchmarks/report.py --quick           # every benchmark at smoke-test size
    python benchmarks/report.py --only stage,loader
    python benchmarks/report.py --skip-run        # redraw from benchmarks/results/*.json

The benchmarks of ``BENCHMARKS`` run one after another, never together (they are timing runs),
each writing its results to ``benchmarks/results/NAME.json`` (``common.write_results``: medians
with their ranges, the key ratios, the command, the machine, the date). A benchmark that needs a
CUDA GPU is skipped where there is none, and its results file is left as it is. Then, from every
results file there is (not only the ones just run), the figures of ``figures.py`` are drawn into
``docs/img/bench-*.png`` and the block between ``<!-- report:begin -->`` and
``<!-- report:end -->`` in ``docs/benchmarks.md`` is rewritten: the key ratios, the runs that
produced them, the plots. So is the block between the same markers in ``README.md``: the key
ratios of the benchmarks of ``README_BENCHMARKS``, their dates and the loader's plot (so that
every figure the README gives is one of these results; ``tests/test_report.py`` checks it).
Nothing outside the markers changes.

Adding a benchmark: a script whose ``--json FILE`` writes its results with
``common.write_results`` (key ratios included), and one ``Benchmark`` entry below; a plot is a
function of ``figures.py`` named in the entry's ``figures``.

Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
FIELDS = ("benchmark", "command", "date", "machine", "ratios", "results")  # write_results'
JSON = "{json}"  # in a command line: the results file


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of the report.

    Args:
        name: its name; its results are ``NAME.json``.
        full: its command line at full size, after ``python`` (``{json}``: the results file).
        quick: the same at smoke-test size (``--quick``); its data under ``bench-data/quick/``,
            apart from the full run's, so that neither remakes the other's.
        figures: functions of ``figures.py`` drawn from its results, one PNG each.
        needs_cuda: run only where CUDA is available; its figures only from a GPU run.
    """

    name: str
    full: str
    quick: str
    figures: tuple[str, ...] = ()
    needs_cuda: bool = False

    def command(self, quick: bool, results: str) -> list[str]:
        line = self.quick if quick else self.full
        return shlex.split(line.replace(JSON, shlex.quote(results)))


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "stage",
        "benchmarks/stage.py --reps 5 --json {json}",
        "benchmarks/stage.py --scale 0.05 --reps 2 --dir bench-data/quick/stage --json {json}",
        figures=("staging",),
    ),
    Benchmark(
        "loader",
        "benchmarks/loader.py --json {json}",
        "benchmarks/loader.py --quick --dir bench-data/quick/loader --json {json}",
        figures=("loader_epochs", "block_reads"),
    ),
    Benchmark(
        "service",
        "benchmarks/service.py --json {json}",
        "benchmarks/service.py --quick --dir bench-data/quick/service --json {json}",
        figures=("service_clients",),
    ),
    Benchmark(
        "peers",
        "benchmarks/peers.py --json {json}",
        "benchmarks/peers.py --quick --dir bench-data/quick/peers --json {json}",
    ),
    Benchmark(
        "shuffle",
        "benchmarks/shuffle.py --json {json}",
        "benchmarks/shuffle.py --samples 100000 --ranks 16 --real-ranks 2 --real-samples 256 "
        "--epochs 2 --json {json}",
    ),
    Benchmark(
        "train_step",
        "benchmarks/train_step.py --json {json}",
        "benchmarks/train_step.py --steps 5 --samples 64 --reps 1 --workers 2 "
        "--dir bench-data/quick/trainer --json {json}",
        figures=("training",),
    ),
    Benchmark(
        "ensemble",
        "benchmarks/ensemble.py --json {json}",
        "benchmarks/ensemble.py --jobs 4 --samples 64 --side 16 --dir bench-data/quick/ensemble "
        "--json {json}",
    ),
    Benchmark(
        "plan_check",
        "benchmarks/plan_check.py --json {json}",
        "benchmarks/plan_check.py --samples 24 --side 32 --epochs 1 --dir bench-data/quick/plan "
        "--json {json}",
    ),
    Benchmark(
        "gpu_feed",
        "benchmarks/gpu_feed.py --json {json}",
        "benchmarks/gpu_feed.py --quick --json {json}",
        figures=("gpu_feed",),
        needs_cuda=True,
    ),
)


README_BENCHMARKS = ("stage", "loader", "service", "peers", "shuffle", "train_step", "ensemble")
README_FIGURE = "loader_epochs"  # the plot the README shows


def results_file(results: Path, b: Benchmark) -> str:
    """``b``'s results file as its command line names it: relative to the repository."""
    return os.path.relpath(results / f"{b.name}.json", REPO)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="run every benchmark at smoke-test size")
    p.add_argument("--only", default=None, help="run only these benchmarks, comma separated")
    p.add_argument("--skip-run", action="store_true", help="run nothing: redraw from the results")
    p.add_argument("--results", default=str(HERE / "results"), help="the results files' folder")
    p.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"), help="the page to update")
    p.add_argument("--img", default=str(REPO / "docs" / "img"), help="where the PNGs go")
    p.add_argument("--readme", default=str(REPO / "README.md"), help="the README to update")
    args = p.parse_args(argv)
    names = [b.name for b in BENCHMARKS]
    args.only = names if args.only is None else [n.strip() for n in args.only.split(",")]
    bad = [n for n in args.only if n not in names]
    if bad or not args.only:
        p.error(f"--only: unknown benchmark(s) {bad}; pick from {','.join(names)}")
    if args.skip_run and args.quick:
        p.error("--quick sizes a run; --skip-run runs nothing")
    return args


def need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(
            "benchmarks/report.py draws its plots with matplotlib, which is not installed: "
            "pip install -e '.[bench]' (or: pip install matplotlib)"
        )


# ----------------------------------------------------------------------------- running


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(benchmarks: list[Benchmark], quick: bool, results: Path) -> list[str]:
    """Run ``benchmarks`` one after another; the names of those that failed."""
    results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    failed = []
    for i, b in enumerate(benchmarks, 1):
        out = results_file(results, b)
        if b.needs_cuda and not cuda_available():
            print(f"\n== [{i}/{len(benchmarks)}] {b.name}: skipped, no CUDA GPU ({out} kept)")
            continue
        cmd = b.command(quick, out)
        print(f"\n== [{i}/{len(benchmarks)}] {b.name}: {shlex.join(['python', *cmd])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env).returncode
        took = time.monotonic() - t0
        if rc:
            failed.append(b.name)
            print(f"== {b.name} FAILED (exit {rc}, {took:.0f} s); {out} is as the run left it")
        else:
            print(f"== {b.name} done in {took:.0f} s: {out}", flush=True)
    return failed


# ----------------------------------------------------------------------------- rendering


def load(path: Path, name: str) -> dict[str, Any]:
    """A results file written by ``common.write_results`` for benchmark ``name``."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a readable results file ({exc})") from None
    missing = [k for k in FIELDS if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise SystemExit(f"{path}: not a results file of common.write_results (no {missing})")
    if doc["benchmark"] != name:
        raise SystemExit(f"{path}: holds results of {doc['benchmark']!r}, not of {name!r}")
    return doc


def measured(b: Benchmark, doc: dict[str, Any] | None) -> bool:
    """Whether ``doc`` holds what ``b`` measures (a GPU benchmark: from a GPU run)."""
    return doc is not None and (not b.needs_cuda or bool(doc["results"].get("cuda")))


def smoke(b: Benchmark, doc: dict[str, Any], results: Path) -> bool:
    """Whether ``doc`` came from ``b``'s ``--quick`` command line."""
    return doc["command"] == shlex.join(["python", *b.command(True, results_file(results, b))])


def caption(function: Any) -> str:
    """The first paragraph of a figure function's docstring, as Markdown."""
    text = " ".join((function.__doc__ or "").split("\n\n")[0].split())
    return text.replace("``", "`")


def draw(name: str, doc: dict[str, Any], path: Path, out: Path) -> bool:
    """Draw figure ``name`` of ``doc`` (read from ``path``) into ``out``; False (and ``out``
    removed) when the run did not measure it."""
    import figures
    import matplotlib.pyplot as plt

    try:
        fig = getattr(figures, name)(doc)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise SystemExit(
            f"{path}: cannot draw figure {name!r} ({type(exc).__name__}: {exc}); was it written "
            f"by an older benchmark? Rerun it: {doc['command']}"
        ) from None
    if fig is None:
        out.unlink(missing_ok=True)
        return False
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return True


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "share":
        return f"{value:.1%}"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2 if abs(value) >= 1 else 3
    return f"{value:.{digits}f} {unit}"


def table(benchmarks: list[Benchmark], docs: dict[str, dict[str, Any]], results: Path) -> list[str]:
    rows = [
        "| benchmark | case | ours | peer | ratio | target |",
        "|---|---|---:|---:|---|---|",
    ]
    for b in benchmarks:
        doc = docs.get(b.name)
        name = f"{b.name} (smoke size)" if doc and smoke(b, doc, results) else b.name
        for r in doc["ratios"] if doc else ():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x ({r['of']})"
            verdict = {True: ": PASS", False: ": MISS", None: ""}[r["pass"]]
            target = f"{r['target']}{verdict}" if r["target"] else ""
            rows.append(
                f"| {name} | {r['case']} | {number(r['ours'], r['unit'])} "
                f"| {number(r['peer'], r['unit'])} | {ratio} | {target} |"
            )
    return rows


def runs(benchmarks: list[Benchmark], docs: dict[str, dict[str, Any]], results: Path) -> list[str]:
    lines = []
    for b in benchmarks:
        doc = docs.get(b.name)
        full = shlex.join(["python", *b.command(False, results_file(results, b))])
        if b.needs_cuda and not measured(b, doc):
            ran = f"; the stored run ran on {doc['results'].get('device')}" if doc else ""
            lines.append(
                f"- **{b.name}**: GPU figures not measured: no results from a GPU run{ran} "
                f"(`{full}` on a machine with a CUDA GPU)"
            )
        elif doc is None:
            lines.append(f"- **{b.name}**: no results yet (`{full}`)")
        else:
            size = " Smoke-test size (`--quick`): a check that the run works, not a measurement."
            lines.append(
                f"- **{b.name}**: `{doc['command']}`, {doc['date']}; {doc['machine']}."
                + (size if smoke(b, doc, results) else "")
            )
    return lines


def block(
    benchmarks: list[Benchmark],
    docs: dict[str, dict[str, Any]],
    pictures: list[tuple[Path, str, dict[str, Any]]],
    results: Path,
    page: Path,
) -> str:
    """The generated Markdown between the markers (without them)."""
    lines = [
        "<!-- Generated by benchmarks/report.py from benchmarks/results/*.json: do not edit; "
        "rerun it. -->",
        "## Latest runs (generated)",
        "",
        "`make bench` (= `python benchmarks/report.py`) runs every benchmark below one after "
        "another and regenerates this section and its plots; `--quick` runs them at smoke-test "
        "size, `--only NAME,...` runs some, `--skip-run` redraws from the stored results. Each "
        "row comes from the run listed under it (medians over its repetitions); compare ratios "
        "measured in one run, never absolute figures across runs. The sections after this one "
        "are written by hand: earlier runs and their analysis.",
        "",
        *table(benchmarks, docs, results),
        "",
        "Runs:",
        "",
        *runs(benchmarks, docs, results),
    ]
    for png, text, doc in pictures:
        lines += ["", f"![{text.replace('`', '')}]({os.path.relpath(png, page.parent)})", ""]
        lines.append(f"*{text} Run: {doc['benchmark']}, {doc['date']}.*")
    return "\n".join(lines)


def readme_block(
    benchmarks: list[Benchmark],
    docs: dict[str, dict[str, Any]],
    results: Path,
    figure: Path,
    readme: Path,
) -> str:
    """The generated Markdown of the README (without the markers): the key ratios of
    ``README_BENCHMARKS``, the date of each run, and ``figure`` (a path) where it exists."""
    shown = [b for b in benchmarks if b.name in README_BENCHMARKS]
    dates = [
        f"{b.name} {docs[b.name]['date']}"
        + (" (smoke size)" if smoke(b, docs[b.name], results) else "")
        for b in shown
        if b.name in docs
    ]
    lines = [
        "<!-- Generated by benchmarks/report.py from benchmarks/results/*.json: do not edit; "
        "rerun it. -->",
        *table(shown, docs, results),
        "",
        f"Runs: {'; '.join(dates) or 'none yet'}. Medians over each run's repetitions; the "
        "command lines, the machine, the plan check, the plots and the earlier runs: "
        "[docs/benchmarks.md](docs/benchmarks.md).",
    ]
    if figure.exists():
        link = os.path.relpath(figure, readme.parent)
        text = caption(figure_function(figure)).replace("`", "").split(". ")[0]
        lines += ["", f"![{text}]({link})"]
    return "\n".join(lines)


def figure_function(png: Path) -> Any:
    """The function of ``figures.py`` that draws ``docs/img/bench-NAME.png``."""
    import figures

    return getattr(figures, png.stem.removeprefix("bench-"))


def replace_block(text: str, body: str, where: Path) -> str:
    """``text`` with what lies between its markers replaced by ``body``; the rest unchanged."""
    i, j = text.find(BEGIN), text.find(END)
    if text.count(BEGIN) != 1 or text.count(END) != 1 or j < i:
        raise SystemExit(
            f"{where}: needs one {BEGIN} line and, after it, one {END} line: the generated "
            "block goes between them"
        )
    return f"{text[: i + len(BEGIN)]}\n{body}\n{text[j:]}"


def rewrite(path: Path, text: str, body: str) -> None:
    """Replace the generated block of ``path`` (whose contents are ``text``), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(replace_block(text, body, path))
    os.replace(tmp, path)


def render(
    results: Path, img: Path, page: Path, readme: Path, benchmarks: list[Benchmark]
) -> list[Path]:
    """Draw every figure there are results for and rewrite the generated blocks of ``page``
    and ``readme``; the files written."""
    import figures

    text, front = page.read_text(), readme.read_text()
    replace_block(text, "", page)  # the markers are there, before drawing anything
    replace_block(front, "", readme)
    docs = {
        b.name: load(results / f"{b.name}.json", b.name)
        for b in benchmarks
        if (results / f"{b.name}.json").exists()
    }
    img.mkdir(parents=True, exist_ok=True)
    pictures, written = [], []
    for b in benchmarks:
        for name in b.figures:
            out = img / f"bench-{name}.png"
            if not measured(b, docs.get(b.name)):
                out.unlink(missing_ok=True)
            elif draw(name, docs[b.name], results / f"{b.name}.json", out):
                pictures.append((out, caption(getattr(figures, name)), docs[b.name]))
                written.append(out)
    rewrite(page, text, block(benchmarks, docs, pictures, results, page))
    figure = img / f"bench-{README_FIGURE}.png"
    rewrite(readme, front, readme_block(benchmarks, docs, results, figure, readme))
    return [*written, page, readme]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    need_matplotlib()
    results, page = Path(args.results).resolve(), Path(args.doc).resolve()
    readme = Path(args.readme).resolve()
    for option, path in (("--doc", page), ("--readme", readme)):
        if not path.is_file():
            sys.exit(f"{option} {path}: no such file")
        replace_block(path.read_text(), "", path)  # fail now, not after an hour of benchmarks
    failed = []
    if not args.skip_run:
        failed = run([b for b in BENCHMARKS if b.name in args.only], args.quick, results)
    written = render(results, Path(args.img).resolve(), page, readme, list(BENCHMARKS))
    print("\nwritten: " + ", ".join(os.path.relpath(p, REPO) for p in written))
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
