"""The Qwen guide's job through `trainer launch` on this machine: two loopback "hosts" (node ranks 0
and 1, one process each, gloo), LoRA with DeepSpeed ZeRO-2, the model and the data on the shared dir.
The same path as on a cluster (ansible-runner, the launch playbooks, run.sh, torchrun), without the
container test bed (tests/testbed/test_finetune_testbed.py is the same job on it)."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.finetune_harness import build, generate
from helpers.loopback_launch import launch_command, loopback_cluster  # noqa: F401


@pytest.mark.bed_twin(
    "tests/testbed/test_finetune_testbed.py::test_lora_with_deepspeed_on_two_nodes_from_the_shared_dir"
)
def test_lora_with_deepspeed_through_launch_on_two_loopback_nodes(loopback_cluster):  # noqa: F811
    inventory, shared = loopback_cluster
    models = shared / "models"
    build("model", str(models / "tiny-qwen2"))
    build("data", str(models / "conversations.jsonl"), "--jsonl")
    sets = [
        f"model.name_or_path={models / 'tiny-qwen2'}", f"data.path={models / 'conversations.jsonl'}",
        "model.max_length=128", "train.micro_batch_size=8", "train.max_steps=8", "train.log_every=2",
        "train.warmup_steps=1", "checkpoint.save_steps=4", "distributed.engine=deepspeed",
        "distributed.zero_stage=2", "lora.enabled=true", "train.learning_rate=0.03", "train.min_lr=0.003",
    ]  # fmt: skip
    done = subprocess.run(
        launch_command(inventory, "--run-name", "lora", *[a for s in sets for a in ("--set", s)]),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "step 8/8" in out and "a LoRA adapter (r=8)" in out
    assert "[node1] node 1: done" in out and "[node0] node 0: done" in out
    run = shared / "runs" / "lora"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 8 and metrics[-1]["world_size"] == 2
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine"] == "deepspeed" and len(set(summary["param_checksums"])) == 1
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert generate(run / "final", adapter_base=models / "tiny-qwen2")
