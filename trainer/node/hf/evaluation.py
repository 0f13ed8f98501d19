"""The eval loss: the `eval` config section and the token-mean loss over the held-out samples.

Every rank evaluates its share of the eval rows and the sums are added across ranks, so the figure is
the same whatever the world size. Every rank runs the same number of forward passes (a rank with no
row left runs one with no labels): under ZeRO-3 each forward is a collective.

torch is imported inside functions: the section is loaded with the config on the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.configerror import require

if TYPE_CHECKING:
    from trainer.node.engines import Engine


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = 0
    """Compute the eval loss every this many steps and at the last step (0 = at the last step only);
    needs data.eval_fraction or data.eval_path. Logged as `eval_loss` in metrics.jsonl and the step line."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", f"must be 0 or more (got {self.every_steps})")


def eval_loss(engine: Engine, eval_batches: Any, device: str) -> float:
    """The mean loss per label token over the eval set, identical on every rank."""
    import torch
    import torch.distributed as dist

    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch, label_tokens in eval_batches:
        totals[0] += engine.evaluate(batch).double()
        totals[1] += label_tokens
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1].clamp(min=1)).item()
