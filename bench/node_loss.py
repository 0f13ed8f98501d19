"""Node loss: a whole node of the test bed killed mid-run, as a spot reclaim takes a machine.

On the live Molecule test bed (ct-head, ct-worker1, ct-worker2; 1 process each), one run of
`trainer launch --max-restarts 2 --exclude-failed` of the bundled trainer (ddp; `--engine deepspeed`:
DeepSpeed ZeRO-2) with a checkpoint every --save-steps steps and every step logged. Once rank 0's
step --kill-at is on the launcher's screen, ct-worker2's container is killed (`podman kill`: every
process on it gone at once). Printed, from the launcher's output (rank 0's `step N/M` lines, its
`resumed from ... at step N` line, the launcher's `Launching run ... on N node(s)` line of each
attempt), in one run:

- seconds from the kill to the launcher naming ct-worker2 unreachable or lost, to its next attempt's
  start, and to the first step logged by the survivors' resumed run (the number that matters);
- the step at the kill (the last step rank 0 logged before its run broke: the last step line before
  the next attempt; the screen may lag behind it when steps are fast), the checkpoint the survivors
  resumed from, and the steps of work lost between;
- whether the run finished (every step done, the launcher's exit code 0) and the launcher's exit code.

Then ct-worker2's container is started again and waited on until it is a usable node
(tests/helpers/testbed_nodes.py: systemd, sshd, the shared dir, ufw, chrony), with the seconds each took.

With --back-after S the container is started again S seconds after the kill while the survivors train
(a spot node back): the launcher probes it and grows the run back to 3 nodes at its next checkpoint.
Printed besides: when the node answered again, when the launcher said it grows back, its first step
on 3 nodes, the nodes of the last attempt, and the run's goodput: the time of the steps the finished
run is made of (each step's `step_time` on rank 0's line, a step redone after a restart counted once,
at its last run) over the wall time, from the launch and from its first step.
A launcher that gives up on the lost node (no step after the kill) is reported as such: the bench
prints what the launcher said after the kill and exits 1. Exit 0 only when the survivors resumed and
the run finished.

The nodes train with the trainer installed by the bed's last converge, not this checkout's: converge
again after changing trainer/node (`scripts/testbed/molecule.sh converge -s default`).

Run (the bed up: scripts/testbed/molecule.sh converge, verify; nothing else training on it, since
the kill takes ct-worker2 from every run there):
    .venv/bin/python bench/node_loss.py [--kill-at 47] [--max-steps 100] [--save-steps 10]
                                        [--engine deepspeed] [--back-after 60] [--log FILE] [--keep-run]
The issue's goodput case (issue 39), with steps of about half a second so that the run outlasts the
comeback: --max-steps 300 --kill-at 100 --back-after 60 --set model.n_layer=4 --set model.n_embd=256.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))
from helpers.testbed_nodes import (  # noqa: E402 - the bed tests' helpers: one way to kill and restore a node
    LauncherOutput,
    Line,
    cluster_settings,
    kill_node,
    restore_node,
    running,
)
from launch import STATUS, make_inventory, testbed_up  # noqa: E402 - the sibling benchmark

VICTIM = "ct-worker2"
#: The bed's master port for this bench (bench/launch.py 29531, bench/scaling.py 29533-4, tests 2954x).
MASTER_PORT = 29535
STEP = re.compile(r"^step (\d+)/(\d+)\b")
ATTEMPT = re.compile(r"^Launching run \S+ on (\d+) node\(s\)")
#: The launcher's line that says why and how it starts again (shown as is; the numbers come from rank 0).
RESTART = re.compile(r"^restart \d+ of \d+:|; (resuming|starting|relaunching) ")
RESUMED = re.compile(r"^resumed from \S+ at step (\d+)")
STEP_TIME = re.compile(r"\bstep_time (\d+)ms\b")
#: The launcher growing the run back once the node passes its probe (launcher/rejoin.py).
GROWN = re.compile(rf"^{VICTIM} is back: growing to (\d+) nodes from (step-\d+)")
#: The launcher naming the victim unreachable (its state line) or lost (the failure, the restart line).
LOST = re.compile(rf"{VICTIM}\b.*(unreachable|\blost\b)")
#: Past this, a run that has not ended is stopped (TERM: the launcher stops its nodes itself).
RUN_TIMEOUT_S = 3600.0


def steps(output: LauncherOutput, since: int = 0) -> list[tuple[int, int, Line]]:
    """Rank 0's step lines from index `since` on: (index, step, line)."""
    found = []
    for index, line in enumerate(output.lines[since:], start=since):
        match = STEP.match(line.text)
        if match:
            found.append((index, int(match.group(1)), line))
    return found


