"""`trainer export RUN_DIR_OR_CHECKPOINT OUT [--merge-lora]`: a standalone Hugging Face model directory
from a fine-tuning run, loadable by transformers (or peft, for an adapter) with no code of ours.

RUN_DIR: its `checkpoints/latest`; or a `checkpoints/step-N` directory. The base model is loaded from
the model.name_or_path the checkpoint was trained from, the checkpoint's weights are put into it (for
any engine: ddp, DeepSpeed ZeRO 1-3 shards, accelerate), and OUT gets `save_pretrained` output plus the
tokenizer: the full model, or the LoRA adapter, or with --merge-lora the adapter merged into the
base (a full model that needs no peft). It runs in one process, on the CPU; nothing is trained.

The ddp and accelerate checkpoints are read with torch.load(weights_only=True); DeepSpeed's shards are
read by DeepSpeed's own zero_to_fp32, which unpickles them: a checkpoint with a file the running
account does not own, or one others can write, is refused before anything is read (check_trusted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

from trainer import exitcodes
from trainer.configerror import ConfigError

EXAMPLES = (
    "trainer export /shared/runs/qwen-lora qwen-lora-hf  # the run's latest checkpoint",
    "trainer export /shared/runs/qwen-lora/checkpoints/step-1000 qwen-merged --merge-lora",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="RUN_DIR_OR_CHECKPOINT", help="a run's output_dir, or a step-N checkpoint"
    )
    parser.add_argument("out", metavar="OUT", help="the directory to write (must not exist yet)")
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="merge a LoRA adapter into the base: a full model, no peft needed",
    )


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = resolve_checkpoint(Path(args.source))
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise ConfigError("OUT", f"{out} exists and is not empty; name a new directory")
        written = export(checkpoint, out, merge_lora=args.merge_lora)
    except ConfigError as err:
        print(f"trainer export: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    print(f"exported {checkpoint} to {out}: {written}")
    return exitcodes.OK


def resolve_checkpoint(source: Path) -> Path:
    from trainer.node.checkpoint import LATEST, STATE_FILE, checkpoints_dir, is_complete

    if is_complete(source):
        return source
    latest = checkpoints_dir(source) / LATEST
    if latest.is_file():
        named = latest.parent / latest.read_text().strip()
        if is_complete(named):
            return named
    raise ConfigError(
        "RUN_DIR_OR_CHECKPOINT",
        f"{source} is neither a run directory (with checkpoints/latest) nor a complete checkpoint "
        f"(a step-N directory with {STATE_FILE})",
    )


def export(checkpoint: Path, out: Path, *, merge_lora: bool) -> str:
    """Write the model of checkpoint to out; what was written, for the user."""
    from trainer.node.checkpoint import check_trusted, read_state
    from trainer.node.config import ModelConfig
    from trainer.node.hf.chat import ensure_chat_template
    from trainer.node.hf.final import save_pretrained, unwrap_state
    from trainer.node.hf.lora import LoraConfig, apply_lora, check_target_modules
    from trainer.node.hf.model import check_source, load_tokenizer

    check_trusted(checkpoint)  # DeepSpeed's zero_to_fp32 unpickles its shards
    fingerprint = read_state(checkpoint).get("fingerprint", {})
    model_config = ModelConfig(**fingerprint.get("model", {}))
    if not model_config.name_or_path:
        raise ConfigError(
            "RUN_DIR_OR_CHECKPOINT",
            f"{checkpoint} is a checkpoint of the built-in tiny GPT; export makes Hugging Face model "
            "directories from runs that fine-tuned one (model.name_or_path)",
        )
    # The export loads the base in its own precision on the CPU: never in 4 bits.
    lora = dataclasses.replace(LoraConfig(**fingerprint.get("lora", {})), qlora=False)
    if merge_lora and not lora.enabled:
        raise ConfigError(
            "--merge-lora", f"{checkpoint} is a full fine-tuning checkpoint: there is no adapter"
        )
    source = check_source(model_config.name_or_path)
    tokenizer = load_tokenizer(model_config, source)
    with contextlib.suppress(ConfigError):  # a run on plain text needs no template
        ensure_chat_template(tokenizer)  # as the run rendered its chats
    model = _load_base(model_config, source)
    if lora.enabled:
        model = apply_lora(model, lora, check_target_modules(lora, model), gradient_checkpointing=False)
    state = unwrap_state(_read_weights(checkpoint, fingerprint.get("engine", "ddp"), frozen=lora.enabled))
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    if unexpected or trained & set(missing):
        raise ConfigError(
            "RUN_DIR_OR_CHECKPOINT",
            f"{checkpoint} does not fit {source} (missing {sorted(trained & set(missing))[:4]}, unexpected "
            f"{sorted(unexpected)[:4]}); was the model directory changed after training?",
        )
    if merge_lora:
        model = model.merge_and_unload()
        what = f"the base {source} with the LoRA adapter merged in, and its tokenizer"
    elif lora.enabled:
        what = f"the LoRA adapter for {source} (load with peft), and the tokenizer"
    else:
        what = "the fine-tuned model and its tokenizer"
    save_pretrained(model, None, tokenizer, out)
    return what


def _load_base(model_config: Any, source: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    # The dtype the model was published in: the export is as big as the model it started from.
    return AutoModelForCausalLM.from_pretrained(
        source, dtype="auto", trust_remote_code=model_config.trust_remote_code
    )


def _read_weights(checkpoint: Path, engine: str, *, frozen: bool) -> dict[str, Any]:
    """The trained weights in a checkpoint, as the engine's model (the loss wrapper) names them."""
    import torch

    if engine == "ddp":
        from trainer.node.engines.ddp import STATE_FILE

        return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)["model"]
    if engine == "deepspeed":
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from trainer.node.engines.deepspeed import CHECKPOINT_TAG

        return get_fp32_state_dict_from_zero_checkpoint(
            str(checkpoint), tag=CHECKPOINT_TAG, exclude_frozen_parameters=frozen
        )
    directory = checkpoint / "accelerate"
    safetensors = directory / "model.safetensors"
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(safetensors)
    return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
