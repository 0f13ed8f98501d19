"""A hang's culprit named by its process state, for real on two loopback "hosts" (issue 39): a rank of
the bundled trainer stopped with SIGSTOP mid-run, and a user's command blocked in the kernel on a FUSE
mount that never answers (state D; needs root). The launcher names the host and the rank with its
state within about the stall bound, stops every process, and exits with HUNG (71). A user's own
torchrun all-reduce loop whose rank 1 sleeps outside the collective, and one whose rank 1 calls
all_gather where its peers all_reduce, are named by the ranks' Python stacks (py-spy, the train
extra), within a minute of the hang's start. And the other side: a healthy run of the bundled trainer
whose step takes 90 s of computing, past the default bound's minute, with checkpoint saves, is not
called a hang."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.loopback import VENV, write_inventory
from helpers.loopback_launch import TINY, launch_command, launch_processes, run_env, trainer_pids
from helpers.loopback_launch import loopback_cluster as _loopback_cluster  # noqa: F401 - the fixture, by its name

from trainer import exitcodes

STALL_S = 20
HANG_SCRIPT = Path(__file__).resolve().parents[1] / "data" / "hang_user" / "allreduce_loop.py"
DIVERGED_SCRIPT = HANG_SCRIPT.with_name("diverged_loop.py")
QUIET_SCRIPT = HANG_SCRIPT.with_name("quiet_loop.py")


@pytest.fixture
def loopback(request) -> tuple[Path, Path]:
    return request.getfixturevalue("_loopback_cluster")


def step_of(node_dir: Path, rank: int) -> int:
    try:
        return int(json.loads((node_dir / "progress" / f"rank-{rank}.json").read_text()).get("started") or 0)
    except (OSError, ValueError):
        return 0


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if proc.poll() is not None:
            raise AssertionError(
                f"the launcher ended ({proc.returncode}) before {what}: {proc.stdout.read()}"
            )
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)
    return value


def test_a_stopped_rank_is_named_with_its_state_and_everything_is_stopped(loopback, tmp_path):
    inventory, shared = loopback
    run = shared / "runs" / "sigstop"
    command = launch_command(
        inventory,
        "--run-name",
        "sigstop",
        "--stall-timeout",
        str(STALL_S),
        "--set",
        "train.max_steps=400",
        *TINY,
    )
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env(tmp_path)
    )
    try:
        node1 = run / "launch" / "node-1"
        wait_for(lambda: step_of(node1, 1) >= 4, "rank 1 in step 4", launcher)
        victims = wait_for(lambda: trainer_pids(node1), "node1's trainer", launcher)
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    took = time.monotonic() - stopped_at
    print(f"SIGSTOP of rank 1 to the launcher's end (culprit named, every node stopped): {took:.0f} s")
    assert launcher.returncode == exitcodes.HUNG, out
    assert (
        "hung: stopped (SIGSTOP or another stop signal) — state T (rank 1 on node1 (node 1), exit code 71)"
        in out
    )
    assert "then: rank 0 on node0 (node 0): waiting in its collective" in out, out
    # Named from the states read before the stop (its stacks and TERM), and before the report.
    named = out.index("culprit: stopped (SIGSTOP or another stop signal) — state T (rank 1 on node1")
    assert named < out.index("hung: stopped (SIGSTOP"), out
    # The stop's history record names that cause (it said `stall` while the states came with the stop).
    history = [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]
    stop = [r for r in history if r.get("event") == "stopped"][-1]
    assert (stop["why"], stop["hosts"], stop["exit_code"]) == ("hung", ["node1"], exitcodes.HUNG), stop
    assert (stop["cause"]["host"], stop["cause"]["rank"]) == ("node1", 1), stop
    assert stop["cause"]["message"].startswith("stopped (SIGSTOP or another stop signal) — state T"), stop
    assert took < STALL_S + 120, f"named and stopped {took:.0f} s after the SIGSTOP (bound {STALL_S} s)"
    for node in (0, 1):
        assert launch_processes(run / "launch" / f"node-{node}") == [], "every process of the launch is gone"
    assert all(not Path(f"/proc/{pid}").exists() for pid in victims), "the stopped rank too"


def test_a_rank_stuck_inside_its_step_is_named_by_the_flight_recorder(loopback, tmp_path):
    """Rank 1 of the bundled trainer sleeps once it started step 5, before the step's collectives (a
    data loader that never answers): every rank's record says step 5, so no rank is behind by its step.
    torch's flight recorder (run.sh sets TORCH_FR_BUFFER_SIZE; each rank reports its last collective)
    tells: rank 0 waits in all_reduce #N, rank 1's last was #N-1 and ended. Named with its state."""
    inventory, shared = loopback
    started = time.monotonic()
    done = subprocess.run(
        launch_command(
            inventory,
            "--run-name",
            "stuck-in-step",
            "--stall-timeout",
            str(STALL_S),
            "--env",
            "TRAINER_TEST_STALL_IN=1:5:3600",
            "--set",
            "train.max_steps=400",
            *TINY,
        ),
        capture_output=True,
        text=True,
        timeout=400,
        env=run_env(tmp_path),
    )
    out = done.stdout + done.stderr
    print(f"launch to the culprit named and every node stopped: {time.monotonic() - started:.0f} s")
    assert done.returncode == exitcodes.HUNG, out
    assert "no rank advanced for" in out and "every rank is in step 5" in out, out
    named = re.search(
        r"culprit: not in the collective its peers wait in \((\w+) #(\d+)\): its last collective: "
        r"(\w+) #(\d+), ended — sleeping — state S.*\(rank 1 on node1 \(node 1\), exit code 71\)",
        out,
    )
    assert named, out
    print(named.group(0))
    waited_op, waited, last_op, last = named.groups()
    assert int(last) == int(waited) - 1 and waited_op == last_op == "all_reduce", named.group(0)
    assert f"rank 0 on node0 (node 0): waiting in all_reduce #{waited} (sleeping — state S" in out, out
    run = shared / "runs" / "stuck-in-step"
    stop = [r for r in history(run) if r.get("event") == "stopped"][-1]
    assert (stop["why"], stop["hosts"], stop["cause"]["rank"]) == ("hung", ["node1"], 1), stop
    for node in (0, 1):
        assert launch_processes(run / "launch" / f"node-{node}") == [], "every process of the launch is gone"
    launch_id = (run / "launch" / "node-0" / "launch-id").read_text().strip()
    assert (run / "launch" / "flight-recorder" / launch_id).is_dir(), "NCCL's dumps would land there"


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]


