"""A checkpoint on the shared dir is loaded only if nobody but the training account could have written it,
and the trainer's own per-rank state is read as tensors only: a planted pickle never runs."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import exitcodes
from trainer.configerror import ConfigError
from trainer.node.checkpoint import check_trusted, load_rng_state, rng_state, set_rng_state

TINY = ["train.max_steps=3", "train.log_every=1", "model.n_layer=1", "checkpoint.save_steps=2"]


class _RunsCode:
    """Unpickling this runs a shell command: what an attacker would plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


def _plant(path: Path, marker: Path) -> None:
    torch.save({"python": _RunsCode(marker)}, path)


def _checkpoint(tmp_path: Path) -> Path:
    step = tmp_path / "out" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}\n")
    torch.save(rng_state(), step / "rng-rank0.pt")
    return step


def test_rng_state_round_trips_through_a_tensors_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # numpy keeps a cached gaussian: it must survive too
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_rng_state(tmp_path / "rng.pt"))
    assert (
        random.random(),
        np.random.standard_normal(),
        np.random.rand(),
        torch.rand(3).tolist(),
    ) == expected


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    _plant(tmp_path / "rng-rank0.pt", marker)
    with pytest.raises(ConfigError, match=r"rng-rank0\.pt is not a random-state file this trainer wrote"):
        load_rng_state(tmp_path / "rng-rank0.pt")
    assert not marker.exists(), "the planted pickle ran"


@pytest.mark.parametrize("where", ["file", "directory", "parent"])
def test_a_file_others_can_write_is_refused_naming_it(tmp_path, where):
    step = _checkpoint(tmp_path)
    (step / "engine").mkdir()
    target = {"file": step / "rng-rank0.pt", "directory": step / "engine", "parent": step.parent}[where]
    target.chmod(target.stat().st_mode | 0o020)
    with pytest.raises(ConfigError) as caught:
        check_trusted(step)
    assert f"{target} is writable by group or others" in str(caught.value)
    assert "checkpoint.resume=never" in str(caught.value)


def test_a_file_of_another_account_or_a_link_is_refused(tmp_path):
    step = _checkpoint(tmp_path)
    check_trusted(step)  # as written: fine
    other = os.getuid() + 4242  # as a training account that did not write these files
    with pytest.raises(
        ConfigError, match=rf"checkpoints is owned by uid \d+, not the training account \(uid {other}\)"
    ):
        check_trusted(step, uid=other)
    (step / "model.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(ConfigError, match=r"model\.pt is a symbolic link"):
        check_trusted(step)


@pytest.mark.slow
def test_a_run_is_private_and_resume_refuses_a_planted_pickle_or_a_writable_file(run_trainer, tmp_path):
    login_umask = os.umask(0o022)  # a common login umask: the run narrows it
    first = run_trainer(*TINY, launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    written = [first.output_dir, *first.output_dir.rglob("*")]
    assert any(p.name == "metrics.jsonl" for p in written) and any(p.suffix == ".pt" for p in written)
    open_to_others = [f"{p} {p.stat().st_mode & 0o777:04o}" for p in written if p.stat().st_mode & 0o007]
    assert open_to_others == [], "a run's files are for the training account and its group only (umask 027)"
    step = first.output_dir / "checkpoints" / "step-3"
    rng = step / "rng-rank0.pt"
    assert rng.is_file()
    genuine = rng.read_bytes()

    marker = tmp_path / "pwned"
    _plant(rng, marker)
    planted = run_trainer(*TINY, "train.max_steps=4", launcher="none")
    assert planted.returncode == exitcodes.CONFIG_ERROR, planted.stderr[-3000:]
    assert f"{rng} is not a random-state file this trainer wrote" in planted.stderr
    assert "Traceback" not in planted.stderr
    assert not marker.exists(), "the planted pickle ran at resume"

    rng.write_bytes(genuine)
    rng.chmod(0o666)
    writable = run_trainer(*TINY, "train.max_steps=4", launcher="none")
    assert writable.returncode == exitcodes.CONFIG_ERROR
    assert f"{rng} is writable by group or others (mode 0666)" in writable.stderr

    if os.getuid() == 0:  # root can hand the file to another account, as an attacker's file would be
        rng.chmod(0o644)
        os.chown(rng, 65534, 65534)
        foreign = run_trainer(*TINY, "train.max_steps=4", launcher="none")
        assert foreign.returncode == exitcodes.CONFIG_ERROR
        assert f"{rng} is owned by uid 65534, not the training account (uid 0)" in foreign.stderr
        os.chown(rng, 0, 0)

    rng.chmod(0o644)
    resumed = run_trainer(*TINY, "train.max_steps=4", launcher="none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and resumed.summary["steps_this_run"] == 1
    os.umask(login_umask)
