"""The launcher forms users type after `trainer launch --` form one job across two loopback "hosts"
(ansible_connection local, 2 processes each, CPU only), through the real playbooks and the real
launchers: plain torchrun (no --nnodes: the PET_* environment), `python -m torch.distributed.run`,
`accelerate launch` without --config_file and with the generated one, and `deepspeed` (run as one
node's share per node). The script of tests/data/world_forms all-reduces a 1: every process must see
world size 4 and a sum of 4. The accelerate script does not pass cpu=True, as most do not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import loopback

FORMS = Path(__file__).resolve().parents[1] / "data" / "world_forms"


@pytest.fixture
def cluster(tmp_path) -> tuple[Path, Path, Path]:
    """(inventory, shared dir, working dir): node0 (head, 127.0.0.1) and node1 (127.0.0.2), 2
    processes each, the working dir holding the scripts of tests/data/world_forms."""
    workdir = tmp_path / "code"
    shutil.copytree(FORMS, workdir)
    inventory, shared = loopback.write_inventory(
        tmp_path,
        cluster_nccl_ib_disable="auto",
        training_procs_per_node=2,
        training_workdir=str(workdir),
        # accelerate's own default config would be read from here: empty, so only ours counts.
        training_env={"HF_HOME": str(tmp_path / "hf-home"), "HOLD_S": "3"},
    )
    return inventory, shared, workdir


def launch(inventory: Path, run_name: str, *command: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name,
         "--poll-interval", "1", "--", *command],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def results(workdir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((workdir / "results").glob("rank-*.json"))]


def assert_one_world(workdir: Path, out: str) -> list[dict]:
    seen = results(workdir)
    assert sorted(r["rank"] for r in seen) == [0, 1, 2, 3], out
    assert {r["world_size"] for r in seen} == {4}, out
    assert {r["sum"] for r in seen} == {4}, "the all-reduce spanned both nodes"
    return seen


@pytest.mark.parametrize(
    "command",
    [
        ["torchrun", "allreduce.py"],
        ["python", "-m", "torch.distributed.run", "allreduce.py"],
    ],
    ids=["torchrun", "python-m-torch.distributed.run"],
)
def test_plain_torchrun_forms_one_job_from_the_pet_environment(cluster, command):
    inventory, _, workdir = cluster
    rc, out = launch(inventory, "plain", *command)
    assert rc == 0, out
    seen = assert_one_world(workdir, out)
    assert {r["node_rank"] for r in seen} == {"0", "1"}
    assert "world check: all 2 nodes joined the job" in out, out


def test_a_job_shorter_than_the_poll_interval_is_still_seen_joined(cluster):
    """An all-reduce that ends at once, followed every 30 s: the launcher's polls cannot catch its
    connection to the head; the worker's own watcher (run.sh) must have."""
    inventory, shared, workdir = cluster
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", "short",
         "--poll-interval", "30", "--env", "HOLD_S=0", "--", "torchrun", "allreduce.py"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert_one_world(workdir, out)
    assert "world check: all 2 nodes joined the job" in out, out
    node1 = shared / "runs" / "short" / "launch" / "node-1"
    assert (node1 / "joined").read_text().strip() == (node1 / "launch-id").read_text().strip()


def test_accelerate_without_config_file_gets_this_nodes_file_and_uses_gloo_on_cpu(cluster):
    inventory, shared, workdir = cluster
    rc, out = launch(inventory, "acc", "accelerate", "launch", "accelerate_allreduce.py")
    assert rc == 0, out
    seen = assert_one_world(workdir, out)
    # Not "NO" (one single-process job per process): accelerate's CPU backend across both nodes.
    assert {r["distributed_type"] for r in seen} == {"DistributedType.MULTI_CPU"}, seen
    run_sh = (shared / "runs" / "acc" / "launch" / "node-1" / "run.sh").read_text()
    assert "--config_file" in run_sh and "accelerate-node1.yaml" in run_sh


def test_accelerate_with_the_generated_file_forms_one_job_on_cpu_nodes(cluster):
    inventory, _, workdir = cluster
    script = 'exec accelerate launch --config_file "$ACCELERATE_CONFIG_FILE" accelerate_allreduce.py'
    rc, out = launch(inventory, "acc-file", "bash", "-c", script)
    assert rc == 0, out
    seen = assert_one_world(workdir, out)
    assert {r["distributed_type"] for r in seen} == {"DistributedType.MULTI_CPU"}, seen


def test_deepspeed_runs_one_nodes_share_per_node(cluster):
    inventory, shared, workdir = cluster
    rc, out = launch(inventory, "ds", "deepspeed", "allreduce.py")
    assert rc == 0, out
    assert_one_world(workdir, out)
    run_sh = (shared / "runs" / "ds" / "launch" / "node-1" / "run.sh").read_text()
    assert "--no_ssh --node_rank=1" in run_sh


def test_a_single_node_form_is_refused_before_any_host_is_touched(cluster):
    inventory, shared, _ = cluster
    rc, out = launch(inventory, "standalone", "torchrun", "--standalone", "allreduce.py")
    assert rc == 2, out
    assert "--standalone starts a separate single-node job on each of the 2 nodes" in out
    assert "fix: drop --standalone" in out
    assert not (shared / "runs" / "standalone").exists(), "nothing was started or written"


def test_the_plan_shows_the_launcher_what_it_reads_and_what_each_node_runs(cluster):
    inventory, _, _ = cluster
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--json", "--",
         "accelerate", "launch", "accelerate_allreduce.py"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["user_launcher"] == "accelerate"
    node1 = plan["commands"]["node1"]
    assert node1[:4] == ["accelerate", "launch", "--config_file", node1[3]] and node1[3].endswith(
        "accelerate-node1.yaml"
    )
    env = plan["env"]["node1"]
    assert env["PET_NODE_RANK"] == "1" and env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["PET_MASTER_ADDR"] == "127.0.0.1" and env["ACCELERATE_USE_CPU"] == "true"
    shown = subprocess.run(
        [sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--", "torchrun", "allreduce.py"],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert "torchrun: reads PET_NNODES, PET_NODE_RANK" in " ".join(shown.split()), shown
