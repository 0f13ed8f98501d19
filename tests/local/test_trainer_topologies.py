"""The trainer without a launcher (one process) and across 2 "nodes" on loopback (two torchruns)."""

from __future__ import annotations

import json
import subprocess

from helpers.trainer_harness import (
    BIN,
    QUICK,
    TIMEOUT_S,
    TRAINER,
    Run,
    assert_trained,
    free_port,
    sets,
    trainer_env,
)

from trainer import exitcodes


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


def start_two_nodes(tmp_path, args_for_node) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [
                str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "test-2-nodes",
                TRAINER, "train", *args_for_node(node),
            ],
            cwd=tmp_path, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip


def wait_all(jobs: list[subprocess.Popen]) -> tuple[list[int], str, str]:
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=TIMEOUT_S))
    finally:
        for job in jobs:
            job.kill()
    return [job.returncode for job in jobs], "".join(o for o, _ in outputs), "".join(e for _, e in outputs)


def test_two_nodes_on_loopback_train_and_leave_cleanly(tmp_path):
    # Two torchrun "nodes" × 2 processes, c10d rendezvous. With gloo this is where
    # destroy_process_group() used to abort a rank and hang its peer: both must exit 0, promptly.
    # Gradient accumulation over 2 micro-batches: DDP syncs only on the second (no_sync on the first).
    output_dir = tmp_path / "out"
    args = sets(f"output_dir={output_dir}", *QUICK, "train.gradient_accumulation_steps=2")
    codes, stdout, stderr = wait_all(start_two_nodes(tmp_path, lambda node: args))
    assert codes == [0, 0], f"{codes}\n{stderr[-5000:]}"
    assert "terminate called" not in stderr
    run = Run(output_dir, 0, stdout, stderr)
    assert_trained(run, world_size=4, engine="ddp")
    topology = run.json("run.json")["topology"]
    assert topology["num_nodes"] == 2
    assert sorted(r["rank"] for r in topology["ranks"]) == [0, 1, 2, 3]
    assert run.json("run.json")["data"]["effective_batch"] == 8 * 4 * 2


def test_output_dir_not_shared_between_nodes_is_refused_with_the_fix(tmp_path):
    # Each "node" gets its own directory, as with a node-local path on a real cluster.
    codes, _, stderr = wait_all(
        start_two_nodes(tmp_path, lambda node: sets(f"output_dir={tmp_path / f'local-{node}'}", *QUICK))
    )
    # torchrun exits 1 whatever its workers returned; it reports their exit codes in its summary.
    assert codes == [1, 1], stderr[-3000:]
    assert f"exitcode  : {exitcodes.CONFIG_ERROR} " in stderr
    assert "config error: output_dir: rank 2 on " in stderr and "rank 3 on " in stderr
    assert "file system shared by all nodes" in stderr
    assert not (tmp_path / "local-0" / "checkpoints").exists()
