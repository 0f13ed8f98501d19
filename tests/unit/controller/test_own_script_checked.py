"""A user's command (`trainer launch -- torchrun train.py`): the probe checks the script it names exists
where the command runs on every node (training_workdir), and says how to get it there; when the job
fails anyway, the report's first line is the failing rank's own error line, and the launcher's
(torchrun's) traceback stays in the node log, off the operator's screen."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from helpers.node_helper import node_ctl
from rich.console import Console

from trainer.controller.launcher.command_forms import script_of
from trainer.controller.launcher.failure import diagnose, render
from trainer.controller.launcher.live import JobMonitor, LiveView


@pytest.mark.parametrize(
    ("command", "script"),
    [
        (["torchrun", "train.py", "--lr", "1"], "train.py"),
        (["torchrun", "--nproc-per-node", "2", "src/train.py"], "src/train.py"),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py"], "train.py"),
        (["accelerate", "launch", "--mixed_precision", "bf16", "train.py"], "train.py"),
        (["deepspeed", "train.py", "--deepspeed"], "train.py"),
        (["python", "-u", "train.py"], "train.py"),
        (["bash", "finetune/finetune_lora_ds.sh", "-m", "x"], "finetune/finetune_lora_ds.sh"),
        (["torchrun", "-m", "mypackage.train"], None),
        (["python", "-c", "print(1)"], None),
        (["bash", "-c", "echo $NODE_RANK"], None),
        (["./run.sh"], None),  # the program itself: checked as the program
    ],
)
def test_the_script_a_command_runs_is_found(command, script):
    assert script_of(command) == script


def test_a_script_missing_from_the_working_dir_stops_the_probe_naming_where(tmp_path):
    workdir = tmp_path / "shared"
    workdir.mkdir()
    request = {
        "workdir": str(workdir),
        "program": "torchrun",
        "venv_bin": str(Path(sys.executable).parent),
        "script": "train.py",
    }
    problem = node_ctl().check(request)
    assert problem.startswith(f"the command's script train.py is not in {workdir} on this node"), problem
    assert "training_workdir" in problem and "trainer push" in problem
    (workdir / "train.py").write_text("print('hi')\n")
    assert node_ctl().check(request) == ""


#: What a node running `torchrun train.py` printed when train.py was not in its working directory.
TORCHRUN_FAILURE = (
    Path(__file__).resolve().parents[2] / "data" / "launcher_output" / "torchrun-missing-script.txt"
).read_text()


def test_the_report_leads_with_the_ranks_own_error_not_torchruns_traceback():
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = JobMonitor({"head": 0, "w1": 1}, "head", view)
        lines = ["starting", *TORCHRUN_FAILURE.splitlines()]
        report = {"state": "exited", "exit": {"exit_code": 1, "time": 1000.0}, "lines": lines}
        monitor.on_message({"host": "head", "type": "report", "report": report})
        diagnosis = diagnose(monitor, bundled=False, now=2000.0)
        render(diagnosis, monitor, view)
    shown = out.getvalue()
    failed = next(line for line in shown.splitlines() if line.startswith("failed: "))
    own = "/opt/clustertrain/venv/bin/python3: can't open file '/srv/shared/train.py': [Errno 2] No such"
    assert failed.startswith(f"failed: {own}"), shown
    assert "rank 0 on head (node 0), exit code 1" in failed
    # torchrun's own traceback and summary stay in the node log.
    assert "Traceback (most recent call last)" not in shown and "ChildFailedError" not in shown, shown
    assert "Root Cause" not in shown


def test_every_nodes_probe_is_given_the_script_to_look_for():
    from trainer.controller.inventory import load_cluster
    from trainer.controller.launcher.launch import Launcher
    from trainer.controller.launcher.plan import make_plan

    command = ("torchrun", "src/train.py", "--lr", "1")
    plan = make_plan(load_cluster("inventory/local"), None, (), None, "own", command=command)
    nodes = Launcher(plan).extravars()["launch_nodes"]
    assert nodes and all(node["check"]["script"] == "src/train.py" for node in nodes.values()), nodes


def test_accelerates_traceback_is_kept_off_the_screen_and_the_scripts_own_stays():
    from trainer.controller.launcher.rank_output import RankOutput

    lines = [
        "Traceback (most recent call last):",
        '  File "/srv/shared/code/train.py", line 3, in <module>',
        "    raise ValueError('no data')",
        "ValueError: no data",
        "Traceback (most recent call last):",
        '  File "/opt/clustertrain/venv/bin/accelerate", line 8, in <module>',
        "    sys.exit(main())",
        "subprocess.CalledProcessError: Command '['python3', 'train.py']' returned non-zero exit status 1.",
    ]
    output = RankOutput()
    shown = [kept for line in lines for kept in output.feed(line)]
    assert shown == [*lines[:4], "(the launcher's traceback, 4 lines: in this node's log)"]
    assert output.own_error == "ValueError: no data"
