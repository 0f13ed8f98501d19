"""A whole node lost mid-run on the Molecule test bed, as users meet it: ct-worker2's container killed
(`podman kill`: every process on it gone at once and its address with it, as a spot reclaim or a
power loss) while `trainer launch --max-restarts 2 --exclude-failed` trains on three nodes, one
process each. The launcher must name the dead node as the cause (not the survivors whose collectives
broke), leave it out at once, resume on the two survivors from the latest complete checkpoint with the
effective batch kept, and finish; the final loss must equal that of a run started on the survivors
from the same checkpoint with the same batch split (within 1e-4 relative for DeepSpeed ZeRO-2, whose
checkpoint is converted to DeepSpeed's universal format on the way). The node is brought back afterwards
(tests/helpers/testbed_nodes.py). The bed's nodes have DeepSpeed's ops built by the node environment;
the ddp case (exact final loss, and the next launch of the run using the node again) runs on simulated
nodes (tests/local/test_node_loss_sim.py), off CI's critical path.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.testbed_nodes import (
    BED_TEST,
    INVENTORY,
    LauncherOutput,
    bed_shared_dir,
    lost_node,
    own_like,
    restore_node,
)

pytestmark = BED_TEST
#: A master port of this file's own, inside the firewall's comm range (the other bed tests use theirs).
MASTER_PORT = 29547
VICTIM = "ct-worker2"
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


def inventory_for(tmp_path: Path, engine: str, without: str = "") -> Path:
    """The bed's inventory with one process per node and `engine`; without the host `without`."""
    inventory = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}"
    shutil.copytree(INVENTORY, inventory)
    overrides = {"training_procs_per_node": 1, "cluster_master_port": MASTER_PORT, "training_engine": engine}
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


@pytest.fixture
def runs():
    """Run names made by the test; their dirs are removed afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        shutil.rmtree(bed_shared_dir() / "runs" / name, ignore_errors=True)


@pytest.mark.parametrize(
    ("engine", "extra_sets", "tolerance"),
    [("deepspeed", ("distributed.zero_stage=2",), 1e-4)],
    ids=["deepspeed-zero2"],
)
def test_a_killed_worker_node_is_left_out_and_the_survivors_finish_like_a_run_started_there(
    tmp_path, runs, engine, extra_sets, tolerance
):
    restore_node(VICTIM)  # whole before it starts, whatever an earlier test left
    run_name = f"nodeloss-{engine}-{uuid.uuid4().hex[:6]}"
    runs.append(run_name)
    run = bed_shared_dir() / "runs" / run_name
    sets = (*SETS, *extra_sets)
    # The victim's rank sleeps 60 s before step 14 (its peers wait in that step's collective): the
    # run is still going when the kill lands, however fast the steps (a quiet machine ran all 40
    # between the launcher showing step 12 and podman's kill). The math is the same; the restart
    # resumes from step-10 on the two survivors, where the hook has no rank to act on.
    stall = ("--env", "TRAINER_TEST_STALL=2:14:60")
    launcher = LauncherOutput.start(
        launch(
            inventory_for(tmp_path, engine),
            run_name,
            "--max-restarts",
            "2",
            "--exclude-failed",
            *stall,
            sets=sets,
        )
    )
    try:
        assert launcher.wait_for(r"^step 1[2-9]/40", timeout=1500) is not None, launcher.text()[-4000:]
        with lost_node(VICTIM) as killed_at:
            code = launcher.finish(timeout=1500)
        out = launcher.text()
    finally:
        if launcher.proc.poll() is None:
            launcher.finish(timeout=1)
    assert code == 0, out
    # The dead node is the cause; the survivors' broken collectives are what followed.
    assert re.search(rf"^failed: {VICTIM} \(node 2\) was lost at step \d+: ", out, re.MULTILINE), out
    assert "its collective failed after ct-worker2 was lost" in out, out
    assert f"[{VICTIM}] node 2: lost (no answer since " in out, "shown as lost, never as running"
    restart = re.search(
        rf"restart 1 of 2: {VICTIM} lost at step (\d+); resuming on 2 nodes from (step-\d+) "
        r"\((micro batch \d+ -> \d+, )?accumulation 1 -> \d+, effective batch (\d+) kept\)",
        out,
    )
    assert restart, out
    lost_at, resumed_from = int(restart.group(1)), restart.group(2)
    record = next(r for r in history(run) if r["event"] == "restart")
    assert record["lost"] == [VICTIM] and VICTIM not in record["nodes"], record
    split = (
        f"train.micro_batch_size={record['micro_batch_size']}",
        f"train.gradient_accumulation_steps={record['gradient_accumulation_steps']}",
    )
    assert record["micro_batch_size"] * record["gradient_accumulation_steps"] * 2 == int(restart.group(4))
    assert lost_at - int(resumed_from.removeprefix("step-")) <= 5, "at most one checkpoint interval lost"
    stopped = next(r for r in history(run) if r["event"] == "stopped")
    assert stopped["cause"]["kind"] == "lost" and stopped["cause"]["host"] == VICTIM, stopped
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 40 and summary["world_size"] == 2, summary
    restarted = next(i for i, line in enumerate(launcher.lines) if line.text.startswith("restart 1 of 2:"))
    first = next(line for line in launcher.lines[restarted:] if re.match(r"^step \d+/40", line.text))
    waited = first.at - killed_at
    print(f"{engine}: from the kill to the survivors' first step ({first.text.split()[1]}): {waited:.1f} s")

    # A run started on the two survivors from the same checkpoint, with the restart's batch split.
    reference_name = f"{run_name}-reference"
    runs.append(reference_name)
    reference = bed_shared_dir() / "runs" / reference_name
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / resumed_from, reference / "checkpoints" / resumed_from)
    (reference / "checkpoints" / "latest").write_text(resumed_from + "\n")
    own_like(reference, run)  # the training account's, as every run dir on the shared dir
    again = LauncherOutput.start(
        launch(
            inventory_for(tmp_path, engine, without=VICTIM),
            reference_name,
            sets=(*sets, *split),
        )
    )
    assert again.finish(timeout=1500) == 0, again.text()[-4000:]
    straight = json.loads((reference / "summary.json").read_text())
    assert straight["final_step"] == 40 and straight["resumed_from"], straight
    difference = abs(summary["final_loss"] - straight["final_loss"]) / abs(straight["final_loss"])
    losses = f"{summary['final_loss']} vs {straight['final_loss']}"
    print(f"{engine}: final loss {losses} (relative {difference:.1e})")
    assert difference <= tolerance, (summary["final_loss"], straight["final_loss"])
