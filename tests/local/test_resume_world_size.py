"""A run resumed at another world size trains exactly the samples an uninterrupted run would.

What a restart on fewer (or more) nodes does: the job goes on from its latest checkpoint with the
effective batch kept by another gradient accumulation. Every rank logs the samples it trains (the
TRAINER_TEST_SAMPLE_LOG hook); each step's samples, all ranks together, must be those of the
uninterrupted run, step by step: none skipped, none seen twice. With dropout off, the loss then
follows the uninterrupted run's to the last bits (gloo sums the ranks' gradients in another order).

An uninterrupted run of 2 processes (8 steps, checkpoints at 4 and 8) is both the reference and, cut
back to its step-4 checkpoint (trainer_harness.stopped_after), the run that stopped there.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.finetune_harness import chat_data_600, hf_cache, tiny_model  # noqa: F401
from helpers.trainer_harness import (
    RESIZE_GPT,
    finish,
    sample_log,
    sample_log_env,
    samples_by_step,
    start_run,
    stopped_after,
)

GPT = RESIZE_GPT
#: The effective batch 24 on 1 and 3 processes: (processes, accumulation).
RESUMED_ON = {1: 6, 3: 2}
#: Relative difference allowed between the losses of a run resumed at another world size and the
#: uninterrupted run's (measured: equal to the last digit on this CPU, 8 steps; see the test).
LOSS_RTOL = 1e-5


def reference(root, name: str, overrides: list[str], launcher: str = "torchrun"):
    """An uninterrupted run on 2 processes, logging its samples."""
    output_dir = root / name
    run = finish(
        start_run(output_dir, overrides, launcher=launcher, env=sample_log_env(root / f"{name}-samples")),
        output_dir,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return run


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("world-size")
    run = reference(root, "reference", GPT)
    samples = samples_by_step(root / "reference-samples")
    # The reference itself: 24 samples a step, no sample twice in its 8 steps (one epoch is 7,267).
    assert sorted(samples) == list(range(1, 9))
    assert all(len(s) == 24 for s in samples.values())
    assert len({i for s in samples.values() for i in s}) == 8 * 24
    return run, samples


def assert_continues(reference_samples: dict, resumed_log, *, first: int = 5, last: int = 8) -> None:
    """The resumed run trained steps first..last, each on exactly the reference's samples."""
    resumed = samples_by_step(resumed_log)
    assert sorted(resumed) == list(range(first, last + 1)), "the resumed run trains the steps after step-4"
    for step, samples in resumed.items():
        assert samples == reference_samples[step], f"step {step} trained other samples"


def assert_resumed(run, *, world_size: int, engine: str = "ddp") -> None:
    """The run resumed from step-4, trained to step 8 on world_size processes, and its ranks agree."""
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    summary = run.summary
    assert summary["resumed_from"].endswith("step-4") and summary["steps_this_run"] == 4
    assert summary["final_step"] == 8 and summary["engine"] == engine
    assert summary["world_size"] == world_size and len(summary["param_checksums"]) == world_size
    assert len(set(summary["param_checksums"])) == 1, "ranks ended with different parameters"
    assert [m["world_size"] for m in run.metrics if m["step"] > 4] == [world_size] * 4


def assert_same_losses(resumed, reference_run, steps=range(5, 9)) -> float:
    """Each step's loss within LOSS_RTOL of the reference's; returns the largest relative difference."""
    ours = {m["step"]: m["loss"] for m in resumed.metrics}
    theirs = {m["step"]: m["loss"] for m in reference_run.metrics}
    differences = [abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in steps]
    assert max(differences) <= LOSS_RTOL, (ours, theirs)
    return max(differences)