def test_a_command_blocked_on_a_hung_mount_names_the_node_and_the_file(loopback, tmp_path):
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount made without fusermount needs root and /dev/fuse")
    from helpers.hung_mount import hung_mount

    inventory, shared = loopback
    shared.mkdir()  # the command's working dir (training_workdir's default)
    mount = tmp_path / "nfs"
    mount.mkdir()
    script = (
        'echo "node $NODE_RANK ready"; '
        # Node 1's last line comes from its python, once started (a start-up slowed by a loaded machine
        # is not counted in the stall): then it opens the file at once.
        f'if [ "$NODE_RANK" = 1 ]; then exec {sys.executable} -c '
        f"\"print('opening', flush=True); open('{mount}/shard-1.bin').read()\"; "
        "else exec sleep 600; fi"
    )
    with hung_mount(str(mount)):
        done = subprocess.run(
            [
                *launch_command(inventory, "--run-name", "dstate", "--stall-timeout", "10"),
                "--",
                "bash",
                "-c",
                script,
            ],
            capture_output=True,
            text=True,
            timeout=400,
            env=run_env(tmp_path),
        )
    out = done.stdout + done.stderr
    assert done.returncode == exitcodes.HUNG, out
    assert "in uninterruptible sleep — state D in fuse_" in out, out
    assert f", blocked in openat on {mount}/shard-1.bin (node1 (node 1), exit code 71)" in out, out
    # The process by its command's name: the python that runs the tests (python or python3).
    python = Path(sys.executable).name
    assert f"hung: {python} (pid " in out and "(node1 (node 1), exit code 71)" in out, out
    assert "then: node0 (node 0): sleep (pid " in out, "the other node's process, its consequence"
    assert out.index(f"culprit: {python} (pid ") < out.index(f"hung: {python} (pid "), out
    history = (shared / "runs" / "dstate" / "launch" / "history.jsonl").read_text().splitlines()
    stop = [r for r in map(json.loads, history) if r.get("event") == "stopped"][-1]
    assert (stop["why"], stop["hosts"], stop["cause"]["host"]) == ("hung", ["node1"], "node1"), stop
    assert f"blocked in openat on {mount}/shard-1.bin" in stop["cause"]["message"], stop
    for node in (0, 1):
        assert launch_processes(shared / "runs" / "dstate" / "launch" / f"node-{node}") == []