def wait_for_step(output: LauncherOutput, step: int, timeout: float) -> tuple[int, int, Line] | None:
    """The first step line at or past `step`, or None when the run ended or `timeout` passed first."""
    deadline = time.monotonic() + timeout
    since = 0
    while (left := deadline - time.monotonic()) > 0:
        found = output.wait_for(STEP.pattern, left, since=since)
        if found is None:
            return None
        index, line = found
        number = int(STEP.match(line.text).group(1))
        if number >= step:
            return index, number, line
        since = index + 1
    return None


def launch_command(args: argparse.Namespace, inventory: Path, run_name: str) -> list[str]:
    sets = [
        f"train.max_steps={args.max_steps}",
        f"checkpoint.save_steps={args.save_steps}",
        "train.log_every=1",
    ]
    if args.engine == "deepspeed":
        sets.append("distributed.zero_stage=2")
    sets += args.set
    return [
        sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name,
        "--engine", args.engine, "--max-restarts", "2", "--exclude-failed",
        *[arg for item in sets for arg in ("--set", item)],
    ]  # fmt: skip


@dataclass
class Killed:
    """The kill's moment (time.monotonic()), its line index in the output, the step then on the screen;
    the launcher's exit code and when it ended."""

    at: float
    index: int
    step_shown: int
    code: int | None = None
    ended_at: float = 0.0
    back: dict[str, float] | None = None
    """With --back-after: the restore's seconds per part (restore_node), and `started`, `usable`: its
    start and end in seconds from the kill."""


def run_and_kill(
    args: argparse.Namespace, inventory: Path, run_dir: Path
) -> tuple[LauncherOutput, Killed | None]:
    """One launch, ct-worker2 killed at --kill-at, followed to its end; the container restored and the
    run's dir removed (unless --keep-run) whatever happens."""
    output = LauncherOutput.start(launch_command(args, inventory, run_dir.name))
    killed = None
    try:
        at_kill = wait_for_step(output, args.kill_at, timeout=RUN_TIMEOUT_S)
        if at_kill is None:
            output.finish(timeout=120)
            return output, None
        index, shown = len(output.lines), steps(output)[-1][1]
        killed = Killed(kill_node(VICTIM), index, shown)
        comeback = None
        if args.back_after is not None:
            comeback = threading.Thread(target=bring_back, args=(killed, args.back_after), daemon=True)
            comeback.start()
        killed.code = output.finish(timeout=RUN_TIMEOUT_S)
        killed.ended_at = time.monotonic()
        if comeback is not None:
            comeback.join(timeout=600)
        return output, killed
    finally:
        if output.proc.poll() is None:  # an error here: the launcher stops its nodes on TERM
            output.finish(timeout=0)
        if not running(VICTIM):
            print(
                f"{VICTIM} restored: "
                + ", ".join(f"{what} {s:.1f} s" for what, s in restore_node(VICTIM).items())
            )
        if args.log:
            zero = killed.at if killed is not None else output.lines[0].at if output.lines else 0.0
            Path(args.log).write_text(
                "".join(f"{line.at - zero:8.1f} {line.text}\n" for line in output.lines)
                + f"# exit {output.proc.returncode}; times are seconds from the kill\n"
            )
        if not args.keep_run:
            shutil.rmtree(run_dir, ignore_errors=True)


def bring_back(killed: Killed, after: float) -> None:
    """Start the victim's container again `after` seconds after the kill, while the run goes on."""
    time.sleep(max(0.0, killed.at + after - time.monotonic()))
    began = time.monotonic()
    parts = restore_node(VICTIM)
    killed.back = {**parts, "started": began - killed.at, "usable": time.monotonic() - killed.at}


