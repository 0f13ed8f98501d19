"""A full disk under output_dir: one clear line (directory, bytes free, the checkpoint's size), the
previous checkpoint intact and still `latest`, and a plain rerun that resumes once space is freed.

The disk is a real, small tmpfs mounted for the test (we run as root); where mounting is not permitted
the tests are skipped with the reason.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers.finetune_harness import chat_data, finetune_sets, hf_cache, tiny_model  # noqa: F401
from helpers.trainer_harness import finish, kill_job, start_run, wait_for

from trainer import exitcodes
from trainer.joblock import LOCK_FILE
from trainer.node.checkpoint import disk_usage, free_bytes

STEPS = ["train.log_every=1", "model.n_layer=1", "checkpoint.save_steps=2"]


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of `size` at tmp_path/out, the run's output_dir (its logs go next to
    it, off the small disk, as a node's log would); remount(size) resizes it."""
    mountpoint = tmp_path / "out"
    mountpoint.mkdir()
    mounted = []

    def mount(size: str) -> Path:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(mountpoint)
        return mountpoint

    def remount(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mountpoint)], check=True)

    mount.remount = remount
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _run(output_dir: Path, *overrides: str, launcher: str = "none", nproc: int = 1, env=None):
    return finish(start_run(output_dir, list(overrides), launcher=launcher, nproc=nproc, env=env), output_dir)


def _fingerprint(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _fill(disk: Path, leave: int) -> Path:
    """A filler file that leaves `leave` bytes free."""
    filler = disk / "filler"
    size = max(0, free_bytes(disk) - leave)
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for offset in range(0, size, 1 << 20):
            os.write(descriptor, b"\0" * min(1 << 20, size - offset))
    except OSError as err:  # filling to the last byte: the last blocks may already be taken
        assert err.errno == errno.ENOSPC and leave == 0, err
    finally:
        os.close(descriptor)
    return filler


def _no_space_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "no space left on device" in line]


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint_and_a_rerun_resumes(small_disk):
    out = disk = small_disk("16m")
    first = _run(out, *STEPS, "train.max_steps=4", "checkpoint.save_total_limit=1")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = out / "checkpoints"
    step4 = _fingerprint(checkpoints / "step-4")

    # The next run stops inside its step-6 write (the test hook); then the disk fills up, as when
    # another job's output lands on the same file system.
    process = start_run(
        out,
        [*STEPS, "train.max_steps=8", "checkpoint.save_total_limit=1"],
        launcher="none",
        nproc=1,
        env={"TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S": "4", "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP": "6"},
    )
    deadline = time.monotonic() + 300
    while not (checkpoints / ".tmp-step-6" / "ddp_state.pt").is_file():
        assert process.poll() is None and time.monotonic() < deadline, "the run never reached step 6"
        time.sleep(0.1)
    filler = _fill(disk, leave=0)
    full = finish(process, out)

    assert full.returncode == exitcodes.NO_SPACE, full.stderr[-3000:]
    assert "Traceback" not in full.stderr and "iostream" not in full.stderr
    (line,) = _no_space_lines(full.stderr)
    assert line.startswith(f"trainer: no space left on device for checkpoint step-6 in {checkpoints}: ")
    assert " free" in line and "step-4 is intact and stays `latest`" in line
    assert "run the same command again to resume" in line
    assert (checkpoints / "latest").read_text().strip() == "step-4"
    assert _fingerprint(checkpoints / "step-4") == step4, "the previous checkpoint changed"
    run_json = (out / "run.json").read_text()
    metrics = (out / "metrics.jsonl").read_text()

    # Rerun on the still-full disk: the incomplete write goes first, then the run is refused before it
    # trains or writes anything, because the next checkpoint cannot fit.
    again = _run(out, *STEPS, "train.max_steps=8", "checkpoint.save_total_limit=1")
    assert again.returncode == exitcodes.NO_SPACE, again.stderr[-3000:]
    (line,) = _no_space_lines(again.stderr)
    needed = disk_usage(checkpoints / "step-4")
    assert "for checkpoint step-6" in line and "(the size of step-4)" in line
    assert not (checkpoints / ".tmp-step-6").exists(), "the incomplete write was not removed"
    assert not any(line.startswith("step ") for line in again.stdout.splitlines()), "it trained"
    assert (out / "run.json").read_text() == run_json and (out / "metrics.jsonl").read_text() == metrics
    # Still too full: the refused run's job lock (trainer.joblock, one tmpfs page) is free again since.
    assert free_bytes(disk) - 4096 < needed

    filler.unlink()
    resumed = _run(out, *STEPS, "train.max_steps=8", "checkpoint.save_total_limit=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from"].endswith("step-4")
    assert resumed.summary["steps_this_run"] == 4
    assert (checkpoints / "latest").read_text().strip() == "step-8"
    assert not list(checkpoints.glob(".tmp-*"))


