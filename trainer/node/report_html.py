"""`report.html`: one page per run, beside the PNGs of trainer.node.report, that a person opens offline.

What it shows, each from the file that holds it: the run's headline numbers and its curves (the PNGs
just drawn, inlined as data: URIs), the eval losses and each node's step time and throughput
(metrics.jsonl), the data summary and the resolved config (run.json), how the run ended (summary.json)
and its launches, restarts and stops (launch/history.jsonl, which the launcher's node helper appends to
on the head).

Self-contained and inert: no URL outside the file, no script at all, and a Content-Security-Policy that
forbids both, so a report copied off the cluster opens anywhere and runs nothing. Every string from a
run (names, paths, config values, failure messages) is HTML-escaped. Standard library only: it is
written on the nodes at the end of every run and by `trainer report` on the controller.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.run_paths import RunPaths
from trainer.safe_files import read_bytes, read_text, umask_mode, write_file

HTML_FILE = "report.html"
RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
#: The launcher's record of the run's launches, restarts and stops, relative to the run dir.
HISTORY_FILE = RunPaths(Path()).history

#: Nothing may be fetched or run: images only from the page itself, styles only inline.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.muted { color: #666; } .numbers { display: flex; flex-wrap: wrap; gap: 10px; margin: 14px 0; }
.number { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; min-width: 120px; }
.number b { display: block; font-size: 18px; }
.curves { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.curves img { width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px;
text-align: left; vertical-align: top; } th { background: #f4f4f4; } td.n { text-align: right; }
td.detail { max-width: 640px; overflow-wrap: anywhere; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} when it is missing or not one (a report never fails on it)."""
    try:
        data = json.loads(read_text(path))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's launch/history.jsonl records in order; a torn line is skipped."""
    try:
        lines = read_text(run_dir / HISTORY_FILE).splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def fmt(value: Any, digits: int = 4) -> str:
    """A number as a person reads it: few significant digits, thousands separated."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.{digits - 1}e}"
    return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _numbers(records: list[dict[str, Any]], run: Mapping, summary: Mapping) -> list[tuple[str, str]]:
    """The headline tiles: (label, value)."""
    config = run.get("config") or {}
    topology = run.get("topology") or {}
    tiles = []
    if records:
        max_steps = (config.get("train") or {}).get("max_steps")
        last = records[-1]["step"]
        tiles.append(("steps", f"{last:,}" + (f" / {max_steps:,}" if isinstance(max_steps, int) else "")))
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), int | float)]
    if losses:
        tiles.append(("last train loss", fmt(losses[-1])))
    evals = [r["eval_loss"] for r in records if isinstance(r.get("eval_loss"), int | float)]
    if evals:
        tiles.append(("last eval loss", fmt(evals[-1])))
        tiles.append(("best eval loss", fmt(min(evals))))
    rates = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), int | float)]
    if rates:
        tiles.append(("tokens/s (mean)", fmt(statistics.fmean(rates), 3)))
    times = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), int | float)]
    if times:
        tiles.append(("step time (mean)", f"{fmt(statistics.fmean(times) * 1000, 3)} ms"))
    if topology.get("world_size"):
        tiles.append(("world", f"{topology['world_size']} ranks on {topology.get('num_nodes', '?')} node(s)"))
    if topology.get("engine"):
        tiles.append(("engine", f"{topology['engine']} ({topology.get('device', '?')})"))
    if summary.get("run_wall_time_s") is not None:
        tiles.append(("run wall time", f"{fmt(float(summary['run_wall_time_s']), 3)} s"))
    if summary.get("wall_time_s") is not None:  # the loop's: written by the loop itself
        tiles.append(("training loop", f"{fmt(float(summary['wall_time_s']), 3)} s"))
    if "ranks_agree" in summary:
        tiles.append(("ranks agree", "yes" if summary["ranks_agree"] else "NO"))
    return tiles


def per_node(records: list[dict[str, Any]], num_nodes: int) -> list[dict[str, Any]]:
    """Each node's step time (mean, slowest) and throughput. A node's tokens/s is its share of the
    tokens of a step (equal shares: every node runs the same number of processes) over its own step
    time, so a slow node shows as a low rate."""
    by_node: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        tokens_per_step = _tokens_per_step(record)
        for host, seconds in (record.get("step_time_s_by_node") or {}).items():
            if isinstance(seconds, int | float) and seconds > 0 and math.isfinite(seconds):
                by_node.setdefault(str(host), []).append((float(seconds), tokens_per_step))
    rows = []
    for host, samples in sorted(by_node.items()):
        seconds = [s for s, _ in samples]
        rates = [t / max(num_nodes, 1) / s for s, t in samples if t]
        rows.append(
            {
                "host": host,
                "logged steps": len(seconds),
                "step time mean (ms)": statistics.fmean(seconds) * 1000,
                "step time max (ms)": max(seconds) * 1000,
                "tokens/s": statistics.fmean(rates) if rates else None,
            }
        )
    return rows


def _tokens_per_step(record: Mapping[str, Any]) -> float:
    rate, seconds = record.get("tokens_per_s"), record.get("step_time_s")
    if isinstance(rate, int | float) and isinstance(seconds, int | float):
        return float(rate) * float(seconds)
    return 0.0


def flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            rows += flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _value_text(value: Any, exact: bool) -> str:
    """A cell's text: a number rounded for reading, or (`exact`, the config) as the run was given it."""
    if isinstance(value, list | tuple | dict) or (exact and not isinstance(value, str)):
        return json.dumps(value, ensure_ascii=False)
    return fmt(value) if isinstance(value, int | float) else str(value)


