"""`train.num_epochs`: the steps derived from the prepared data and the effective batch, said in the log,
the dry run and run.json, for the built-in tiny GPT and a Hugging Face fine-tune; one of max_steps and
num_epochs decides."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.finetune_harness import build, hf_cache, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.cli import main
from trainer.node.config import ConfigError, load_config
from trainer.node.order import SAMPLE_LOG_VARIABLE

BLOCK = 64


def text_of_samples(tmp_path: Path, samples: int) -> Path:
    """A text file that holds exactly `samples` samples of data.block_size characters."""
    path = tmp_path / "text.txt"
    path.write_text(("the quick brown fox jumps over the lazy dog. " * 400)[: samples * BLOCK + 1])
    return path


def test_dry_run_says_how_many_steps_the_epochs_make(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = text_of_samples(tmp_path, 100)
    args = ["train", "--dry-run", "--set", f"data.path={data}", "--set", "train.num_epochs=2"]
    args += ["--set", "train.micro_batch_size=4", "--set", "train.gradient_accumulation_steps=3"]
    assert main(args) == exitcodes.OK
    out = capsys.readouterr().out
    # 100 samples in steps of 4 × 2 × 3 = 24: 4 whole steps per epoch, the last 4 samples left out.
    assert (
        "# train.max_steps = 8: train.num_epochs 2 × 4 steps per epoch (100 training rows × data.repeats 1 "
        "in steps of the effective batch 24 = micro_batch_size 4 × world size 2 × "
        "gradient_accumulation_steps 3; the last 4 of each epoch's shuffled order are left out)"
    ) in out
    # The resolved config shows what the user set: epochs, no step count of its own.
    assert "  max_steps: null\n  num_epochs: 2.0\n" in out


def test_both_in_one_file_is_refused_naming_both(tmp_path, capsys):
    path = tmp_path / "both.yaml"
    path.write_text("train:\n  max_steps: 100\n  num_epochs: 3\n")
    assert main(["train", str(path), "--dry-run"]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.num_epochs: and train.max_steps (100) are both set; keep one" in err


def test_the_command_line_picks_one_over_the_files_other(tmp_path):
    path = tmp_path / "steps.yaml"
    path.write_text("train:\n  max_steps: 1000\n")
    epochs = load_config(path, ["train.num_epochs=1.5"]).train
    assert (epochs.max_steps, epochs.num_epochs) == (None, 1.5)
    path.write_text("train:\n  num_epochs: 3\n")
    steps = load_config(path, ["train.max_steps=10"]).train
    assert (steps.max_steps, steps.num_epochs) == (10, None)
    # The embedded default's max_steps: 80 gives way too.
    assert load_config(None, ["train.num_epochs=1"]).train.max_steps is None
    with pytest.raises(ConfigError, match=r"train\.num_epochs: and train\.max_steps \(10\) are both set"):
        load_config(None, ["train.num_epochs=1", "train.max_steps=10"])
    with pytest.raises(ConfigError, match=r"train\.num_epochs: must be greater than 0"):
        load_config(None, ["train.num_epochs=0"])


def _trained_samples(sample_log: Path) -> list[int]:
    return [
        sample
        for path in sorted(sample_log.glob("rank-*.jsonl"))
        for line in path.read_text().splitlines()
        for sample in json.loads(line)["samples"]
    ]


@pytest.mark.slow
def test_one_epoch_of_the_tiny_gpt_trains_every_sample_once(run_trainer, tmp_path):
    data = text_of_samples(tmp_path, 48)
    sample_log = tmp_path / "samples"
    run = run_trainer(
        f"data.path={data}",
        "train.num_epochs=1",
        "train.micro_batch_size=4",
        "train.gradient_accumulation_steps=2",
        "train.log_every=1",
        "model.n_layer=1",
        env={SAMPLE_LOG_VARIABLE: str(sample_log)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # 48 samples, effective batch 4 × 2 processes × 2 = 16: 3 steps.
    assert [record["step"] for record in run.metrics] == [1, 2, 3]
    assert run.summary["final_step"] == 3
    assert sorted(_trained_samples(sample_log)) == list(range(48))
    assert run.json("run.json")["steps"] == {
        "max_steps": 3,
        "set_by": "train.num_epochs",
        "num_epochs": 1.0,
        "steps_per_epoch": 3,
        "training_rows": 48,
        "repeats": 1,
        "effective_batch": 16,
    }
    assert "train.max_steps = 3: train.num_epochs 1 × 3 steps per epoch (48 training rows" in run.stdout


@pytest.mark.slow
def test_half_an_epoch_of_a_hugging_face_fine_tune(run_trainer, tmp_path, tiny_model):  # noqa: F811
    data = tmp_path / "chats.json"
    build("data", str(data), "--samples", "40")
    sample_log = tmp_path / "samples"
    run = run_trainer(
        f"model.name_or_path={tiny_model}",
        f"data.path={data}",
        "model.max_length=128",
        "train.num_epochs=0.5",
        "train.micro_batch_size=4",
        "train.log_every=1",
        "train.warmup_ratio=0.5",
        launcher="none",
        env={SAMPLE_LOG_VARIABLE: str(sample_log)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    steps = run.json("run.json")["steps"]
    rows = steps["training_rows"]
    assert rows == 40  # one row per conversation: no packing, none too long
    expected = math.ceil(0.5 * (rows // 4))
    assert steps["max_steps"] == expected == 5
    assert [record["step"] for record in run.metrics] == list(range(1, expected + 1))
    trained = _trained_samples(sample_log)
    assert len(trained) == len(set(trained)) == 20  # half the conversations, none twice
    # warmup_ratio is a share of the derived steps: ceil(0.5 × 5) = 3 steps of warmup, peak at step 3.
    lrs = [record["lr"] for record in run.metrics]
    assert lrs[2] == pytest.approx(3e-3) and lrs[1] < lrs[2] and lrs[3] < lrs[2]
