"""The Hugging Face model: its directory checked, its tokenizer, the weights loaded in the right dtype,
and the loss wrapper the engines train.

The checks (`check_source`, `load_tokenizer`, `load_model_config`) run before the process group starts
and raise ConfigError naming `model.name_or_path` (or the key at fault) with the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.configerror import ConfigError

if TYPE_CHECKING:
    from trainer.node.config import ModelConfig

KEY = "model.name_or_path"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
#: `org/name` or `name`: what a hub id looks like (a path that does not exist may look like one too).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_source(name_or_path: str) -> str:
    """The directory (or hub id) to load from; ConfigError when it cannot hold a model."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
            raise ConfigError(
                KEY,
                f"{path} is not a Hugging Face model directory: it has no config.json (found: {found}); "
                "point it at the directory `save_pretrained` or `huggingface-cli download --local-dir` wrote",
            )
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            raise ConfigError(
                KEY,
                f"{path} has a config.json but no weights (*.safetensors or *.bin); the download may be "
                "incomplete: download the model again",
            )
        return str(path)
    if path.exists():
        raise ConfigError(
            KEY, f"{path} is a file; it must be a model directory (with config.json and weights)"
        )
    looks_like_path = name_or_path.startswith(("/", ".", "~")) or not HUB_ID.fullmatch(name_or_path)
    if looks_like_path:
        raise ConfigError(
            KEY,
            f"no such directory: {path}; on a cluster, put the model on the shared dir (every node reads "
            "the same path) and check the spelling",
        )
    return name_or_path  # a hub id: loading says whether a hub is reachable


def _hub_failure(name: str, err: Exception) -> ConfigError:
    return ConfigError(
        KEY,
        f"{name!r} is not a local directory, and loading it as a hub id failed ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}); download it where a hub is reachable "
        f"(`huggingface-cli download {name} --local-dir DIR`) and set model.name_or_path to DIR",
    )


def load_model_config(config: ModelConfig, source: str) -> Any:
    """The model's AutoConfig; ConfigError if it is not a causal LM or needs code it may not run."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        model_config = AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ConfigError(
                "model.trust_remote_code",
                f"{source} ships its own model code; set model.trust_remote_code=true if you trust it",
            ) from None
        raise ConfigError(KEY, f"{source}: its config.json cannot be read: {err}") from None
    except OSError as err:
        if Path(source).is_dir():
            raise ConfigError(KEY, f"{source}: its config.json cannot be read: {err}") from None
        raise _hub_failure(source, err) from None
    remote = "AutoModelForCausalLM" in (getattr(model_config, "auto_map", None) or {})
    if model_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        raise ConfigError(
            KEY,
            f"{source} is a {model_config.model_type!r} model, which has no causal language-model head "
            "(AutoModelForCausalLM); fine-tune a decoder-only model such as Qwen, Llama or Mistral",
        )
    return model_config


def load_tokenizer(config: ModelConfig, source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            KEY,
            f"{source}: its tokenizer cannot be loaded ({type(err).__name__}: {err}); the directory needs "
            "the tokenizer files (tokenizer.json or the model's vocabulary files, tokenizer_config.json)",
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            KEY,
            f"{source}: the tokenizer is a slow (Python) one; the trainer needs a fast tokenizer "
            "(tokenizer.json), which finds each token's place in the text; convert it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(DIR)",
        )
    return tokenizer


def pad_token_id(tokenizer: Any) -> int:
    """Pads carry no label and no real token ever attends to one: any id works, the model's pad best."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def weights_dtype(config: ModelConfig, *, updates_all_weights_itself: bool, on_gpu: bool) -> torch.dtype:
    """model.dtype resolved (see ModelConfig.dtype). `updates_all_weights_itself`: full fine-tuning under
    an engine whose optimizer steps the model's own parameters (ddp, accelerate); DeepSpeed keeps fp32
    master weights of bf16 parameters by itself."""
    if config.dtype == "fp32":
        return torch.float32
    if config.dtype == "bf16":
        return torch.bfloat16
    if not (on_gpu and torch.cuda.is_bf16_supported()):
        return torch.float32
    return torch.float32 if updates_all_weights_itself else torch.bfloat16


def load_model(
    config: ModelConfig,
    source: str,
    *,
    dtype: torch.dtype,
    qlora: bool,
    device: str,
    gradient_checkpointing: bool,
) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": config.trust_remote_code}
    if qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16,
        )
        kwargs["device_map"] = {"": torch.device(device).index or 0}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as err:
        raise _hub_failure(source, err) from None
    model.config.use_cache = False  # a cache is for generation; in training it only costs memory
    if gradient_checkpointing:
        # Non-reentrant: works with frozen inputs (LoRA) and DDP without extra hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class CausalLMLoss(nn.Module):
    """What the engines train: forward(input_ids, labels, position_ids, num_items_in_batch) -> the loss
    summed over label tokens and divided by num_items_in_batch (see trainer.node.hf.batches)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        num_items_in_batch: torch.Tensor,
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            num_items_in_batch=num_items_in_batch,
            use_cache=False,
        ).loss
