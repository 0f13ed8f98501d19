"""The node's side of trainer.ds_config: the DeepSpeed config from the node's config objects (`train`,
`distributed`), with the user's own JSON (`distributed.deepspeed_config: PATH`) merged in. The
controller builds its launch dir's `deepspeed.json` through the same trainer.ds_config.build.
No torch here: train.py checks the user's file on every rank before the process group starts.
"""

from __future__ import annotations

from typing import Any

from trainer.ds_config import TrainerValues, build, load_user_config

__all__ = ["deepspeed_config", "load_user_config", "merge_user_config", "trainer_values"]


def trainer_values(train, distributed, world_size: int, bf16: bool | None) -> TrainerValues:
    return TrainerValues(
        micro_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        world_size=world_size,
        grad_clip=train.grad_clip,
        zero_stage=distributed.zero_stage,
        bf16=bf16,
        optimizer=train.optimizer,
        learning_rate=train.learning_rate,
        weight_decay=train.weight_decay,
    )


def merge_user_config(
    user: dict[str, Any], path: str, *, train, distributed, world_size: int, bf16: bool | None
) -> dict[str, Any]:
    """The JSON with its "auto" values filled; bf16=None (not known yet) leaves bf16 unchecked."""
    return build(trainer_values(train, distributed, world_size, bf16), user, path)


def deepspeed_config(train, distributed, world_size: int, bf16: bool) -> dict[str, Any]:
    """What DeepSpeed trains with: the user's JSON merged, or the config built from the trainer's keys."""
    path = distributed.deepspeed_config
    user = load_user_config(path) if path else None
    return build(trainer_values(train, distributed, world_size, bf16), user, path)