def table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[bool] = (), exact: bool = False
) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            cls = ' class="n"' if index < len(numeric) and numeric[index] else ""
            cls = ' class="detail"' if not cls and index == len(row) - 1 else cls
            cells.append(f"<td{cls}>{esc('' if cell is None else _value_text(cell, exact))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def history_rows(history: list[dict[str, Any]]) -> list[list[Any]]:
    """(time, event, launch, nodes, what happened) for each launch, restart and stop."""
    rows = []
    for record in history:
        when = record.get("time")
        stamp = (
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
            if isinstance(when, int | float)
            else "?"
        )
        launch = record.get("launch_id") or ""
        if record.get("attempt"):
            launch = f"{launch} (attempt {record['attempt']})"
        nodes = record.get("nodes")
        nodes_text = ", ".join(f"{h} ({r})" for h, r in nodes.items()) if isinstance(nodes, dict) else ""
        event = str(record.get("event") or "?")
        if event == "restart":
            event = f"restart {record.get('restart', '?')}/{record.get('max_restarts', '?')}"
        what = next(
            (str(record[key]) for key in ("summary", "reason", "detail", "why") if record.get(key)), ""
        )
        if record.get("resume_from"):
            what += f" (resumes from {record['resume_from']})"
        if record.get("excluded"):
            what += f" (left out: {', '.join(map(str, record['excluded']))})"
        rows.append([stamp, event, launch, nodes_text, what])
    return rows


def picture(run_dir: Path, file: str, title: str) -> str:
    data = base64.b64encode(read_bytes(run_dir / file)).decode("ascii")
    return f'<figure><img alt="{esc(title)}" src="data:image/png;base64,{data}"></figure>'


def render(run_dir: Path, records: list[dict[str, Any]], pictures: Sequence[tuple[str, str]]) -> str:
    """The page's HTML. `records` are metrics.jsonl's, `pictures` (file, title) the PNGs drawn."""
    run = read_json(run_dir / RUN_FILE)
    summary = read_json(run_dir / SUMMARY_FILE)
    history = read_history(run_dir)
    config = run.get("config") or {}
    name = str((config.get("metrics") or {}).get("run_name") or run_dir.resolve().name)
    num_nodes = int((run.get("topology") or {}).get("num_nodes") or 1)
    parts = [
        f"<h1>{esc(name)}</h1>",
        f'<div class="muted">run directory {esc(run_dir.resolve())}; report written '
        f"{esc(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))}</div>",
        '<div class="numbers">'
        + "".join(
            f'<div class="number"><span class="muted">{esc(label)}</span><b>{esc(value)}</b></div>'
            for label, value in _numbers(records, run, summary)
        )
        + "</div>",
    ]
    if pictures:
        parts.append("<h2>Curves</h2>")
        parts.append('<div class="curves">' + "".join(picture(run_dir, f, t) for f, t in pictures) + "</div>")
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), int | float)]
    if evals:
        parts += ["<h2>Eval</h2>", table(["step", "eval loss"], evals, numeric=[True, True])]
    nodes = per_node(records, num_nodes)
    if nodes:
        parts += [
            "<h2>Per node</h2>",
            table(
                list(nodes[0]), [list(row.values()) for row in nodes], numeric=[False, True, True, True, True]
            ),
            '<p class="muted">tokens/s of a node: its equal share of a step\'s tokens over its own step time '
            "(a slow node shows as a low rate).</p>",
        ]
    data = run.get("data") or {}
    if data:
        parts += ["<h2>Data</h2>", table(["", "value"], flatten(data))]
    parts.append("<h2>Launches and restarts</h2>")
    if history:
        parts.append(
            table(["time", "event", "launch", "nodes (rank)", "what happened"], history_rows(history))
        )
    else:
        parts.append(
            f'<p class="muted">no {esc(HISTORY_FILE)}: this run was not started by trainer launch.</p>'
        )
    if summary:
        shown = {k: v for k, v in summary.items() if k != "param_checksums"}
        parts += ["<h2>End of the run</h2>", table(["", "value"], flatten(shown))]
    if config:
        parts += ["<h2>Resolved config</h2>", table(["key", "value"], flatten(config), exact=True)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{esc(name)} — run report</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def write_html(run_dir: Path, records: list[dict[str, Any]], pictures: Sequence[tuple[str, str]]) -> Path:
    """Write run_dir/report.html (whole or not at all: a reader never sees half a page)."""
    path = run_dir / HTML_FILE
    write_file(path, render(run_dir, records, pictures), umask_mode())
    return path
