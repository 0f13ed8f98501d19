"""One DeepSpeed config for a run: the `deepspeed.json` the controller writes into the launch dir is the
config the nodes' DeepSpeed engine trains with (both come from trainer.ds_config.build), for every
ZeRO stage, with and without bf16, and with a user's own JSON (offload, "auto" values) merged in."""

from __future__ import annotations

import json

import pytest
from helpers.plan_inventory import three_nodes

from trainer.controller.launcher.launchfiles import deepspeed_config, launch_files
from trainer.controller.launcher.plan import make_plan
from trainer.node.config import load_config
from trainer.node.engines.ds_json import deepspeed_config as node_deepspeed_config

#: Offload and the Qwen guide's style: "auto" wherever the trainer decides, the rest as the user wrote.
OFFLOAD = {
    "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_bucket_size": 2e8},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 100,
}  # fmt: skip


def controller_and_node(tmp_path, gpus: bool, sets: list[str]) -> tuple[dict, dict]:
    """The launch dir's deepspeed.json, and the config a node builds from the launch dir's config.yaml
    (bf16 as the node decides it: mixed_precision auto is bf16 on a GPU that has it, as on H100s)."""
    inventory = three_nodes(
        tmp_path, cluster_shared_dir=str(tmp_path / "shared"), **({"cluster_accelerators": 2} if gpus else {})
    )
    plan = make_plan(inventory, overrides=["distributed.engine=deepspeed", *sets])
    files = launch_files(plan)
    (tmp_path / "config.yaml").write_text(files["config.yaml"])
    loaded = load_config(tmp_path / "config.yaml")
    wanted = loaded.train.mixed_precision
    bf16 = wanted == "bf16" or (wanted == "auto" and gpus)
    node = node_deepspeed_config(loaded.train, loaded.distributed, plan.topology.world_size, bf16)
    return json.loads(files["deepspeed.json"]), node


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("gpus", "precision", "bf16"), [(True, "auto", True), (False, "auto", False),
                                                         (True, "'no'", False)])  # fmt: skip
def test_the_launch_dir_holds_the_config_the_nodes_train_with(tmp_path, stage, gpus, precision, bf16):
    sets = [
        *(f"distributed.zero_stage={stage}", f"train.mixed_precision={precision}"),
        *("train.micro_batch_size=3", "train.gradient_accumulation_steps=2", "train.grad_clip=0.5"),
    ]
    controller, node = controller_and_node(tmp_path, gpus, sets)
    assert controller == node
    assert controller["zero_optimization"] == {"stage": stage}
    assert controller["bf16"] == {"enabled": bf16}
    # three nodes of two processes
    assert (controller["train_batch_size"], controller["gradient_clipping"]) == (3 * 2 * 6, 0.5)


@pytest.mark.parametrize("gpus", [True, False])
def test_a_users_json_with_offload_and_auto_values_is_merged_the_same_on_both_sides(tmp_path, gpus):
    path = tmp_path / "ds_offload.json"
    path.write_text(json.dumps(OFFLOAD))
    sets = [f"distributed.deepspeed_config={path}", "distributed.zero_stage=3", "train.micro_batch_size=4"]
    controller, node = controller_and_node(tmp_path, gpus, sets)
    assert controller == node
    assert "auto" not in json.dumps(controller)
    assert controller["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert controller["zero_optimization"]["stage"] == 3 and controller["bf16"] == {"enabled": gpus}
    assert controller["steps_per_print"] == 100, "what the user wrote goes through"
    assert "optimizer" not in controller and "scheduler" not in controller, "the trainer's own run"
    assert controller["train_batch_size"] == 4 * 6


def test_a_relative_json_is_read_from_the_head_s_working_directory(tmp_path, monkeypatch):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "ds.json").write_text(json.dumps(OFFLOAD))
    monkeypatch.chdir(tmp_path)  # the controller's own directory holds no ds.json
    inventory = three_nodes(tmp_path, cluster_shared_dir=str(tmp_path / "shared"), cluster_accelerators=2)
    plan = make_plan(
        inventory, overrides=["distributed.engine=deepspeed", "distributed.deepspeed_config=ds.json"]
    )
    controller = deepspeed_config(plan)
    monkeypatch.chdir(tmp_path / "shared")  # where the nodes run the trainer (training_workdir's default)
    loaded = load_config(None, list(plan.overrides))
    node = node_deepspeed_config(loaded.train, loaded.distributed, plan.topology.world_size, True)
    assert controller == node and "offload_optimizer" in controller["zero_optimization"]


def test_a_json_the_controller_cannot_read_leaves_the_config_built_from_the_keys(tmp_path):
    inventory = three_nodes(tmp_path)
    plan = make_plan(
        inventory, overrides=["distributed.engine=deepspeed", "distributed.deepspeed_config=/nowhere.json"]
    )
    built = make_plan(inventory, overrides=["distributed.engine=deepspeed"])
    assert deepspeed_config(plan) == deepspeed_config(built)