def goodput(output: LauncherOutput, launched: float, ended: float) -> tuple[float, float, float] | None:
    """(useful seconds, goodput from the launch, goodput from the first step): the step time of every
    step the finished run is made of, each at its last run (a step redone after a restart replaces the
    one lost), over the wall time. None where no step line carried its time."""
    last_run: dict[int, float] = {}
    first_at = None
    for line in output.lines:
        step, took = STEP.match(line.text), STEP_TIME.search(line.text)
        if step and took:
            last_run[int(step.group(1))] = int(took.group(1)) / 1000
            first_at = line.at if first_at is None else first_at
    if not last_run or first_at is None:
        return None
    useful = sum(last_run.values())
    return useful, useful / (ended - launched), useful / (ended - first_at)


def report_comeback(output: LauncherOutput, killed: Killed) -> bool:
    """With --back-after: when the node was back, when the run grew back and its first step on 3 nodes,
    and whether the last attempt ran on 3 nodes."""
    after = output.lines[killed.index :]
    back = killed.back or {}
    if back:
        print(
            f"node back             : started {back['started']:.1f} s after the kill, usable at "
            f"{back['usable']:.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in back.items() if k not in ("started", "usable"))
            + ")"
        )
    else:
        print("node back             : not restored before the run ended")
    grown_index = next((i for i, line in enumerate(after) if GROWN.match(line.text)), None)
    if grown_index is None:
        print("grew back             : never (the run went on without it)")
    else:
        grown = after[grown_index]
        print(f"grew back             : {grown.at - killed.at:7.1f} s after the kill: {grown.text}")
        first = next((line for line in after[grown_index:] if STEP.match(line.text)), None)
        if first is not None:
            print(
                f"first step on 3 nodes : {first.at - killed.at:7.1f} s after the kill"
                + (f", {first.at - (killed.at + back['usable']):.1f} s after it was usable" if back else "")
            )
    attempts = [int(match.group(1)) for line in output.lines if (match := ATTEMPT.match(line.text))]
    last_nodes = attempts[-1] if attempts else 0
    print(f"last attempt          : on {last_nodes} nodes")
    return grown_index is not None and last_nodes == 3


def report(args: argparse.Namespace, output: LauncherOutput, killed: Killed, started: float) -> int:
    """Print the numbers; 0 when the survivors resumed and the run finished, else 1 (and why)."""
    after = output.lines[killed.index :]
    lost_seen = next((line for line in after if LOST.search(line.text)), None)
    attempt_index = next((killed.index + i for i, line in enumerate(after) if ATTEMPT.match(line.text)), None)
    attempt = output.lines[attempt_index] if attempt_index is not None else None
    resumed_steps = steps(output, attempt_index) if attempt_index is not None else []
    # No step can end on the survivors once a peer is gone: the last one logged before the next attempt
    # (some shown after the kill: the screen lags a poll behind rank 0's log) is the step at the kill.
    before = [step for index, step, _ in steps(output) if attempt_index is None or index < attempt_index]
    at_kill = before[-1] if before else killed.step_shown
    first_resumed = resumed_steps[0] if resumed_steps else None
    resumed_from = None
    if attempt_index is not None:
        matches = (RESUMED.match(line.text) for line in output.lines[attempt_index:])
        resumed_line = next((match for match in matches if match), None)
        resumed_from = int(resumed_line.group(1)) if resumed_line else None
    if resumed_from is None and first_resumed is not None:
        resumed_from = first_resumed[1] - 1  # every step is logged: the one before is the checkpoint's
    logged = steps(output)
    last_step = logged[-1][1] if logged else None
    finished = killed.code == 0 and last_step == args.max_steps

    def since_kill(line: Line | None) -> str:
        return f"{line.at - killed.at:7.1f} s after the kill" if line is not None else "  never"

    nodes = f" (on {ATTEMPT.match(attempt.text).group(1)} nodes)" if attempt is not None else ""
    print(
        f"\nstep at the kill      : {at_kill} (rank 0's last logged step; {killed.step_shown} on the screen)"
    )
    print(f"launcher saw it lost  : {since_kill(lost_seen)}")
    print(f"next attempt started  : {since_kill(attempt)}{nodes}")
    restart = next((line for line in after if RESTART.search(line.text)), None)
    print(f"  its restart line    : {restart.text if restart is not None else '-'}")
    print(
        f"first resumed step    : {since_kill(first_resumed[2] if first_resumed else None)}"
        + (f" (step {first_resumed[1]})" if first_resumed else "")
    )
    if resumed_from is not None:
        print(f"resumed from          : step {resumed_from}; steps of work lost: {at_kill - resumed_from}")
    else:
        print("resumed from          : - (no resumed run)")
    print(f"run finished          : {'yes' if finished else 'no'} (last step {last_step}/{args.max_steps})")
    print(
        f"launcher exit code    : {killed.code}, {killed.ended_at - killed.at:.1f} s after the kill, "
        f"{killed.ended_at - started:.1f} s in all"
    )
    came_back = report_comeback(output, killed) if args.back_after is not None else True
    measured = goodput(output, started, killed.ended_at)
    if measured is not None:
        useful, from_launch, from_first_step = measured
        print(
            f"goodput               : {from_launch:.1%} from the launch, {from_first_step:.1%} from the "
            f"first step ({useful:.1f} s of the finished run's steps in {killed.ended_at - started:.1f} s)"
        )
    if first_resumed is not None and finished and came_back:
        return 0
    why = (
        "the survivors never logged a step after the kill"
        if first_resumed is None
        else "the run did not finish"
        if not finished
        else f"{VICTIM} came back but the run did not end on 3 nodes"
    )
    print(f"\nFAILED: {why}. What the launcher said after the kill (step lines left out):")
    print("\n".join(f"  {line.text}" for line in after if not STEP.match(line.text))[:6000])
    return 1


