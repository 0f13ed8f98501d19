"""The ddp engine on a model with a frozen part (what a LoRA base is), in a one-process gloo group,
and a LoRA adapter on a bf16 base under autocast.

What a user relies on: a step changes the adapter and never the base; the optimizer holds the trained
parameters only; a decoder's constant buffers are not broadcast before every forward (a collective per
micro-batch for nothing), while a model with running statistics (batch norm) keeps DDP's broadcast,
so its ranks keep rank 0's statistics. Under bf16 autocast the adapters' inputs stay bf16 (no fp32
copy per adapted layer) and the loss is the same.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from helpers.finetune_harness import hf_cache, tiny_model  # noqa: F401
from torch import nn

from trainer.node.distributed import Topology
from trainer.node.engines.ddp import DDPEngine
from trainer.node.hf.lora import keep_adapter_inputs_in_compute_dtype
from trainer.node.schedule import TrainConfig


@pytest.fixture(scope="module")
def one_process_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield Topology(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        device="cpu",
        backend="gloo",
        hostname="localhost",
    )
    dist.destroy_process_group()


class Adapted(nn.Module):
    """A frozen linear base plus a trainable low-rank update, with a constant buffer as a decoder's
    rotary frequencies are; forward(x, y) -> the loss, as the engines call it."""

    def __init__(self, norm: nn.Module | None = None):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.down, self.up = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)
        self.norm = norm or nn.Identity()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.norm(self.base(x) + self.up(self.down(x))), y)


def engine_for(model: nn.Module, topology: Topology) -> DDPEngine:
    torch.manual_seed(0)
    config = TrainConfig(max_steps=3, micro_batch_size=4, learning_rate=0.01, min_lr=0.001, grad_clip=0.5)
    return DDPEngine(config, topology, model)


def test_a_step_trains_the_adapter_and_leaves_the_frozen_base_alone(one_process_group):
    torch.manual_seed(0)
    model = Adapted()
    base = {name: p.detach().clone() for name, p in model.base.named_parameters()}
    adapter = model.up.weight.detach().clone()
    engine = engine_for(model, one_process_group)
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(model.down.weight), id(model.up.weight)}
    for _ in range(3):
        engine.train_step([(torch.randn(4, 8), torch.randn(4, 8))])
    assert not torch.equal(model.up.weight, adapter), "the adapter trained"
    for name, p in model.base.named_parameters():
        assert torch.equal(p, base[name]) and p.grad is None, f"the frozen base.{name} is untouched"


def test_constant_buffers_are_not_broadcast_but_running_statistics_are(one_process_group):
    decoder_like = engine_for(Adapted(), one_process_group)
    assert decoder_like.model.broadcast_buffers is False
    with_batch_norm = engine_for(Adapted(norm=nn.BatchNorm1d(8)), one_process_group)
    assert with_batch_norm.model.broadcast_buffers is True


def test_under_bf16_autocast_adapter_inputs_stay_bf16_and_the_loss_is_the_same(tiny_model):  # noqa: F811
    import peft
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for keep in (False, True):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear")
        model = peft.get_peft_model(base, lora)
        if keep:
            assert keep_adapter_inputs_in_compute_dtype(model) == 14  # 7 projections × 2 layers
        seen = set()
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_pre_hook(lambda _, args, seen=seen: seen.add(args[0].dtype))
        torch.manual_seed(1)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append((model(input_ids=ids, labels=ids).loss.item(), seen))
    (loss_cast, dtypes_cast), (loss_kept, dtypes_kept) = results
    assert dtypes_cast == {torch.float32} and dtypes_kept == {torch.bfloat16}
    assert loss_kept == loss_cast
