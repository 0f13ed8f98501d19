"""`trainer launch -- COMMAND` on the Molecule test bed: three containers, the training user, gloo over
the podman network, the bind-mounted shared dir (same path here and in the containers).

The command is the Qwen-shaped script of tests/data/own_command (NNODES, NODE_RANK, MASTER_ADDR and
MASTER_PORT from the environment, torchrun started by the script itself), copied to a working dir
on the shared dir that the training user owns. Each test's run and working dir are removed after it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import BED_UP, ENV, HOSTS, INVENTORY, group_vars, run_launch
from helpers.testbed_nodes import own_like

OWN_COMMAND = Path(__file__).resolve().parents[1] / "data" / "own_command"
#: A master port of its own (access 29543, finetune 29545, node loss 29547, launcher forms 29549): a
#: run another test left behind cannot hold it.
MASTER_PORT = 29551
SECRET = "testbed-secret-5d2e"

pytestmark = [pytest.mark.slow, BED_UP]


@pytest.fixture
def testbed(tmp_path):
    """(inventory, run name, run output dir, working dir): one process per node, the working dir on
    the shared dir with the Qwen-shaped script, owned by the training user like the shared dir."""
    settings = group_vars()
    shared = Path(settings["cluster_shared_dir"])
    tag = uuid.uuid4().hex[:8]
    workdir = shared / f"code-{tag}"
    shutil.copytree(OWN_COMMAND, workdir)
    (workdir / "data.json").write_text(json.dumps([[x / 10, 3 * x / 10 + 1] for x in range(40)]))
    own_like(workdir, shared)
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    overrides = {
        "training_procs_per_node": 1,
        "cluster_master_port": MASTER_PORT,
        "training_workdir": str(workdir),
        "training_env": {
            **settings["training_env"],
            "HF_HOME": f"{workdir}/hf-home",
            "WANDB_API_KEY": SECRET,
        },
    }
    (inventory / "group_vars" / "cluster" / "zz_command_test.yml").write_text(yaml.safe_dump(overrides))
    run_name = f"cmd-{tag}"
    output = shared / "runs" / run_name
    yield inventory, run_name, output, workdir
    shutil.rmtree(output, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)


def launch(inventory: Path, run_name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name, *args]


def launch_pids(host: str, node_dir: Path) -> list[int]:
    """The live processes of the node's launch, listed as the training user (root in a container
    cannot read another user's process environment, where the launch's tag is)."""
    settings = group_vars()
    listed = subprocess.run(
        ["podman", "exec", "--user", settings["cluster_training_user"], host,
         f"{settings['training_venv']}/bin/python", f"{node_dir}/node_ctl.py", str(node_dir), "pids"],
        capture_output=True, text=True, env=ENV, check=True, timeout=60,
    )  # fmt: skip
    return [p["pid"] for p in json.loads(listed.stdout)["processes"]]


def process_environment(host: str, pid: int) -> dict[str, str]:
    user = group_vars()["cluster_training_user"]
    raw = subprocess.run(
        ["podman", "exec", "--user", user, host, "cat", f"/proc/{pid}/environ"],
        capture_output=True, env=ENV, check=True, timeout=60,
    ).stdout  # fmt: skip
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def test_a_qwen_shaped_script_trains_across_three_nodes(testbed):
    inventory, run_name, output, workdir = testbed
    command = ["bash", "finetune/finetune_lora_ds.sh", "-m", "tiny-model", "-d", "data.json"]
    rc, out = run_launch(launch(inventory, run_name, "--", *command), timeout=900)
    assert rc == 0, out
    assert all(f"[{host}]" in out and "done" in out for host in HOSTS), out
    result = json.loads((workdir / "output_qwen" / "result.json").read_text())
    assert result["world_size"] == 3
    by_rank = {seen["rank"]: seen for seen in result["ranks"]}
    for rank, seen in by_rank.items():
        env = seen["env"]
        assert env["NODE_RANK"] == str(rank) and env["NNODES"] == "3"
        assert env["MASTER_ADDR"] == "10.89.42.10" and env["MASTER_PORT"] == str(MASTER_PORT)
        assert env["NCCL_SOCKET_IFNAME"].startswith("=") and env["NCCL_IB_DISABLE"] == "1"
        assert seen["accelerate_machine_rank"] == rank and seen["cwd"] == str(workdir)
        assert env["CLUSTER_OUTPUT_DIR"] == str(output)
    assert len({seen["hostname"] for seen in by_rank.values()}) == 3, "one rank per container"
    assert len({tuple(seen["params"]) for seen in by_rank.values()}) == 1


def test_a_command_exiting_3_on_node_2_stops_every_node_and_is_named(testbed):
    inventory, run_name, output, _ = testbed
    gives_up = (
        'if [ "$NODE_RANK" = 2 ]; then echo "node 2: giving up"; exit 3; fi; '
        "exec python -c 'import time; time.sleep(900)'"
    )
    rc, out = run_launch(launch(inventory, run_name, "--", "bash", "-c", gives_up), timeout=600)
    assert rc == 3, "the command's own exit code, the cause's"
    assert "failed: ct-worker2 (node 2) exited with code 3" in out, out
    assert "node 2: giving up" in out
    for rank, host in enumerate(HOSTS):
        assert launch_pids(host, output / "launch" / f"node-{rank}") == [], f"{host} still runs the command"


def test_env_reaches_the_training_users_processes_and_the_secret_stays_hidden(testbed):
    inventory, run_name, output, _ = testbed
    node_dir = output / "launch" / "node-1"
    launcher = subprocess.Popen(
        launch(inventory, run_name, "--env", "RUN_LABEL=bed test", "--env", "HF_TOKEN",
               "--", "python", "-c", "import time; time.sleep(900)"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**ENV, "HF_TOKEN": "hf-bed-secret-77"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        pids: list[int] = []
        while not pids:
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "ct-worker1's command did not start within 300 s"
            time.sleep(1)
            if (node_dir / "pid").exists():
                pids = launch_pids("ct-worker1", node_dir)
        seen = process_environment("ct-worker1", pids[-1])
        owner = subprocess.run(
            ["podman", "exec", "ct-worker1", "stat", "-c", "%U", f"/proc/{pids[-1]}"],
            capture_output=True, text=True, env=ENV, check=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.communicate(timeout=120)
    assert seen["RUN_LABEL"] == "bed test" and seen["HF_TOKEN"] == "hf-bed-secret-77"
    assert seen["WANDB_API_KEY"] == SECRET and seen["NODE_RANK"] == "1" and seen["NNODES"] == "3"
    assert owner == group_vars()["cluster_training_user"], "the command runs as the training user"
    assert launcher.returncode == 130, out
    assert SECRET not in out and "hf-bed-secret-77" not in out
    assert SECRET not in (node_dir / "run.sh").read_text()
    for rank, host in enumerate(HOSTS):
        assert launch_pids(host, output / "launch" / f"node-{rank}") == []


def test_the_logs_of_every_launch_survive_a_relaunch(testbed):
    inventory, run_name, output, _ = testbed
    for attempt in ("first", "second"):
        command = ["bash", "-c", f"echo attempt {attempt} on node $NODE_RANK"]
        rc, out = run_launch(launch(inventory, run_name, "--", *command), timeout=600)
        assert rc == 0, out
    for rank in range(len(HOSTS)):
        node_dir = output / "launch" / f"node-{rank}"
        assert f"attempt first on node {rank}" in (node_dir / "log.1").read_text()
        assert f"attempt second on node {rank}" in (node_dir / "log").read_text()


def test_plan_with_a_command_touches_nothing(testbed):
    inventory, run_name, output, workdir = testbed
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--run-name", run_name,
         "--", "bash", "finetune/finetune_lora_ds.sh"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "node 2 (ct-worker2):" in done.stdout and "NODE_RANK=2" in done.stdout
    assert f"cd {workdir} && bash finetune/finetune_lora_ds.sh" in done.stdout
    assert "WANDB_API_KEY=<redacted>" in done.stdout and SECRET not in done.stdout
    assert not output.exists()