def measure(args: argparse.Namespace, workdir: Path) -> int:
    inventory, _ = make_inventory(workdir, loopback=False, hosts=3, port=MASTER_PORT)
    settings = cluster_settings(inventory)
    run_dir = Path(settings["cluster_shared_dir"]) / "runs" / f"bench-node-loss-{os.getpid()}"
    zero = " ZeRO-2" if args.engine == "deepspeed" else ""
    back = f", started again {args.back_after:g} s later" if args.back_after is not None else ""
    print(
        f"node loss on the test bed: 3 nodes x 1 process, {args.engine}{zero}, {args.max_steps} steps, a "
        f"checkpoint every {args.save_steps}; {VICTIM}'s container killed at step {args.kill_at}{back}",
        flush=True,
    )
    started = time.monotonic()
    output, killed = run_and_kill(args, inventory, run_dir)
    if killed is None:
        print(
            f"\nno step {args.kill_at} before the run ended (exit {output.proc.returncode}); nothing killed:"
        )
        print("\n".join(line.text for line in output.lines[-30:]))
        return 1
    return report(args, output, killed, started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-at", type=int, default=47, help="kill at this step of rank 0 (default: 47)")
    parser.add_argument("--max-steps", type=int, default=100, help="train.max_steps (default: 100)")
    parser.add_argument("--save-steps", type=int, default=10, help="checkpoint.save_steps (default: 10)")
    parser.add_argument("--engine", choices=("ddp", "deepspeed"), default="ddp", help="deepspeed: ZeRO-2")
    parser.add_argument(
        "--back-after", type=float, help="start the killed node again this many seconds after the kill"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a trainer setting, as trainer launch --set (a larger model: steps that last past the comeback)",
    )  # fmt: skip
    parser.add_argument("--log", help="write the launcher's output here, with seconds from the kill")
    parser.add_argument("--keep-run", action="store_true", help="keep the run's dir on the shared dir")
    args = parser.parse_args()
    if args.kill_at >= args.max_steps:
        parser.error("--kill-at must come before --max-steps")
    if not testbed_up():
        print(f"the test bed is not up ({STATUS}): scripts/testbed/molecule.sh converge, verify")
        return 2
    if not running(VICTIM):
        print(f"{VICTIM} is not running; bringing it back first", flush=True)
        restore_node(VICTIM)
    with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as tmp:
        return measure(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
