"""`trainer sbatch`: the launch's job as a Slurm (or PBS) batch script, run on a real Slurm.

The Slurm is tests/helpers/slurm_cluster.py: slurmctld and two slurmd on this machine, each node in a network
namespace of its own (two addresses, two routes to the head). It needs root and the Debian packages
slurmctld, slurmd, slurm-client and munge; without them the Slurm tests are skipped with the reason.
The script checks that need no Slurm (syntax, secrets, PBS form) always run.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.loopback import VENV
from helpers.slurm_cluster import SlurmCluster, slurm_for_test

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

OWN_COMMAND = Path(__file__).resolve().parents[1] / "data" / "own_command"
TINY = ("train.log_every=1", "train.warmup_steps=1", "checkpoint.save_steps=2")


def sbatch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "sbatch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def sets(*items: str) -> list[str]:
    return [arg for item in (*TINY, *items) for arg in ("--set", item)]


def inventory_for_slurm(tmp_path: Path, secret: str = "") -> tuple[Path, Path, Path]:
    """An inventory of two nodes for a Slurm job: (inventory, shared dir, working dir). The hosts'
    names and addresses do not matter (Slurm picks the hosts); the shared dir, venv, working dir
    and training_env do."""
    shared, workdir = tmp_path / "shared", tmp_path / "code"
    shared.mkdir()
    shutil.copytree(OWN_COMMAND, workdir)
    (workdir / "data.json").write_text(json.dumps([[x / 10, 3 * x / 10 + 1] for x in range(40)]))
    inventory = tmp_path / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    node = {"cluster_accelerators": 0}
    hosts = {
        "cluster": {
            "children": {
                "head": {"hosts": {"a": {"cluster_ip": "192.0.2.10", **node}}},
                "workers": {"hosts": {"b": {"cluster_ip": "192.0.2.11", **node}}},
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    settings = {
        "cluster_master_port": 29512,
        "cluster_shared_dir": str(shared),
        "training_venv": str(VENV),
        "training_procs_per_node": 2,
        "training_engine": "ddp",
        "training_workdir": str(workdir),
        "cluster_nccl_timeout_s": 120,
        "training_env": {"HF_HOME": str(tmp_path / "hf"), **({"WANDB_API_KEY": secret} if secret else {})},
    }
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(settings))
    return inventory, shared, workdir


# --- the scripts, without Slurm --------------------------------------------------------------------


def test_scripts_are_valid_bash_and_carry_the_job(tmp_path):
    inventory, shared, _ = inventory_for_slurm(tmp_path)
    for flag, suffix in (([], "sbatch"), (["--pbs"], "pbs")):
        target = tmp_path / f"job.{suffix}"
        done = sbatch("-i", str(inventory), "--run-name", "syntax", "-o", str(target), *flag, *sets())
        assert done.returncode == 0, done.stderr
        script = target.read_text()
        assert subprocess.run(["bash", "-n", str(target)], capture_output=True).returncode == 0, script
        assert f"{shared}/runs/syntax/launch/node.sh" in script
        assert "export MASTER_ADDR" in script and "export HF_HOME=" in script
    slurm = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in slurm and "#SBATCH --ntasks-per-node=1" in slurm
    assert "scontrol show hostnames" in slurm and "srun --kill-on-bad-exit=1" in slurm
    # Static rendezvous (node rank = the scheduler's node id), as trainer launch starts it.
    assert '--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' in slurm
    assert "--rdzv-backend" not in slurm
    assert "#SBATCH --gpus-per-node" not in slurm, "CPU nodes ask for no GPUs"
    pbs = (tmp_path / "job.pbs").read_text()
    assert "#PBS -l nodes=2:ppn=2" in pbs and '"$PBS_NODEFILE"' in pbs and "ssh -o BatchMode=yes" in pbs
    # node.sh as the batch script writes it is valid bash too.
    node_sh = slurm.split("node.sh <<'CLUSTERTRAIN_EOF'\n", 1)[1].split("\nCLUSTERTRAIN_EOF\n", 1)[0]
    (tmp_path / "node.sh").write_text(node_sh + "\n")
    assert subprocess.run(["bash", "-n", str(tmp_path / "node.sh")], capture_output=True).returncode == 0


def test_the_bundled_trainer_is_warned_before_the_time_limit_and_your_command_is_not(tmp_path):
    inventory, _, _ = inventory_for_slurm(tmp_path)
    scripts = {}
    for name, args in (
        ("default", []),
        ("longer", ["--warning-seconds", "300"]),
        ("off", ["--warning-seconds", "0"]),
        ("own", ["--", "python", "train.py"]),
    ):
        target = tmp_path / f"{name}.sbatch"
        done = sbatch("-i", str(inventory), "--run-name", name, "-o", str(target), *sets(), *args)
        assert done.returncode == 0, done.stderr
        scripts[name] = target.read_text()
    asked = "#SBATCH --signal=USR2@120\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
    script = scripts["default"]
    # sbatch reads #SBATCH lines only before the script's first command.
    assert asked in script and script.index(asked) < script.index("set -euo pipefail"), script
    assert "#SBATCH --signal=USR2@300\n" in scripts["longer"]
    node_sh = script.split("node.sh <<'CLUSTERTRAIN_EOF'\n", 1)[1].split("\nCLUSTERTRAIN_EOF\n", 1)[0]
    # node.sh and torchrun live through the signal; the trainer's ranks take it.
    assert node_sh.index("trap '' USR2") < node_sh.index("/torchrun"), node_sh
    for unwarned in ("off", "own"):
        assert "#SBATCH --signal" not in scripts[unwarned] and "#SBATCH --requeue" not in scripts[unwarned]
    # Your own command gets SIGUSR2 as it is (it may handle it; a shell that inherits it ignored cannot).
    assert "trap '' USR2" not in scripts["own"]


def test_gpu_nodes_ask_slurm_for_their_gpus(tmp_path):
    target = tmp_path / "gpu.sbatch"
    done = sbatch("--nodes", "4", "--gpus-per-node", "8", "--shared-dir", str(tmp_path), "-o", str(target))
    assert done.returncode == 0, done.stderr
    script = target.read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert '"bf16": {\n    "enabled": true' in script, "GPU nodes train in bf16 (mixed_precision auto)"


def test_secrets_stay_out_of_the_script_in_0600_files_the_job_reads(tmp_path):
    # Slurm keeps every submitted script in slurmctld's state and accounting: a secret in it outlives
    # the job, readable by the cluster's admins and tools. So the script holds none.
    inventory, shared, _ = inventory_for_slurm(tmp_path, secret="wandb-secret-3c1")
    target = tmp_path / "secret.sbatch"
    done = sbatch(
        "-i", str(inventory), "--run-name", "secrets", "-o", str(target), "--env", "HF_TOKEN",
        "--", "bash", "train.sh", env={**os.environ, "HF_TOKEN": "hf-secret-88a"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wandb-secret-3c1" not in done.stdout + done.stderr and "hf-secret-88a" not in done.stdout
    script = target.read_text()
    assert "wandb-secret-3c1" not in script and "hf-secret-88a" not in script
    secret_env = shared / "runs" / "secrets" / "launch" / "secret-env"
    assert stat.S_IMODE(secret_env.stat().st_mode) == 0o600
    assert secret_env.read_text() == "export HF_TOKEN=hf-secret-88a\nexport WANDB_API_KEY=wandb-secret-3c1\n"
    node_part = script.split("node.sh <<'CLUSTERTRAIN_EOF'\n", 1)[1].split("\nCLUSTERTRAIN_EOF\n", 1)[0]
    assert '. "$launch_dir/secret-env"' in node_part, "node.sh reads the secrets when the job runs"

    # A secret in the trainer config (the health webhook): config.yaml is such a file too.
    config = tmp_path / "webhook.yaml"
    config.write_text("health:\n  webhook_url: https://hooks.example.com/services/T0/hook-secret-51f\n")
    done = sbatch("-i", str(inventory), "--run-name", "hooked", "--config", str(config), "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert "hook-secret-51f" not in target.read_text() + done.stdout
    written = shared / "runs" / "hooked" / "launch" / "config.yaml"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and "hook-secret-51f" in written.read_text()


def test_a_job_with_secrets_is_refused_where_the_shared_dir_is_not_mounted(tmp_path):
    inventory, shared, _ = inventory_for_slurm(tmp_path, secret="wandb-secret-3c1")
    shared.rmdir()  # this machine does not have the cluster's shared dir
    done = sbatch("-i", str(inventory), "-o", str(tmp_path / "x.sbatch"), "--", "bash", "train.sh")
    assert done.returncode == 2 and "run trainer sbatch where the shared dir is mounted" in done.stderr
    assert not (tmp_path / "x.sbatch").exists() and "wandb-secret-3c1" not in done.stderr


def test_bad_arguments_are_refused(tmp_path):
    inventory, _, _ = inventory_for_slurm(tmp_path)
    for args, expected in (
        (["--nodes", "2", "-i", str(inventory)], "either -i INVENTORY or --nodes N"),
        (["--nodes", "2"], "CPU nodes need --procs-per-node"),
        ([], "give -i INVENTORY, or --nodes N"),
        (["-i", str(inventory), "--env", "MASTER_ADDR=x"], "MASTER_ADDR is set by the launcher"),
        (["-i", str(inventory), "--warning-seconds", "-1"], "--warning-seconds must be 0 to 65535, not -1"),
        (["-i", str(inventory), "--warning-seconds", "70000"], "--warning-seconds must be 0 to 65535"),
    ):
        done = sbatch(*args, "-o", str(tmp_path / "x.sbatch"))
        assert done.returncode == 2 and expected in done.stderr, (args, done.stderr)
    assert not (tmp_path / "x.sbatch").exists()


# --- on a real Slurm -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_for_test(tmp_path_factory.mktemp("slurm"), nodes=2) as cluster:
        yield cluster


def run_job(slurm: SlurmCluster, script: Path, cwd: Path, timeout: float = 600) -> str:
    job = slurm.submit(script, cwd=cwd)
    state = slurm.wait(job, timeout)
    output = (cwd / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output[-6000:]}\n{slurm.logs()}"
    return output


@pytest.mark.slow
def test_the_bundled_trainer_trains_on_two_slurm_nodes_and_a_resubmission_resumes(slurm, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = tmp_path / "train.sbatch"
    common = ["--nodes", "2", "--procs-per-node", "2", "--shared-dir", str(shared), "--run-name", "slurm"]
    assert sbatch(*common, "-o", str(script), *sets("train.max_steps=4")).returncode == 0
    output = run_job(slurm, script, shared)
    run_dir = shared / "runs" / "slurm"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["final_step"] == 4, output
    assert len(set(map(str, summary["param_checksums"]))) == 1
    assert "node 1 of 2" in output and "node 0 of 2" in output, "one task per node"
    addresses = {slurm.addresses[name] for name in slurm.nodes}
    assert f"master {slurm.addresses['sn0']}:29500" in output and len(addresses) == 2
    # Resubmitted with more steps: it resumes from the run's latest checkpoint.
    assert sbatch(*common, "-o", str(script), *sets("train.max_steps=6")).returncode == 0
    run_job(slurm, script, shared)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 6 and "step-4" in str(summary["resumed_from"])


@pytest.mark.slow
def test_a_qwen_shaped_script_runs_on_slurm_from_the_inventory(slurm, tmp_path):
    inventory, shared, workdir = inventory_for_slurm(tmp_path)
    script = tmp_path / "qwen.sbatch"
    done = sbatch(
        "-i", str(inventory), "--run-name", "qwen", "-o", str(script),
        "--", "bash", "finetune/finetune_lora_ds.sh", "-m", "tiny-model", "-d", "data.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    output = run_job(slurm, script, shared)
    result = json.loads((workdir / "output_qwen" / "result.json").read_text())
    assert result["world_size"] == 4, output
    for seen in result["ranks"]:
        node = seen["rank"] // 2
        env = seen["env"]
        assert env["NODE_RANK"] == str(node) and env["NNODES"] == "2"
        assert env["MASTER_ADDR"] == slurm.addresses["sn0"] and env["MASTER_PORT"] == "29512"
        assert env["NCCL_SOCKET_IFNAME"] == "=eth0", "auto: the interface toward the head"
        assert env["NCCL_IB_DISABLE"] == "1" and env["HF_HOME"] == str(tmp_path / "hf")
        assert env["CLUSTER_OUTPUT_DIR"] == str(shared / "runs" / "qwen")
        assert seen["accelerate_machine_rank"] == node and seen["cwd"] == str(workdir)
    assert len({tuple(r["params"]) for r in result["ranks"]}) == 1


def kept_by_slurm(slurm: SlurmCluster, job: str) -> str:
    """The batch script as slurmctld keeps it (what its admins and `scontrol` read after the job)."""
    return subprocess.run(
        ["scontrol", "write", "batch_script", job, "-"],
        capture_output=True, text=True, env=slurm.env, timeout=30,
    ).stdout  # fmt: skip


def test_a_slurm_job_gets_its_secret_at_run_time_and_slurm_keeps_none(slurm, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = tmp_path / "secret.sbatch"
    done = sbatch(
        "--nodes", "2", "--procs-per-node", "1", "--shared-dir", str(shared), "--run-name", "secret",
        "-o", str(script), "--env", "WANDB_API_KEY", "--", "sh", "-c",
        'printf %s "$WANDB_API_KEY" > "got-$NODE_RANK"',
        env={**os.environ, "WANDB_API_KEY": "wandb-secret-9d2"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = slurm.submit(script, cwd=shared)
    state = slurm.wait(job, 180)
    assert state == "COMPLETED", (shared / f"slurm-{job}.out").read_text()[-3000:]
    assert [(shared / f"got-{rank}").read_text() for rank in (0, 1)] == ["wandb-secret-9d2"] * 2
    kept = kept_by_slurm(slurm, job)
    assert "srun --kill-on-bad-exit" in kept, "slurmctld keeps the script"
    assert "wandb-secret-9d2" not in kept


def test_a_second_slurm_job_of_a_running_run_is_refused_and_the_first_finishes(slurm, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = tmp_path / "busy.sbatch"
    # The command waits for a file the test writes: the first job runs for as long as the test needs.
    done = sbatch(
        "--nodes", "1", "--procs-per-node", "1", "--shared-dir", str(shared), "--run-name", "busy",
        "-o", str(script), "--", "sh", "-c",
        'while [ ! -e go ]; do sleep 0.2; done; echo finished > "done-$CLUSTER_JOB_ID"',
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lock = shared / "runs" / "busy" / "job.lock"
    first = slurm.submit(script, cwd=shared)
    deadline = time.monotonic() + 120
    while not (shared / "runs" / "busy" / "launch" / "job.env").exists():  # written under the lock
        assert time.monotonic() < deadline, f"the first job never started: {slurm.logs()}"
        time.sleep(0.2)

    second = slurm.submit(script, cwd=shared)
    assert slurm.wait(second, 120) == "FAILED"
    assert slurm.job(second).get("ExitCode") == "2:0"
    refused = (shared / f"slurm-{second}.out").read_text()
    assert f"is in use by the batch job of run busy (job {first})" in refused, refused[-3000:]

    (shared / "go").touch()
    state = slurm.wait(first, 120)
    assert state == "COMPLETED", (shared / f"slurm-{first}.out").read_text()[-3000:]
    assert (shared / f"done-{first}").read_text() == "finished\n", "the first job was disturbed"
    assert not lock.exists(), "the lock outlived its job"
