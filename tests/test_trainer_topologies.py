"""The trainer without a launcher (one process) and across 2 "nodes" on loopback (two torchruns)."""

from __future__ import annotations

import json
import subprocess

import pytest
from trainer_harness import BIN, QUICK, TIMEOUT_S, TRAINER, Run, assert_trained, free_port, sets, trainer_env


@pytest.mark.slow
def test_single_process_without_launcher_json_lines_oversubscribed_and_rotated(run_trainer, tmp_path):
    data = tmp_path / "notes.jsonl"
    lines = [json.dumps({"text": f"note {i}: the cat sat on the mat. " * 3}) for i in range(7)]
    data.write_text("\n".join(lines) + "\n")  # about 700 characters: 10 samples of 64
    run = run_trainer(
        *QUICK,
        f"data.path={data}",
        "train.gradient_accumulation_steps=2",
        "data.allow_dataset_oversubscription=true",
        "checkpoint.save_steps=5",
        "checkpoint.save_total_limit=2",
        launcher="none",
    )
    assert_trained(run, world_size=1, engine="ddp")
    assert (
        "effective batch = train.micro_batch_size × world size × train.gradient_accumulation_steps"
        in run.stdout
    )
    assert "training with data.repeats = 2" in run.stdout
    assert run.json("run.json")["data"]["repeats"] == 2
    # Saved at 5, 10, 15, 20; only the newest two are kept.
    kept = sorted(p.name for p in (run.output_dir / "checkpoints").iterdir())
    assert kept == ["latest", "step-15", "step-20"]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_and_leave_cleanly(tmp_path):
    # Two torchrun "nodes" × 2 processes, c10d rendezvous. With gloo this is where
    # destroy_process_group() used to abort a rank and hang its peer: both must exit 0, promptly.
    # Gradient accumulation over 2 micro-batches: DDP syncs only on the second (no_sync on the first).
    output_dir = tmp_path / "out"
    port = free_port()
    args = sets(f"output_dir={output_dir}", *QUICK, "train.gradient_accumulation_steps=2")
    jobs = [
        subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "test-2-nodes",
                TRAINER,
                "train",
                *args,
            ],
            cwd=tmp_path,
            env=trainer_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=TIMEOUT_S))
    finally:
        for job in jobs:
            job.kill()
    codes = [job.returncode for job in jobs]
    stdout = "".join(out for out, _ in outputs)
    stderr = "".join(err for _, err in outputs)
    assert codes == [0, 0], f"{codes}\n{stderr[-5000:]}"
    assert "terminate called" not in stderr
    run = Run(output_dir, 0, stdout, stderr)
    assert_trained(run, world_size=4, engine="ddp")
    topology = run.json("run.json")["topology"]
    assert topology["num_nodes"] == 2
    assert sorted(r["rank"] for r in topology["ranks"]) == [0, 1, 2, 3]
    assert run.json("run.json")["data"]["effective_batch"] == 8 * 4 * 2
