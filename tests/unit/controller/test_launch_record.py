"""launch.json (launch_record.py): what a launch writes is what attach, status and stop read back, and
a launch.json an older launcher wrote, or one the training account changed, still reads as it did."""

from __future__ import annotations

import json

from helpers.plan_inventory import three_nodes

from trainer.controller.launcher.launch_record import LaunchRecord, RestartState
from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.wire import STALL_CEILING_S, WatchOptions

#: A bundled-trainer launch.json as the launcher wrote it before the adaptive stall bound (issue 39)
#: and before the world check and the batch sizes were recorded.
OLDER = {
    "launch_id": "first-0123456789ab",
    "run_name": "first",
    "attempt": 2,
    "bundled_trainer": True,
    "command": [],
    "head": "n-head",
    "nodes": {"n-head": 0, "n-w1": 1},
    "gpus_per_node": 2,
    "launched_at": 1790000000.5,
    "controller": "ctl",
    "launcher_pid": 4242,
    "poll_interval_s": 2.0,
    "unreachable_grace_s": 30.0,
    "stop_grace_s": 10.0,
    "max_restarts": 3,
    "exclude_failed": False,
    "allow_batch_change": False,
    "restarts": 1,
}


def test_what_a_launch_writes_reads_back_the_same(tmp_path):
    plan = make_plan(three_nodes(tmp_path), run_name="first", command=("bash", "job.sh"))
    options = WatchOptions(poll_interval_s=1.0, stall_timeout_s=90.0, world_timeout_s=30.0)
    restart = RestartState(max_restarts=2, exclude_failed=True, restarts=1)
    written = LaunchRecord.of_attempt(plan, options, launch_id="first-x", attempt=2, restart=restart)
    on_disk = json.loads(json.dumps(written.to_json()))
    read = LaunchRecord.from_json(on_disk)
    assert read == written
    assert read.nodes == {n.host: n.node_rank for n in plan.topology.nodes} and len(read.nodes) == 3
    # node_ctl.py reads these two on the nodes by their names: the spelling is the wire format.
    assert on_disk["world_check"] == {"head_address": plan.topology.master_addr}
    assert on_disk["world_timeout_s"] == 30.0


def test_an_older_launch_json_reads_with_the_defaults_of_its_time():
    read = LaunchRecord.from_json(OLDER)
    assert (read.launch_id, read.attempt, read.launcher_pid) == ("first-0123456789ab", 2, 4242)
    assert read.nodes == {"n-head": 0, "n-w1": 1}
    # The watch settings it has are kept; those it lacks are the bundled trainer's defaults.
    assert read.watch == WatchOptions(
        unreachable_grace_s=30.0, stall_timeout_s=STALL_CEILING_S, stall_adaptive=True
    )
    assert read.restart == RestartState(max_restarts=3, restarts=1)
    assert read.as_read is OLDER


def test_a_users_command_launched_without_a_stall_watchdog_keeps_none():
    read = LaunchRecord.from_json({"command": ["bash", "x.sh"], "stall_timeout_s": None})
    assert read.watch.stall_timeout_s is None and not read.watch.stall_adaptive
    # One an older launcher wrote without the keys: today's default (its quiet checked for a culprit).
    assert LaunchRecord.from_json({"command": ["bash", "x.sh"]}).watch == WatchOptions.defaults(bundled=False)


def test_a_changed_launch_json_names_no_nodes_and_its_wrong_values_read_as_absent():
    assert LaunchRecord.from_json(["not", "an", "object"]).nodes is None
    assert LaunchRecord.from_json({"nodes": {"n-head": "zero"}}).nodes is None
    assert LaunchRecord.from_json({"nodes": {"n-head": True}}).nodes is None
    read = LaunchRecord.from_json({"attempt": "2", "launcher_pid": "x", "poll_interval_s": "fast"})
    assert (read.attempt, read.launcher_pid, read.watch.poll_interval_s) == (None, None, 2.0)
