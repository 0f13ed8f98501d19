"""A config in another tool's words (axolotl, LLaMA-Factory, TRL, the Hugging Face Trainer): every unknown
key of the file in one error, each answered with the key here from one table (trainer.node.config_aliases),
which `trainer train --help-config` shows; the config named as `trainer train CONFIG`."""

from __future__ import annotations

import json

import yaml

from trainer import exitcodes
from trainer.cli import main
from trainer.node.config import config_keys, load_config
from trainer.node.config_aliases import ALIASES

from helpers.finetune_harness import hf_cache, tiny_model  # noqa: F401  isort: skip

#: An axolotl LoRA config as its examples write one (examples/llama-3/lora-1b.yml, abridged).
AXOLOTL_LORA = """\
base_model: NousResearch/Llama-3.2-1B
load_in_8bit: true
datasets:
  - path: teknium/GPT4-LLM-Cleaned
    type: alpaca
val_set_size: 0.1
output_dir: ./outputs/lora-out
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target_linear: true
sequence_len: 2048
sample_packing: true
gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_8bit
lr_scheduler: cosine
learning_rate: 0.0002
bf16: auto
gradient_checkpointing: true
logging_steps: 1
warmup_steps: 10
weight_decay: 0.0
"""

#: A LLaMA-Factory SFT config (examples/train_lora/llama3_lora_sft.yaml, abridged).
LLAMA_FACTORY_LORA = """\
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
val_size: 0.1
"""


