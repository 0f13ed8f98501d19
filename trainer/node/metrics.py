"""What a run tells the user: step lines, a progress bar, run.json, metrics.jsonl, summary.json, and the
same scalars in TensorBoard, Weights & Biases or MLflow when `metrics.report_to` asks for them.

Only rank 0 reports (every method is a no-op elsewhere). The step line format is a contract: it starts
with `step <N>/<MAX>` and the launcher parses it for its live per-host view.

The `metrics` config section lives here; this module imports nothing heavy at load time (the controller
validates configs without torch): each tracker's package is imported when rank 0 opens it.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainer.configerror import ConfigError, require
from trainer.redaction import redact_urls
from trainer.safe_files import umask_mode, write_file

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
#: When this module was first imported (early in `trainer train`): process_wall_s's fallback.
_IMPORTED = time.time()
#: Where each tracker writes inside output_dir (W&B makes its own `wandb/` there).
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"

log = logging.getLogger(__name__)

#: report_to name -> (module imported, pip package, the project's extra that installs it)
TRACKERS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard", "train"),
    "wandb": ("wandb", "wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny", "mlflow"),
}

#: metrics.jsonl field -> the tag the trackers show (HF Trainer's train/ and eval/ grouping).
SCALAR_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
}


@dataclass(kw_only=True)
class MetricsConfig:
    """Where the logged metrics go besides metrics.jsonl (always written): TensorBoard, Weights & Biases,
    MLflow. Rank 0 writes them, with the whole config as the run's hyperparameters."""

    report_to: list[str] = field(default_factory=list)
    """Trackers to also send every logged step to: tensorboard (event files in output_dir/tensorboard),
    wandb (W&B; WANDB_MODE=offline keeps it in output_dir/wandb), mlflow (a file store in
    output_dir/mlruns unless tracking_uri or MLFLOW_TRACKING_URI says otherwise). [] = metrics.jsonl only.
    wandb and mlflow are optional installs: pip install 'clustertrain[wandb]' / 'clustertrain[mlflow]'."""
    project: str = "clustertrain"
    """The W&B project and the MLflow experiment the run goes into."""
    run_name: str = ""
    """The run's name in W&B and MLflow; '' = the name of output_dir."""
    tracking_uri: str = ""
    """MLflow tracking URI; '' = MLFLOW_TRACKING_URI if set, else a file store in output_dir/mlruns."""

    def __post_init__(self) -> None:
        for name in self.report_to:
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, list(TRACKERS), n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(
                    "report_to", f"unknown tracker {name!r}: {hint}choose from {', '.join(TRACKERS)}"
                )
        require(
            len(set(self.report_to)) == len(self.report_to),
            "report_to",
            f"names a tracker twice (got {self.report_to})",
        )
        require(bool(self.project.strip()), "project", "must not be empty")
        # The config is written to run.json and sent to the trackers as hyperparameters: no secret in it.
        require(
            not urlsplit(self.tracking_uri).password,
            "tracking_uri",
            "holds a password: give MLflow its credentials through MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) on the nodes, not in the URI (the config is "
            "written to run.json)",
        )

    def check_installed(self) -> None:
        """Raise ConfigError naming the package and the pip extra of each asked-for tracker that is not
        installed here. Called on rank 0 (which writes them) before anything is created."""
        for name in self.report_to:
            module, package, extra = TRACKERS[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(
                    "metrics.report_to",
                    f"{name} needs the {package} package, which is not installed in {sys.prefix}: "
                    f"pip install 'clustertrain[{extra}]' (or pip install {package}) on the nodes, or "
                    f"drop {name} from metrics.report_to",
                )


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'max_steps': 8}} -> {'train.max_steps': 8}; lists become comma-separated text."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, list | tuple):
            flat[name] = ",".join(str(item) for item in value)
        else:
            flat[name] = value
    return flat


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The tracker scalars of one metrics.jsonl record, by tag (each node's step time as
    train/step_time_s_by_node/nodeN: a tag is never also the folder of another in MLflow's file store)."""
    values = {tag: float(record[key]) for key, tag in SCALAR_TAGS.items() if record.get(key) is not None}
    for node, seconds in (record.get("step_time_s_by_node") or {}).items():
        values[f"train/step_time_s_by_node/{node}"] = float(seconds)
    return values


class _TensorBoard:
    def __init__(self, output_dir: Path, hparams: dict[str, Any], first_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # purge_step: a resumed run hides the old events past its checkpoint, as metrics.jsonl drops them.
        self.writer = SummaryWriter(
            str(output_dir / TENSORBOARD_DIR), purge_step=first_step if first_step > 1 else None
        )
        flat = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()}
        for summary in hparams_summary(flat, {}):
            self.writer.file_writer.add_summary(summary)
        self.where = self.writer.log_dir

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, output_dir: Path, hparams: dict[str, Any], config: MetricsConfig):
        import wandb

        self.run = wandb.init(
            project=config.project,
            name=config.run_name or output_dir.resolve().name,
            dir=str(output_dir),
            config=hparams,
            # Our stdout is the step lines the launcher parses: W&B does not wrap or copy it.
            settings=wandb.Settings(console="off"),
        )
        self.where = f"{self.run.dir} ({self.run.settings.mode} mode)"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, output_dir: Path, hparams: dict[str, Any], config: MetricsConfig):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = (
            config.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (output_dir / MLFLOW_DIR).resolve().as_uri()
        )
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps the file store in maintenance mode behind this switch; it needs no server
            # or database, and a single writer on a shared file system is what it was made for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(config.project)
        )
        self.run_id = self.client.create_run(
            experiment_id, run_name=config.run_name or output_dir.resolve().name
        ).info.run_id
        # The URI may carry a token (user part, ?access_token=...): never logged.
        self.where = f"{redact_urls(uri)} (experiment {config.project!r}, run {self.run_id})"
        params = [Param(key, str(value)) for key, value in hparams.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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
    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        max_steps: int,
        metrics: MetricsConfig | None = None,
        hparams: dict[str, Any] | None = None,
    ):
        """metrics: where else the steps go (metrics.report_to); hparams: the run's config as plain
        data (TrainerConfig.to_dict(), secrets redacted), logged to each tracker once."""
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.max_steps = max_steps
        self.metrics = metrics or MetricsConfig()
        self.hparams = flatten(hparams or {})
        self._progress = None
        self._task = None
        self._trackers: dict[str, Any] = {}

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
            # NAME.tmp: the name trainer.node.checkpoint.layout knows as an incomplete write.
            text = json.dumps(data, indent=2) + "\n"
            write_file(self.output_dir / name, text, umask_mode(), tmp_name=f"{name}.tmp")

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
        self._open_trackers(first_step)
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
        values = scalars(record)
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.log(record["step"], values)
            except Exception as err:  # a tracker's outage costs its curves, never the run
                self._drop_tracker(name, "stopped logging", err)
                with contextlib.suppress(Exception):
                    tracker.close()

    def _open_trackers(self, first_step: int) -> None:
        for name in self.metrics.report_to:
            if name in self._trackers:
                continue
            try:
                if name == "tensorboard":
                    tracker = _TensorBoard(self.output_dir, self.hparams, first_step)
                elif name == "wandb":
                    tracker = _Wandb(self.output_dir, self.hparams, self.metrics)
                else:
                    tracker = _Mlflow(self.output_dir, self.hparams, self.metrics)
            except Exception as err:
                self._drop_tracker(name, "could not start", err)
                continue
            self._trackers[name] = tracker
            log.info("metrics.report_to: %s writes to %s", name, tracker.where)

    def _drop_tracker(self, name: str, what: str, err: Exception) -> None:
        self._trackers.pop(name, None)
        log.warning(
            "metrics.report_to: %s %s, training goes on without it (metrics.jsonl has every step): %s: %s",
            name,
            what,
            type(err).__name__,
            err,
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.close()
            except Exception as err:
                self._drop_tracker(name, "did not close cleanly", err)
        self._trackers.clear()

    def write_report(self) -> None:
        """The run's curves as PNGs beside metrics.jsonl (`trainer report`); never fails the run. First
        summary.json is completed (the run's wall time beside the loop's, the last eval loss)."""
        if not self.enabled:
            return
        self._complete_summary()
        if not (self.output_dir / METRICS_FILE).is_file():
            return
        try:
            from trainer.node.report import write_report

            written = write_report(self.output_dir)
        except Exception as err:
            log.warning("run report not written (`trainer report %s` retries): %s", self.output_dir, err)
            return
        if written:
            self.info(
                f"report: {', '.join(path.name for path in written)} in {self.output_dir}; the run on one "
                f"page: {self.output_dir / 'report.html'}"
            )

    def _complete_summary(self) -> None:
        """summary.json as the loop wrote it (its wall_time_s is the loop's: 0.55 s of a 12.9 s run) with
        run_wall_time_s (this process's, from its start: loading, data, model, loop, final save) and
        loop_wall_time_s beside it, and eval_loss (the last one logged, or null)."""
        path = self.output_dir / SUMMARY_FILE
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(summary, dict):
            return
        evals = []
        with contextlib.suppress(OSError):
            for line in (self.output_dir / METRICS_FILE).read_text().splitlines():
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    value = json.loads(line).get("eval_loss")
                    if isinstance(value, int | float):
                        evals.append(value)
        summary["loop_wall_time_s"] = summary.get("wall_time_s")
        summary["run_wall_time_s"] = round(process_wall_s(), 3)
        summary["eval_loss"] = evals[-1] if evals else None
        self.write_json(SUMMARY_FILE, summary)


def process_wall_s(now: float | None = None) -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    now = time.time() if now is None else now
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        started = _IMPORTED
    return max(0.0, now - min(started, _IMPORTED))


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62
