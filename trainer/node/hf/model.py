"""The Hugging Face model: its directory checked, its tokenizer, the weights loaded in the right dtype,
and the loss wrapper the engines train.

The checks (`check_source`, `load_tokenizer`, `load_model_config`) run before the process group starts
and raise ConfigError naming `model.name_or_path` (or the key at fault) with the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


#: Model types whose forward is `logits = lm_head(decoder(...).last_hidden_state)` and whose loss is
#: the plain shifted cross-entropy (no logit scaling or soft-capping, no router loss): the chunked loss
#: below computes exactly what their own forward would. Any other model computes its own loss.
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})
#: A micro batch's logits (tokens × vocabulary) up to this many are computed whole: on an H100, a 0.4B
#: Qwen2's 16k tokens × 32k vocabulary (2^29) in chunks cost 7 % of the step for 4.2 GiB less peak
#: memory (docs/performance.md); a 152k vocabulary's logits are 5 times larger.
CHUNK_ABOVE = 2**30
#: Logits held at once by the chunked loss: tokens per chunk × vocabulary (2^27: 512 MiB in fp32).
CHUNK_LOGITS = 2**27
#: Fewest tokens per chunk (a huge vocabulary would otherwise make chunks too small to run fast).
MIN_CHUNK_TOKENS = 256


class CausalLMLoss(nn.Module):
    """What the engines train: forward(input_ids, labels, position_ids, num_items_in_batch) -> the loss
    summed over label tokens and divided by num_items_in_batch (see trainer.node.hf.batches).

    With the chunked_loss speed-up (trainer.node.speedups) and a model of PLAIN_HEAD_MODELS, the output
    head and the cross-entropy of a micro batch with more than CHUNK_ABOVE logits run over chunks of at
    most CHUNK_LOGITS / vocabulary tokens, each
    chunk's logits recomputed in the backward pass (torch.utils.checkpoint): a large micro batch's logits
    are never held whole (16k tokens × a 152k vocabulary are 9.3 GiB in fp32, with their gradient twice
    that). On the CPU only the labelled positions go through the head (selecting them on a GPU would
    wait for the device). The loss is the model's own, up to the order of the sum."""

    def __init__(self, model: nn.Module):
        from trainer.node import speedups

        super().__init__()
        self.model = model
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(hf, "config", None)
        head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
        plain = (
            getattr(config, "model_type", None) in PLAIN_HEAD_MODELS
            and type(head) is nn.Linear
            and hasattr(hf, "get_decoder")
            # ZeRO-3 partitions the weights (loaded so, under deepspeed.zero.Init) and gathers each for
            # its module's own forward: the model's own path.
            and not hasattr(head.weight, "ds_id")
            and speedups.enabled("chunked_loss")
        )
        # Not attributes: a second path to the same modules would show in state_dict and named_modules.
        self._parts = (hf.get_decoder(), head) if plain else None
        self._head_loss = _head_loss

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        num_items_in_batch: torch.Tensor,
    ) -> torch.Tensor:
        if self._parts is None:
            return self.model(
                input_ids=input_ids,
                labels=labels,
                position_ids=position_ids,
                num_items_in_batch=num_items_in_batch,
                use_cache=False,
            ).loss
        decoder, head = self._parts
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return chunked_cross_entropy(hidden, head, labels, head_loss=self._head_loss) / num_items_in_batch

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile each decoder layer (regional compilation): the layers share their code, so one
        compilation serves them all (a fraction of the whole model's compile time), and the chunked
        loss stays outside any graph. The inductor cache (TORCHINDUCTOR_CACHE_DIR, default under /tmp)
        is node-local: a second run on the node compiles from it, warm. With the compiled_head speed-up
        the output head and the cross-entropy of a plain-head model are compiled too: Inductor fuses the
        logits' upcast into the softmax, so the fp32 logits are never written whole."""
        from trainer.node import speedups

        hf = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        layers = getattr(hf.get_decoder(), "layers", None) if hasattr(hf, "get_decoder") else None
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            super().compile(*args, **kwargs)
            return
        for layer in layers:
            layer.compile(*args, **kwargs)
        if self._parts is not None and speedups.enabled("compiled_head"):
            self._head_loss = torch.compile(_head_loss, *args, **kwargs)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    head_loss: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The cross-entropy of head(hidden) against labels shifted left by one (position t predicts
    labels[t + 1], the last predicts nothing), summed over the labelled positions, in chunks.
    `head_loss`: _head_loss or its compiled form."""
    head_loss = head_loss or _head_loss
    from trainer.node.hf.chat import IGNORE

    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1).reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if hidden.device.type == "cpu":  # free here; on a GPU the selection would wait for the device
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]
    chunk = max(MIN_CHUNK_TOKENS, CHUNK_LOGITS // head.out_features)
    if hidden.shape[0] <= chunk or hidden.shape[0] * head.out_features <= CHUNK_ABOVE:
        return head_loss(hidden, targets, head)
    from torch.utils.checkpoint import checkpoint

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(head_loss, hidden[part], targets[part], head, use_reentrant=False)
    return total


def _head_loss(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module) -> torch.Tensor:
    from trainer.node.hf.chat import IGNORE

    logits = head(hidden).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