def _error(tmp_path, text: str, capsys) -> str:
    path = tmp_path / "theirs.yaml"
    path.write_text(text)
    assert main(["train", str(path), "--dry-run"]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("trainer: config error: ")
    return err


def test_an_axolotl_config_gets_every_unknown_key_in_one_error(tmp_path, capsys):
    err = _error(tmp_path, AXOLOTL_LORA, capsys)
    theirs = [key for key in yaml.safe_load(AXOLOTL_LORA) if key != "output_dir"]  # output_dir is ours too
    assert f"{len(theirs)} unknown keys in {tmp_path / 'theirs.yaml'}:" in err
    for key in theirs:
        assert f"\n  {key}: unknown key; `{key}` is axolotl's" in err, key
    assert "`lora_r` is axolotl's name: here it is lora.r\n" in err
    assert "`sequence_len` is axolotl's name: here it is model.max_length\n" in err
    assert "`num_epochs` is axolotl's name: here it is train.num_epochs\n" in err
    assert "`load_in_8bit` is axolotl's name: it has no counterpart here" in err
    assert "here it is train.optimizer; adamw_torch is adamw" in err


def test_the_renames_the_error_writes_out_are_a_config_that_loads(tmp_path, capsys):
    err = _error(tmp_path, AXOLOTL_LORA, capsys)
    ours = _block(err)
    assert ours["model"] == {"name_or_path": "NousResearch/Llama-3.2-1B", "max_length": 2048}
    assert ours["lora"] == {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": []}
    assert ours["train"]["num_epochs"] == 1 and ours["train"]["learning_rate"] == 0.0002
    pasted = tmp_path / "ours.yaml"
    pasted.write_text(yaml.safe_dump(ours))
    config = load_config(pasted)
    assert (config.lora.r, config.model.max_length, config.train.num_epochs) == (16, 2048, 1.0)
    assert (config.data.packing, config.data.eval_fraction) == (True, 0.1)


def test_a_llama_factory_config_is_answered_in_its_own_names(tmp_path, capsys):
    err = _error(tmp_path, LLAMA_FACTORY_LORA, capsys)
    assert "`lora_rank` is LLaMA-Factory's name: here it is lora.r\n" in err
    assert "did you mean lora" not in err
    assert "`cutoff_len` is LLaMA-Factory's name: here it is model.max_length" in err
    assert "`template` is LLaMA-Factory's name: here it is data.chat_template" in err
    assert "`lora_target` is LLaMA-Factory's name: here it is lora.target_modules; all (every linear" in err
    assert "`stage` is LLaMA-Factory's name: it has no counterpart here" in err
    assert "`num_train_epochs` is LLaMA-Factory's, TRL's and the Hugging Face Trainer's name" in err


def test_a_single_key_in_the_wrong_section_is_answered_too(capsys):
    assert main(["train", "--dry-run", "--set", "train.lora_rank=8"]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.lora_rank: unknown key; `lora_rank` is LLaMA-Factory's name: here it is lora.r" in err


def test_unknown_keys_of_the_file_and_the_command_line_come_together(tmp_path, capsys):
    path = tmp_path / "typos.yaml"
    path.write_text("train:\n  max_stepz: 3\nmodel:\n  n_layers: 2\n")
    assert main(["train", str(path), "--dry-run", "--set", "data.pth=x"]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "3 unknown keys in" in err
    assert "train.max_stepz: unknown key; did you mean train.max_steps?" in err
    assert "model.n_layers: unknown key; did you mean model.n_layer?" in err
    assert "data.pth: unknown key; did you mean data.path?" in err


def test_every_name_in_the_table_points_at_a_real_key_and_is_not_one():
    keys = {key for key, *_ in config_keys()}
    ours = {alias.ours for alias in ALIASES.values() if alias.ours}
    assert sorted(ours - keys) == []
    # A name that is a key here already (at the top level) would never be reported as unknown.
    assert sorted(name for name in ALIASES if name in keys) == []


def test_help_config_shows_the_table(capsys):
    assert main(["train", "--help-config"]) == exitcodes.OK
    listing = capsys.readouterr().out
    for theirs, alias in ALIASES.items():
        assert f"  {theirs:<28} -> {alias.ours or '(no counterpart)'}  [" in listing, theirs


def test_the_config_file_as_a_positional_argument(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 7\n")
    assert main(["train", str(path), "--dry-run"]) == exitcodes.OK
    assert "  max_steps: 7\n" in capsys.readouterr().out
    other = tmp_path / "other.yaml"
    other.write_text("{}\n")
    assert main(["train", str(path), "--config", str(other), "--dry-run"]) == exitcodes.CONFIG_ERROR
    assert "two config files given" in capsys.readouterr().err


def test_launch_takes_the_config_file_as_a_positional_argument_too(tmp_path, capsys):
    path, other = tmp_path / "run.yaml", tmp_path / "other.yaml"
    args = ["launch", "-i", "inventory/local", str(path), "--config", str(other)]
    assert main(args) == exitcodes.CONFIG_ERROR  # refused before the inventory is even read
    assert f"two config files given ({path} and --config {other}); give one" in capsys.readouterr().err


def _block(err: str) -> dict:
    """The translated block of an unknown-keys error, as a user pastes it."""
    block = err.split("In this trainer's words (paste it as your config")[1].split("\n", 1)[1]
    block = block.split("(every key:")[0]
    return yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))


def _alpaca(tmp_path) -> str:
    """200 alpaca records: enough to fill a batch of packed rows."""
    path = tmp_path / "alpaca.jsonl"
    path.write_text(
        "".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i}."}) + "\n" for i in range(200))
    )
    return str(path)


def _pasted_dry_run(tmp_path, ours: dict, tiny_model, data: str, capsys) -> str:  # noqa: F811
    """The block pasted into a file as it stands; only the model and the data are this machine's."""
    pasted = tmp_path / "ours.yaml"
    pasted.write_text(yaml.safe_dump(ours))
    sets = [f"model.name_or_path={tiny_model}", "model.max_length=256"]
    sets += (
        [f"data.datasets=[{{path: {data}}}]"] if "datasets" in ours.get("data", {}) else [f"data.path={data}"]
    )
    code = main(["train", str(pasted), "--dry-run", *(arg for s in sets for arg in ("--set", s))])
    captured = capsys.readouterr()
    assert code == exitcodes.OK, captured.err
    return captured.out + captured.err


def test_a_llama_factory_lora_config_translates_to_a_lora_block_that_dry_runs(tiny_model, tmp_path, capsys):  # noqa: F811
    err = _error(tmp_path, LLAMA_FACTORY_LORA.replace("template: llama3", "template: qwen"), capsys)
    ours = _block(err)
    assert ours["lora"] == {"enabled": True, "r": 8, "target_modules": []}
    assert ours["train"]["lr_schedule"] == "cosine" and ours["train"]["mixed_precision"] == "bf16"
    assert ours["data"]["chat_template"] == "tokenizer"  # qwen's template is the model's own
    assert ours["data"]["eval_fraction"] == 0.1
    assert ours["output_dir"] == "saves/llama3-8b/lora/sft"  # the keys that are ours already come along
    data = tmp_path / "alpaca.jsonl"
    data.write_text(
        "".join(f'{{"instruction": "Say {i}.", "input": "", "output": "{i}."}}\n' for i in range(20))
    )
    out = _pasted_dry_run(tmp_path, ours, tiny_model, str(data), capsys)
    assert "enabled: true" in out.split("lora:")[1].split("\n", 2)[1]


def test_an_axolotl_config_translates_every_value_it_can(tiny_model, tmp_path, capsys):  # noqa: F811
    err = _error(
        tmp_path, AXOLOTL_LORA.replace("optimizer: adamw_8bit", "optimizer: adamw_torch_fused"), capsys
    )
    ours = _block(err)
    assert ours["lora"] == {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": []}
    assert ours["data"]["datasets"] == [{"path": "teknium/GPT4-LLM-Cleaned", "format": "alpaca"}]
    assert ours["train"]["optimizer"] == "adamw_fused" and ours["train"]["lr_schedule"] == "cosine"
    assert ours["train"]["mixed_precision"] == "auto"
    assert "`load_in_8bit` is axolotl's name: it has no counterpart here" in err
    data = tmp_path / "alpaca.jsonl"
    data.write_text(
        "".join(f'{{"instruction": "Say {i}.", "input": "", "output": "{i}."}}\n' for i in range(200))
    )
    _pasted_dry_run(tmp_path, ours, tiny_model, str(data), capsys)


def test_lora_settings_with_lora_off_are_named(tmp_path, capsys):
    path = tmp_path / "full.yaml"
    path.write_text("lora:\n  r: 16\n")
    assert main(["train", str(path), "--dry-run"]) == exitcodes.OK
    err = capsys.readouterr().err
    assert "lora.r is set (16) but lora.enabled is false: this run trains every weight" in err, err


def test_plan_takes_the_config_file_as_a_positional_argument_too(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  micro_batch_size: 3\n")
    assert main(["plan", "-i", "inventory/local", str(path), "--json"]) == exitcodes.OK
    plan = json.loads(capsys.readouterr().out)
    assert plan["config_source"] == str(path) and plan["micro_batch_size"] == 3


def test_a_second_config_option_is_refused_not_silently_taken(tmp_path, capsys):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for verb in (["train", "--dry-run"], ["plan", "-i", "inventory/local"]):
        assert main([*verb, "--config", str(first), "--config", str(second)]) == exitcodes.CONFIG_ERROR
        assert f"--config given 2 times ({first}, {second}); give one" in capsys.readouterr().err
