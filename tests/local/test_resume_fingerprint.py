"""Resuming checks what the checkpoint was trained on: the vocabulary, the training data and, for a
Hugging Face model, the tokenizer's files, by content. A change is the exit-2 resume error naming it and
the way out, before anything is written; old checkpoints without these records resume with a warning."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from helpers.finetune_harness import chat_data, finetune_sets, hf_cache, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.node.checkpoint import STATE_FILE

TINY = ["train.max_steps=2", "train.log_every=1", "model.n_layer=1", "checkpoint.save_steps=2"]
LONGER = "train.max_steps=4"


def _text(seed: int, alphabet: str = "abcdefgh \n") -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(20_000))


def _unchanged(out: Path):
    """A snapshot of what a refused resume must leave alone."""
    files = ("metrics.jsonl", "run.json", "checkpoints/latest", f"checkpoints/step-2/{STATE_FILE}")
    return {name: (out / name).read_bytes() for name in files}


def _refused(run, *needles: str) -> str:
    assert run.returncode == exitcodes.CONFIG_ERROR, f"exit {run.returncode}\n{run.stderr[-3000:]}"
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("trainer: config error:")]
    assert line.startswith("trainer: config error: checkpoint.resume: "), line
    for needle in needles:
        assert needle in line, line
    return line


def test_changed_training_data_is_refused_naming_what_changed_and_the_override_resumes(run_trainer, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(_text(1))
    first = run_trainer(*TINY, f"data.path={data}", launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _unchanged(first.output_dir)

    # Same size, same characters, other text: the ids mean the same, the samples are others.
    data.write_text(_text(2))
    same_size = run_trainer(*TINY, LONGER, f"data.path={data}", launcher="none")
    line = _refused(
        same_size, f"the training data ({data}) changed since", "checkpoint.allow_data_change=true"
    )
    assert "another output_dir (or run name)" in line and "checkpoint.resume=never" in line
    assert _unchanged(first.output_dir) == before

    # Same size, one character more in the alphabet: every id after it now means another character.
    data.write_text(_text(2, alphabet="abcdefghi \n"))
    new_vocabulary = run_trainer(*TINY, LONGER, f"data.path={data}", launcher="none")
    line = _refused(
        new_vocabulary, "was trained on another vocabulary (10 tokens", "this run's has 11 tokens"
    )
    assert "allow_data_change" not in line  # no override: the weights cannot mean the new ids
    overridden = run_trainer(
        *TINY, LONGER, f"data.path={data}", "checkpoint.allow_data_change=true", launcher="none"
    )
    _refused(overridden, "another vocabulary")
    assert _unchanged(first.output_dir) == before

    # Bigger data (used to crash with `size mismatch`, exit 1): the vocabulary error, exit 2.
    data.write_text(_text(3, alphabet="abcdefghijklmnop \n") * 2)
    bigger = run_trainer(*TINY, LONGER, f"data.path={data}", launcher="none")
    _refused(bigger, "another vocabulary (10 tokens")
    assert "size mismatch" not in bigger.stderr  # found before the load, not by it
    assert _unchanged(first.output_dir) == before

    # The same vocabulary, other text, told to go on: resumes at step 2 on the new data.
    data.write_text(_text(4))
    resumed = run_trainer(
        *TINY, LONGER, f"data.path={data}", "checkpoint.allow_data_change=true", launcher="none"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from"].endswith("step-2") and resumed.summary["steps_this_run"] == 2
    # The new checkpoint records the new data: a plain rerun with it is not refused.
    again = run_trainer(*TINY, "train.max_steps=6", f"data.path={data}", launcher="none")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.summary["resumed_from"].endswith("step-4")


def test_a_checkpoint_without_the_data_records_resumes_with_a_warning(run_trainer, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(_text(1))
    first = run_trainer(*TINY, f"data.path={data}", launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    state_file = first.output_dir / "checkpoints" / "step-2" / STATE_FILE
    state = json.loads(state_file.read_text())
    for key in ("vocabulary", "data"):  # as a trainer before this check wrote it
        del state["fingerprint"][key]
    state_file.write_text(json.dumps(state))

    resumed = run_trainer(*TINY, LONGER, f"data.path={data}", launcher="none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "did not record which data and vocabulary it was trained on" in resumed.stdout
    assert resumed.summary["resumed_from"].endswith("step-2")

    # Such a checkpoint with a vocabulary of another size: the load finds it, still exit 2 (was 1).
    state_file = first.output_dir / "checkpoints" / "step-4" / STATE_FILE
    state = json.loads(state_file.read_text())
    for key in ("vocabulary", "data"):
        del state["fingerprint"][key]
    state_file.write_text(json.dumps(state))
    data.write_text(_text(1, alphabet="abcdefghijk \n"))
    other = run_trainer(*TINY, "train.max_steps=6", f"data.path={data}", launcher="none")
    _refused(other, "does not fit this model (size mismatch", "checkpoint.resume=never")


def test_fine_tuning_refuses_changed_data_and_tokenizer_files(run_trainer, tmp_path, tiny_model, chat_data):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    data = tmp_path / "chat.json"
    shutil.copy(chat_data, data)
    base = finetune_sets(model, data, "train.max_steps=2", "checkpoint.save_steps=2")
    first = run_trainer(*base, launcher="none")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _unchanged(first.output_dir)
    longer = [*base, LONGER]

    records = json.loads(data.read_text())
    data.write_text(json.dumps(records[::-1]))  # same records, same size, another order
    changed = run_trainer(*longer, launcher="none")
    _refused(changed, f"the training data ({data}) changed since", "checkpoint.allow_data_change=true")
    data.write_text(json.dumps(records))

    config = model / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["model_max_length"] = 77  # still loads, the same vocabulary; the files differ
    config.write_text(json.dumps(settings))
    tokenizer = run_trainer(*longer, launcher="none")
    _refused(tokenizer, f"the tokenizer's files ({model}) changed since")
    assert _unchanged(first.output_dir) == before

    resumed = run_trainer(*longer, "checkpoint.allow_data_change=true", launcher="none")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from"].endswith("step-2")
