"""Every path of a run comes from trainer.run_paths.RunPaths: the launcher's plan, the node's
checkpoints, and the launcher's node helper, which is sent to the nodes as text and keeps its own
copy of the few names it needs (these tests tie that copy to RunPaths)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from helpers.node_helper import node_ctl
from helpers.plan_inventory import three_nodes

from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.runscript import node_dir
from trainer.run_paths import RunPaths


def test_a_plan_puts_the_run_where_run_paths_say(tmp_path):
    plan = make_plan(three_nodes(tmp_path), run_name="first")
    paths = RunPaths(PurePosixPath("/srv/shared/runs/first"))
    assert plan.paths == paths
    assert (plan.output_dir, plan.launch_dir) == ("/srv/shared/runs/first", "/srv/shared/runs/first/launch")
    assert dict(o.split("=", 1) for o in plan.overrides)["output_dir"] == plan.output_dir
    worker = plan.topology.nodes[2]
    assert node_dir(plan, worker) == "/srv/shared/runs/first/launch/node-2"
    assert f"--log-dir={paths.node_dir(2)}/torchrun" in plan.node_command(worker)


def test_the_node_helper_finds_the_runs_lock_history_and_latest_checkpoint_where_run_paths_put_them():
    helper, paths = node_ctl(), RunPaths(Path("/srv/shared/runs/first"))
    assert helper.runs_dir_of(paths.node_dir(3)) == paths.runs_dir
    assert helper.lock_file_of(paths.node_dir(3)) == paths.lock == paths.launch_dir / helper.LOCK_FILE
    assert paths.launch_dir / helper.HISTORY_FILE == paths.history
    assert helper.latest_checkpoint_file(paths.run_dir) == paths.latest
    assert paths.node_dir(0).name == helper.HEAD_NODE_DIR
