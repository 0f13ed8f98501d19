"""A whole node lost mid-run, as users meet it, on three simulated nodes (scripts/testbed/netns_nodes.py:
a network namespace, an address and a real sshd each): every process of n02 killed at once and its
address gone with it (its link to the bridge down), as a spot reclaim or a power loss, while
`trainer launch --max-restarts 2 --exclude-failed` trains on three nodes, one process each (ddp). The
launcher must name the dead node as the cause (not the survivors whose collectives broke), leave it out
at once, resume on the two survivors from the latest complete checkpoint with the effective batch kept,
and finish; the final loss must equal, exactly, that of a run started on the survivors from the same
checkpoint with the same batch split. The node is brought back afterwards (its link up: its sshd, the one
process spared, answers again), and the next launch of the run uses it again.

This case ran on the Molecule bed (95 s of CI's critical path, most of it the container's restart and
its services' checks); what it shows is the launcher's and the trainer's, over SSH towards nodes that
train for real, which the simulated nodes have. The assertions are the bed's but the host names (n02
for ct-worker2). Its DeepSpeed ZeRO-2 case stays on the bed (tests/testbed/test_node_loss_testbed.py),
whose nodes have DeepSpeed's ops built by the node environment.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes
from helpers.testbed_nodes import LauncherOutput, own_like
from helpers.trainer_harness import finish, start_run

pytestmark = NEEDS_NETNS
VICTIM = 2
SETS = (
    "train.max_steps=40",
    "train.warmup_steps=1",
    "train.log_every=1",
    "checkpoint.save_steps=5",
    # Every checkpoint kept: the one the restart resumed from is copied for the reference run.
    "checkpoint.save_total_limit=0",
    # A lost peer fails the survivors' collectives at once (its connections reset); this bounds the
    # case where they would wait instead.
    "distributed.timeout_s=120",
)


@pytest.fixture
def cluster(sim_workdir) -> Iterator:
    with netns_nodes.nodes(3, sim_workdir / "sim") as nodes:
        yield nodes


def inventory_for(cluster, tmp_path: Path, without: str = "") -> Path:
    """The simulated nodes' inventory with one process per node (ddp); without the host `without`."""
    inventory = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}"
    shutil.copytree(cluster.inventory, inventory)
    overrides = {"training_procs_per_node": 1, "training_engine": "ddp"}
    (inventory / "group_vars" / "cluster" / "zz_node_loss_test.yml").write_text(yaml.safe_dump(overrides))
    if without:
        hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
        for group in hosts["cluster"]["children"].values():
            (group.get("hosts") or {}).pop(without, None)
        (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    return inventory


def launch(inventory: Path, run_name: str, *extra: str, sets: tuple[str, ...] = SETS) -> list[str]:
    args = [arg for item in sets for arg in ("--set", item)]
    return [
        sys.executable,
        "-m",
        "trainer",
        "launch",
        "-i",
        str(inventory),
        "--run-name",
        run_name,
        *args,
        *extra,
    ]


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]


