"""`trainer report RUN_DIR`: a run's curves as PNG files beside its metrics.jsonl.

Loss (with the eval loss where there is one), learning rate, tokens/s and step time (one line per node
when the records carry per-node step times), drawn with matplotlib's Agg renderer: files only, nothing
served or shown. rank 0 writes the same report at the end of every run (trainer.node.metrics.Reporter);
this verb redraws it for any run directory, also on the controller (no torch needed).

`report.html` beside them is the one page to open (trainer.node.report_html): the same pictures inlined,
the run's numbers, per-node throughput, data summary, launches and restarts, and the resolved config.
`report.json` beside the PNGs names each picture and the step and value range of every line drawn in it,
for tools (and tests) that check a picture without looking at it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import exitcodes
from trainer.node.report_html import HTML_FILE, write_html
from trainer.safe_files import read_text, umask_mode, write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"


@dataclass(frozen=True)
class Curve:
    """One picture: its file name, title, y label and its lines (label -> (steps, values))."""

    file: str
    title: str
    ylabel: str
    lines: dict[str, tuple[list[int], list[float]]]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a torn last line (a run killed while writing) is skipped."""
    records = []
    for line in read_text(run_dir / METRICS_FILE).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value) * scale)
    return steps, values


def curves(records: list[dict[str, Any]]) -> list[Curve]:
    """What the report draws, from metrics.jsonl's records; a picture without data is left out."""
    loss = {"train loss": _series(records, "loss")}
    if _series(records, "eval_loss")[0]:
        loss["eval loss"] = _series(records, "eval_loss")
    step_time = {"rank 0": _series(records, "step_time_s", 1000.0)}
    hosts = sorted({host for r in records for host in (r.get("step_time_s_by_node") or {})})
    if hosts:
        step_time = {}
        for host in hosts:
            steps, values = [], []
            for record in records:
                value = (record.get("step_time_s_by_node") or {}).get(host)
                if isinstance(value, int | float) and math.isfinite(value):
                    steps.append(record["step"])
                    values.append(float(value) * 1000.0)
            step_time[host] = (steps, values)
    candidates = [
        Curve("loss.png", "loss", "loss", loss),
        Curve("learning_rate.png", "learning rate", "lr", {"lr": _series(records, "lr")}),
        Curve("tokens_per_s.png", "throughput", "tokens/s", {"tokens/s": _series(records, "tokens_per_s")}),
        Curve("step_time.png", "step time" + (" per node" if hosts else ""), "ms", step_time),
    ]
    kept = []
    for curve in candidates:
        lines = {label: line for label, line in curve.lines.items() if line[0]}
        if lines:
            kept.append(Curve(curve.file, curve.title, curve.ylabel, lines))
    return kept


def figure(curve: Curve, run_name: str) -> Figure:
    """The curve drawn on its own Figure (no pyplot: no global state, no display)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    axes = fig.add_subplot()
    for label, (steps, values) in curve.lines.items():
        axes.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
    axes.set_title(f"{curve.title} — {run_name}")
    axes.set_xlabel("step")
    axes.xaxis.get_major_locator().set_params(integer=True)  # steps, never 2.5
    axes.set_ylabel(curve.ylabel)
    axes.grid(True, alpha=0.3)
    if len(curve.lines) > 1:
        axes.legend()
    return fig


def write_report(run_dir: Path) -> list[Path]:
    """Draw every curve of run_dir/metrics.jsonl to run_dir/*.png and describe them in report.json."""
    # The Agg canvas attached to each Figure directly: files only, whatever backend pyplot would pick.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    written, described, pictures = [], {}, []
    for curve in curves(records):
        fig = figure(curve, run_dir.resolve().name)
        FigureCanvasAgg(fig)
        path = run_dir / curve.file
        png = io.BytesIO()
        fig.savefig(png, format="png")
        write_file(path, png.getvalue(), umask_mode())
        written.append(path)
        pictures.append((curve.file, curve.title))
        described[curve.file] = {
            "title": curve.title,
            "ylabel": curve.ylabel,
            "lines": {
                label: {
                    "points": len(steps),
                    "steps": [min(steps), max(steps)],
                    "values": [min(values), max(values)],
                }
                for label, (steps, values) in curve.lines.items()
            },
        }
    write_file(
        run_dir / REPORT_FILE,
        json.dumps({"records": len(records), "pictures": described}, indent=2) + "\n",
        umask_mode(),
    )
    if records:
        # Not in the list returned (the pictures): `trainer report` and the run's last lines name it.
        write_html(run_dir, records, pictures)
    return written


EXAMPLES = ("trainer report /shared/runs/qwen-lora  # curves as PNGs and report.html, in the run dir",)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a run's output_dir (has metrics.jsonl)"
    )


def run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not (run_dir / METRICS_FILE).is_file():
        print(
            f"trainer report: {run_dir} has no {METRICS_FILE}: give a run's output_dir (the directory "
            "with run.json and metrics.jsonl)",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    try:
        written = write_report(run_dir)
    except ModuleNotFoundError as err:
        print(
            f"trainer report: needs {(err.name or 'matplotlib').split('.')[0]}, which is not installed here: "
            "pip install matplotlib "
            "(a dependency of clustertrain)",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    except OSError as err:
        print(f"trainer report: cannot write the report in {run_dir}: {err}", file=sys.stderr)
        return exitcodes.FAILURE
    if not written:
        print(f"trainer report: {run_dir / METRICS_FILE} has no logged step yet; nothing drawn")
        return exitcodes.OK
    for path in written:
        print(path)
    print(run_dir / REPORT_FILE)
    print(run_dir / HTML_FILE)
    return exitcodes.OK
