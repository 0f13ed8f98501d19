"""A DeepSpeed ZeRO checkpoint resumed by another number of processes (trainer/node/engines/ds_universal.py).

What a restart on fewer (or more) nodes does with DeepSpeed: the checkpoint written by 2 processes is
converted once to DeepSpeed's universal checkpoint and loaded by 3, by 1, and a checkpoint of 3 back
by 2, with the effective batch kept by the accumulation (4 × 2 × 3 = 4 × 3 × 2 = 4 × 1 × 6).

What must hold, and can fail:
- the state comes back as it was saved: every parameter's fp32 weight, Adam exp_avg and exp_avg_sq,
  gathered to full tensors by DeepSpeed's own safe_get_full_* API in the saving and the loading run
  (the TRAINER_TEST_OPTIMIZER_DUMP hook), equal bit for bit; Adam's step count, the parameter groups
  (lr, weight decay per group) and the LR scheduler's state equal;
- training goes on as the uninterrupted 2-process run did: the same samples per step (the sample
  order, trainer/node/order.py) with dropout off, so each later step's loss within LOSS_RTOL and the
  learning rate equal, and the state after the last step close to the uninterrupted run's (a wrong
  weight decay or step count shows there first: measured 2e-4 after 4 steps);
- a conversion killed half-way leaves `latest` and the checkpoint as they were, and the next run
  removes the leftover and converts again; a conversion that fails stops every rank with one error.

Fine-tuning is checked the same way: full fine-tuning with ZeRO-3 on 1 process, LoRA with ZeRO-1 on 3.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from helpers.finetune_harness import chat_data, hf_cache, tiny_model  # noqa: F401
from helpers.trainer_harness import RESIZE_GPT, finish, kill_job, start_run, stopped_after, wait_for

from trainer.configerror import ConfigError
from trainer.node.checkpoint import STATE_FILE, check_resumable, resume_fingerprint
from trainer.node.config import load_config

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

slow = pytest.mark.slow  # real multi-process DeepSpeed runs: every test here but the first

GPT = RESIZE_GPT
#: The effective batch 24 on 1, 2 and 3 processes: processes -> accumulation.
ACCUMULATION = {1: 6, 2: 3, 3: 2}
#: Relative loss difference allowed after resuming (measured: below 1e-7; ZeRO-3's shared Adam step
#: before its mend: 7e-4 at the third step after the resume).
LOSS_RTOL = 1e-4
#: Largest difference of a weight or moment from the uninterrupted run's after the 4 resumed steps
#: (measured: 1e-9; ZeRO-3 without its weight-decay mend: 2e-4).
STATE_ATOL = 1e-6
DUMP = "TRAINER_TEST_OPTIMIZER_DUMP"
CONVERTED = re.compile(r"converted to DeepSpeed's universal checkpoint \((\d+\.\d) s\)")


def test_only_nvme_offloaded_optimizer_state_is_refused_at_another_world_size(tmp_path):
    config = load_config(None, ["distributed.engine=deepspeed"])
    checkpoint = tmp_path / "checkpoints" / "step-4"
    (checkpoint / "deepspeed").mkdir(parents=True)
    state = {"step": 4, "world_size": 2, "fingerprint": resume_fingerprint(config)}
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    for world_size in (1, 2, 3):  # resumable: converted when the engine loads
        assert check_resumable(checkpoint, config, world_size=world_size) == []
    (checkpoint / "deepspeed" / "offloaded_tensors" / "rank0").mkdir(parents=True)
    assert check_resumable(checkpoint, config, world_size=2) == []  # its own swap files: loaded as ever
    with pytest.raises(ConfigError, match=r"offloaded to NVMe per process.*resume it with 2 processes"):
        check_resumable(checkpoint, config, world_size=3)


def deepspeed(stage: int) -> list[str]:
    return ["distributed.engine=deepspeed", f"distributed.zero_stage={stage}"]


def run_job(root, name: str, overrides: list[str], processes: int = 2, env=None):
    """A finished `trainer train` on `processes` processes (torchrun; alone for 1), state dumps on."""
    output_dir = root / name
    launcher = "none" if processes == 1 else "torchrun"
    env = {DUMP: str(root / f"{name}-dump"), **(env or {})}
    return finish(start_run(output_dir, overrides, launcher=launcher, nproc=processes, env=env), output_dir)


def dump(run, event: str, step: int, world_size: int) -> dict:
    return torch.load(
        run.output_dir.parent / f"{run.output_dir.name}-dump" / f"{event}-step-{step}-w{world_size}.pt"
    )


def assert_ok(run) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """references(name, overrides) -> the uninterrupted 2-process run (once per module)."""
    root = tmp_path_factory.mktemp("ds-resize")
    done = {}

    def get(name: str, overrides: list[str]):
        if name not in done:
            done[name] = run_job(root, name, overrides)
            assert_ok(done[name])
        return done[name]

    return get


def gpt_reference(references, stage: int):
    return references(f"zero{stage}", [*GPT, *deepspeed(stage)])


def assert_state_carried(saved: dict, loaded: dict) -> None:
    """What the loading run holds is what the saving run held: bit for bit."""
    assert loaded["params"].keys() == saved["params"].keys() and saved["params"]
    for name, tensors in saved["params"].items():
        for key, tensor in tensors.items():
            assert torch.equal(loaded["params"][name][key], tensor), f"{name} {key} changed"
    assert loaded["steps"] == saved["steps"] and saved["steps"][0] > 0, "Adam's step count"
    assert loaded["param_groups"] == saved["param_groups"], "lr, weight decay, betas per group"
    assert loaded["scheduler"] == saved["scheduler"], "the LR scheduler"


def assert_state_close(ours: dict, theirs: dict) -> None:
    """The state after the same steps, resumed or not: equal up to the order of float sums."""
    assert ours["steps"] == theirs["steps"] and ours["param_groups"] == theirs["param_groups"]
    for name, tensors in theirs["params"].items():
        for key, tensor in tensors.items():
            difference = (ours["params"][name][key] - tensor).abs().max().item()
            assert difference <= STATE_ATOL, f"{name} {key} differs by {difference:.2e}"


def assert_continues(resumed, reference, first: int, last: int = 8) -> float:
    """Steps first..last trained by the resumed run, with the reference's loss (within LOSS_RTOL) and
    learning rate; returns the largest relative loss difference."""
    ours = {m["step"]: m for m in resumed.metrics if m["step"] >= first}
    theirs = {m["step"]: m for m in reference.metrics}
    assert sorted(ours) == list(range(first, last + 1))
    differences = [abs(ours[s]["loss"] - theirs[s]["loss"]) / theirs[s]["loss"] for s in ours]
    assert max(differences) <= LOSS_RTOL, [(s, ours[s]["loss"], theirs[s]["loss"]) for s in ours]
    assert [ours[s]["lr"] for s in ours] == pytest.approx([theirs[s]["lr"] for s in ours], rel=1e-12)
    summary = resumed.summary
    assert len(set(summary["param_checksums"])) == 1, "ranks ended with different parameters"
    return max(differences)


def resume(root, name, overrides, checkpoint, processes: int, *extra: str):
    return run_job(
        root,
        name,
        [*overrides, f"train.gradient_accumulation_steps={ACCUMULATION[processes]}",
         f"checkpoint.resume={checkpoint}", *extra],
        processes,
    )  # fmt: skip


def converted_line(run, step: int, saved: int, now: int) -> float:
    """The one line saying the checkpoint was converted; returns the conversion's seconds."""
    line = f"resuming step-{step} written by {saved} processes on {now}: "
    found = [text for text in run.stdout.splitlines() if text.startswith(line)]
    assert len(found) == 1, run.stdout[-3000:]
    match = CONVERTED.search(found[0])
    assert match, found[0]
    return float(match.group(1))


