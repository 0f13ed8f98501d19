"""`trainer stop`, `trainer logs` and the live view's step line on a real run: two loopback "hosts"
(ansible_connection local, node ranks 0 and 1), through the real playbooks, torchrun and the trainer.

One launch serves every test here (a module fixture): while it trains, `trainer logs` prints both
nodes' last lines, a `logs -f` of the head follows it and another is stopped with Ctrl-C; then
`trainer stop` stops it under its launcher, which ends and says so, and the first `logs -f` returns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import loopback

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
RUN = "verbs"
HEAD_STEP = re.compile(r"^(?:\[node0\] )?step (\d+)/")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def loopback_cluster(tmp: Path) -> tuple[Path, Path]:
    """(inventory, shared dir) for node0 (head, 127.0.0.1) and node1 (worker, 127.0.0.2)."""
    return loopback.write_inventory(tmp)


def trainer(verb: str, inventory: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", verb, "-i", str(inventory), *extra]


def head_steps(lines: list[str]) -> list[int]:
    return [int(match.group(1)) for line in lines if (match := HEAD_STEP.match(line))]


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def launch_processes(node_dir: Path) -> list[int]:
    """The live processes of the node's launch (by the launch's tag, as a stop finds them). Both
    loopback "hosts" are this machine and share the tag: NODE_RANK tells them apart."""
    if not (node_dir / "node_ctl.py").exists():
        return []  # the launch never reached this node
    listed = subprocess.run(
        [str(VENV / "bin" / "python"), str(node_dir / "node_ctl.py"), str(node_dir), "pids"],
        capture_output=True,
        text=True,
        check=True,
    )
    node_rank = f"NODE_RANK={node_dir.name.removeprefix('node-')}".encode()
    found = []
    for process in json.loads(listed.stdout)["processes"]:
        try:
            if node_rank in Path(f"/proc/{process['pid']}/environ").read_bytes().split(b"\0"):
                found.append(process["pid"])
        except OSError:
            pass  # gone meanwhile
    return found


class Lines:
    """A child's output lines as they come (a thread reads them), so a test can wait for one."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(line.rstrip("\n") for line in stream))
        self.thread.start()