def user_hang(
    tmp_path: Path,
    script: Path,
    run_name: str,
    stall: tuple[str, ...] = ("--stall-timeout", str(STALL_S)),
    named_within: float = 60,
    **settings,
) -> tuple[list[str], dict]:
    """`trainer launch --stall-timeout 20 -- torchrun SCRIPT` (`stall`: those options) on two loopback
    nodes (`settings` over the inventory's), to its end: the launcher's lines and its last `stopped`
    record. It must have exited HUNG (71), named a culprit within `named_within` seconds of the hang's
    start (the time the script wrote into HANG_MARK), and left no process of the launch on either node."""
    if shutil.which("py-spy", path=str(VENV / "bin")) is None:
        pytest.fail("py-spy is not in the test venv: make install-train installs the train extra with it")
    workdir = tmp_path / "code"
    workdir.mkdir()
    shutil.copy(script, workdir)
    mark = workdir / "hang-mark"
    inventory, shared = write_inventory(tmp_path, training_workdir=str(workdir), **settings)
    command = [
        *launch_command(inventory, "--run-name", run_name, *stall),
        *("--env", f"HANG_MARK={mark}", "--", "torchrun", script.name),
    ]
    started = time.monotonic()
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=run_env(tmp_path)
    )
    lines, named_at = [], None
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # the culprit's line timed as it arrives
            lines.append(line)
            if named_at is None and line.startswith("culprit: "):
                named_at = time.time()
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(lines)
    print(out, f"launch to end {time.monotonic() - started:.0f} s", sep="\n")
    assert launcher.returncode == exitcodes.HUNG, out
    assert named_at is not None, out
    named_after = named_at - float(mark.read_text())
    print(f"hang's start to the culprit named: {named_after:.1f} s ({' '.join(stall) or 'no bound given'})")
    assert named_after < named_within, f"named {named_after:.0f} s after the hang began: {out}"
    run = shared / "runs" / run_name
    for node in (0, 1):
        assert launch_processes(run / "launch" / f"node-{node}") == []
    history = (run / "launch" / "history.jsonl").read_text().splitlines()
    return lines, [r for r in map(json.loads, history) if r.get("event") == "stopped"][-1]


def test_a_user_command_rank_sleeping_outside_its_collective_is_named_by_its_stack(tmp_path):
    """`trainer launch -- torchrun allreduce_loop.py` on two loopback nodes, one rank each: rank 1
    sleeps at step 5 while rank 0 waits in all_reduce. With --stall-timeout 20 the launcher finds the
    silence, reads each rank's state and Python stack (py-spy) and names rank 1 on node1 with its top
    frame, the sleep, within 60 s of the hang's start; it stops every process and exits HUNG (71)."""
    lines, stop = user_hang(tmp_path, HANG_SCRIPT, "usersleep")
    out = "".join(lines)
    sleep_frame = "hang (allreduce_loop.py:20: time.sleep(3600))"
    culprit = next(line for line in lines if line.startswith("culprit: "))
    assert culprit.startswith(
        f"culprit: not in the collective its peers wait in (all_reduce): at {sleep_frame} ← main "
    ), culprit
    assert "(rank 1 on node1 (node 1), exit code 71)" in culprit, culprit
    assert "then: rank 0 on node0 (node 0): waiting in all_reduce, called at main (allreduce_loop.py:" in out
    assert f"stack of rank 1 on node1 (node 1) (py-spy, innermost first):\n  {sleep_frame}" in out, out
    assert (stop["why"], stop["hosts"], stop["exit_code"]) == ("hung", ["node1"], exitcodes.HUNG), stop
    assert (stop["cause"]["host"], stop["cause"]["rank"]) == ("node1", 1), stop
    assert sleep_frame in stop["cause"]["message"], stop


