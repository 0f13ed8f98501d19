"""The launcher forms users type after `trainer launch --`: which ones are recognised, what each
node runs, and which forms are refused because they cannot form one job on several nodes."""

from __future__ import annotations

import pytest

from trainer.controller.launcher.command_forms import NodeValues, adapt, launcher_of, problem

NODE1 = NodeValues(
    nnodes=3,
    node_rank=1,
    master_addr="10.0.0.1",
    master_port=29500,
    accelerate_config="/shared/runs/r/launch/accelerate-node1.yaml",
    hostfile="/shared/runs/r/launch/hostfile",
)


@pytest.mark.parametrize(
    ("command", "launcher"),
    [
        (["torchrun", "train.py"], "torchrun"),
        (["/opt/venv/bin/torchrun", "--nproc-per-node", "8", "train.py"], "torchrun"),
        (["python", "-m", "torch.distributed.run", "train.py"], "torchrun"),
        (["python3.11", "-u", "-m", "torch.distributed.run", "train.py"], "torchrun"),
        (["accelerate", "launch", "train.py"], "accelerate"),
        (["deepspeed", "train.py"], "deepspeed"),
        (["accelerate", "config"], None),
        (["python", "train.py"], None),
        (["python", "-m", "mypkg.train"], None),
        (["bash", "-c", "torchrun train.py"], None),
    ],
)
def test_the_launchers_users_type_are_recognised(command, launcher):
    assert launcher_of(command)[0] == launcher


def test_plain_torchrun_runs_as_given_and_reads_the_pet_environment():
    form = adapt(["torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1e-4"], NODE1)
    assert form.command == ("torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1e-4")
    assert form.added == ()


def test_accelerate_gets_this_nodes_config_file_unless_it_names_one():
    form = adapt(["accelerate", "launch", "train.py", "--epochs", "1"], NODE1)
    assert form.command == (
        "accelerate",
        "launch",
        "--config_file",
        NODE1.accelerate_config,
        "train.py",
        "--epochs",
        "1",
    )
    own = ["accelerate", "launch", "--config_file", "mine.yaml", "train.py"]
    assert adapt(own, NODE1).command == tuple(own)


def test_deepspeed_starts_one_nodes_share_on_each_node():
    form = adapt(["deepspeed", "train.py", "--deepspeed", "ds.json"], NODE1)
    assert form.command == (
        "deepspeed",
        "--no_ssh",
        "--node_rank=1",
        f"--hostfile={NODE1.hostfile}",
        "--master_addr=10.0.0.1",
        "--master_port=29500",
        "train.py",
        "--deepspeed",
        "ds.json",
    )
    # The user's own --no_ssh form is theirs to get right: left alone.
    own = ["deepspeed", "--no_ssh", "--node_rank=0", "train.py"]
    assert adapt(own, NODE1).command == tuple(own)


def test_a_script_argument_that_looks_like_a_launcher_option_is_not_read_as_one():
    # --standalone after the script belongs to the script.
    assert problem(["torchrun", "train.py", "--standalone"], 3) is None
    assert adapt(["deepspeed", "train.py", "--no_ssh"], NODE1).added != ()


@pytest.mark.parametrize(
    ("command", "named", "fix"),
    [
        (
            ["torchrun", "--standalone", "--nproc-per-node", "8", "train.py"],
            "--standalone",
            "drop --standalone",
        ),
        (["torchrun", "--nnodes", "1", "train.py"], "--nnodes 1", "drop --nnodes"),
        (["torchrun", "--nnodes=1:1", "train.py"], "--nnodes 1:1", "drop --nnodes"),
        (
            ["python", "-m", "torch.distributed.run", "--node_rank", "0", "x.py"],
            "--node-rank 0",
            "PET_NODE_RANK",
        ),
        (["accelerate", "launch", "--num_machines", "1", "x.py"], "--num_machines 1", "drop it"),
        (["accelerate", "launch", "--machine_rank=0", "x.py"], "--machine_rank 0", "drop it"),
        (["deepspeed", "--hostfile", "hosts", "x.py"], "--hostfile", "drop --hostfile"),
    ],
)
def test_single_node_forms_are_refused_on_several_nodes_with_the_fix(command, named, fix):
    why = problem(command, 3)
    assert why is not None and named in why and fix in why
    assert problem(command, 1) is None, "on one node these forms are fine"


def test_forms_that_form_one_job_pass():
    for command in (
        ["torchrun", "--nnodes", "3", "--nproc-per-node", "8", "train.py"],
        ["torchrun", "--nnodes=1:3", "train.py"],
        ["torchrun", "--master-addr", "10.0.0.1", "--master-port", "29500", "train.py"],
        ["accelerate", "launch", "--num_machines", "3", "train.py"],
        ["deepspeed", "--no_ssh", "--node_rank", "0", "--hostfile", "h", "train.py"],
        ["bash", "train.sh"],
    ):
        assert problem(command, 3) is None, command


def test_every_recognised_launcher_has_its_row_in_the_docs_and_the_plans_reads():
    """A launcher added to command_forms.FORMS gets a row in docs/own-command.md's table of launchers
    and what the plan shows it reads; no row names a launcher the registry lacks."""
    import re
    from pathlib import Path

    from trainer.controller.launcher.command_forms import FORMS, READS

    docs = (Path(__file__).resolve().parents[3] / "docs" / "own-command.md").read_text()
    table = docs.split("## Launchers written after `--`", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `-- (?:python -m \S+ )?(\S+)", table, flags=re.MULTILINE)
    assert set(rows) == set(FORMS), rows
    assert set(READS) == set(FORMS) and all(READS.values())
    for form in FORMS.values():
        assert launcher_of([form.program, *form.subcommand, "train.py"])[0] == form.name
