"""A tiny character-level GPT in the style of nanoGPT: embeddings, pre-norm blocks, tied output head.

Its size comes from `ModelConfig` (in trainer.node.config, which stays free of torch) and its context
length from `data.block_size`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.configerror import ConfigError
from trainer.node.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (
            t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, *, vocab_size: int, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, vocab_size, bias=False)
        # Weight tying (as in GPT-2): the output head shares the token embedding matrix.
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # Scaled init of the residual projections (GPT-2 paper): keeps the residual stream's variance
        # from growing with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting `targets` (the next characters) from `idx`."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


# --- will it fit? ---------------------------------------------------------------------------------

#: What to try when a model does not fit (the end of the too-big error).
MEMORY_FIXES = (
    "use a smaller model (model.n_layer, model.n_embd, or a smaller model.name_or_path), train a LoRA "
    "adapter (lora.enabled=true, Hugging Face models), or shard it with DeepSpeed "
    "(distributed.engine=deepspeed, zero_stage=3, over more processes; offload_optimizer / offload_param "
    "to the CPU in a distributed.deepspeed_config)"
)


def parameter_count(config: ModelConfig, *, vocab_size: int, block_size: int) -> int:
    """The built-in GPT's parameters, counted on a weightless copy (nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(config, vocab_size=vocab_size, block_size=block_size)
    return sum(p.numel() for p in model.parameters())


def training_bytes(
    *,
    parameters: int,
    trained: int,
    weight_bytes: float,
    engine: str,
    zero_stage: int,
    world_size: int,
) -> int:
    """Bytes one process holds for the weights, their gradients and AdamW's two moments: a lower bound
    (activations, buffers and the allocator's slack come on top). `trained` of the `parameters` get
    gradients and optimizer state; DeepSpeed keeps fp32 master weights and moments of 16-bit ones and
    shards the optimizer state (stage 1), the gradients (2) and the weights (3) over the processes."""
    frozen = parameters - trained
    if engine != "deepspeed":
        # The optimizer steps the parameters themselves: moments in their dtype.
        return int(frozen * weight_bytes + trained * 4 * weight_bytes)
    shards = max(1, world_size)
    optimizer = trained * (8 + (4 if weight_bytes < 4 else 0)) / shards
    gradients = trained * weight_bytes / (shards if zero_stage >= 2 else 1)
    weights = parameters * weight_bytes / (shards if zero_stage >= 3 else 1)
    return int(weights + gradients + optimizer)


def available_memory(device: str) -> tuple[int, str]:
    """Bytes a run on `device` may still allocate and where that number comes from. The CPU: the
    kernel's MemAvailable plus free swap (/proc/meminfo); a GPU: its free memory (cudaMemGetInfo)."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"free on GPU {index}"
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
    if "MemAvailable" not in fields:
        raise OSError("/proc/meminfo has no MemAvailable")
    return fields["MemAvailable"] + fields.get("SwapFree", 0), "MemAvailable + SwapFree in /proc/meminfo"


def check_fits(
    *,
    parameters: int,
    trained: int,
    weight_bytes: float,
    engine: str,
    zero_stage: int,
    world_size: int,
    local_world_size: int,
    device: str,
) -> None:
    """ConfigError("model") when the weights, gradients and optimizer state alone exceed the memory the
    node has: a run that cannot start, refused before anything is created. Only the clearly impossible
    is refused (the estimate is a lower bound); a memory reading that fails refuses nothing."""
    from trainer.node.checkpoint import human_size

    try:
        available, source = available_memory(device)
    except (OSError, RuntimeError, ValueError):
        return
    per_process = training_bytes(
        parameters=parameters,
        trained=trained,
        weight_bytes=weight_bytes,
        engine=engine,
        zero_stage=zero_stage,
        world_size=world_size,
    )
    # The CPU's memory is shared by the node's processes; each GPU is one process's own.
    sharing = 1 if device.startswith("cuda") else max(1, local_world_size)
    needed = per_process * sharing
    if needed <= available:
        return
    processes = f" × {sharing} processes on this node" if sharing > 1 else ""
    trained_note = f" ({trained:,} trained)" if trained != parameters else ""
    raise ConfigError(
        "model",
        f"the model does not fit in memory: {parameters:,} parameters{trained_note} need at least "
        f"{human_size(needed)} for weights, gradients and optimizer state ({human_size(per_process)} per "
        f"process{processes}, {engine}), but {human_size(available)} is available ({source}); "
        f"{MEMORY_FIXES}",
    )


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("can't allocate memory", "out of memory", "Cannot allocate memory")
    )


def out_of_memory_error(error: BaseException) -> ConfigError:
    """The too-big error for an allocation that failed while the model was built."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
    return ConfigError(
        "model",
        f"the model does not fit in memory: allocating it failed ({type(error).__name__}: {first}); "
        f"{MEMORY_FIXES}",
    )
