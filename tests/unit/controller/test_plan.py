"""`trainer plan`: the topology from an inventory alone, and the refusal of bad topologies."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers.plan_inventory import three_nodes, write_inventory

from trainer.cli import main
from trainer.controller.inventory import InventoryError
from trainer.controller.launcher.plan import PlanError, make_plan
from trainer.controller.launcher.topology import TopologyError

REPO = Path(__file__).resolve().parents[3]


def test_head_is_rank_zero_and_workers_follow_inventory_order(tmp_path):
    plan = make_plan(three_nodes(tmp_path))
    topo = plan.topology
    assert [(n.host, n.node_rank) for n in topo.nodes] == [("n-head", 0), ("n-b", 1), ("n-a", 2)]
    assert (topo.nnodes, topo.gpus_per_node, topo.world_size) == (3, 2, 6)
    assert topo.master_addr == "10.0.0.10" and topo.master_port == 29500
    env = topo.node_env(topo.node("n-a"), resolved_ifname="=eth1")
    assert env["NODE_RANK"] == "2" and env["NNODES"] == "3" and env["MASTER_ADDR"] == "10.0.0.10"
    assert env["GPUS_PER_NODE"] == "2"
    assert env["NCCL_SOCKET_IFNAME"] == "=eth1" and env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_DEBUG"] == "WARN"
    assert plan.config["distributed"]["timeout_s"] == 1800
    assert plan.output_dir == "/srv/shared/runs/default"
    command = plan.node_command(topo.node("n-a"))
    assert command[0] == "/opt/venv/bin/torchrun" and "--node-rank=2" in command


def test_effective_batch_size_reads_the_trainer_config(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({"train": {"micro_batch_size": 3, "gradient_accumulation_steps": 4}}))
    plan = make_plan(
        three_nodes(tmp_path), config=str(config), overrides=["train.gradient_accumulation_steps=5"]
    )
    assert plan.effective_batch_size == 3 * 6 * 5
    assert plan.config["output_dir"] == "/srv/shared/runs/default"


def test_rank_override_pins_a_worker(tmp_path):
    inventory = three_nodes(tmp_path, worker_vars={"n-a": {"cluster_node_rank": 1}})
    topo = make_plan(inventory).topology
    assert [(n.host, n.node_rank) for n in topo.nodes] == [("n-head", 0), ("n-a", 1), ("n-b", 2)]


@pytest.mark.parametrize(
    ("head_vars", "worker_vars", "group_vars", "message"),
    [
        ({}, {"n-a": {"training_procs_per_node": 4}}, {}, "training_procs_per_node differs between hosts"),
        (
            {},
            {"n-a": {"cluster_node_rank": 1}, "n-b": {"cluster_node_rank": 1}},
            {},
            "cluster_node_rank 1 is also the rank of n-",
        ),
        ({"cluster_node_rank": 2}, {}, {}, "cluster_node_rank is 2 on the head; fix: the head is rank 0"),
        ({}, {"n-a": {"cluster_node_rank": "first"}}, {}, "cluster_node_rank is 'first'; fix: use 0 to 2"),
        ({}, {"n-a": {"cluster_node_rank": 1.5}}, {}, "cluster_node_rank is 1.5; fix: use 0 to 2"),
        ({}, {"n-a": {"cluster_node_rank": 7}}, {}, "cluster_node_rank is 7; fix: use 0 to 2"),
        ({}, {}, {"training_procs_per_node": 0}, "training_procs_per_node is 0; fix: use 1 or more"),
    ],
)
def test_bad_topologies_are_refused(tmp_path, head_vars, worker_vars, group_vars, message):
    inventory = three_nodes(tmp_path, head_vars, worker_vars, **group_vars)
    # The inventory rules (shared with site.yml) refuse most of these before the topology is built.
    with pytest.raises((InventoryError, TopologyError), match=re.escape(message)):
        make_plan(inventory)


def test_missing_head_is_refused_by_the_command(tmp_path, capsys):
    inventory = write_inventory(tmp_path, {}, {"n-a": {"cluster_ip": "10.0.0.11"}})
    assert main(["plan", "-i", str(inventory)]) == 2
    err = capsys.readouterr().err
    assert "group 'head' must hold exactly one host" in err


def test_bad_run_name_and_output_dir_override_are_refused(tmp_path):
    inventory = three_nodes(tmp_path)
    with pytest.raises(PlanError, match="not a valid run name"):
        make_plan(inventory, run_name="../escape")
    with pytest.raises(PlanError, match="use --run-name"):
        make_plan(inventory, overrides=["output_dir=/tmp/x"])


def test_bad_trainer_config_is_refused_before_anything_runs(tmp_path, capsys):
    inventory = three_nodes(tmp_path)
    assert main(["plan", "-i", str(inventory), "--set", "train.max_stepz=3"]) == 2
    assert "train.max_stepz" in capsys.readouterr().err


def test_plan_json_on_the_local_inventory(capsys):
    assert main(["plan", "-i", str(REPO / "inventory" / "local"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nnodes"] == 1 and plan["gpus_per_node"] == 2 and plan["world_size"] == 2
    assert plan["master_addr"] == "127.0.0.1"
    assert plan["output_dir"] == str(REPO / "output" / "runs" / "default")
    assert plan["nodes"][0]["nccl_socket_ifname"] == "auto"


def test_plan_table_names_the_settings(capsys):
    assert main(["plan", "-i", str(REPO / "inventory" / "local")]) == 0
    out = capsys.readouterr().out
    for text in ("NNODES", "MASTER_PORT", "29500", "auto (resolved at launch", "effective batch size"):
        assert text in out


def write_config(tmp_path: Path, tree: dict) -> Path:
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump(tree))
    return config


def test_the_config_file_wins_over_the_inventory_and_every_value_names_its_source(tmp_path, capsys):
    """trainer default < inventory group_vars < the config file: the file's engine, ZeRO stage, data
    path and webhook are this job's choice, the inventory's only the cluster's default."""
    inventory = three_nodes(
        tmp_path,
        training_engine="deepspeed",
        training_zero_stage=3,
        cluster_data_path="/srv/shared/data/cluster.txt",
        training_health_webhook_url="https://hooks.example/inventory-secret",
    )
    config = write_config(
        tmp_path,
        {
            "distributed": {"engine": "deepspeed", "zero_stage": 1},
            "data": {"path": "/srv/shared/data/mine.txt"},
            "health": {"webhook_url": "https://hooks.example/file-secret"},
        },
    )
    assert main(["plan", "-i", str(inventory), "--config", str(config), "--json"]) == 0
    text = capsys.readouterr().out
    assert "secret" not in text, "a webhook URL is a secret, whichever layer set it"
    plan = json.loads(text)
    sources = plan["sources"]
    assert sources["distributed.zero_stage"] == {
        "value": 1,
        "source": "--config file",
        "overruled": "the inventory's training_zero_stage says 3",
    }
    assert sources["data.path"]["value"] == "/srv/shared/data/mine.txt"
    assert sources["data.path"]["source"] == "--config file"
    # Equal values overrule nothing: the engine is the file's, and nothing is said about it.
    engine = {"value": "deepspeed", "source": "--config file", "overruled": None}
    assert sources["distributed.engine"] == engine
    assert sources["train.max_steps"] == {"value": 80, "source": "trainer default", "overruled": None}
    assert sources["lora.enabled"]["source"] == "trainer default"
    assert plan["overruled"] == [
        "data.path: /srv/shared/data/mine.txt from --config file (the inventory's cluster_data_path says "
        "/srv/shared/data/cluster.txt)",
        "distributed.zero_stage: 1 from --config file (the inventory's training_zero_stage says 3)",
        "health.webhook_url: <redacted> from --config file (the inventory's training_health_webhook_url "
        "says <redacted>)",
    ]

    # A config file that leaves them out: the inventory's values train, and say where they come from.
    plan = make_plan(inventory, config=str(write_config(tmp_path, {"train": {"max_steps": 40}})))
    assert (plan.engine, plan.config["distributed"]["zero_stage"]) == ("deepspeed", 3)
    assert plan.config["data"]["path"] == "/srv/shared/data/cluster.txt"
    assert plan.sources["distributed.zero_stage"].source == "inventory group_vars (training_zero_stage)"
    assert plan.sources["train.max_steps"].source == "--config file"
    assert plan.overruled == []


