"""Data prepared once per cluster, through `trainer launch` on two loopback "hosts" × two processes
(ansible-runner, run.sh, torchrun, gloo): one process of the four prepares, the other three reuse it,
and the run trains to the same losses as one where every process prepares its own copy."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.finetune_harness import build
from helpers.loopback import write_inventory


def launch(inventory, run_name: str, *sets: str) -> str:
    command = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--poll-interval", "1"]
    command += ["--run-name", run_name, *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_preparation_for_two_nodes_of_two_processes(tmp_path):
    inventory, shared = write_inventory(tmp_path, training_procs_per_node=2)
    models = shared / "models"
    build("model", str(models / "tiny-qwen2"))
    build("data", str(models / "conversations.jsonl"), "--jsonl", "--samples", "600")
    sets = [
        f"model.name_or_path={models / 'tiny-qwen2'}", f"data.path={models / 'conversations.jsonl'}",
        "model.max_length=128", "train.micro_batch_size=4", "train.max_steps=4", "train.log_every=1",
        "train.warmup_steps=1", "checkpoint.save_steps=0", "data.packing=true",
    ]  # fmt: skip
    launch(inventory, "once", *sets)
    logs = {p.parent.name: p.read_text() for p in (shared / "runs" / "once" / "launch").glob("node-*/log")}
    assert sorted(logs) == ["node-0", "node-1"]
    everything = "\n".join(logs.values())
    cache = shared / "prepared-data"
    assert everything.count("data: prepared ") == 1, everything
    assert f"data: prepared {cache}/" in logs["node-0"], "rank 0 prepared, in the cluster's shared dir"
    # node 1's first process says it reused rank 0's preparation; no process on it prepared.
    assert f"rank 2: data: reused prepared data {cache}/" in logs["node-1"] and " rank 0)" in logs["node-1"]
    [entry] = [p for p in cache.iterdir() if "." not in p.name]
    assert json.loads((entry / "meta.json").read_text())["prepared_by"]["rank"] == 0

    launch(inventory, "every-process", *sets, "data.prepare_once=false")
    assert losses(shared / "runs" / "once") == losses(shared / "runs" / "every-process")
    run_json = [json.loads((shared / "runs" / r / "run.json").read_text()) for r in ("once", "every-process")]
    assert run_json[0]["data"] == run_json[1]["data"], "run.json's data section is the same"