def test_a_run_killed_on_a_full_disk_leaves_a_stale_lock_and_the_rerun_still_makes_room(small_disk):
    # Killed (-9, as a stuck job is) while its write filled the disk: its job lock stays behind, and
    # the disk has no block left for the next run's lock until the incomplete write goes.
    out = disk = small_disk("16m")
    first = _run(out, *STEPS, "train.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = out / "checkpoints"
    process = start_run(
        out,
        [*STEPS, "train.max_steps=8"],
        launcher="none",
        nproc=1,
        env={"TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S": "300", "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP": "6"},
    )
    try:
        wait_for(lambda: (checkpoints / ".tmp-step-6" / "ddp_state.pt").is_file(), 300, "the step-6 write")
        filler = _fill(disk, leave=0)
    finally:
        kill_job(process)
    assert (out / LOCK_FILE).exists() and free_bytes(disk) == 0

    # The rerun removes the incomplete write first (its holder is dead), takes the lock over and
    # resumes: the room the write held, with the checkpoints save_total_limit lets go, is enough.
    again = _run(out, *STEPS, "train.max_steps=8")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removing incomplete checkpoint" in again.stdout and "took over " in again.stdout
    assert again.summary["resumed_from"].endswith("step-4") and again.summary["final_step"] == 8
    assert filler.exists()


def test_a_first_checkpoint_that_does_not_fit_is_named_and_the_run_restarts_after_a_remount(small_disk):
    # No checkpoint to measure: the write itself runs out of space (torch's writer says only
    # "iostream error"; the trainer recognises the full disk).
    out = small_disk("600k")
    full = _run(out, *STEPS, "train.max_steps=4")
    assert full.returncode == exitcodes.NO_SPACE, full.stderr[-3000:]
    assert "Traceback" not in full.stderr and "iostream" not in full.stderr
    (line,) = _no_space_lines(full.stderr)
    assert f"for checkpoint step-2 in {out / 'checkpoints'}: it needs more than " in line
    assert "free without the incomplete write" in line and "no earlier checkpoint" in line
    assert not (out / "checkpoints" / "latest").exists()

    small_disk.remount("16m")
    again = _run(out, *STEPS, "train.max_steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "removing incomplete checkpoint" in again.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_a_checkpoint_that_fits_once_older_ones_go_is_written(small_disk):
    # Room for two checkpoints only, save_total_limit=2: the oldest goes before the write instead of
    # after it (the disk of the original report), never the one `latest` names.
    out = disk = small_disk("16m")
    first = _run(out, *STEPS, "train.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    size = disk_usage(out / "checkpoints" / "step-4")
    _fill(disk, leave=size // 2)
    resumed = _run(out, *STEPS, "train.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "making room for step-6" in resumed.stdout and "removing step-2 now" in resumed.stdout
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-4", "step-6"]


@pytest.mark.parametrize(
    ("engine", "launcher"), [("deepspeed", "torchrun"), ("accelerate", "accelerate")], ids=str
)
def test_every_engine_names_a_full_disk_and_resumes_after_space_is_freed(small_disk, engine, launcher):
    out = small_disk("600k")
    overrides = [*STEPS, "train.max_steps=4", f"distributed.engine={engine}"]
    full = _run(out, *overrides, launcher=launcher, nproc=2)
    assert full.returncode != 0
    lines = _no_space_lines(full.stderr)
    assert lines and all(f"for checkpoint step-2 in {out / 'checkpoints'}" in line for line in lines)
    assert "iostream" not in full.stderr
    assert not (out / "checkpoints" / "latest").exists()

    small_disk.remount("64m")
    again = _run(out, *overrides, launcher=launcher, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_fine_tuning_names_a_full_disk_keeps_its_checkpoint_and_resumes(small_disk, tiny_model, chat_data):  # noqa: F811
    out = disk = small_disk("64m")
    overrides = finetune_sets(tiny_model, chat_data, "train.max_steps=2", "checkpoint.save_steps=2")
    first = _run(out, *overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    step2 = _fingerprint(out / "checkpoints" / "step-2")
    filler = _fill(disk, leave=disk_usage(out / "checkpoints" / "step-2") // 2)
    longer = [*overrides, "train.max_steps=4", "checkpoint.save_total_limit=1"]
    full = _run(out, *longer)
    assert full.returncode == exitcodes.NO_SPACE, full.stderr[-3000:]
    (line,) = _no_space_lines(full.stderr)
    assert "for checkpoint step-4" in line and "step-2 is intact and stays `latest`" in line
    assert _fingerprint(out / "checkpoints" / "step-2") == step2

    filler.unlink()
    resumed = _run(out, *longer)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from"].endswith("step-2")
    assert (out / "final" / "config.json").is_file()
    assert not os.path.exists(out / ".tmp-final")


def test_a_limit_above_the_checkpoints_kept_makes_no_room_and_deletes_nothing(small_disk):
    """Three checkpoints and save_total_limit=6: after the next save all four stay, so none may be
    deleted to make room (the slice used to wrap around and delete the oldest)."""
    from trainer.node.checkpoint.layout import STATE_FILE
    from trainer.node.checkpoint.space import space_problem

    out = small_disk("2M")
    for step in (2, 4, 6):
        checkpoint = out / f"step-{step}"
        checkpoint.mkdir()
        (checkpoint / STATE_FILE).write_text("{}")
        (checkpoint / "model.bin").write_bytes(os.urandom(300 << 10))
    (out / "filler").write_bytes(os.urandom(1 << 20))  # what else fills the disk
    said = []
    problem = space_problem(out, step=8, save_total_limit=6, log=said.append)
    assert problem and "no space left on device for checkpoint step-8" in problem
    assert said == [] and (out / "step-2").is_dir(), "nothing is deleted that the limit would keep"