def test_a_set_or_engine_over_the_config_file_is_said_in_one_line(tmp_path, capsys):
    """The more explicit wins (--set over the file, --engine over both), and the plan says which
    value of the user's file it overrode, one line each, besides each row's source."""
    inventory = three_nodes(tmp_path)
    config = write_config(tmp_path, {"train": {"max_steps": 500}, "distributed": {"engine": "ddp"}})
    args = ["plan", "-i", str(inventory), "--config", str(config), "--set", "train.max_steps=20"]
    assert main([*args, "--engine", "deepspeed"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("overruled")] == [
        "overruled: train.max_steps: 20 from --set (your --config file says 500)",
        "overruled: distributed.engine: deepspeed from --engine (your --config file says ddp)",
    ]
    assert re.search(r"│ steps +│ 20 \(--set\)", out), out
    assert re.search(r"│ engine +│ deepspeed \(--engine\)", out), out
    assert re.search(r"│ ZeRO stage +│ 2 \(trainer default\)", out), out
    assert re.search(r"│ model +│ the built-in tiny GPT \(trainer default\)", out), out
    assert re.search(r"│ LoRA +│ off \(trainer default\)", out), out

    # The inventory's training_config is the config file when --config is not given.
    inventory = three_nodes(tmp_path / "with-file", training_config=str(config))
    plan = make_plan(inventory, overrides=["train.max_steps=20"])
    assert plan.overruled == ["train.max_steps: 20 from --set (the training_config file says 500)"]
    assert plan.sources["distributed.engine"].source == "training_config file"
