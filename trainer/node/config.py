"""The trainer's configuration: one dataclass per section, loaded from YAML, overridden with `--set`.

Each component owns its section (torchtitan style): `train` in `trainer.node.schedule`, `data` in
`trainer.node.data`, `distributed` in `trainer.node.engines`, `checkpoint` in
`trainer.node.checkpoint`, `health` in `trainer.node.health.config`, `metrics` in
`trainer.node.metrics`; `model` lives here because
`trainer.node.model` needs torch at import time and this module must stay light (the controller
validates configs without torch). None of those modules imports this one (no import circles).
Adding a section is a dataclass in its component and one field in `TrainerConfig`;
loading, `--set` overrides, type checks and error messages are generic.

Every value is checked before anything starts: an unknown key, a wrong type or an impossible value
raises `ConfigError` naming the key (`train.max_steps`), and `trainer train` exits with CONFIG_ERROR.
All unknown keys of a file come in one error, another tool's names answered with the key here
(trainer.node.config_aliases).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import logging
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.configerror import ConfigError, require
from trainer.node import config_aliases
from trainer.node.checkpoint import CheckpointConfig
from trainer.node.data import DataConfig
from trainer.node.engines import DistributedConfig
from trainer.node.health.config import HealthConfig
from trainer.node.hf.evaluation import EvalConfig
from trainer.node.hf.lora import LoraConfig
from trainer.node.metrics import MetricsConfig
from trainer.node.schedule import TrainConfig
from trainer.redaction import redact_tree

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass(kw_only=True)
class ModelConfig:
    """A Hugging Face causal LM to fine-tune (`name_or_path`), or the built-in tiny char-level GPT
    (nanoGPT-style, sized by n_layer/n_head/n_embd; its context length is `data.block_size`)."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """Width of the embeddings and of every block."""
    dropout: float = 0.1
    """Dropout probability during training (0 disables it)."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers (False is slightly faster and as good)."""
    name_or_path: str = ""
    """A Hugging Face causal LM to fine-tune: a local directory (config.json, safetensors or bin weights,
    tokenizer files; on a cluster, on the shared dir) or a hub id where a hub is reachable.
    '' = the built-in tiny GPT above (n_layer, n_head, n_embd, dropout and bias apply to it only)."""
    max_length: int = 512
    """Tokens per training sample (and per packed row) with a Hugging Face model."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Weights' dtype. auto: fp32 on the CPU; on a GPU with bf16, bf16, except the weights an accelerate
    full fine-tuning updates, which stay fp32 (bf16 compute through train.mixed_precision), and those of
    a ddp run with train.mixed_precision=no. Trained bf16 weights get fp32 master copies that the
    optimizer steps (under ddp and DeepSpeed; checkpoints hold those)."""
    trust_remote_code: bool = False
    """Run the Python code a model directory ships (custom architectures); only for a model you trust."""

    def __post_init__(self) -> None:
        require(self.max_length >= 8, "max_length", f"must be at least 8 tokens (got {self.max_length})")
        require(self.n_layer >= 1, "n_layer", f"must be at least 1 (got {self.n_layer})")
        require(self.n_head >= 1, "n_head", f"must be at least 1 (got {self.n_head})")
        require(
            self.n_embd >= 1 and self.n_embd % self.n_head == 0,
            "n_embd",
            f"must be a positive multiple of model.n_head={self.n_head} (got {self.n_embd})",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1) (got {self.dropout})")

    def check_positions(self, model_config: Any) -> None:
        """ConfigError("model.max_length") when a Hugging Face model has fewer positions than max_length:
        rows past them would train on positions the model never learnt (or fail deep in its attention).
        `model_config` is the model's transformers config (its config.json)."""
        limit, name = _positions(model_config)
        if limit is None or self.max_length <= limit:
            return
        rope = _rope_settings(model_config)
        scaling = (
            "; or, since it uses rotary positions, a longer context by rope scaling in its config.json "
            '(e.g. "rope_scaling": {"rope_type": "yarn", "factor": '
            f"{-(-self.max_length // limit)}.0}}, where the model supports it)"
            if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default"
            else ""
        )
        raise ConfigError(
            "model.max_length",
            f"{self.max_length} tokens is more than the model's {limit} positions ({name} in its "
            f"config.json): use model.max_length={limit} or less{scaling}",
        )