def alive(pid: str) -> bool:
    """Whether any thread of the process still runs: its sockets close when the last one exits (a
    zombie leader may wait for its other threads; a zombie has closed them)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except (OSError, IndexError):
            continue
    return False


@contextlib.contextmanager
def lost_node(cluster, node: int) -> Iterator[float]:
    """Kill every process of the node but its listening sshd, at once, and take its address off the
    network (its veth down), for the block (which gets the kill's time.monotonic()); bring the link
    back up afterwards, whatever the block did. The spared sshd is out of reach while the link is down,
    so the node is gone for the controller and its peers as a killed container is."""
    namespace, link = cluster.namespaces[node], f"cts{cluster.slot}v{node}"
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True)
    spared = set(cluster.sshd_pids())
    victims = [pid for pid in listed.stdout.split() if int(pid) not in spared]
    assert victims, "the node runs something to lose"
    try:
        subprocess.run(["kill", "-9", *victims], check=False)
        killed_at = time.monotonic()
        # As a killed container's: its processes' sockets close as they die (the peers' connections
        # reset), then the address goes. Taken down at once, the link dropped the resets, and the
        # survivors waited in their collective until the launcher stopped them.
        deadline = killed_at + 30
        while any(map(alive, victims)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)  # their resets on the wire
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        yield killed_at
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)


def test_a_killed_worker_node_is_left_out_and_the_survivors_finish_like_a_run_started_there(
    cluster, tmp_path
):
    victim = cluster.hosts[VICTIM]
    run_name = f"nodeloss-ddp-{uuid.uuid4().hex[:6]}"
    run = cluster.shared / "runs" / run_name
    launcher = LauncherOutput.start(
        launch(inventory_for(cluster, tmp_path), run_name, "--max-restarts", "2", "--exclude-failed")
    )
    try:
        assert launcher.wait_for(r"^step 1[2-9]/40", timeout=1500) is not None, launcher.text()[-4000:]
        with lost_node(cluster, VICTIM) as killed_at:
            code = launcher.finish(timeout=1500)
        out = launcher.text()
    finally:
        if launcher.proc.poll() is None:
            launcher.finish(timeout=1)
    assert code == 0, out
    # The dead node is the cause; the survivors' broken collectives are what followed.
    assert re.search(rf"^failed: {victim} \(node 2\) was lost at step \d+: ", out, re.MULTILINE), out
    assert f"its collective failed after {victim} was lost" in out, out
    assert f"[{victim}] node 2: lost (no answer since " in out, "shown as lost, never as running"
    restart = re.search(
        rf"restart 1 of 2: {victim} lost at step (\d+); resuming on 2 nodes from (step-\d+) "
        r"\((micro batch \d+ -> \d+, )?accumulation 1 -> \d+, effective batch (\d+) kept\)",
        out,
    )
    assert restart, out
    lost_at, resumed_from = int(restart.group(1)), restart.group(2)
    record = next(r for r in history(run) if r["event"] == "restart")
    assert record["lost"] == [victim] and victim not in record["nodes"], record
    split = (
        f"train.micro_batch_size={record['micro_batch_size']}",
        f"train.gradient_accumulation_steps={record['gradient_accumulation_steps']}",
    )
    assert record["micro_batch_size"] * record["gradient_accumulation_steps"] * 2 == int(restart.group(4))
    assert lost_at - int(resumed_from.removeprefix("step-")) <= 5, "at most one checkpoint interval lost"
    stopped = next(r for r in history(run) if r["event"] == "stopped")
    assert stopped["cause"]["kind"] == "lost" and stopped["cause"]["host"] == victim, stopped
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 40 and summary["world_size"] == 2, summary
    restarted = next(i for i, line in enumerate(launcher.lines) if line.text.startswith("restart 1 of 2:"))
    first = next(line for line in launcher.lines[restarted:] if re.match(r"^step \d+/40", line.text))
    waited = first.at - killed_at
    print(f"ddp: from the kill to the survivors' first step ({first.text.split()[1]}): {waited:.1f} s")

    # A run started on the two survivors from the same checkpoint, with the restart's batch split.
    reference = cluster.shared / "runs" / f"{run_name}-reference"
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / resumed_from, reference / "checkpoints" / resumed_from)
    (reference / "checkpoints" / "latest").write_text(resumed_from + "\n")
    own_like(reference, run)  # the training account's, as every run dir on the shared dir
    again = LauncherOutput.start(
        launch(inventory_for(cluster, tmp_path, without=victim), reference.name, sets=(*SETS, *split))
    )
    assert again.finish(timeout=1500) == 0, again.text()[-4000:]
    straight = json.loads((reference / "summary.json").read_text())
    assert straight["final_step"] == 40 and straight["resumed_from"], straight
    print(f"ddp: final loss {summary['final_loss']} vs {straight['final_loss']}")
    assert summary["final_loss"] == straight["final_loss"], "exactly, for ddp on the CPU"

    # n02 is back (lost_node brought its link up): the next launch of the run uses all three nodes.
    more = LauncherOutput.start(
        launch(inventory_for(cluster, tmp_path), run_name, sets=(*SETS[1:], "train.max_steps=44"))
    )
    assert more.finish(timeout=1500) == 0, more.text()[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 44 and summary["world_size"] == 3, summary


def trainer_ranks(cluster, nodes: list[int]) -> list[int]:
    """The bundled trainer's rank processes (not torchrun) running on those nodes."""
    ranks = []
    for node in nodes:
        listed = subprocess.run(
            ["ip", "netns", "pids", cluster.namespaces[node]], capture_output=True, text=True, check=True
        )
        for pid in map(int, listed.stdout.split()):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                names = [arg.rsplit(b"/", 1)[-1] for arg in argv]
                if b"trainer" in names and b"train" in names and b"torchrun" not in names:
                    ranks.append(pid)
    return ranks


@contextlib.contextmanager
def ranks_paused(cluster, nodes: list[int]) -> Iterator[None]:
    """SIGSTOP the nodes' trainer ranks for the block, SIGCONT after (far under the 60 s stall floor)."""
    ranks = trainer_ranks(cluster, nodes)
    assert ranks, "the nodes train"
    subprocess.run(["kill", "-STOP", *map(str, ranks)], check=True)
    try:
        yield
    finally:
        subprocess.run(["kill", "-CONT", *map(str, ranks)], check=False)


def test_a_killed_node_that_comes_back_rejoins_the_run_at_a_checkpoint(cluster, tmp_path):
    """The comeback (issue 39): n02 killed mid-run is left out and the run goes on at 2 nodes; once its
    link is up again (its sshd answers) it passes its probe and the run grows back to 3 nodes at its
    next checkpoint, without a restart, and ends as an uninterrupted run does (the loss within the
    resize tests' tolerance: a 1-process run of the same config and effective batch)."""
    victim = cluster.hosts[VICTIM]
    run_name = f"rejoin-{uuid.uuid4().hex[:6]}"
    run = cluster.shared / "runs" / run_name
    sets = (*SETS[1:], "model.dropout=0", "train.max_steps=200")
    options = ("--max-restarts", "2", "--exclude-failed", "--rejoin-probe-interval", "3")
    launcher = LauncherOutput.start(launch(inventory_for(cluster, tmp_path), run_name, *options, sets=sets))
    try:
        assert launcher.wait_for(r"^step (1[2-9])/200", timeout=900) is not None, launcher.text()[-4000:]
        with contextlib.ExitStack() as paused:
            with lost_node(cluster, VICTIM):
                lost = rf"restart 1 of 2: {victim} lost at step \d+; resuming on 2 nodes"
                shrunk = launcher.wait_for(lost, 600)
                assert shrunk is not None, launcher.text()[-4000:]
                on_two = launcher.wait_for(r"^step \d+/200", 600, since=shrunk[0])
                assert on_two is not None, launcher.text()[-4000:]
                # The survivors wait while the node comes back and passes its probe: at 25 steps a
                # second (a quiet machine, one thread per rank) the run otherwise ended before the
                # probe, on 2 nodes (the last step's checkpoint never grows back, as designed). 200
                # steps: the stop after the next checkpoint takes a second or two, 50 steps here.
                paused.enter_context(ranks_paused(cluster, [0, 1]))
            back_at = time.monotonic()  # its link up: the node answers again
            probed = launcher.wait_for(rf"{victim} answers its probe again", 120, since=shrunk[0])
        assert probed is not None, launcher.text()[-4000:]
        code = launcher.finish(timeout=900)
        out = launcher.text()
    finally:
        if launcher.proc.poll() is None:
            launcher.finish(timeout=1)
    assert code == 0, out
    grown = re.search(
        rf"^{victim} is back: growing to 3 nodes from (step-\d+) \((micro batch \d+ -> \d+, )?accumulation "
        r"\d+ -> 1, effective batch "
        r"(\d+) kept\); no restart used$",
        out,
        re.MULTILINE,
    )
    assert grown, out
    assert "restart 2 of 2" not in out, "growing back used no restart"
    records = history(run)
    restarts = [r for r in records if r["event"] == "restart"]
    assert [r["restart"] for r in restarts] == [1] and restarts[0]["restart_used"], restarts
    rejoin = next(r for r in records if r["event"] == "rejoin")
    assert rejoin["why"] == "rejoin" and rejoin["rejoined"] == [victim] and rejoin["restart"] == 1, rejoin
    assert rejoin["resume_from"].endswith(grown.group(1)) and victim in rejoin["nodes"], rejoin
    assert rejoin["gradient_accumulation_steps"] == 1, "the user's own batch split again"
    assert any(r["event"] == "stopped" and r["why"] == "rejoin" for r in records), records
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 200 and summary["world_size"] == 3 and summary["num_nodes"] == 3, summary
    assert summary["resumed_from"].endswith(grown.group(1)), summary
    index = next(i for i, line in enumerate(launcher.lines) if " is back: growing to 3 nodes" in line.text)
    first = next((line for line in launcher.lines[index:] if re.match(r"^step \d+/200", line.text)), None)
    assert first is not None, "steps on 3 nodes after the growth:\n" + out[-4000:]
    print(f"rejoin: from the node's return to the first step on 3 nodes: {first.at - back_at:.1f} s")
    # Where the time went: each phase's line in order after the shrink, from the node's return.
    at, times = shrunk[0], []
    for phase in ("answers its probe again", "to grow back", " is back: growing", "Launching run"):
        at = next(i for i in range(at, len(launcher.lines)) if phase in launcher.lines[i].text)
        times.append(f"{phase.strip()!r} +{launcher.lines[at].at - back_at:.1f} s")
    print("rejoin: " + ", ".join(times))

    # The uninterrupted run: the launch's own config (the user's batch split) on 3 local processes,
    # which reduce their gradients in the same order as the 3 nodes (the steps between the loss and the
    # rejoin ran on 2).
    reference = tmp_path / "reference"
    straight = finish(start_run(reference, [], nproc=3, config=run / "launch" / "config.yaml"), reference)
    assert straight.returncode == 0, straight.stderr[-4000:]
    ours = {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    theirs = {m["step"]: m["loss"] for m in straight.metrics}
    differences = {step: abs(ours[step] - theirs[step]) / theirs[step] for step in theirs}
    expected = straight.json("summary.json")["final_loss"]
    print(f"rejoin: final loss {summary['final_loss']} vs uninterrupted {expected}")
    print(
        "rejoin: relative loss difference by step: "
        + " ".join(f"{s}:{d:.1e}" for s, d in differences.items())
    )
    assert summary["final_loss"] == pytest.approx(expected, rel=1e-5)
