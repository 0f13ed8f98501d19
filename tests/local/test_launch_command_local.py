"""`trainer launch -- COMMAND`: the user's own command on two loopback "hosts" (ansible_connection
local, node ranks 0 and 1), through the real playbooks, real torchrun and real gloo.

The command is a script of the Qwen guide's shape (tests/data/own_command/finetune/finetune_lora_ds.sh):
it reads NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT from the environment and runs torchrun on a
tiny training script of the tests' own (tests/data/own_command/finetune.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.loopback import VENV, free_port
from helpers.loopback_launch import environ, launch_processes

REPO = Path(__file__).resolve().parents[2]
OWN_COMMAND = Path(__file__).resolve().parents[1] / "data" / "own_command"
QWEN_SCRIPT = ["bash", "finetune/finetune_lora_ds.sh", "-m", "tiny-model", "-d", "data.json"]
INVENTORY_SECRET = "inv-secret-7f3a"
CLI_SECRET = "cli-secret-91bd"


@pytest.fixture
def cluster(tmp_path) -> tuple[Path, Path, Path]:
    """(inventory, shared dir, working dir) for two local hosts, node0 (head) and node1 (worker).
    The working dir (training_workdir) holds the Qwen-shaped script, finetune.py and data.json."""
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "cluster_accelerators": 0,
        "cluster_accelerator_model": "cpu",
    }
    inventory = tmp_path / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    hosts = {
        "cluster": {
            "children": {
                # One address per host, as the inventory rules require: all of 127/8 is on lo.
                "head": {"hosts": {"node0": dict(local, cluster_ip="127.0.0.1")}},
                "workers": {"hosts": {"node1": dict(local, cluster_ip="127.0.0.2")}},
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    shared, workdir = tmp_path / "shared", tmp_path / "code"
    shutil.copytree(OWN_COMMAND, workdir)
    (workdir / "data.json").write_text(json.dumps([[x / 10, 3 * x / 10 + 1] for x in range(40)]))
    settings = {
        "cluster_training_user": subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(),
        "cluster_master_port": free_port(),
        "cluster_nccl_socket_ifname": "auto",
        "cluster_nccl_ib_disable": "auto",
        "cluster_nccl_debug": "WARN",
        "cluster_nccl_timeout_s": 120,
        "cluster_shared_dir": str(shared),
        "cluster_data_path": "",
        "training_venv": str(VENV),
        "training_procs_per_node": 2,
        "training_engine": "ddp",
        "training_config": "",
        "training_workdir": str(workdir),
        "training_env": {
            "HF_HOME": str(tmp_path / "hf-home"),
            "NCCL_IB_HCA": "mlx5_0,mlx5_1",
            "WANDB_API_KEY": INVENTORY_SECRET,
        },
    }
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(settings))
    return inventory, shared, workdir


def trainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def launch(inventory: Path, run_name: str, *args: str) -> list[str]:
    return trainer("launch", "-i", str(inventory), "--run-name", run_name, "--poll-interval", "1", *args)


def run(command: list[str], timeout: float = 600, env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout + done.stderr


def test_a_qwen_shaped_script_trains_across_both_nodes_unchanged(cluster):
    inventory, shared, workdir = cluster
    rc, out = run(launch(inventory, "qwen", "--", *QWEN_SCRIPT))
    assert rc == 0, out
    assert "[Rank 0] {'loss'" in out, "rank 0's output is shown live"
    assert "[node0] node 0: done" in out and "[node1] node 1: done" in out, out
    result = json.loads((workdir / "output_qwen" / "result.json").read_text())
    # 2 nodes x 2 processes: torchrun on each node got the launcher's NNODES/NODE_RANK/MASTER_*.
    assert result["world_size"] == 4
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    run_dir = shared / "runs" / "qwen"
    for rank, seen in ranks.items():
        node = rank // 2
        env = seen["env"]
        assert env["NNODES"] == "2" and env["NODE_RANK"] == str(node) and env["WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["GPUS_PER_NODE"] == "2"
        assert env["NCCL_IB_DISABLE"] == "1", "auto: no InfiniBand devices on this machine"
        assert env["NCCL_SOCKET_IFNAME"] == "=lo"
        assert env["CLUSTER_OUTPUT_DIR"] == str(run_dir)
        assert env["DEEPSPEED_CONFIG"] == str(run_dir / "launch" / "deepspeed.json")
        assert seen["accelerate_machine_rank"] == node, "each node reads its own accelerate config"
        assert seen["cwd"] == str(workdir), "the command runs in training_workdir"
        assert env["HF_HOME"].endswith("hf-home"), "training_env reaches the training processes"
    assert len({tuple(r["params"]) for r in ranks.values()}) == 1, "DDP kept the ranks in step"
    assert (workdir / "output_qwen" / "checkpoint-6" / "state.pt").exists()
    log = (run_dir / "launch" / "node-1" / "log").read_text()
    assert "finetune_lora_ds.sh" in log.splitlines()[0], "each node's log starts with what it ran"


def test_a_command_failing_on_one_node_stops_every_node_and_is_named(cluster):
    inventory, shared, _ = cluster
    gives_up = (
        'if [ "$NODE_RANK" = 1 ]; then echo "node 1: out of patience"; exit 3; fi; '
        "exec python -c 'import time; time.sleep(600)'"
    )
    started = time.monotonic()
    rc, out = run(launch(inventory, "exit3", "--", "bash", "-c", gives_up), timeout=300)
    took = time.monotonic() - started
    assert rc == 3, "the command's own exit code, the cause's"
    assert "failed: node1 (node 1) exited with code 3" in out, out
    assert "node 1: out of patience" in out, "the failing node's last lines are shown"
    assert "[node0] node 0: stopped" in out, out
    assert took < 120, f"{took:.0f} s: node 0's sleep was not stopped promptly"
    node0 = shared / "runs" / "exit3" / "launch" / "node-0"
    assert launch_processes(node0) == [], "node 0's command was stopped"


def test_env_and_training_env_reach_the_processes_and_secrets_stay_hidden(cluster):
    inventory, shared, _ = cluster
    node0 = shared / "runs" / "envs" / "launch" / "node-0"
    env = {**os.environ, "HF_TOKEN": CLI_SECRET}
    launcher = subprocess.Popen(
        launch(
            inventory, "envs", "--env", "EXTRA_SETTING=two words", "--env", "HF_TOKEN",
            "--", "python", "-c", "import time; time.sleep(600)",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (pids := launch_processes(node0) if (node0 / "node_ctl.py").exists() else []):
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "node 0's command did not start within 180 s"
            time.sleep(0.5)
        seen = dict(item.decode().split("=", 1) for item in environ(pids[-1]) if b"=" in item)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert seen["EXTRA_SETTING"] == "two words"
    assert seen["HF_TOKEN"] == CLI_SECRET, "--env NAME takes the value from the launching shell"
    assert seen["WANDB_API_KEY"] == INVENTORY_SECRET and seen["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert seen["NODE_RANK"] == "0" and seen["NNODES"] == "2"
    assert launcher.returncode == 130, out
    assert launch_processes(node0) == [], "TERM to the launcher stopped the command"
    for secret in (INVENTORY_SECRET, CLI_SECRET):
        assert secret not in out
        assert secret not in (node0 / "run.sh").read_text()
    secret_file = node0 / "secret-env"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert INVENTORY_SECRET in secret_file.read_text() and CLI_SECRET in secret_file.read_text()


def test_a_relaunch_keeps_the_earlier_launches_logs(cluster):
    inventory, shared, _ = cluster
    for attempt in ("first", "second", "third"):
        rc, out = run(
            launch(
                inventory, "again", "--env", f"ATTEMPT={attempt}", "--", "bash", "-c", "echo attempt $ATTEMPT"
            )
        )
        assert rc == 0, out
    for rank in (0, 1):
        node_dir = shared / "runs" / "again" / "launch" / f"node-{rank}"
        assert "attempt first" in (node_dir / "log.1").read_text()
        assert "attempt second" in (node_dir / "log.2").read_text()
        assert "attempt third" in (node_dir / "log").read_text()
        assert json.loads((node_dir / "exit.1").read_text())["exit_code"] == 0


def test_plan_shows_each_nodes_environment_and_command_without_touching_anything(cluster):
    inventory, shared, workdir = cluster
    shell = {**os.environ, "HF_TOKEN": "abc123"}  # a secret comes from the shell, never the command line
    rc, out = run(trainer("plan", "-i", str(inventory), "--env", "HF_TOKEN", "--", *QWEN_SCRIPT), 120, shell)
    assert rc == 0, out
    assert "node 1 (node1):" in out and "NODE_RANK=1" in out
    assert f"ACCELERATE_CONFIG_FILE={shared}/runs/default/launch/accelerate-node1.yaml" in out
    assert f"cd {workdir} && bash finetune/finetune_lora_ds.sh -m tiny-model -d data.json" in out
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in out
    assert "WANDB_API_KEY=<redacted>" in out and "HF_TOKEN=<redacted>" in out
    assert INVENTORY_SECRET not in out and "abc123" not in out
    rc, out = run(trainer("plan", "-i", str(inventory), "--json", "--", *QWEN_SCRIPT), 120)
    plan = json.loads(out)
    assert plan["env"]["node1"]["NODE_RANK"] == "1" and plan["env"]["node1"]["WANDB_API_KEY"] == "<redacted>"
    assert plan["commands"]["node0"] == QWEN_SCRIPT and plan["workdirs"]["node0"] == str(workdir)
    assert not shared.exists(), "plan touched nothing"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--env", "2FAST=x"], "'2FAST' is not a valid environment variable name"),
        (["--env", "NODE_RANK=3"], "NODE_RANK is set by the launcher"),
        (["--env", "UNSET_IN_THIS_SHELL_X"], "UNSET_IN_THIS_SHELL_X is not set in this shell"),
        (["--engine", "deepspeed"], "--engine picks the bundled trainer's engine"),
    ],
    ids=["bad-name", "launcher-variable", "unset", "engine-with-command"],
)
def test_bad_command_line_is_refused_before_anything_starts(cluster, args, expected):
    inventory, shared, _ = cluster
    rc, out = run(launch(inventory, "bad", *args, "--", "true"), 120)
    assert rc == 2, out
    assert expected in out
    assert not shared.exists()


def test_bad_training_env_is_refused_naming_the_hosts_and_the_fix(cluster):
    inventory, shared, _ = cluster
    settings_file = inventory / "group_vars" / "cluster" / "all.yml"
    settings = yaml.safe_load(settings_file.read_text())
    settings["training_env"] = {"MASTER_PORT": 1234, "BAD-NAME": "x", "NESTED": [1, 2]}
    settings_file.write_text(yaml.safe_dump(settings))
    rc, out = run(launch(inventory, "bad", "--", "true"), 120)
    assert rc == 2, out
    assert (
        "hosts node0, node1: training_env: MASTER_PORT is set by the launcher from cluster_master_port" in out
    )
    assert "'BAD-NAME' is not a valid environment variable name" in out
    assert "training_env.NESTED is [1, 2]; fix: give a string or a number" in out
    assert not shared.exists()


def test_a_program_that_is_not_there_stops_the_launch_before_any_node_starts(cluster):
    inventory, shared, _ = cluster
    rc, out = run(launch(inventory, "missing", "--", "no-such-trainer-program", "--lr", "1"), 300)
    assert rc == 1, out
    assert "could not start on" in out and "'no-such-trainer-program' is not found" in out, out
    for rank in (0, 1):
        assert not (shared / "runs" / "missing" / "launch" / f"node-{rank}" / "log").exists()


def test_a_command_with_template_braces_reaches_the_nodes_as_written(cluster):
    # Ansible renders {{ }} in whatever it is given as a template; the launcher gives values only.
    inventory, shared, _ = cluster
    rc, out = run(
        launch(inventory, "braces", "--", "bash", "-c", "echo 'sum {{ 1 + 1 }} {% raw %}'"), timeout=300
    )
    assert rc == 0, out
    log = (shared / "runs" / "braces" / "launch" / "node-0" / "log").read_text()
    assert "sum {{ 1 + 1 }} {% raw %}" in log.splitlines(), log


def test_the_prestarted_launch_is_given_every_variable_it_was_started_for(cluster):
    # start.yml is started before the plan, its variables named in advance (LAUNCH_VARS): a name
    # missing there would make every launch start ansible-playbook a second time.
    from trainer.controller.inventory import load_cluster
    from trainer.controller.launcher.launch import Launcher
    from trainer.controller.launcher.plan import make_plan
    from trainer.controller.launcher.wire import LAUNCH_VARS

    inventory, _, _ = cluster
    launcher = Launcher(make_plan(load_cluster(inventory), None, (), None, "names", command=("true",)))
    assert set(launcher.extravars()) == LAUNCH_VARS
