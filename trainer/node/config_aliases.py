"""The names other fine-tuning tools give to settings, and the key that means the same here.

People arrive with an axolotl, LLaMA-Factory, TRL or Hugging Face Trainer YAML. Each of their keys that
this trainer has a counterpart for is answered with that key when it turns up in a config (the loader
reports every unknown key of a file in one error) and listed by `trainer train --help-config`: this
table is the one place both read.

None is accepted in their words: the meanings differ in details (LLaMA-Factory's `val_size: 100` is a
count, its `lora_target: all` is `[]` here, `bf16: true` is `mixed_precision: bf16`), and
a config that reads two ways is worse than one error that names the fix. A `note` says how a value
translates where it is not the same value under another name; an empty `ours` means no counterpart.

A leaf module (no trainer imports): the loader and the controller read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

AXOLOTL = "axolotl"
LLAMA_FACTORY = "LLaMA-Factory"
TRL = "TRL"
HF = "the Hugging Face Trainer"
QWEN = "Qwen's finetune.py"


@dataclass(frozen=True)
class Alias:
    ours: str
    """The dotted key here ('' = no counterpart: leave the key out)."""
    tools: tuple[str, ...]
    """Whose name it is."""
    note: str = ""
    """How the value translates, where it is not the same value under another name."""


def _alias(ours: str, *tools: str, note: str = "") -> Alias:
    return Alias(ours=ours, tools=tools, note=note)


#: Their key -> ours. Grouped as the config is: model, adapter, data, train, checkpoint, the rest.
ALIASES: dict[str, Alias] = {
    # model
    "base_model": _alias("model.name_or_path", AXOLOTL),
    "model_name_or_path": _alias("model.name_or_path", LLAMA_FACTORY, TRL, HF),
    "sequence_len": _alias("model.max_length", AXOLOTL),
    "cutoff_len": _alias("model.max_length", LLAMA_FACTORY),
    "max_seq_length": _alias("model.max_length", TRL),
    "max_length": _alias("model.max_length", TRL),
    "model_max_length": _alias("model.max_length", QWEN),
    "trust_remote_code": _alias("model.trust_remote_code", AXOLOTL, LLAMA_FACTORY, TRL),
    # adapter
    "adapter": _alias(
        "lora.enabled", AXOLOTL, note="adapter: lora is lora.enabled: true; qlora adds lora.qlora: true"
    ),
    "finetuning_type": _alias(
        "lora.enabled", LLAMA_FACTORY, note="lora is lora.enabled: true; full is lora.enabled: false"
    ),
    "load_in_4bit": _alias("lora.qlora", AXOLOTL, note="with lora.enabled: true"),
    "quantization_bit": _alias(
        "lora.qlora", LLAMA_FACTORY, note="4 is lora.qlora: true; 8 has no counterpart"
    ),
    "load_in_8bit": _alias(
        "", AXOLOTL, note="an 8-bit base has no counterpart; lora.qlora gives a 4-bit one"
    ),
    "lora_r": _alias("lora.r", AXOLOTL),
    "lora_rank": _alias("lora.r", LLAMA_FACTORY),
    "lora_alpha": _alias("lora.alpha", AXOLOTL, LLAMA_FACTORY),
    "lora_dropout": _alias("lora.dropout", AXOLOTL, LLAMA_FACTORY),
    "lora_target_modules": _alias("lora.target_modules", AXOLOTL),
    "lora_target_linear": _alias(
        "lora.target_modules", AXOLOTL, note="true is [] here: every linear layer of the decoder"
    ),
    "lora_target": _alias(
        "lora.target_modules", LLAMA_FACTORY, note="all (every linear layer) is [] here; else a list of names"
    ),
    # data
    "datasets": _alias(
        "data.datasets", AXOLOTL, note="each entry's type, e.g. alpaca or sharegpt, is data.format here"
    ),
    "dataset": _alias(
        "data.datasets",
        LLAMA_FACTORY,
        note="give each file's path or a hub id; dataset_info.json names are not read",
    ),
    "test_datasets": _alias("data.eval_path", AXOLOTL),
    "eval_dataset": _alias("data.eval_path", LLAMA_FACTORY),
    "val_set_size": _alias("data.eval_fraction", AXOLOTL),
    "val_size": _alias(
        "data.eval_fraction", LLAMA_FACTORY, note="a fraction below 1; a count of samples has no counterpart"
    ),
    "sample_packing": _alias("data.packing", AXOLOTL),
    "packing": _alias("data.packing", LLAMA_FACTORY, TRL),
    "chat_template": _alias("data.chat_template", AXOLOTL),
    "template": _alias("data.chat_template", LLAMA_FACTORY),
    "train_on_inputs": _alias("data.train_on_inputs", AXOLOTL),
    "train_on_prompt": _alias("data.train_on_inputs", LLAMA_FACTORY),
    # train
    "num_epochs": _alias("train.num_epochs", AXOLOTL),
    "num_train_epochs": _alias("train.num_epochs", LLAMA_FACTORY, TRL, HF),
    "max_steps": _alias("train.max_steps", AXOLOTL, LLAMA_FACTORY, TRL, HF),
    "micro_batch_size": _alias("train.micro_batch_size", AXOLOTL),
    "per_device_train_batch_size": _alias("train.micro_batch_size", LLAMA_FACTORY, TRL, HF),
    "gradient_accumulation_steps": _alias("train.gradient_accumulation_steps", AXOLOTL, LLAMA_FACTORY, HF),
    "learning_rate": _alias("train.learning_rate", AXOLOTL, LLAMA_FACTORY, TRL, HF),
    "lr": _alias("train.learning_rate", "torchtune"),
    "lr_scheduler": _alias(
        "train.lr_schedule",
        AXOLOTL,
        note="cosine, linear or constant here; constant_with_warmup is constant (warmup always applies)",
    ),
    "lr_scheduler_type": _alias(
        "train.lr_schedule",
        LLAMA_FACTORY,
        HF,
        note="cosine, linear or constant here; cosine_with_min_lr is cosine with train.min_lr",
    ),
    "cosine_min_lr_ratio": _alias("train.min_lr_ratio", AXOLOTL),
    "warmup_steps": _alias("train.warmup_steps", AXOLOTL, LLAMA_FACTORY, HF),
    "warmup_ratio": _alias("train.warmup_ratio", AXOLOTL, LLAMA_FACTORY, HF),
    "optimizer": _alias(
        "train.optimizer",
        AXOLOTL,
        note="adamw_torch is adamw, adamw_torch_fused is adamw_fused, adamw_bnb_8bit is adamw_8bit",
    ),
    "optim": _alias(
        "train.optimizer",
        LLAMA_FACTORY,
        HF,
        note="adamw_torch is adamw, adamw_torch_fused is adamw_fused, adamw_bnb_8bit is adamw_8bit",
    ),
    "weight_decay": _alias("train.weight_decay", AXOLOTL, LLAMA_FACTORY, HF),
    "max_grad_norm": _alias("train.grad_clip", AXOLOTL, LLAMA_FACTORY, HF),
    "bf16": _alias("train.mixed_precision", AXOLOTL, LLAMA_FACTORY, HF, note="true is bf16, false is no"),
    "fp16": _alias(
        "train.mixed_precision", AXOLOTL, LLAMA_FACTORY, HF, note="no fp16 training here: bf16 or no"
    ),
    "gradient_checkpointing": _alias("train.gradient_checkpointing", AXOLOTL, HF),
    "torch_compile": _alias("train.compile", AXOLOTL, HF),
    "seed": _alias("train.seed", AXOLOTL, LLAMA_FACTORY, HF),
    "logging_steps": _alias("train.log_every", AXOLOTL, LLAMA_FACTORY, HF),
    # checkpoint, eval
    "save_steps": _alias("checkpoint.save_steps", AXOLOTL, LLAMA_FACTORY, HF),
    "save_total_limit": _alias("checkpoint.save_total_limit", AXOLOTL, LLAMA_FACTORY, HF),
    "resume_from_checkpoint": _alias(
        "checkpoint.resume", AXOLOTL, LLAMA_FACTORY, HF, note="true is auto; a path stays a path"
    ),
    "eval_steps": _alias("eval.every_steps", AXOLOTL, LLAMA_FACTORY, HF),
    # distributed
    "deepspeed": _alias(
        "distributed.deepspeed_config",
        AXOLOTL,
        LLAMA_FACTORY,
        HF,
        note="with distributed.engine: deepspeed",
    ),
    "ddp_timeout": _alias("distributed.timeout_s", AXOLOTL, LLAMA_FACTORY, HF),
    # metrics
    "report_to": _alias("metrics.report_to", LLAMA_FACTORY, HF),
    "run_name": _alias("metrics.run_name", LLAMA_FACTORY, HF),
    "wandb_project": _alias("metrics.project", AXOLOTL),
    "wandb_name": _alias("metrics.run_name", AXOLOTL),
    # theirs only
    "stage": _alias("", LLAMA_FACTORY, note="supervised fine-tuning (sft) is what trains here: leave it out"),
    "do_train": _alias("", LLAMA_FACTORY, HF, note="trainer train always trains: leave it out"),
}


def _whose(tools: tuple[str, ...]) -> str:
    names = [f"{tool}'s" for tool in tools]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def explain(name: str, key: str) -> str | None:
    """Why `key` (ending in `name`) is unknown, when it is another tool's name: which tool's and what
    to write here. None when it is no other tool's name, or already the key here."""
    alias = ALIASES.get(name)
    if alias is None or alias.ours == key:
        return None
    text = f"`{name}` is {_whose(alias.tools)} name: "
    text += f"here it is {alias.ours}" if alias.ours else "it has no counterpart here"
    return f"{text}; {alias.note}" if alias.note else text


_ABSENT = object()


def renames(tree: dict, unknown: list[str]) -> dict:
    """The settings under the unknown dotted keys that are plain renames (no note), as a nested mapping
    in this trainer's words: what to paste instead."""
    out: dict = {}
    for key in unknown:
        *path, name = key.split(".")
        alias = ALIASES.get(name)
        if alias is None or not alias.ours or alias.note or alias.ours == key:
            continue
        value: object = tree
        for part in [*path, name]:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is _ABSENT:  # a --set, not the file's
            continue
        section, _, ours = alias.ours.rpartition(".")
        (out.setdefault(section, {}) if section else out)[ours] = value
    return out


def format_aliases() -> str:
    """The table as `trainer train --help-config` ends: their key, ours, whose, the note."""
    lines = [f"Names from {AXOLOTL}, {LLAMA_FACTORY}, {TRL} and {HF} (refused, the key here named):"]
    for theirs, alias in ALIASES.items():
        ours = alias.ours or "(no counterpart)"
        lines.append(f"  {theirs:<28} -> {ours}  [{', '.join(alias.tools)}]")
        if alias.note:
            lines.append(f"  {'':<28}    {alias.note}")
    return "\n".join(lines)
