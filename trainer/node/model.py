"""A tiny character-level GPT in the style of nanoGPT: embeddings, pre-norm blocks, tied output head.

Its size comes from `ModelConfig` (in trainer.node.config, which stays free of torch) and its context
length from `data.block_size`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

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


def parameter_count(config: ModelConfig, *, vocab_size: int, block_size: int) -> int:
    """The built-in GPT's parameters, counted on a weightless copy (nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(config, vocab_size=vocab_size, block_size=block_size)
    return sum(p.numel() for p in model.parameters())
