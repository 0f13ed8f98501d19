"""The trainer's configuration: defaults, overrides, and bad values stopped before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import exitcodes
from trainer.cli import main
from trainer.node.config import DEFAULT_CONFIG, ConfigError, TrainerConfig, load_config


def test_embedded_default_yaml_matches_the_dataclass_defaults():
    # One source of truth: the documented default file and the code's defaults never drift apart.
    assert load_config(DEFAULT_CONFIG) == TrainerConfig()


def test_overrides_are_parsed_as_yaml_and_type_checked():
    config = load_config(
        None,
        [
            "train.max_steps=7",
            "train.learning_rate=1e-3",  # YAML 1.1 reads this as text; a float key still takes it
            "train.grad_clip=2",  # an int where a float is expected is fine
            "data.allow_dataset_oversubscription=true",
            "data.path=123",  # a str key takes the text as written
            "distributed.engine=deepspeed",
            "checkpoint.resume=never",
        ],
    )
    assert config.train.max_steps == 7
    assert config.train.learning_rate == 0.001
    assert config.train.grad_clip == 2.0 and isinstance(config.train.grad_clip, float)
    assert config.data.allow_dataset_oversubscription is True
    assert config.data.path == "123"
    assert config.distributed.engine == "deepspeed"
    assert config.checkpoint.resume == "never"


def test_a_yaml_file_sets_only_what_it_names(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: /tmp/x\ntrain:\n  max_steps: 5\ndistributed:\n  engine: accelerate\n")
    config = load_config(path, ["train.max_steps=6"])
    assert (config.output_dir, config.train.max_steps, config.distributed.engine) == (
        "/tmp/x",
        6,
        "accelerate",
    )
    assert config.train.micro_batch_size == TrainerConfig().train.micro_batch_size


BAD_OVERRIDES = [
    (["train.max_step=10"], "train.max_step: unknown key; did you mean train.max_steps?"),
    (["optimizer.lr=0.1"], "optimizer: unknown key"),
    (["train.max_steps=ten"], "train.max_steps: must be int or null (got str 'ten')"),
    (["train.micro_batch_size=1.5"], "train.micro_batch_size: must be int (got float 1.5)"),
    (["data.allow_dataset_oversubscription=maybe"], "data.allow_dataset_oversubscription: must be bool"),
    (["train.max_steps=0"], "train.max_steps: must be at least 1 (got 0)"),
    (["train.gradient_accumulation_steps=-2"], "train.gradient_accumulation_steps: must be at least 1"),
    (["distributed.engine=horovod"], "distributed.engine: must be one of 'ddp' | 'deepspeed' | 'accelerate'"),
    (["distributed.zero_stage=4"], "distributed.zero_stage: must be 1, 2 or 3 (got 4)"),
    (["model.n_embd=65"], "model.n_embd: must be a positive multiple of model.n_head=4 (got 65)"),
    (["train.learning_rate=0"], "train.learning_rate: must be greater than 0 (got 0.0)"),
    (["train.min_lr=0.5"], "train.min_lr: must be between 0 and train.learning_rate"),
    (["checkpoint.save_total_limit=-1"], "checkpoint.save_total_limit: must be 0 (keep all) or more"),
    (["train.mixed_precision=fp16"], "train.mixed_precision: must be one of 'auto' | 'bf16' | 'no'"),
    (["train=5"], "train: is a section, not a value"),
    (["train.max_steps"], "--set: expected section.key=value"),
    (["model.dropout=1.0"], "model.dropout: must be in [0, 1)"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_OVERRIDES, ids=[o[0] for o, _ in BAD_OVERRIDES])
def test_bad_value_is_a_config_error_naming_the_key_before_anything_starts(
    tmp_path, capsys, overrides, message
):
    output_dir = tmp_path / "out"
    args = ["train", "--set", f"output_dir={output_dir}"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("trainer: config error: ")
    assert not output_dir.exists(), "nothing may be created for a rejected config"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  max_stepz: 3\n", "train.max_stepz: unknown key; did you mean train.max_steps?"),
        ("- just\n- a list\n", "must hold a mapping of sections"),
        ("train: 3\n", "train: must be a mapping of keys to values"),
        ("train: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_config_file_is_a_config_error(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == exitcodes.CONFIG_ERROR
    assert message in capsys.readouterr().err


def test_missing_config_file_and_missing_data_file_name_what_is_missing(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == exitcodes.CONFIG_ERROR
    assert "--config: cannot read" in capsys.readouterr().err
    args = ["train", "--set", f"output_dir={tmp_path / 'out'}", "--set", f"data.path={tmp_path / 'no.txt'}"]
    assert main(args) == exitcodes.CONFIG_ERROR
    assert "data.path: no such file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resume_from_a_path_that_is_not_a_checkpoint_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "step-3").mkdir()
    args = [
        "train",
        "--set",
        f"output_dir={tmp_path / 'out'}",
        "--set",
        f"checkpoint.resume={tmp_path / 'step-3'}",
    ]
    assert main(args) == exitcodes.CONFIG_ERROR
    assert "checkpoint.resume: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_config_errors_are_exceptions_with_the_key():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["checkpoint.save_steps=-1"])
    assert raised.value.key == "checkpoint.save_steps"


def tiny_text(tmp_path: Path, characters: int) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(("hello world. " * 1000)[:characters])
    return path


def test_dataset_smaller_than_one_batch_shows_the_arithmetic_and_four_ways_out(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    data = tiny_text(tmp_path, 10 * 64 + 1)  # exactly 10 samples of 64 characters
    args = ["train", "--dry-run", "--set", f"data.path={data}", "--set", "train.micro_batch_size=8"]
    args += ["--set", "train.gradient_accumulation_steps=2"]
    assert main(args) == exitcodes.DATA_ERROR
    err = capsys.readouterr().err
    assert "= 8 × 4 × 2 = 64 samples, but the dataset has 10 samples × data.repeats 1 = 10" in err
    for way_out in (
        "train.micro_batch_size",
        "fewer processes",
        "data.repeats=7",
        "allow_dataset_oversubscription",
    ):
        assert way_out in err


def test_oversubscription_computes_the_minimum_repeats(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    data = tiny_text(tmp_path, 10 * 64 + 1)
    args = ["train", "--dry-run", "--set", f"data.path={data}", "--set", "train.micro_batch_size=8"]
    args += [
        "--set",
        "train.gradient_accumulation_steps=2",
        "--set",
        "data.allow_dataset_oversubscription=true",
    ]
    assert main(args) == exitcodes.OK
    assert "training with data.repeats = 7" in capsys.readouterr().out


def test_json_lines_need_a_text_field(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    assert main(["train", "--dry-run", "--set", f"data.path={data}"]) == exitcodes.DATA_ERROR
    assert f"{data}:2: each JSON line needs a string field `text`" in capsys.readouterr().err


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, argparse; from trainer.node import train; "
        "train.configure_parser(argparse.ArgumentParser()); "
        "from trainer.node.config import load_config; load_config(None); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _flat(tree: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, value in tree.items():
        key = f"{prefix}.{name}" if prefix else name
        keys |= _flat(value, key) if isinstance(value, dict) else {key}
    return keys


def test_help_config_lists_every_key_of_default_yaml_with_its_meaning(capsys):
    import yaml

    assert main(["train", "--help-config"]) == exitcodes.OK
    listing = capsys.readouterr().out
    listed = {line.split("  (")[0] for line in listing.splitlines() if line and not line.startswith(" ")}
    assert _flat(yaml.safe_load(DEFAULT_CONFIG.read_text())) <= listed
    # Each key comes with its docstring, type and default, e.g.:
    assert (
        "train.grad_clip  (float) [1.0]\n    Clip the global gradient norm to this (0 disables clipping)."
        in listing
    )
    assert "distributed.engine  ('ddp' | 'deepspeed' | 'accelerate') [\"ddp\"]" in listing
    assert "max_grad_norm                -> train.grad_clip" in listing
    assert "lora_rank                    -> lora.r  [LLaMA-Factory]" in listing


def test_every_key_has_a_docstring():
    from trainer.node.config import config_keys

    keys = {key: doc for key, _, _, doc in config_keys()}
    assert [key for key, doc in keys.items() if not doc] == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "train.max_grad_norm=1.0",
            "train.max_grad_norm: unknown key; `max_grad_norm` is axolotl's, LLaMA-Factory's and the "
            "Hugging Face Trainer's name: here it is train.grad_clip",
        ),
        ("logging_steps=5", "logging_steps: unknown key; `logging_steps` is axolotl's"),
        (
            "resume_from_checkpoint=true",
            "resume_from_checkpoint: unknown key; `resume_from_checkpoint` is axolotl's, LLaMA-Factory's "
            "and the Hugging Face Trainer's name: here it is checkpoint.resume; true is auto",
        ),
        ("train.per_device_train_batch_size=4", "name: here it is train.micro_batch_size"),
    ],
)
def test_hugging_face_names_are_pointed_at_ours(override, expected, capsys):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_config(None, [override])
    # and through the command line: exit 2 with the same message
    assert main(["train", "--dry-run", "--set", override]) == exitcodes.CONFIG_ERROR
    assert expected in capsys.readouterr().err


def test_hugging_face_names_in_a_yaml_file_are_pointed_at_ours(tmp_path):
    path = tmp_path / "hf.yaml"
    path.write_text("train:\n  max_grad_norm: 0.5\n  logging_steps: 1\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    message = str(raised.value)
    # Both in one error, not one per run.
    assert "2 unknown keys in" in message
    assert "train.max_grad_norm: unknown key; `max_grad_norm` is" in message
    assert "here it is train.grad_clip" in message
    assert "train.logging_steps: unknown key; `logging_steps` is" in message
