"""The run's DeepSpeed config, built in one place for both sides.

The node's DeepSpeed engine trains with it (and writes it to OUTPUT_DIR/ds_config.json); the controller
writes the same config into the launch dir (`deepspeed.json`) for people and hand runs. Both call
`build` with the same `TrainerValues`, so the two cannot drift; tests/unit/test_ds_config.py checks it.

Without a JSON of the user's, the config is built from the trainer's keys. With one
(`distributed.deepspeed_config: PATH`), it is merged the way the Hugging Face Trainer does it: every
`"auto"` takes the trainer's value, a value the JSON states must agree with the trainer's, else
ConfigError naming both (exit 2). The Qwen guide's `ds_config_zero2.json` works as it is.

The trainer's own optimizer (train.optimizer: AdamW, plain or fused) and learning-rate schedule always
run (all engines optimize the same way), so the JSON's `optimizer` and `scheduler` sections are only
checked (an Adam/AdamW type, lr, weight decay) and then left out.
Everything else the JSON holds (offload, bucket sizes, overlap_comm, ...) goes to DeepSpeed as written.

Shared by trainer.node and trainer.controller, so it imports neither torch nor Ansible, nor either side.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError

KEY = "distributed.deepspeed_config"

#: DeepSpeed prints every N steps; the trainer prints its own step lines and DeepSpeed's would
#: interleave from every rank.
NEVER = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class TrainerValues:
    """The trainer's settings a DeepSpeed config depends on (train.*, distributed.*, the world)."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    grad_clip: float
    zero_stage: int
    bf16: bool | None
    """None (not known yet, before the accelerator is seen) leaves a user JSON's bf16 unchecked."""
    optimizer: str = "adamw"
    learning_rate: float = 0.0
    weight_decay: float = 0.0

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size


def build(values: TrainerValues, user: dict[str, Any] | None = None, path: str = "") -> dict[str, Any]:
    """The config DeepSpeed gets: from the trainer's values, or the user's JSON (read from `path`)
    merged with them."""
    if user is not None:
        return merge_user_config(user, path, values)
    return {
        "train_micro_batch_size_per_gpu": values.micro_batch_size,
        "gradient_accumulation_steps": values.gradient_accumulation_steps,
        "train_batch_size": values.train_batch_size,
        "gradient_clipping": values.grad_clip,
        "zero_optimization": {"stage": values.zero_stage},
        "bf16": {"enabled": bool(values.bf16)},
        # The trainer's AdamW and LR schedule are passed in, so all engines optimize the same way.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }


def for_own_command(zero_stage: int) -> dict[str, Any]:
    """For a user's own command: the batch sizes and precision are `auto`, which Hugging Face Trainer
    and accelerate fill in from the script's own arguments (as in the Qwen guide's ds_config_zero2.json)."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": "auto"},
    }


def load_user_config(path: str) -> dict[str, Any]:
    source = Path(path).expanduser()
    try:
        data = json.loads(source.read_text())
    except OSError as err:
        raise ConfigError(KEY, f"cannot read {source}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(KEY, f"{source} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"{source} must hold a JSON object (got {type(data).__name__})")
    return data


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return theirs is ours or theirs == ours
    if isinstance(theirs, int | float) and isinstance(ours, int | float):
        return math.isclose(theirs, ours, rel_tol=1e-9, abs_tol=1e-12)
    return theirs == ours


def merge_user_config(user: dict[str, Any], path: str, values: TrainerValues) -> dict[str, Any]:
    """The JSON with its "auto" values filled; values.bf16=None leaves bf16 unchecked."""
    merged = copy.deepcopy(user)

    def fill(where: dict[str, Any], name: str, dotted: str, ours: Any, our_key: str) -> None:
        if name not in where or where[name] == "auto":
            where[name] = ours
        elif not _same(where[name], ours):
            raise ConfigError(
                KEY,
                f"{path} sets {dotted} to {where[name]!r} but {our_key} is {ours!r}; "
                f'write "auto" there (the trainer\'s value) or set {our_key}={where[name]}',
            )

    fill(merged, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu",
         values.micro_batch_size, "train.micro_batch_size")  # fmt: skip
    fill(merged, "gradient_accumulation_steps", "gradient_accumulation_steps",
         values.gradient_accumulation_steps, "train.gradient_accumulation_steps")  # fmt: skip
    fill(merged, "gradient_clipping", "gradient_clipping", values.grad_clip, "train.grad_clip")
    effective = values.train_batch_size
    if merged.get("train_batch_size", "auto") not in ("auto", effective):
        raise ConfigError(
            KEY,
            f"{path} sets train_batch_size to {merged['train_batch_size']!r} but train.micro_batch_size "
            f"{values.micro_batch_size} x train.gradient_accumulation_steps "
            f"{values.gradient_accumulation_steps} x world size {values.world_size} is {effective}; "
            'write "auto" there',
        )
    merged["train_batch_size"] = effective

    zero = merged.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(KEY, f"{path}: zero_optimization must be an object")
    fill(zero, "stage", "zero_optimization.stage", values.zero_stage, "distributed.zero_stage")

    fp16 = merged.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled") not in (None, "auto", False):
        raise ConfigError(
            KEY,
            f"{path} enables fp16, which this trainer does not train in; write "
            '"enabled": "auto" (or false) there and use train.mixed_precision=bf16',
        )
    if "fp16" in merged and isinstance(fp16, dict):
        merged["fp16"] = {**fp16, "enabled": False}
    bf16_section = merged.setdefault("bf16", {})
    if not isinstance(bf16_section, dict):
        raise ConfigError(KEY, f"{path}: bf16 must be an object")
    if values.bf16 is not None:
        fill(bf16_section, "enabled", "bf16.enabled", values.bf16, "bf16 (from train.mixed_precision)")

    # The trainer's optimizer and schedule run; the JSON's are checked, then left out.
    optimizer = merged.pop("optimizer", None)
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if kind is not None and str(kind).lower() not in ("adam", "adamw", "auto"):
        # DeepSpeed's own optimizers (OneBitAdam, Lamb, ...) never run here: train.optimizer does.
        raise ConfigError(
            KEY,
            f"{path} names optimizer.type {kind!r}, but the trainer's train.optimizer "
            f'({values.optimizer}) is what runs; write "type": "AdamW" (or leave the optimizer '
            "section out)",
        )
    if isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict):
        params = optimizer["params"]
        fill(params, "lr", "optimizer.params.lr", values.learning_rate, "train.learning_rate")
        fill(params, "weight_decay", "optimizer.params.weight_decay", values.weight_decay,
             "train.weight_decay")  # fmt: skip
    scheduler = merged.pop("scheduler", None)
    if isinstance(scheduler, dict) and isinstance(scheduler.get("params"), dict):
        params = scheduler["params"]
        if params.get("warmup_max_lr", "auto") != "auto":
            fill(params, "warmup_max_lr", "scheduler.params.warmup_max_lr", values.learning_rate,
                 "train.learning_rate")  # fmt: skip
    merged["zero_allow_untested_optimizer"] = True
    merged.setdefault("steps_per_print", NEVER)
    return merged