#: The world size each stage's 2-process checkpoint of the GPT is resumed on. ZeRO 1 and 2 share
#: DeepSpeed's loader (stage_1_and_2.py): ZeRO-2 here (and on 1 process in the kill test below), ZeRO-1
#: in the LoRA fine-tuning test (2 -> 3), which costs no reference run of its own (a GPT ZeRO-1 test
#: did: ~100 CPU-s of CI). ZeRO-3 has its own loader and gets the whole round: 3, 1 (the conversion
#: reused), 3 -> 2.
FIRST_RESUME = {2: 3, 3: 3}


@slow
@pytest.mark.parametrize("stage", sorted(FIRST_RESUME))
def test_zero_checkpoint_resumes_at_another_world_size(references, stage, tmp_path):
    ref = gpt_reference(references, stage)
    overrides = [*GPT, *deepspeed(stage)]
    step4 = ref.output_dir / "checkpoints" / "step-4"
    saved = dump(ref, "saved", 4, 2)
    processes = FIRST_RESUME[stage]
    differences = {}

    # Converted once, into step-4/universal, then loaded by the other number of processes.
    first = resume(tmp_path, "first", overrides, step4, processes, "checkpoint.save_steps=2")
    assert_ok(first)
    seconds = converted_line(first, 4, 2, processes)
    assert (step4 / "universal").is_dir() and not list(step4.glob(".tmp-*"))
    assert (ref.output_dir / "checkpoints" / "latest").read_text().strip() == "step-8"
    assert_state_carried(saved, dump(first, "loaded", 4, processes))
    differences[f"2 -> {processes}"] = assert_continues(first, ref, first=5)
    assert_state_close(dump(first, "saved", 8, processes), dump(ref, "saved", 8, 2))

    if stage == 3:
        # 2 -> 1: the conversion is there already, no second one.
        one = resume(tmp_path, "one", overrides, step4, 1)
        assert_ok(one)
        assert (
            "resuming step-4 written by 2 processes on 1: DeepSpeed's universal checkpoint converted before "
            f"({step4 / 'universal'})" in one.stdout
        )
        assert_state_carried(saved, dump(one, "loaded", 4, 1))
        differences["2 -> 1"] = assert_continues(one, ref, first=5)

        # 3 -> 2: the 3-process run's step-6 (3 shards), back on 2 processes.
        step6 = first.output_dir / "checkpoints" / "step-6"
        assert len(list((step6 / "deepspeed").glob("*optim_states.pt"))) == 3
        back = resume(tmp_path, "back", overrides, step6, 2)
        assert_ok(back)
        converted_line(back, 6, 3, 2)
        assert_state_carried(dump(first, "saved", 6, 3), dump(back, "loaded", 6, 2))
        differences["3 -> 2"] = assert_continues(back, ref, first=7)
    print(
        f"ZeRO-{stage}: conversion {seconds} s; largest relative loss difference to the uninterrupted "
        "run: " + ", ".join(f"{moved} {difference:.1e}" for moved, difference in differences.items())
    )