def test_gpt_resumed_on_1_and_3_processes_trains_the_uninterrupted_runs_samples(
    gpt_reference, run_trainer, tmp_path
):
    ref, ref_samples = gpt_reference
    checkpoint = ref.output_dir / "checkpoints" / "step-4"

    # Stopped after step 4 on 2 processes, resumed (auto) on 1 with the accumulation doubled.
    stopped_after(ref.output_dir, 4, tmp_path / "stopped")
    one = run_trainer(
        *GPT,
        f"train.gradient_accumulation_steps={RESUMED_ON[1]}",
        launcher="none",
        name="stopped",
        env=sample_log_env(tmp_path / "one-samples"),
    )
    assert_resumed(one, world_size=1)
    assert (
        "resuming from step-4 (written by 2 processes, now 1; accumulation 3 -> 6, effective batch 24 kept; "
        "data continues at sample 96)" in one.stdout
    )
    assert "warning" not in one.stdout
    assert_continues(ref_samples, tmp_path / "one-samples")
    assert [m["world_size"] for m in one.metrics] == [2] * 4 + [1] * 4  # one metrics file, both runs
    one_difference = assert_same_losses(one, ref)
    assert one.summary["final_loss"] == pytest.approx(ref.summary["final_loss"], rel=LOSS_RTOL)

    # A run started on 1 process from the same checkpoint (in another output dir) is the same run.
    again = run_trainer(
        *GPT,
        f"train.gradient_accumulation_steps={RESUMED_ON[1]}",
        f"checkpoint.resume={checkpoint}",
        launcher="none",
        name="again",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.summary["final_loss"] == one.summary["final_loss"]
    assert again.summary["param_checksums"] == one.summary["param_checksums"]

    # On 3 processes: rank 2 has no random state in the checkpoint (2 processes wrote it).
    three = run_trainer(
        *GPT,
        f"train.gradient_accumulation_steps={RESUMED_ON[3]}",
        f"checkpoint.resume={checkpoint}",
        nproc=3,
        name="three",
        env=sample_log_env(tmp_path / "three-samples"),
    )
    assert_resumed(three, world_size=3)
    assert (
        f"rank 2 has no random state in {checkpoint}: seeded from train.seed, step 4 and the rank"
        in three.stdout
    )
    assert "written by 2 processes, now 3; accumulation 3 -> 2, effective batch 24 kept" in three.stdout
    assert_continues(ref_samples, tmp_path / "three-samples")
    ranks = {(r["step"], r["rank"]) for r in sample_log(tmp_path / "three-samples")}
    assert ranks == {(step, rank) for step in range(5, 9) for rank in range(3)}, "every rank trains"
    three_difference = assert_same_losses(three, ref)
    print(
        f"largest relative loss difference to the uninterrupted run: 1 process {one_difference:.2e}, "
        f"3 processes {three_difference:.2e}"
    )


def test_another_effective_batch_continues_from_the_samples_consumed(gpt_reference, run_trainer, tmp_path):
    ref, ref_samples = gpt_reference
    checkpoint = ref.output_dir / "checkpoints" / "step-4"
    # Half the effective batch (12): steps 5 and 6 together train what step 5 of the reference did.
    half = run_trainer(
        *GPT,
        "train.max_steps=6",
        "checkpoint.save_steps=2",
        f"checkpoint.resume={checkpoint}",
        launcher="none",
        name="half",
        env=sample_log_env(tmp_path / "half-samples"),
    )
    assert half.returncode == 0, half.stderr[-3000:]
    assert (
        "resuming from step-4 (written by 2 processes, now 1; effective batch 24 -> 12; data continues at "
        "sample 96 (the samples consumed, not step × 12 = 48))" in half.stdout
    )
    trained = samples_by_step(tmp_path / "half-samples")
    assert sorted(trained) == [5, 6]
    assert sorted(trained[5] + trained[6]) == ref_samples[5]
    state = json.loads((half.output_dir / "checkpoints" / "step-6" / "clustertrain_state.json").read_text())
    assert state["samples_consumed"] == 96 + 2 * 12
    assert state["data_position"] == {
        "epoch": 0,
        "epoch_offset": 120,
        "epoch_length": 7267,
        "effective_batch": 12,
    }


def test_a_checkpoint_without_samples_consumed_resumes_at_step_times_the_batch(
    gpt_reference, run_trainer, tmp_path
):
    ref, ref_samples = gpt_reference
    # As an older trainer wrote it: no samples consumed, no data position, no batch sizes.
    old = tmp_path / "old" / "checkpoints" / "step-4"
    shutil.copytree(ref.output_dir / "checkpoints" / "step-4", old)
    state_file = old / "clustertrain_state.json"
    state = json.loads(state_file.read_text())
    for key in ("samples_consumed", "data_position", "micro_batch_size", "gradient_accumulation_steps"):
        del state[key]
    state["micro_batches_consumed"] = 12
    state_file.write_text(json.dumps(state))
    resumed = run_trainer(
        *GPT,
        "train.max_steps=5",
        f"checkpoint.resume={old}",
        launcher="none",
        name="from-old",
        env=sample_log_env(tmp_path / "old-samples"),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "note: step-4 was written by an older trainer that did not record the samples consumed: data "
        "continues at step 4 × effective batch 12 = sample 48" in resumed.stdout
    )
    # Sample 48 on: the first half of what the reference (effective batch 24) trained in step 3.
    trained = samples_by_step(tmp_path / "old-samples")
    assert sorted(trained) == [5] and set(trained[5]) < set(ref_samples[3])


def test_accelerate_resumed_on_3_processes_trains_the_uninterrupted_runs_samples(
    gpt_reference, run_trainer, tmp_path
):
    engine = ["distributed.engine=accelerate"]
    ref = reference(tmp_path, "reference", [*GPT, *engine], launcher="accelerate")
    ref_samples = samples_by_step(tmp_path / "reference-samples")
    assert ref_samples == gpt_reference[1], "every engine trains the same samples in each step"
    checkpoint = ref.output_dir / "checkpoints" / "step-4"
    three = run_trainer(
        *GPT,
        *engine,
        f"train.gradient_accumulation_steps={RESUMED_ON[3]}",
        f"checkpoint.resume={checkpoint}",
        launcher="accelerate",
        nproc=3,
        name="three",
        env=sample_log_env(tmp_path / "three-samples"),
    )
    assert_resumed(three, world_size=3, engine="accelerate")
    assert f"rank 2 has no random state in {checkpoint}" in three.stdout
    assert_continues(ref_samples, tmp_path / "three-samples")
    print(f"accelerate, 3 processes: largest relative loss difference {assert_same_losses(three, ref):.2e}")


HF = {
    # Packed rows and a held-out tenth: the order is over rows, the eval split is the samples'.
    "packed": (["data.packing=true", "data.eval_fraction=0.1"], (1, 3)),
    "unpacked": ([], (1,)),
}


@pytest.mark.parametrize("name", HF)
def test_finetuning_resumed_at_another_world_size_trains_the_uninterrupted_runs_samples(
    name,
    run_trainer,
    tmp_path,
    tiny_model,  # noqa: F811
    chat_data_600,  # noqa: F811
):
    extra, world_sizes = HF[name]
    finetune = [
        f"model.name_or_path={tiny_model}",
        f"data.path={chat_data_600}",
        "model.max_length=128",
        *[setting for setting in GPT if not setting.startswith("model.")],
        *extra,
    ]
    ref = reference(tmp_path, "reference", finetune)
    ref_samples = samples_by_step(tmp_path / "reference-samples")
    # 24 rows a step: a packed row holds several samples, none of them twice in the run.
    everything = [i for s in ref_samples.values() for i in s]
    assert len(everything) == len(set(everything)) >= 8 * 24
    for processes in world_sizes:
        resumed = run_trainer(
            *finetune,
            f"train.gradient_accumulation_steps={RESUMED_ON[processes]}",
            f"checkpoint.resume={ref.output_dir / 'checkpoints' / 'step-4'}",
            launcher="none" if processes == 1 else "torchrun",
            nproc=processes,
            name=f"on-{processes}",
            env=sample_log_env(tmp_path / f"on-{processes}-samples"),
        )
        assert_resumed(resumed, world_size=processes)
        assert f"written by 2 processes, now {processes}" in resumed.stdout
        assert_continues(ref_samples, tmp_path / f"on-{processes}-samples")
        difference = assert_same_losses(resumed, ref)
        print(
            f"fine-tuning {name}, {processes} process(es): largest relative loss difference {difference:.2e}"
        )
        if "data.eval_fraction=0.1" in extra:  # the same held-out samples: the same eval loss
            eval_losses = [run.metrics[-1]["eval_loss"] for run in (resumed, ref)]
            assert eval_losses[0] == pytest.approx(eval_losses[1], rel=LOSS_RTOL)
