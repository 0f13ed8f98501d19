"""`OUTPUT_DIR/final/`: what `transformers` / `peft` load with no code of ours.

Full fine-tuning: `save_pretrained` of the model (config.json, generation_config.json, safetensors)
plus the tokenizer. LoRA: the adapter (adapter_config.json, adapter_model.safetensors) plus the
tokenizer; `trainer export --merge-lora` makes a full model of it.

The weights come from the engine complete on rank 0 (ZeRO-3 gathers its shards into one copy in the
training dtype, 16-bit on GPUs). The directory is written under a temporary name and renamed, so a
crash never leaves a half-written `final/` that looks complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FINAL = "final"
WRAPPER_PREFIX = "model."  # the engines train trainer.node.hf.model.CausalLMLoss, which holds the model


def unwrap_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The loss wrapper's state dict with the wrapper's prefix removed: the model's own names."""
    return {key.removeprefix(WRAPPER_PREFIX): value for key, value in state.items()}


def save_pretrained(model: Any, state: Mapping[str, Any] | None, tokenizer: Any, directory: Path) -> None:
    """Write model (a transformers or peft model) with `state` as its weights, and the tokenizer, to
    directory atomically (directory.tmp first, then renamed over any older one)."""
    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"safe_serialization": True}
    if state is not None:
        kwargs["state_dict"] = dict(state)
    model.save_pretrained(tmp, **kwargs)
    tokenizer.save_pretrained(tmp)
    for path in tmp.iterdir():  # safetensors writes 0600; the run's output is read by other users
        path.chmod(0o644)
    old = directory.with_name(f".old-{directory.name}")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