FINETUNE = {
    # (ZeRO stage, the settings beyond the model and data, the processes that resume)
    "full-zero3": (3, [], 1),
    # An adapter on a random-init model learns slowly: a higher rate. Its dropout off, as the model's.
    "lora-zero1": (
        1,
        ["lora.enabled=true", "lora.dropout=0", "train.learning_rate=0.03", "train.min_lr=0.003"],
        3,
    ),
}


@slow
@pytest.mark.parametrize("name", FINETUNE)
def test_finetuning_checkpoint_resumes_at_another_world_size(
    references,
    name,
    tmp_path,
    tiny_model,  # noqa: F811
    chat_data,  # noqa: F811
):
    stage, extra, processes = FINETUNE[name]
    overrides = [
        f"model.name_or_path={tiny_model}",
        f"data.path={chat_data}",
        "model.max_length=128",
        *[setting for setting in GPT if not setting.startswith("model.")],
        *deepspeed(stage),
        *extra,
    ]
    ref = references(name, overrides)
    step4 = ref.output_dir / "checkpoints" / "step-4"
    resumed = resume(tmp_path, "resumed", overrides, step4, processes)
    assert_ok(resumed)
    converted_line(resumed, 4, 2, processes)
    saved = dump(ref, "saved", 4, 2)
    if extra:  # the adapter and its optimizer state only: the frozen base comes from the model dir
        assert all("lora_" in parameter for parameter in saved["params"])
    assert_state_carried(saved, dump(resumed, "loaded", 4, processes))
    difference = assert_continues(resumed, ref, first=5)
    assert_state_close(dump(resumed, "saved", 8, processes), dump(ref, "saved", 8, 2))
    assert (resumed.output_dir / "final").is_dir()
    print(f"fine-tuning {name} on {processes}: largest relative loss difference {difference:.1e}")


