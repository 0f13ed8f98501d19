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

from collections.abc import Callable
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

#: Their chat template names -> ours: what they call the model's own template, and the ones bundled here.
#: Any other name (qwen, mistral, gemma, ...) is a model's own template: the tokenizer's.
TEMPLATES = {"chatml": "chatml", "llama3": "llama3", "tokenizer_default": "tokenizer"}
#: Their dataset `type`s -> data.format (axolotl's chat_template reads `messages` by default).
DATASET_TYPES = {
    "alpaca": "alpaca",
    "sharegpt": "sharegpt",
    "chat_template": "messages",
    "completion": "text",
    "messages": "messages",
    "prompt_completion": "prompt_completion",
}
SCHEDULES = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine_with_min_lr": "cosine",
}
OPTIMIZERS = {
    "adamw": "adamw",
    "adamw_torch": "adamw",
    "adamw_hf": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "adamw_bnb_8bit": "adamw_8bit",
    "adamw_8bit": "adamw_8bit",
}


def _yes(value: object) -> bool:
    return value is True or str(value).lower() in ("true", "yes", "1")


def _names(value: object) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(item).strip() for item in items if str(item).strip()]


def _datasets(value: object) -> dict[str, object] | str:
    entries = value if isinstance(value, list) else []
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or not entry.get("path"):
            return "each dataset needs a path here; give each file's path in data.datasets"
        ours: dict[str, object] = {"path": entry["path"]}
        kind = entry.get("type")
        if isinstance(kind, str):
            if kind not in DATASET_TYPES:
                return f"dataset type {kind!r} has no counterpart; set data.format (docs/data.md)"
            ours["format"] = DATASET_TYPES[kind]
        if entry.get("split"):
            ours["split"] = entry["split"]
        out.append(ours)
    return {"data.datasets": out} if out else "no dataset paths to translate"


def _eval_path(value: object) -> dict[str, object] | str:
    if isinstance(value, str) and ("/" in value or "." in value):  # a path, not a dataset_info name
        return {"data.eval_path": value}
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and value[0].get("path"):
        return {"data.eval_path": value[0]["path"]}
    return "give the eval file's path as data.eval_path"


def _adapter(value: object) -> dict[str, object] | str:
    if value == "lora":
        return {"lora.enabled": True}
    if value == "qlora":
        return {"lora.enabled": True, "lora.qlora": True}
    if value in ("full", None, ""):
        return {"lora.enabled": False}
    return f"{value!r} has no counterpart (lora, qlora or full)"


def _fraction(value: object) -> dict[str, object] | str:
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1:
        return {"data.eval_fraction": value}
    return f"{value!r} is a count of samples; data.eval_fraction is a fraction below 1"


def _mapped(key: str, table: dict[str, str], what: str) -> Callable[[object], dict[str, object] | str]:
    def translate(value: object) -> dict[str, object] | str:
        if isinstance(value, str) and value in table:
            return {key: table[value]}
        return f"{what} {value!r} has no counterpart here ({', '.join(sorted(set(table.values())))})"

    return translate


#: Their key -> how its value is said here: {our dotted key: value}, or why it cannot be (a string).
#: A name not in this table and without a note is a plain rename (the same value under our key).
TRANSLATE: dict[str, Callable[[object], dict[str, object] | str]] = {
    "adapter": _adapter,
    "finetuning_type": _adapter,
    "load_in_4bit": lambda v: {"lora.qlora": True} if _yes(v) else {},
    "quantization_bit": lambda v: {"lora.qlora": True} if v == 4 else f"{v}-bit has no counterpart (4 only)",
    "lora_target_linear": lambda v: {"lora.target_modules": []} if _yes(v) else {},
    "lora_target": lambda v: {"lora.target_modules": [] if v == "all" else _names(v)},
    "lora_target_modules": lambda v: {"lora.target_modules": [] if v == "all-linear" else _names(v)},
    "datasets": _datasets,
    "test_datasets": _eval_path,
    "eval_dataset": _eval_path,
    "val_set_size": _fraction,
    "val_size": _fraction,
    "chat_template": lambda v: {"data.chat_template": TEMPLATES.get(str(v), "tokenizer")},
    "template": lambda v: {"data.chat_template": TEMPLATES.get(str(v), "tokenizer")},
    "lr_scheduler": _mapped("train.lr_schedule", SCHEDULES, "the schedule"),
    "lr_scheduler_type": _mapped("train.lr_schedule", SCHEDULES, "the schedule"),
    "optimizer": _mapped("train.optimizer", OPTIMIZERS, "the optimizer"),
    "optim": _mapped("train.optimizer", OPTIMIZERS, "the optimizer"),
    "bf16": lambda v: {"train.mixed_precision": "auto" if v == "auto" else "bf16" if _yes(v) else "no"},
    "fp16": lambda v: {"train.mixed_precision": "bf16"} if _yes(v) else {},
    "resume_from_checkpoint": lambda v: {"checkpoint.resume": "auto" if v is True else str(v)},
    "deepspeed": lambda v: {"distributed.engine": "deepspeed", "distributed.deepspeed_config": str(v)},
    "dataset": lambda v: "dataset_info.json names are not read here: give each file's path in data.datasets",
}


@dataclass
class Translation:
    block: dict
    """The whole config in this trainer's words, nested as a file writes it."""
    left_out: list[str]
    """`their_key: why` for each setting of theirs that is not in the block."""


def translate(tree: dict, unknown: list[str]) -> Translation:
    """A config in this trainer's words from a tree with other tools' names: the keys that are ours
    already, and each unknown key's value translated (TRANSLATE, else a plain rename); what has no
    counterpart is left out and said."""
    flat: dict[str, object] = {}
    left_out: list[str] = []
    unknown_set = set(unknown)

    def known(node: object, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for name, value in node.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if key in unknown_set:
                continue
            if isinstance(value, dict) and value and not key.endswith("columns"):
                known(value, key)
            else:
                flat[key] = value

    known(tree, "")
    for key in unknown:
        *path, name = key.split(".")
        value: object = tree
        for part in [*path, name]:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is _ABSENT:  # a --set, not the file's
            continue
        alias = ALIASES.get(name)
        if alias is None or not alias.ours:
            continue  # no counterpart, or no other tool's name: the error's lines say so
        if name in TRANSLATE:
            said = TRANSLATE[name](value)
            if isinstance(said, str):
                left_out.append(f"{name}: {said}")
            else:
                flat.update(said)
        elif alias.ours != key:
            flat[alias.ours] = value
    block: dict = {}
    for dotted, value in flat.items():
        *sections, leaf = dotted.split(".")
        node = block
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return Translation(block=block, left_out=left_out)


def renames(tree: dict, unknown: list[str]) -> dict:
    """The translated block alone (translate(...).block)."""
    return translate(tree, unknown).block


def format_aliases() -> str:
    """The table as `trainer train --help-config` ends: their key, ours, whose, the note."""
    lines = [f"Names from {AXOLOTL}, {LLAMA_FACTORY}, {TRL} and {HF} (refused, the key here named):"]
    for theirs, alias in ALIASES.items():
        ours = alias.ours or "(no counterpart)"
        lines.append(f"  {theirs:<28} -> {ours}  [{', '.join(alias.tools)}]")
        if alias.note:
            lines.append(f"  {'':<28}    {alias.note}")
    return "\n".join(lines)
