"""What a run tells the user: step lines, a progress bar, run.json, metrics.jsonl, summary.json.

Only rank 0 reports (every method is a no-op elsewhere). The step line format is a contract: it starts
with `step <N>/<MAX>` and the launcher parses it for its live per-host view.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def step_line(
    step: int,
    max_steps: int,
    loss: float,
    lr: float,
    tokens_per_s: float,
    step_time_s: float,
    eval_loss: float | None = None,
) -> str:
    line = (
        f"step {step}/{max_steps} loss {loss:.4f} lr {lr:.2e} tok/s {tokens_per_s:,.0f} "
        f"step_time {step_time_s * 1000:.0f}ms"
    )
    return line if eval_loss is None else f"{line} eval_loss {eval_loss:.4f}"


class Reporter:
    def __init__(self, output_dir: str | Path, *, enabled: bool, max_steps: int):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.max_steps = max_steps
        self._progress = None
        self._task = None

    def info(self, message: str) -> None:
        if self.enabled:
            self._print(message)

    def _print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.enabled:
            path = self.output_dir / name
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            tmp.replace(path)

    def start(self, first_step: int, resumed_step: int) -> None:
        """Open metrics.jsonl: a resumed run keeps the lines up to its checkpoint, a fresh run starts empty;
        show a progress bar when stdout is a terminal (a log file gets the step lines only)."""
        if not self.enabled:
            return
        metrics = self.output_dir / METRICS_FILE
        kept = []
        if resumed_step and metrics.is_file():
            kept = [line for line in metrics.read_text().splitlines() if _step_of(line) <= resumed_step]
        metrics.write_text("".join(line + "\n" for line in kept))
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("training"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.max_steps, completed=first_step - 1)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log_step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._print(
            step_line(
                record["step"],
                self.max_steps,
                record["loss"],
                record["lr"],
                record["tokens_per_s"],
                record["step_time_s"],
                record.get("eval_loss"),
            )
        )
        with open(self.output_dir / METRICS_FILE, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62
