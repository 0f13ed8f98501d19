"""fp32 master copies of a bf16 model's trained weights, for the ddp engine (the bf16_master speed-up).

The model runs and makes its gradients in bf16 (no cast of every weight per forward, half the bytes
all-reduced); the optimizer steps the fp32 masters, so small updates are not rounded away, and the
bf16 weights are refreshed from them after each step: the scheme DeepSpeed's bf16 mode uses. The
masters are what a checkpoint holds under the parameters' own names, so checkpoints written with or
without masters load into either.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterWeights:
    def __init__(self, module: torch.nn.Module):
        #: The trained parameters (bf16) and their fp32 masters, pairwise.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        # Every name of a trained parameter: a tied output head shares the embedding's weight.
        self._names = {
            name: self._master_of[id(p)]
            for name, p in module.named_parameters(remove_duplicate=False)
            if id(p) in self._master_of
        }

    def groups(self, groups: Iterable[dict]) -> list[dict]:
        """The optimizer's parameter groups over the masters instead of the model's parameters."""
        return [{**group, "params": [self._master_of[id(p)] for p in group["params"]]} for group in groups]

    def gradients_to_masters(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = None if param.grad is None else param.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """The stepped masters into the model's weights (rounded to bf16); the masters' gradients freed."""
        torch._foreach_copy_(self.params, self.masters)
        for master in self.masters:
            master.grad = None

    def state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's state dict with each trained weight's fp32 master in its place."""
        names = self._names
        return {name: names[name].detach() if name in names else value for name, value in state.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """The masters from a checkpoint's weights (fp32 in those written with or without masters)."""
        for name, master in self._names.items():
            if name in state:
                master.copy_(state[name])


def wanted(weights_dtype: torch.dtype, optimizer: str) -> bool:
    """fp32 masters for trained weights of this dtype (the bf16_master speed-up), as DeepSpeed's bf16
    mode keeps them; not for bitsandbytes' 8-bit AdamW, which keeps its own state for its parameters."""
    from trainer.node import speedups

    return weights_dtype == torch.bfloat16 and optimizer != "adamw_8bit" and speedups.enabled("bf16_master")