#: Where models' configs give their number of positions, in the order tried.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _positions(model_config: Any) -> tuple[int | None, str]:
    """(the positions a model can take, the config field that says so); (None, '') where none does.
    A rope scaling with a factor over the original positions multiplies them."""
    for name in POSITION_FIELDS:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            rope = _rope_settings(model_config) or {}
            factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default" and isinstance(factor, int | float) and factor > 1 and original == value:
                return int(value * factor), f"{name} × the rope scaling factor {factor:g}"
            return value, name
    return None, ""


def _rope_settings(model_config: Any) -> dict[str, Any] | None:
    """A model's rotary position settings (transformers 5's rope_parameters, 4's rope_scaling), or None
    for a model without rotary positions."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(model_config, name, None)
        if isinstance(value, dict):
            return value
    if getattr(model_config, "rope_theta", None) is not None:
        return {}
    return None


@dataclass(kw_only=True)
class TrainerConfig:
    """The whole configuration: `output_dir` plus one field per section."""

    output_dir: str = "output"
    """Where run.json, metrics.jsonl, summary.json, ds_config.json and checkpoints/ go (relative paths
    are relative to the working directory; on a cluster, a directory on the shared file system)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps or epochs, batch sizes, optimizer, learning-rate schedule, precision."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training text and how it is cut into samples."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model size."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Engine (ddp, deepspeed, accelerate) and its settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to save, how many to keep, whether to resume."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """GPU health circuit breaker and its `gpu.fault` webhook."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA / Q-LoRA adapter training of a Hugging Face model (peft)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """When to compute the eval loss (the eval samples come from data.eval_fraction or data.eval_path)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where the logged metrics go besides metrics.jsonl: TensorBoard, W&B, MLflow."""

    def __post_init__(self) -> None:
        require(bool(self.output_dir.strip()), "output_dir", "must not be empty")
        if not self.model.name_or_path:
            # Settings that only mean something for a Hugging Face model are refused, not ignored.
            for key, is_set in (
                ("lora.enabled", self.lora.enabled),
                ("data.packing", self.data.packing),
                ("data.eval_fraction", self.data.eval_fraction > 0),
                ("data.eval_path", bool(self.data.eval_path)),
                ("data.format", self.data.format not in ("auto", "text")),
                ("data.datasets", bool(self.data.datasets)),
                ("data.columns", bool(self.data.columns)),
                ("data.chat_template", self.data.chat_template != "tokenizer"),
                ("data.train_on_inputs", self.data.train_on_inputs),
                ("train.gradient_checkpointing", self.train.gradient_checkpointing),
            ):
                require(
                    not is_set,
                    key,
                    "applies to Hugging Face models only; set model.name_or_path to a model directory "
                    "(the built-in tiny GPT trains on plain text in full)",
                )
        require(
            not (
                self.lora.qlora
                and self.distributed.engine == "deepspeed"
                and self.distributed.zero_stage == 3
            ),
            "lora.qlora",
            "does not work with DeepSpeed ZeRO-3 (a 4-bit base cannot be partitioned); use "
            "distributed.zero_stage=2, as the Qwen guide's Q-LoRA does, or the ddp engine",
        )
        require(
            not (self.train.optimizer == "adamw_8bit" and self.distributed.engine == "deepspeed"),
            "train.optimizer",
            "adamw_8bit is not run under DeepSpeed here (ZeRO partitions the optimizer state itself, "
            "and bitsandbytes' 8-bit state is untested inside it); use train.optimizer=adamw with "
            "deepspeed, or distributed.engine=ddp or accelerate for 8-bit AdamW",
        )

    def warnings(self) -> list[str]:
        """Settings that load but would not do what they seem to: `lora.*` set while LoRA is off (a
        translated or copied block that trains every weight instead of an adapter)."""
        if self.lora.enabled:
            return []
        defaults = LoraConfig()
        return [
            f"lora.{name} is set ({getattr(self.lora, name)!r}) but lora.enabled is false: this run trains "
            "every weight (a full fine-tune); set lora.enabled: true to train a LoRA adapter, or leave "
            f"lora.{name} out"
            for name in ("r", "alpha", "dropout", "target_modules")
            if getattr(self.lora, name) != getattr(defaults, name)
        ]

    def to_dict(self, *, secrets: bool = False) -> dict[str, Any]:
        """Plain data. The webhook URL is a secret, and so is a credential inside any URL (a token
        in metrics.tracking_uri's user part or query): redacted unless `secrets` (only for a config
        file that a node trains with, e.g. the launcher's config.yaml; never for run.json, the
        trackers' hyperparameters or printing)."""
        data = dataclasses.asdict(self)
        if not secrets:
            data["health"] = self.health.to_public_dict()
            data = redact_tree(data)
        return data


# --- loading -------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return value if it matches tp (ints are accepted for floats); raise ConfigError naming key."""
    if typing.get_origin(tp) is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise ConfigError(key, f"must be one of {_type_name(tp)} (got {value!r})")
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        for option in typing.get_args(tp):
            try:
                return _check_type(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(key, f"must be {_type_name(tp)} (got {type(value).__name__} {value!r})")
    if typing.get_origin(tp) is dict or (
        typing.get_origin(tp) is list and typing.get_origin(typing.get_args(tp)[0]) is dict
    ):
        # A mapping (data.columns) or a list of mappings (data.datasets): their section checks the keys.
        shape = dict if typing.get_origin(tp) is dict else list
        if isinstance(value, shape) and (shape is dict or all(isinstance(item, dict) for item in value)):
            return value
        raise ConfigError(
            key, f"must be a {'mapping' if shape is dict else 'list of mappings'} (got {value!r})"
        )
    if typing.get_origin(tp) is list:
        # A list of names, as a YAML list or as `a,b` (what `--set key=a,b` gives).
        items = (
            [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value
        )
        if isinstance(items, list) and all(isinstance(item, str) for item in items):
            return items
        raise ConfigError(key, f"must be a list of names or a comma-separated string (got {value!r})")
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        # YAML 1.1 reads `3e-4` (no dot) as a string; it is the way people write learning rates.
        return float(value)
    ok = {
        type(None): value is None,
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"config field {key} has an unsupported type {tp!r}")
    if not ok:
        raise ConfigError(key, f"must be {_type_name(tp)} (got {type(value).__name__} {value!r})")
    return float(value) if tp is float else value


def _unknown_key(key: str, known: typing.Iterable[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    # Another tool's name is answered with the key here, never with a near spelling (lora_rank: not lora).
    theirs = config_aliases.explain(name, key)
    if theirs is not None:
        return ConfigError(key, f"unknown key; {theirs}")
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        section = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return ConfigError(key, f"unknown key; did you mean {section}{close[0]}?")
    return ConfigError(key, f"unknown key (known: {', '.join(sorted(known))})")


def _unknown_keys(tree: Any, cls: type, prefix: str = "") -> list[ConfigError]:
    """Every key of a config tree that cls (and its sections) does not have, each with its hint."""
    if not isinstance(tree, dict):
        return []  # a section that is not a mapping is _build's to refuse
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    found: list[ConfigError] = []
    for name, value in tree.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            found.append(_unknown_key(key, fields))
        elif dataclasses.is_dataclass(hints[name]):
            found += _unknown_keys(value, hints[name], key)
    return found


def _one_error(unknown: list[ConfigError], tree: dict[str, Any], source: Path) -> ConfigError:
    """All of a file's unknown keys in one error (a config from another tool has a score of them),
    with the whole config written out in this trainer's words: a block that loads as it stands."""
    if len(unknown) == 1:
        return unknown[0]
    lines = [f"{len(unknown)} unknown keys in {source}:"] + [f"  {err}" for err in unknown]
    translation = config_aliases.translate(tree, [err.key for err in unknown])
    block, refused = _loadable(translation.block)
    if block:
        lines += ["In this trainer's words (paste it as your config; what has no counterpart is left out):"]
        lines += [f"  {line}" for line in yaml.safe_dump(block, sort_keys=False).splitlines()]
    for note in [*translation.left_out, *refused]:
        lines.append(f"  # left out: {note}")
    lines.append("(every key: trainer train --help-config)")
    return ConfigError("", "\n".join(lines))


def _loadable(block: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The block less each value this trainer refuses (each said), so that it loads as it stands."""
    refused: list[str] = []
    for _ in range(50):
        try:
            _build(TrainerConfig, block, "")
        except ConfigError as err:
            refused.append(str(err))
            if not _drop(block, err.key):
                return {}, refused
            continue
        return block, refused
    return {}, refused


def _drop(block: dict[str, Any], key: str) -> bool:
    """Remove `key` (dotted; a list entry's key, `data.datasets[0].format`, removes the list) from the
    block and any section it leaves empty; False when there is no such key."""
    parts = key.split("[", 1)[0].split(".") if key else []
    nodes = [block]
    for part in parts[:-1]:
        child = nodes[-1].get(part)
        if not isinstance(child, dict):
            return False
        nodes.append(child)
    if not parts or parts[-1] not in nodes[-1]:
        return False
    del nodes[-1][parts[-1]]
    for parent, part, node in reversed(list(zip(nodes[:-1], parts[:-1], nodes[1:], strict=True))):
        if not node:
            del parent[part]
    return True


def _build(cls: type, values: Any, prefix: str) -> Any:
    """Instantiate dataclass cls from a mapping, recursing into nested sections, checking every value."""
    if not isinstance(values, dict):
        raise ConfigError(prefix, f"must be a mapping of keys to values (got {type(values).__name__})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise _unknown_key(key, fields)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key)
        else:
            kwargs[name] = _check_type(key, value, tp)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) if prefix else err from None


def _set_path(tree: dict[str, Any], dotted: str, raw: str, root_cls: type) -> None:
    """Apply one `--set section.key=value`, parsing value as YAML (so 10, 0.5, true, null work)."""
    parts = dotted.split(".")
    cls, node = root_cls, tree
    for i, part in enumerate(parts):
        key = ".".join(parts[: i + 1])
        fields = {f.name for f in dataclasses.fields(cls)}
        if part not in fields:
            raise _unknown_key(key, fields)
        tp = typing.get_type_hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(key, "is a section, not a value; set one of its keys")
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(key, f"must be a mapping of keys to values (got {node[part]!r})")
            cls, node = tp, node[part]
            continue
        if not last:
            raise ConfigError(key, f"is a value, not a section (cannot set {dotted})")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        # `--set data.path=123` means the string "123": a str key takes the text as written.
        wants_str = tp is str or (isinstance(tp, types.UnionType) and str in typing.get_args(tp))
        if wants_str and value is not None and not isinstance(value, str):
            value = raw
        node[part] = value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> TrainerConfig:
    """Read YAML (default: the embedded default), apply `key=value` overrides, validate everything."""
    source = Path(path) if path else DEFAULT_CONFIG
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError("--config", f"cannot read {source}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            "--config",
            f"{source} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "save it as UTF-8",
        ) from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("--config", f"{source} is not valid YAML: {err}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError("--config", f"{source} must hold a mapping of sections (got {type(tree).__name__})")
    unknown = _unknown_keys(tree, TrainerConfig)
    in_file = dict(tree.get("train") or {}) if isinstance(tree.get("train"), dict) else {}
    set_here: set[str] = set()
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError("--set", f"expected section.key=value (got {item!r})")
        try:
            _set_path(tree, dotted.strip(), raw.strip(), TrainerConfig)
        except ConfigError as err:
            if not err.problem.startswith("unknown key"):
                raise
            unknown.append(err)
        set_here.add(dotted.strip())
    if unknown:
        raise _one_error(unknown, tree, source)
    _steps_or_epochs(tree, in_file, set_here)
    config = _build(TrainerConfig, tree, "")
    for warning in config.warnings():
        if os.environ.get("RANK", "0") == "0":  # one copy of it in a job's log
            logging.getLogger("trainer.config").warning(warning)
    return config


def _steps_or_epochs(tree: dict[str, Any], in_file: dict[str, Any], set_here: set[str]) -> None:
    """One of train.max_steps and train.num_epochs decides. A --set of one replaces the other where only
    the file sets it (`--set train.num_epochs=1` on a file with max_steps: 1000, or on the embedded
    default); both in the file, or both on the command line, stay both: TrainConfig refuses that."""
    train = tree.get("train")
    if not isinstance(train, dict):
        return
    for ours, other in (("train.num_epochs", "max_steps"), ("train.max_steps", "num_epochs")):
        if (
            ours in set_here
            and train.get(ours.split(".")[1]) is not None
            and f"train.{other}" not in set_here
            and in_file.get(other) is not None
        ):
            train[other] = None


def dump_config(config: TrainerConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


# --- discovering the keys -----------------------------------------------------------------------


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (a string literal right after its annotation)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): keys without their text
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_keys(cls: type = TrainerConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Every settable key as (dotted key, type, default, docstring), sections in their order."""
    keys: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, key)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        type_name = _type_name(tp)
        if typing.get_origin(tp) is list:
            mappings = typing.get_origin(typing.get_args(tp)[0]) is dict
            type_name = "list of mappings" if mappings else "list of names"
        keys.append((key, type_name, default, docs.get(f.name, "")))
    return keys


def format_config_keys() -> str:
    """The text of `trainer train --help-config`."""
    lines = [
        "Config keys (YAML sections, or --set SECTION.KEY=VALUE); default in brackets.",
        "",
    ]
    for key, type_name, default, doc in config_keys():
        lines.append(f"{key}  ({type_name}) [{json.dumps(default)}]")
        lines += [f"    {line}" for line in doc.splitlines()]
    lines += ["", config_aliases.format_aliases()]
    return "\n".join(lines)