def test_a_user_command_rank_in_another_collective_is_named_by_its_stack(tmp_path):
    """`trainer launch -- torchrun diverged_loop.py` on two loopback nodes, two ranks each: at step 5
    rank 1 calls all_gather while ranks 0, 2 and 3 call all_reduce, and every rank waits for ever
    (gloo). Every stack is in a collective, so no rank is outside one: the launcher names rank 1 as
    the one in another collective than its peers (all_gather against all_reduce, each with its line),
    within 60 s of the hang's start, stops every process and exits HUNG (71)."""
    lines, stop = user_hang(tmp_path, DIVERGED_SCRIPT, "diverged", training_procs_per_node=2)
    out = "".join(lines)
    culprit = next(line for line in lines if line.startswith("culprit: "))
    gather = "all_gather, called at main (diverged_loop.py:22: dist.all_gather("
    reduce = "all_reduce, called at main (diverged_loop.py:24: dist.all_reduce(total))"
    assert culprit.startswith(f"culprit: in another collective than its peers: {gather}"), culprit
    assert f"while they wait in {reduce} — sleeping" in culprit, culprit
    assert "(rank 1 on node0 (node 0), exit code 71)" in culprit, culprit
    for rank, node in ((0, 0), (2, 1), (3, 1)):
        assert f"then: rank {rank} on node{node} (node {node}): waiting in {reduce}" in out, out
    assert (stop["why"], stop["cause"]["host"], stop["cause"]["rank"]) == ("hung", "node0", 1), stop


def test_a_step_computed_for_90_s_with_checkpoint_saves_is_not_called_a_hang(loopback, tmp_path):
    """The bundled trainer on two loopback nodes with the default watchdog (no --stall-timeout: the
    bound adapts, 4 x the slowest step and at least 60 s): rank 1 computes for 90 s before step 6
    (TRAINER_TEST_COMPUTE, a busy loop on its training thread) while rank 0 waits in its collective,
    and a checkpoint is saved every 3 steps. The launcher sees rank 1 computing past the minute, says
    it is a slow step, not a hang, and the run ends with every step done (exit 0)."""
    inventory, shared = loopback
    command = launch_command(
        inventory,
        "--run-name",
        "slowstep",
        "--env",
        "TRAINER_TEST_COMPUTE=1:6:90",
        "--set",
        "train.max_steps=9",
        *TINY,
    )
    run = subprocess.run(
        command, capture_output=True, text=True, env=run_env(tmp_path), timeout=600, check=False
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    said = [line for line in out.splitlines() if "a slow step, not a hang" in line]
    assert len(said) == 1 and "rank 1 on node1 computing its step" in said[0], out
    assert "stalled" not in out and "culprit" not in out, out
    assert "done: step 9" in (shared / "runs" / "slowstep" / "launch" / "node-0" / "log").read_text()
    assert (shared / "runs" / "slowstep" / "checkpoints" / "step-9").is_dir()


def test_a_user_commands_quiet_is_checked_with_no_bound_given_its_own_wait_is_not_named_and_a_hang_is(
    tmp_path,
):
    """`trainer launch -- torchrun quiet_loop.py` on two loopback nodes with the default watchdog (no
    --stall-timeout): at step 5 both ranks sleep 70 s on purpose, printing nothing and using no CPU.
    After a minute of quiet the launcher reads each rank's state and stack, finds no culprit (no rank
    waits in a collective for another) and follows on; the steps go on. At step 15 rank 1 sleeps for
    good outside the collective rank 0 waits in: a minute later it is named by its stack, every
    process is stopped, exit 71."""
    lines, stop = user_hang(tmp_path, QUIET_SCRIPT, "quiet", stall=(), named_within=120)
    out = "".join(lines)
    quiet = [
        i for i, line in enumerate(lines) if line.startswith("quiet: no node printed a line and no rank")
    ]
    dismissed = [i for i, line in enumerate(lines) if line.startswith("no culprit: ")]
    assert len(quiet) == 2 and len(dismissed) == 1 and quiet[0] < dismissed[0] < quiet[1], out
    assert any(line.startswith("rank 0 step 6:") for line in lines[dismissed[0] :]), (
        "followed on after the wait"
    )
    sleep_frame = "main (quiet_loop.py:26: time.sleep(3600))"
    culprit = next(line for line in lines if line.startswith("culprit: "))
    assert culprit.startswith(
        f"culprit: not in the collective its peers wait in (all_reduce): at {sleep_frame}"
    )
    assert "(rank 1 on node1 (node 1), exit code 71)" in culprit, culprit
    assert (stop["why"], stop["cause"]["host"], stop["cause"]["rank"]) == ("hung", "node1", 1), stop