def files_hash(directory) -> str:
    """The checkpoint's own files (names and bytes), not a conversion's leftover."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = str(path.relative_to(directory))
        if not name.startswith(".tmp-universal-"):
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()


def stopped_at_step_4(ref, copy):
    """The reference as a run stopped after step-4 (trainer_harness.stopped_after), without the
    universal checkpoint another test may have made of it."""
    output_dir = stopped_after(ref.output_dir, 4, copy)
    step4 = output_dir / "checkpoints" / "step-4"
    for made in step4.glob("*universal*"):
        shutil.rmtree(made)
    return output_dir, step4


@slow
def test_a_conversion_killed_half_way_leaves_the_checkpoint_and_the_next_run_converts_again(
    references, tmp_path
):
    ref = gpt_reference(references, 2)
    output_dir, step4 = stopped_at_step_4(ref, tmp_path / "out")
    before = files_hash(step4)
    overrides = [*GPT, *deepspeed(2), f"train.gradient_accumulation_steps={ACCUMULATION[1]}"]

    # Documented test hook: rank 0 sleeps after the conversion wrote its temporary directory.
    job = start_run(output_dir, overrides, launcher="none", env={"TRAINER_TEST_UNIVERSAL_DELAY_S": "300"})
    try:
        wait_for(
            lambda: any(step4.glob(".tmp-universal-*/latest_universal")),
            timeout_s=400,
            what=f"the conversion to write its temporary directory in {step4}",
        )
    finally:
        kill_job(job)
    checkpoints = output_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-4"
    assert not (step4 / "universal").exists()
    (leftover,) = step4.glob(".tmp-universal-*")  # removed by the next run, not by this one
    assert files_hash(step4) == before

    again = finish(start_run(output_dir, overrides, launcher="none"), output_dir)  # ... until this run
    assert_ok(again)
    assert f"removing an interrupted conversion of step-4 ({leftover})" in again.stdout
    converted_line(again, 4, 2, 1)
    assert not leftover.exists() and (step4 / "universal").is_dir()
    assert again.summary["resumed_from"].endswith("step-4") and again.summary["steps_this_run"] == 4
    assert_continues(again, ref, first=5)


@slow
def test_a_failed_conversion_stops_every_rank_with_one_error(references, tmp_path):
    ref = gpt_reference(references, 2)
    output_dir, step4 = stopped_at_step_4(ref, tmp_path / "out")
    shard = step4 / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # damaged, as by a failing disk
    overrides = [*GPT, *deepspeed(2), f"train.gradient_accumulation_steps={ACCUMULATION[3]}"]

    failed = finish(start_run(output_dir, overrides, nproc=3), output_dir)
    assert failed.returncode != 0
    error = (
        "trainer: config error: checkpoint.resume: resuming step-4 written by 2 processes on 3: converting "
        "it to DeepSpeed's universal checkpoint failed ("
    )
    assert failed.stderr.count(error) == 1, failed.stderr[-5000:]  # rank 0 says it, once
    assert "PytorchStreamReader failed reading zip archive" in failed.stderr  # the cause, in one line
    assert f"{step4} is intact: resume it with 2 processes" in failed.stderr
    # Every rank left with that error (2), or was ended by torchrun as the first ones left: none
    # stayed waiting for rank 0, none failed otherwise.
    codes = [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", failed.stderr)]
    assert codes and set(codes) <= {2, -15} and 2 in codes, failed.stderr[-3000:]
    assert "trainer: rank" not in failed.stderr  # no rank's traceback, none "stopped: another rank failed"
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert not list(step4.glob("*universal*"))
    assert not (output_dir / "checkpoints" / "step-8").exists()
