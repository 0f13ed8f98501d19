"""LoRA and Q-LoRA through peft: the `lora` config section, the target-module check, the adapter.

torch and peft are imported inside functions: the section is loaded with the config on the controller.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.configerror import ConfigError, require

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True)
class LoraConfig:
    enabled: bool = False
    """Train a LoRA adapter instead of every weight (needs model.name_or_path); `final/` then holds
    the adapter (adapter_model.safetensors, adapter_config.json); `trainer export --merge-lora`
    makes the merged model."""
    r: int = 8
    """Rank of the update matrices."""
    alpha: int = 16
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the adapter's input during training."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the linear layers to adapt (e.g. [q_proj, v_proj], or `q_proj,v_proj`); each must match
    a module of the model. Empty = every linear layer of the decoder (the attention and MLP
    projections), not the output head."""
    qlora: bool = False
    """Q-LoRA: the frozen base in 4 bits (NF4, bitsandbytes, the `qlora` extra); CUDA GPUs only."""

    def __post_init__(self) -> None:
        require(self.r >= 1, "r", f"must be at least 1 (got {self.r})")
        require(self.alpha >= 1, "alpha", f"must be at least 1 (got {self.alpha})")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1) (got {self.dropout})")
        require(
            all(name.strip() for name in self.target_modules),
            "target_modules",
            f"has an empty name (got {self.target_modules}); list module names such as q_proj, v_proj",
        )
        require(
            not self.qlora or self.enabled,
            "qlora",
            "needs lora.enabled=true: Q-LoRA trains a LoRA adapter on a 4-bit base",
        )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Leaf names (`q_proj`) of the linear layers LoRA can adapt, the output head left out."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for name, module in model.named_modules():
        if module is output or not name:
            continue
        # bitsandbytes' Linear4bit is a torch.nn.Linear too; transformers' Conv1D (GPT-2) is not.
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_target_modules(config: LoraConfig, model: torch.nn.Module) -> list[str]:
    """The target modules to give peft; ConfigError naming lora.target_modules if one matches nothing."""
    available = linear_module_names(model)
    if not available:
        raise ConfigError(
            "lora.enabled",
            "the model has no linear layers LoRA can adapt; train it in full (lora.enabled=false)",
        )
    if not config.target_modules:
        return available
    for wanted in config.target_modules:
        full_names = [name for name, _ in model.named_modules()]
        if not any(name == wanted or name.endswith("." + wanted) for name in full_names):
            close = difflib.get_close_matches(wanted, available, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                "lora.target_modules",
                f"{wanted!r} matches no module of the model{hint} Its linear layers are: "
                f"{', '.join(available)} (or leave lora.target_modules empty for all of them)",
            )
    return list(config.target_modules)


def apply_lora(
    model: Any, config: LoraConfig, target_modules: list[str], *, gradient_checkpointing: bool
) -> Any:
    """The peft model: base weights frozen, adapter weights trainable (fp32 even on a bf16 base)."""
    import peft

    if config.qlora:
        from trainer.node import speedups

        if speedups.enabled("qlora_bf16_rest"):
            freeze_for_kbit_training(model, gradient_checkpointing=gradient_checkpointing)
        else:
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=gradient_checkpointing
            )
    lora = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, lora)


def freeze_for_kbit_training(model: torch.nn.Module, *, gradient_checkpointing: bool) -> None:
    """What peft.prepare_model_for_kbit_training does for a bf16 run, less its cast of every weight
    that is not quantized to fp32 (a guard for fp16 training): every base weight frozen and, under
    gradient checkpointing, the embeddings' output made to require a gradient (a checkpointed layer
    whose inputs need none would pass no gradient back to the adapters). The model's load already
    turned gradient checkpointing on (trainer.node.hf.model.load_model)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing:
        model.enable_input_require_grads()


def keep_adapter_inputs_in_compute_dtype(model: torch.nn.Module) -> int:
    """Under bf16 autocast: stop peft casting each adapter's input to the adapter's dtype. The adapters
    are fp32 on a bf16 base, so peft copies every adapted layer's input to fp32 (and its dropout runs on
    that fp32 copy), which autocast casts straight back to bf16 for the adapter's matmul: two copies of
    an activation per adapted layer for nothing. The loss is the same; gradients differ by bf16 rounding.
    Call it only when the model runs under autocast (without it, a bf16 input would meet fp32 weights).
    Returns how many layers it changed (0 for a model without peft layers)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft comes with the fine-tuning dependencies; a model without it has no adapter
        return 0
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False  # what peft.helpers.disable_input_dtype_casting sets
    return len(layers)
