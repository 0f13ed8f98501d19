"""Each engine on 2 CPU processes, start to finish, then killed and resumed.

1. An uninterrupted run: the loss falls, both ranks end with identical parameters, metrics, run.json,
   summary.json and checkpoints (in the engine's own format) are where promised.
2. The same config killed with SIGKILL in the middle of writing its step-20 checkpoint: `latest`
   still names the complete step-10.
3. Launched again: it resumes at step 10 and ends with the same loss and the same parameters, bit for
   bit, as the uninterrupted run.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers.trainer_harness import (
    PAUSE_IN_STEP_20_WRITE,
    QUICK,
    assert_trained,
    finish,
    kill_job,
    start_run,
    wait_for,
)

ENGINES = [
    pytest.param("torchrun", ["distributed.engine=ddp"], id="ddp"),
    pytest.param(
        "torchrun", ["distributed.engine=deepspeed", "distributed.zero_stage=1"], id="deepspeed-zero1"
    ),
    pytest.param(
        "torchrun", ["distributed.engine=deepspeed", "distributed.zero_stage=2"], id="deepspeed-zero2"
    ),
    # accelerate's own launcher (`--multi_gpu` on the CPU: `--cpu` would start a single process).
    pytest.param("accelerate", ["distributed.engine=accelerate"], id="accelerate"),
]


def assert_engine_files(run, engine: list[str]) -> None:
    step_dir = run.output_dir / "checkpoints" / "step-20"
    name = engine[0].split("=")[1]
    if name == "ddp":
        assert (step_dir / "ddp_state.pt").is_file()
    elif name == "deepspeed":
        stage = int(engine[1].split("=")[1])
        ds_config = json.loads((run.output_dir / "ds_config.json").read_text())
        assert ds_config["zero_optimization"]["stage"] == stage
        assert ds_config["train_batch_size"] == 8 * 2 * 1
        for rank in (0, 1):  # ZeRO shards the optimizer state: one file per rank
            assert (step_dir / "deepspeed" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file()
    else:
        assert (step_dir / "accelerate" / "optimizer.bin").is_file()


@pytest.mark.parametrize(("launcher", "engine"), ENGINES)
def test_engine_trains_and_resumes_exactly_after_kill_mid_checkpoint(run_trainer, tmp_path, launcher, engine):
    name = engine[0].split("=")[1]
    reference = run_trainer(*QUICK, *engine, launcher=launcher, name="reference")
    assert_trained(reference, world_size=2, engine=name)
    assert_engine_files(reference, engine)

    output_dir = tmp_path / "interrupted"
    job = start_run(output_dir, [*QUICK, *engine], launcher=launcher, env=PAUSE_IN_STEP_20_WRITE)
    checkpoints = output_dir / "checkpoints"
    partial = checkpoints / ".tmp-step-20"
    try:
        # Both ranks have written their part of step 20; rank 0 is now paused before completing it.
        wait_for(
            lambda: (partial / "rng-rank0.pt").is_file() and (partial / "rng-rank1.pt").is_file(),
            timeout_s=400,
            what=f"the step-20 checkpoint write to start in {checkpoints}",
        )
        time.sleep(1)
    finally:
        kill_job(job)
    assert (checkpoints / "latest").read_text().strip() == "step-10"
    assert (checkpoints / "step-10" / "clustertrain_state.json").is_file()
    assert not (checkpoints / "step-20").exists()
    assert not (partial / "clustertrain_state.json").exists()

    resumed = finish(start_run(output_dir, [*QUICK, *engine], launcher=launcher), output_dir)
    assert_trained(resumed, world_size=2, engine=name)
    assert "resumed from" in resumed.stdout and "removing incomplete checkpoint" in resumed.stdout
    assert resumed.summary["resumed_from"].endswith("step-10")
    assert resumed.summary["steps_this_run"] == 10
    assert not list(checkpoints.glob(".tmp-*"))
    # The same world size: DeepSpeed loads its own shards, no universal checkpoint is made.
    assert "universal" not in resumed.stdout and not list(checkpoints.glob("step-*/universal"))
    assert [m["step"] for m in resumed.metrics] == [1, 5, 10, 15, 20]
    assert resumed.summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=1e-6)
    assert resumed.summary["param_checksums"] == reference.summary["param_checksums"]
