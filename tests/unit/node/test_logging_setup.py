"""Logging is configured once per process by the CLI: every record on stderr carries time, host, rank and
level; the trainer's info lines are shown (they used to be lost); --log-level and TRAINER_LOG_LEVEL
choose the level; the step lines on stdout stay what the launcher parses."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys

import pytest
from helpers.trainer_harness import TRAINER, finish, sets, start_run, trainer_env

from trainer import logsetup

STEPS = ["train.max_steps=4", "train.log_every=2", "train.micro_batch_size=8", "checkpoint.save_steps=0"]
# An MLflow store nobody can create: the tracker gives up with a warning, the run goes on.
BROKEN_MLFLOW = ["metrics.report_to=tensorboard,mlflow", "metrics.tracking_uri=file:///proc/no-such/mlruns"]
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def lines(stderr: str, level: str) -> list[str]:
    return [line for line in stderr.splitlines() if f" {level} trainer." in line]


@pytest.mark.slow
def test_a_run_logs_with_time_host_rank_and_level_and_keeps_its_step_lines(tmp_path):
    output_dir = tmp_path / "run"
    run = finish(start_run(output_dir, [*STEPS, *BROKEN_MLFLOW]), output_dir)
    assert run.returncode == 0, run.stderr[-4000:]
    host = re.escape(socket.gethostname())
    info = lines(run.stderr, "INFO")
    assert any(
        re.fullmatch(
            rf"{STAMP} {host} rank 0 INFO trainer\.node\.metrics: metrics\.report_to: tensorboard writes to "
            + re.escape(str(output_dir / "tensorboard")),
            line,
        )
        for line in info
    ), run.stderr[-3000:]
    warning = lines(run.stderr, "WARNING")
    assert len(warning) == 1, run.stderr[-3000:]  # rank 0 alone opens the trackers
    assert re.match(
        rf"{STAMP} {host} rank 0 WARNING trainer\.node\.metrics: metrics\.report_to: mlflow could not start, "
        r"training goes on without it",
        warning[0],
    ), warning
    # The step lines are prints, as before: the launcher's live view parses them.
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" loss ")[0] for line in steps] == ["step 1/4", "step 2/4", "step 4/4"]
    assert len(run.metrics) == 3


@pytest.mark.slow
@pytest.mark.parametrize("by", ["option", "variable"])
def test_log_level_warning_hides_the_info_lines_but_not_the_warnings(tmp_path, by):
    # The variable is what `trainer launch --env TRAINER_LOG_LEVEL=...` hands every node.
    output_dir = tmp_path / "run"
    args = sets(f"output_dir={output_dir}", *STEPS, *BROKEN_MLFLOW)
    option = ["--log-level", "warning"] if by == "option" else []
    env = trainer_env({"TRAINER_LOG_LEVEL": "warning"} if by == "variable" else {})
    run = subprocess.run(
        [TRAINER, "train", *option, *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert lines(run.stderr, "INFO") == []
    # Without a launcher there is no RANK: the host alone says where.
    host = re.escape(socket.gethostname())
    assert re.match(
        rf"{STAMP} {host} WARNING trainer\.node\.metrics: metrics\.report_to: mlflow",
        lines(run.stderr, "WARNING")[0],
    )


def test_a_bad_level_is_refused_with_the_choices(tmp_path):
    by_option = subprocess.run(
        [TRAINER, "train", "--dry-run", "--log-level", "loud"], capture_output=True, text=True, timeout=120
    )
    assert by_option.returncode == 2
    assert "--log-level: invalid choice: 'LOUD'" in by_option.stderr
    by_variable = subprocess.run(
        [TRAINER, "train", "--dry-run"],
        capture_output=True, text=True, timeout=120, env=trainer_env({"TRAINER_LOG_LEVEL": "loud"}),
    )  # fmt: skip
    assert by_variable.returncode == 2
    assert "TRAINER_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR (got 'loud')" in by_variable.stderr


# In a fresh interpreter: configured twice (a second verb run in-process, e.g. by a test), one line per
# record; another library's INFO stays hidden, its WARNING is shown in the same format.
TWICE = """
import logging
from trainer import logsetup
logsetup.configure("info")
logsetup.configure("debug")
logging.getLogger("trainer.node.x").debug("once %d", 1)
logging.getLogger("transformers.somewhere").info("not ours")
logging.getLogger("transformers.somewhere").warning("theirs")
"""


def test_configured_twice_logs_each_record_once():
    run = subprocess.run(
        [sys.executable, "-c", TWICE],
        capture_output=True, text=True, timeout=60, env=trainer_env({"RANK": "3"}),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    host = re.escape(socket.gethostname())
    assert re.fullmatch(
        rf"{STAMP} {host} rank 3 DEBUG trainer\.node\.x: once 1\n"
        rf"{STAMP} {host} rank 3 WARNING transformers\.somewhere: theirs\n",
        run.stderr,
    ), run.stderr


def test_records_follow_the_current_stderr(capsys):
    """A handler bound to the stderr of its first call would write to a closed stream later (a test's
    capture, a redirected stream); it follows sys.stderr instead."""
    root, ours = logging.getLogger(), logging.getLogger("trainer")
    before, levels = list(root.handlers), (root.level, ours.level)
    try:
        logsetup.configure("info")
        logging.getLogger("trainer.test").info("first")
        assert "INFO trainer.test: first" in capsys.readouterr().err
        logging.getLogger("trainer.test").info("second")
        assert "INFO trainer.test: second" in capsys.readouterr().err
    finally:
        for handler in root.handlers:
            if handler not in before:
                root.removeHandler(handler)
        root.setLevel(levels[0])
        ours.setLevel(levels[1])