def wait_for(predicate, what: str, *processes: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for process in processes:
            assert process.poll() is None, f"{process.args[3]} ended ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("verbs")
    inventory, shared = loopback_cluster(tmp)
    run_dir = shared / "runs" / RUN
    head_log = run_dir / "launch" / "node-0" / "log"
    launcher_out = tmp / "launcher.out"
    # As on a terminal: the launcher draws its table of hosts, whose state column shows the step text.
    env = {**os.environ, "TTY_COMPATIBLE": "1", "COLUMNS": "200"}
    long_run = [
        "--set",
        "train.max_steps=5000",
        "--set",
        "train.log_every=2",
        "--set",
        "train.warmup_steps=1",
    ]
    with open(launcher_out, "w") as out:
        launcher = subprocess.Popen(
            trainer("launch", inventory, "--run-name", RUN, "--poll-interval", "1", *long_run),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    children = [launcher]
    try:
        wait_for(lambda: len(head_steps(log_lines(head_log))) >= 3, "3 step lines", launcher)
        last_lines = subprocess.run(
            trainer("logs", inventory, "--run-name", RUN, "--lines", "4"), capture_output=True, text=True
        )
        logged_before = head_log.read_text().splitlines()
        follower = subprocess.Popen(
            trainer("logs", inventory, "--run-name", RUN, "--node", "0", "--lines", "1", "-f"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # As a terminal's Ctrl-C finds it: SIGINT not ignored (a background job's would be).
        interrupted = subprocess.Popen(
            trainer("logs", inventory, "--run-name", RUN, "--lines", "0", "-f"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        children += [follower, interrupted]
        followed, interrupted_lines = Lines(follower.stdout), Lines(interrupted.stdout)
        # The first follower's first line is the log's last: a second step line came by following.
        wait_for(
            lambda: len(head_steps(followed.lines)) >= 3 and interrupted_lines.lines,
            "new step lines shown by both followers",
            launcher,
            follower,
            interrupted,
        )
        interrupted.send_signal(signal.SIGINT)
        interrupted_code = interrupted.wait(timeout=120)
        running_after_ctrl_c = launcher.poll() is None and bool(launch_processes(head_log.parent))
        stop = subprocess.run(trainer("stop", inventory, "--run-name", RUN), capture_output=True, text=True)
        launcher_code = launcher.wait(timeout=180)
        follower_code = follower.wait(timeout=180)
        followed.thread.join(timeout=10)
        return SimpleNamespace(
            inventory=inventory,
            run_dir=run_dir,
            last_lines=last_lines,
            logged_before=logged_before,
            followed=followed.lines,
            follower_code=follower_code,
            follower_err=follower.stderr.read(),
            interrupted_code=interrupted_code,
            interrupted_err=interrupted.stderr.read(),
            running_after_ctrl_c=running_after_ctrl_c,
            stop=stop,
            launcher_code=launcher_code,
            launcher_out=ANSI.sub("", launcher_out.read_text()),
        )
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if launch_processes(head_log.parent) or launch_processes(run_dir / "launch" / "node-1"):
            subprocess.run(trainer("stop", inventory, "--run-name", RUN), capture_output=True, timeout=300)


def test_stop_ends_the_run_on_every_node_and_its_launcher_says_it_was_stopped(stopped_run):
    stop = stopped_run.stop
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "[node0] node 0: stopped" in stop.stdout and "[node1] node 1: stopped" in stop.stdout, stop.stdout
    launch_dir = stopped_run.run_dir / "launch"
    assert launch_processes(launch_dir / "node-0") == [] and launch_processes(launch_dir / "node-1") == []
    out = stopped_run.launcher_out
    assert stopped_run.launcher_code == exitcodes.INTERRUPTED, out[-3000:]
    assert f"run {RUN} was stopped on node0, node1 from outside this launcher (trainer stop)" in out, out[
        -3000:
    ]
    assert "failed" not in out.split("Launching run", 1)[1], "a stop is not reported as a failure"
    assert not (launch_dir / "lock").exists(), "the launcher released the run's lock as it ended"
    history = [json.loads(line) for line in (launch_dir / "history.jsonl").read_text().splitlines()]
    assert history[-1]["why"] == "stop_command" and history[-1]["detail"].startswith("trainer stop by ")


def test_logs_prints_each_nodes_last_lines_with_its_host_in_front(stopped_run):
    shown = stopped_run.last_lines
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    head = [line.removeprefix("[node0] ") for line in lines if line.startswith("[node0] ")]
    assert len(head) == 4 and head_steps(head), lines
    # The head's lines are its log's (the log has grown since, so they are in it, in order).
    logged = stopped_run.logged_before
    assert logged[logged.index(head[0]) : logged.index(head[0]) + 4] == head
    assert any(line.startswith("[node1] [clustertrain] ") and "--node-rank=1" in line for line in lines), (
        lines
    )
    assert all(line.startswith(("[node0] ", "[node1] ")) for line in lines), lines


def test_logs_follow_prints_new_lines_as_they_come_and_returns_when_the_run_ends(stopped_run):
    followed = stopped_run.followed
    assert stopped_run.follower_code == 0, stopped_run.follower_err
    steps = head_steps(followed)
    assert max(steps) > max(head_steps(stopped_run.logged_before)), followed[-5:]
    assert steps == list(range(steps[0], steps[-1] + 1, 2)), "every step line (log_every 2), none missed"
    assert not any(line.startswith("[node") for line in followed), "one node: its lines as they are"
    assert "node 0: stopped (exit code" in stopped_run.follower_err, stopped_run.follower_err


def test_ctrl_c_ends_logs_follow_with_130_and_leaves_the_run_running(stopped_run):
    assert stopped_run.interrupted_code == exitcodes.INTERRUPTED, stopped_run.interrupted_err
    assert f"stopped following run {RUN}; it goes on" in stopped_run.interrupted_err
    assert stopped_run.running_after_ctrl_c, "the launcher and the head's trainer still ran after the Ctrl-C"


def test_the_live_view_shows_tokens_per_second_and_an_eta_in_the_step_line(stopped_run):
    shown = re.findall(r"running (step \d+/5000 · [\d,]+ tok/s · ETA \d+[smhd]\S*)", stopped_run.launcher_out)
    assert shown, stopped_run.launcher_out[-3000:]


def test_a_run_or_node_that_does_not_exist_is_refused_naming_those_that_do(stopped_run):
    inventory = stopped_run.inventory
    for verb in ("logs", "stop", "status"):
        wrong = subprocess.run(trainer(verb, inventory, "--run-name", "nope"), capture_output=True, text=True)
        assert wrong.returncode == exitcodes.CONFIG_ERROR, wrong.stdout + wrong.stderr
        assert "run nope has no launch on node0" in wrong.stderr, wrong.stderr
        assert f"runs launched there: {RUN} (--run-name NAME)" in wrong.stderr, wrong.stderr
    node = subprocess.run(
        trainer("logs", inventory, "--run-name", RUN, "--node", "7"), capture_output=True, text=True
    )
    assert node.returncode == exitcodes.CONFIG_ERROR, node.stdout + node.stderr
    assert "has no node '7': give --node one of its node ranks or hosts: 0 (node0), 1 (node1)" in node.stderr
