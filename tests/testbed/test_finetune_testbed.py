"""The Qwen guide's job on the Molecule test bed: LoRA fine-tuning of a Hugging Face model with DeepSpeed
ZeRO-2 on two nodes (ct-head, ct-worker1; one process each, gloo over the podman network) through
`trainer launch`, with the model and the conversations on the shared dir.

The model is the tiny random-init Qwen2 of scripts/build_tiny_hf_model.py, built here into the shared
dir (the same path on this machine and in the containers); the test removes it and its run afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.bed_launch import BED_UP, INVENTORY, group_vars, launch, run_launch
from helpers.finetune_harness import generate

REPO = Path(__file__).resolve().parents[2]
NODES = ("ct-head", "ct-worker1")
#: Its own (access 29543, node loss 29547, launcher forms 29549, commands 29551), so a run another
#: test left behind cannot hold it.
MASTER_PORT = 29545

pytestmark = [pytest.mark.slow, BED_UP]


@pytest.fixture
def two_nodes(tmp_path):
    """(inventory of ct-head and ct-worker1, one process each; run name; run dir; shared model dir)."""
    inventory = tmp_path / "inventory"
    shutil.copytree(INVENTORY, inventory)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    del hosts["cluster"]["children"]["workers"]["hosts"]["ct-worker2"]
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    overrides = {
        "training_procs_per_node": 1,
        "cluster_master_port": MASTER_PORT,
        "training_engine": "deepspeed",
    }
    (inventory / "group_vars" / "cluster" / "zz_finetune_test.yml").write_text(yaml.safe_dump(overrides))
    shared = Path(group_vars()["cluster_shared_dir"])
    tag = uuid.uuid4().hex[:8]
    models = shared / f"finetune-test-{tag}"
    script = REPO / "scripts" / "build_tiny_hf_model.py"
    for args in (
        ["model", str(models / "tiny-qwen2")],
        ["data", str(models / "conversations.jsonl"), "--jsonl"],
    ):
        subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, timeout=300)
    for path in [models, *models.rglob("*")]:  # the training user in the containers reads them
        path.chmod(0o755 if path.is_dir() else 0o644)
    run_name = f"finetune-{tag}"
    output = shared / "runs" / run_name
    yield inventory, run_name, output, models
    shutil.rmtree(output, ignore_errors=True)
    shutil.rmtree(models, ignore_errors=True)


def test_lora_with_deepspeed_on_two_nodes_from_the_shared_dir(two_nodes):
    inventory, run_name, output, models = two_nodes
    sets = (
        f"model.name_or_path={models / 'tiny-qwen2'}", f"data.path={models / 'conversations.jsonl'}",
        "model.max_length=128", "train.micro_batch_size=8", "train.max_steps=8", "distributed.zero_stage=2",
        "lora.enabled=true", "train.learning_rate=0.03", "train.min_lr=0.003",
    )  # fmt: skip
    rc, out = run_launch(launch(inventory, run_name, *sets), timeout=1500)
    assert rc == 0, out
    assert "step 8/8" in out and all(f"[{host}]" in out for host in NODES), out
    assert "a LoRA adapter (r=8)" in out
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 8 and metrics[-1]["world_size"] == 2
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["engine"] == "deepspeed" and summary["num_nodes"] == 2
    assert len(set(summary["param_checksums"])) == 1, "the nodes ended with different adapters"
    final = output / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert generate(final, adapter_base=models / "tiny-qwen2")  # loads here with plain transformers + peft
