"""Helpers for trainer tests: real `trainer train` runs under real launchers, on the CPU, on loopback.

Imported by the trainer tests (`from helpers.trainer_harness import ...`); the fixture is in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from trainer.node.order import SAMPLE_LOG_VARIABLE

BIN = Path(sys.executable).parent
TRAINER = str(BIN / "trainer")
#: Short runs of the tiny model: enough steps for the loss to fall, few enough to stay quick.
QUICK = [
    "train.max_steps=20",
    "train.log_every=5",
    "train.micro_batch_size=8",
    "checkpoint.save_steps=10",
]
#: The resume-at-another-world-size runs (test_resume_world_size, test_ds_resize): 8 steps of 4 samples
#: × 2 processes × 3 micro-batches (effective batch 24), checkpoints at 4 and 8. Dropout off: a rank's
#: dropout masks depend on its rank, so another split across ranks would change the loss.
RESIZE_GPT = [
    "train.max_steps=8",
    "train.log_every=1",
    "train.micro_batch_size=4",
    "train.gradient_accumulation_steps=3",
    "checkpoint.save_steps=4",
    "model.dropout=0",
]

#: Documented test hook (trainer/node/checkpoint/writer.py): rank 0 pauses inside the temporary write of
#: step 20 (test_trainer_engines, test_finetune_engines).
PAUSE_IN_STEP_20_WRITE = {
    "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S": "300",
    "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP": "20",
}

#: DeepSpeed's first start on a machine compiles a small op (about a minute) before it trains.
TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


@dataclass
class Run:
    output_dir: Path
    returncode: int
    stdout: str
    stderr: str

    def json(self, name: str) -> dict:
        return json.loads((self.output_dir / name).read_text())

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def summary(self) -> dict:
        return self.json("summary.json")


def launch_command(launcher: str, nproc: int, port: int, trainer_args: list[str]) -> list[str]:
    if launcher == "none":
        return [TRAINER, "train", *trainer_args]
    if launcher == "accelerate":
        return [
            str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), TRAINER, "train", *trainer_args,
        ]  # fmt: skip
    return [
        str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(port), TRAINER, "train", *trainer_args,
    ]  # fmt: skip


def start_run(
    output_dir: Path,
    overrides: list[str],
    *,
    launcher: str = "torchrun",
    nproc: int = 2,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    config: Path | None = None,
) -> subprocess.Popen:
    """Start a training job in its own process group (so a test can kill the launcher and all workers).
    `config`: a --config file (where secrets go: `trainer train` refuses them in --set)."""
    trainer_args = (["--config", str(config)] if config else []) + sets(
        f"output_dir={output_dir}", *overrides
    )
    command = launch_command(launcher, nproc, free_port(), trainer_args)
    # Output goes to files, not pipes: a test that polls the output dir never blocks a full pipe.
    logs = _log_paths(output_dir)
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        return subprocess.Popen(
            command,
            cwd=cwd or output_dir.parent,
            env=trainer_env(env),
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )


def _log_paths(output_dir: Path) -> tuple[Path, Path]:
    return output_dir.with_name(output_dir.name + ".stdout"), output_dir.with_name(
        output_dir.name + ".stderr"
    )


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Poll condition() until it is true; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every process under `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[parent].append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_job(process: subprocess.Popen, sig: int) -> list[int]:
    """`sig` to the launcher and every worker: the process group start_run made and every process
    under the launcher (torchrun starts its workers in sessions of their own, outside that group).
    The processes signalled."""
    job = [process.pid, *descendants(process.pid)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return job


def kill_job(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker (signal_job): none is left writing to the output dir."""
    job = signal_job(process, signal.SIGKILL)
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in job[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)  # a worker's exit, and its files closed, before the test looks


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (one that no parent reaps is gone all the same)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def finish(process: subprocess.Popen, output_dir: Path) -> Run:
    try:
        process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_job(process)
        raise
    stdout, stderr = (path.read_text() for path in _log_paths(output_dir))
    return Run(output_dir, process.returncode, stdout, stderr)


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def assert_trained(run: Run, *, world_size: int, engine: str, max_steps: int = 20) -> None:
    """What a user checks after a run: it succeeded, the loss fell, the ranks agree, files are there."""
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    metrics = run.metrics
    assert [m["step"] for m in metrics][-1] == max_steps
    assert all(
        m["world_size"] == world_size and m["tokens_per_s"] > 0 and m["step_time_s"] > 0 for m in metrics
    )
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3, [m["loss"] for m in metrics]
    summary = run.summary
    assert summary["engine"] == engine and summary["world_size"] == world_size
    assert summary["final_step"] == max_steps
    assert len(summary["param_checksums"]) == world_size
    assert len(set(summary["param_checksums"])) == 1, "ranks ended with different parameters"
    latest = (run.output_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{max_steps}"
    assert (run.output_dir / "checkpoints" / latest / "clustertrain_state.json").is_file()
    step_lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert step_lines and step_lines[-1].startswith(f"step {max_steps}/{max_steps} loss ")
    if not summary["resumed_from"]:
        assert len(step_lines) == len(metrics), "only rank 0 prints step lines"
    run_json = run.json("run.json")
    assert run_json["topology"]["world_size"] == world_size
    assert len(run_json["topology"]["ranks"]) == world_size


def sample_log_env(directory: Path) -> dict[str, str]:
    """The environment that makes every rank log the samples it trains into directory (the
    TRAINER_TEST_SAMPLE_LOG hook, trainer/node/order.py)."""
    return {SAMPLE_LOG_VARIABLE: str(directory)}


def sample_log(directory: Path) -> list[dict]:
    """Every micro-batch the ranks logged: {"step", "micro_batch", "rank", "world_size", "samples"}."""
    return [
        json.loads(line)
        for path in sorted(directory.glob("rank-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def samples_by_step(directory: Path) -> dict[int, list[int]]:
    """Each step's samples, all ranks and micro-batches together, sorted (a multiset)."""
    steps: dict[int, list[int]] = defaultdict(list)
    for record in sample_log(directory):
        steps[record["step"]] += record["samples"]
    return {step: sorted(samples) for step, samples in sorted(steps.items())}


def stopped_after(output_dir: Path, step: int, copy: Path) -> Path:
    """A copy of a finished run's output dir as a run stopped right after checkpoint step-N would have
    left it (killed before the next): the later checkpoints gone, `latest` naming step-N. What step-N
    holds does not depend on whether the run went on; the resumed run drops the later metrics itself."""
    shutil.copytree(output_dir, copy, symlinks=True)
    checkpoints = copy / "checkpoints"
    for later in checkpoints.glob("step-*"):
        if int(later.name.removeprefix("step-")) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step-{step}\n")
    return copy
