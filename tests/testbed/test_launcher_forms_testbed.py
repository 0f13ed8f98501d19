"""The launcher forms users type after `trainer launch --`, on the Molecule test bed (three
containers, two processes each, gloo over the podman network): each forms one job of 6 processes,
and the world check tells a job that did not form.

The script of tests/data/world_forms all-reduces a 1: every process must see world size 6 and a sum of 6.
It is copied to a working dir on the shared dir, owned by the training user; each test's run and
working dir are removed after it. `python -m torch.distributed.run`, accelerate with the generated
file in a script, and a script's separate jobs (the world check's warning) run on two loopback hosts
only (test_launcher_forms_local, test_world_check): the bed's time in CI is the longer side.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import BED_UP, HOSTS, INVENTORY, group_vars, run_launch
from helpers.testbed_nodes import own_like

FORMS = Path(__file__).resolve().parents[1] / "data" / "world_forms"
#: A master port of its own (other testbed tests use 29543, 29545, 29547, 29551).
MASTER_PORT = 29549
NODES, PROCS = 3, 2

pytestmark = [pytest.mark.slow, BED_UP]


@pytest.fixture
def testbed(tmp_path):
    """(inventory, run name, working dir)."""
    settings = group_vars()
    shared = Path(settings["cluster_shared_dir"])
    tag = uuid.uuid4().hex[:8]
    workdir = shared / f"forms-{tag}"
    shutil.copytree(FORMS, workdir)
    own_like(workdir, shared)
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    overrides = {
        "training_procs_per_node": PROCS,
        "cluster_master_port": MASTER_PORT,
        "training_workdir": str(workdir),
        # accelerate's own default config would be read from here: empty, so only the launcher's counts.
        "training_env": {**settings["training_env"], "HF_HOME": f"{workdir}/hf-home", "HOLD_S": "3"},
    }
    (inventory / "group_vars" / "cluster" / "zz_forms_test.yml").write_text(yaml.safe_dump(overrides))
    run_name = f"forms-{tag}"
    yield inventory, run_name, workdir
    shutil.rmtree(shared / "runs" / run_name, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)


def launch(inventory: Path, run_name: str, *args: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name]
    return run_launch([*command, "--poll-interval", "1", *args], timeout=900)


def results(workdir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((workdir / "results").glob("rank-*.json"))]


def assert_one_world(workdir: Path, out: str) -> list[dict]:
    seen = results(workdir)
    world = NODES * PROCS
    assert sorted(r["rank"] for r in seen) == list(range(world)), out
    assert {r["world_size"] for r in seen} == {world}, out
    assert {r["sum"] for r in seen} == {world}, "the all-reduce spanned every node"
    assert {r["hostname"] for r in seen} == set(HOSTS)
    return seen


@pytest.mark.parametrize(
    "command",
    [
        ["torchrun", "allreduce.py"],
        ["deepspeed", "allreduce.py"],
    ],
    ids=["torchrun", "deepspeed"],
)
def test_torchrun_and_deepspeed_forms_form_one_job(testbed, command):
    inventory, run_name, workdir = testbed
    # A loaded CI machine may take minutes to start deepspeed's launcher: only the verdict counts here.
    rc, out = launch(inventory, run_name, "--world-timeout", "600", "--", *command)
    assert rc == 0, out
    assert_one_world(workdir, out)
    assert f"world check: all {NODES} nodes joined the job" in out, out


def test_accelerate_forms_one_job_on_cpu_nodes_without_cpu_true(testbed):
    inventory, run_name, workdir = testbed
    command = ["accelerate", "launch", "accelerate_allreduce.py"]
    rc, out = launch(inventory, run_name, "--world-timeout", "600", "--", *command)
    assert rc == 0, out
    seen = assert_one_world(workdir, out)
    assert {r["distributed_type"] for r in seen} == {"DistributedType.MULTI_CPU"}, seen


def test_a_launcher_whose_nodes_never_join_the_head_is_stopped_with_exit_2(testbed):
    """c10d with a loopback endpoint: each node hosts a store of its own and waits there for 3 nodes."""
    inventory, run_name, workdir = testbed
    command = ["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29612", "allreduce.py"]
    rc, out = launch(inventory, run_name, "--world-timeout", "10", "--", *command)
    assert rc == 2, out
    assert "world check failed: ct-worker1, ct-worker2 did not connect to the head within 10 s" in out
    assert "torchrun formed a separate job" in out
    assert "stopped" in out and not results(workdir)
