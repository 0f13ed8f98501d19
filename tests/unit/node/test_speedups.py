"""Issue 41's speed-ups, each switched on and off (TRAINER_SPEEDUPS_OFF) on the tiny Qwen2: what is
trained does not change. The chunked loss gives the model's own loss and gradients (over several
chunks), the fused AdamW the default AdamW's step; train.compile=auto compiles where it was measured
to help. tests/local/test_speedups_local.py runs `trainer train` with all of them on and off."""

from __future__ import annotations

import pytest
import torch
from helpers.finetune_harness import hf_cache, tiny_model  # noqa: F401

from trainer.configerror import ConfigError
from trainer.node import speedups
from trainer.node.hf import model as hf_model
from trainer.node.hf.chat import IGNORE
from trainer.node.hf.model import CausalLMLoss
from trainer.node.optim import build_optimizer
from trainer.node.schedule import TrainConfig


@pytest.fixture(scope="module")
def qwen2(tiny_model):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def batch(vocab: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (3, 90), generator=generator)
    labels = input_ids.clone()
    labels[:, :25] = IGNORE  # a prompt: no loss on it
    labels[2, 70:] = IGNORE  # a padded row
    num_items = torch.tensor(float((labels[:, 1:] != IGNORE).sum()))
    return input_ids, labels, None, num_items


def loss_and_grads(wrapper: torch.nn.Module, inputs) -> tuple[float, dict[str, torch.Tensor]]:
    wrapper.zero_grad()
    loss = wrapper(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}
    return loss.item(), grads


def assert_same(a: tuple[float, dict], b: tuple[float, dict]) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_loss_is_the_models_own_loss_and_gradients(qwen2, monkeypatch):
    inputs = batch(qwen2.config.vocab_size)
    monkeypatch.setenv(speedups.VARIABLE, "chunked_loss")
    own = CausalLMLoss(qwen2)
    assert own._parts is None, "switched off: the model computes its own loss"
    monkeypatch.delenv(speedups.VARIABLE)
    # Chunks of 40 labelled tokens: the 150 of the batch take four, each recomputed in the backward.
    monkeypatch.setattr(hf_model, "CHUNK_LOGITS", 40 * qwen2.config.vocab_size)
    monkeypatch.setattr(hf_model, "MIN_CHUNK_TOKENS", 1)
    monkeypatch.setattr(hf_model, "CHUNK_ABOVE", 0)
    chunked = CausalLMLoss(qwen2)
    assert chunked._parts is not None, "a Qwen2 takes the chunked path"
    assert_same(loss_and_grads(own, inputs), loss_and_grads(chunked, inputs))


def test_fused_adamw_steps_as_the_default_adamw_does(monkeypatch):
    config = TrainConfig(learning_rate=0.01, weight_decay=0.1)
    trained = []
    for off in ("fused_adamw", ""):
        monkeypatch.setenv(speedups.VARIABLE, off)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        optimizer, _ = build_optimizer(model, config)
        assert bool(optimizer.defaults["fused"]) == (off == ""), optimizer.defaults
        for step in range(5):
            torch.manual_seed(step)
            model(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(trained[0], trained[1], rtol=1e-5, atol=1e-6)


def test_master_weights_keep_the_updates_bf16_weights_round_away(monkeypatch):
    """A bf16 model's AdamW steps, each smaller than half a bf16 step of the weights it moves: with fp32
    masters (bf16_master) the weights follow an fp32 model's; without, every update is rounded away."""
    from trainer.node.engines.ddp import wants_masters
    from trainer.node.engines.master_weights import MasterWeights

    config = TrainConfig(learning_rate=2e-4, weight_decay=0.0, warmup_steps=0, lr_schedule="constant")

    def make(dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(4.0)  # weights near 4: a bf16 step there is 2^-5, far above the updates
        return model.to(dtype)

    def train(model, masters=None, steps=20):
        optimizer, _ = build_optimizer(model, config, masters=masters)
        for step in range(steps):
            torch.manual_seed(step)
            x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
            model(x).float().square().mean().backward()
            if masters is not None:
                masters.gradients_to_masters()
            optimizer.step()
            if masters is not None:
                masters.masters_to_model()
            model.zero_grad(set_to_none=True)
        return masters

    reference, plain, mastered = make(torch.bfloat16).float(), make(torch.bfloat16), make(torch.bfloat16)
    start = [p.detach().clone() for p in plain.parameters()]
    train(reference)
    monkeypatch.setenv(speedups.VARIABLE, "bf16_master")
    assert not wants_masters(list(plain.parameters()), "adamw")
    train(plain)
    monkeypatch.delenv(speedups.VARIABLE)
    assert wants_masters(list(mastered.parameters()), "adamw")
    assert not wants_masters(list(reference.parameters()), "adamw"), "fp32 weights need no masters"
    masters = train(mastered, MasterWeights(mastered))
    assert all(torch.equal(a, b) for a, b in zip(start, plain.parameters(), strict=True)), (
        "bf16 AdamW: nothing moved"
    )
    moved = torch.cat([(m - s.float()).flatten() for m, s in zip(masters.masters, start, strict=True)])
    wanted = torch.cat(
        [(r - s.float()).flatten() for r, s in zip(reference.parameters(), start, strict=True)]
    )
    torch.testing.assert_close(moved, wanted.detach(), rtol=0.1, atol=1e-3)  # bf16 gradients
    assert moved.abs().mean() > 2e-3, "20 steps of about 2e-4 moved the masters"
    # The bf16 weights are the masters rounded; a checkpoint holds the masters under the weights' names.
    for weight, master in zip(mastered.parameters(), masters.masters, strict=True):
        assert torch.equal(weight, master.detach().to(torch.bfloat16))
    state = masters.state_dict(mastered.state_dict())
    assert all(value.dtype == torch.float32 for value in state.values())
    restored = MasterWeights(make(torch.bfloat16))
    restored.load(state)
    assert all(torch.equal(a, b) for a, b in zip(restored.masters, masters.masters, strict=True))


def test_compiled_head_gives_the_models_own_loss_and_gradients(qwen2, monkeypatch):
    """train.compile with compiled_head: the head and the cross-entropy through Inductor (the CPU's C++
    backend here) give the loss and gradients of the model's own forward."""
    inputs = batch(qwen2.config.vocab_size)
    monkeypatch.setenv(speedups.VARIABLE, "chunked_loss")
    own = loss_and_grads(CausalLMLoss(qwen2), inputs)
    monkeypatch.delenv(speedups.VARIABLE)
    wrapper = CausalLMLoss(qwen2)
    with monkeypatch.context() as patch:  # only the head: the decoder layers' compile is the slow part
        patch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: None)
        wrapper.compile()
    assert wrapper._head_loss is not hf_model._head_loss, "the head's loss is compiled"
    assert_same(own, loss_and_grads(wrapper, inputs))
    torch._dynamo.reset()


def test_qlora_bf16_rest_leaves_the_unquantized_weights_in_bf16(tiny_model, monkeypatch):  # noqa: F811
    """Q-LoRA's preparation with qlora_bf16_rest: the base frozen, its weights left in bf16 (peft's own
    casts them to fp32), and the LoRA model's loss the same within bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from trainer.node.hf.lora import LoraConfig, apply_lora

    config = LoraConfig(enabled=True, qlora=True, r=4, alpha=8, dropout=0.0)
    inputs = None
    losses = {}
    for off in ("qlora_bf16_rest", ""):
        monkeypatch.setenv(speedups.VARIABLE, off)
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
        inputs = inputs or batch(base.config.vocab_size)
        model = apply_lora(base, config, ["q_proj", "v_proj"], gradient_checkpointing=False)
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert frozen == ({torch.float32} if off else {torch.bfloat16}), (off, frozen)
        assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[off] = CausalLMLoss(model)(*inputs[:2], None, inputs[3]).item()
    assert losses[""] == pytest.approx(losses["qlora_bf16_rest"], rel=2e-2), losses


def test_an_unknown_speedup_name_is_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setenv(speedups.VARIABLE, "chunked_los")
    with pytest.raises(ConfigError, match="unknown speed-up chunked_los; known: fused_adamw"):
        speedups.describe()
    monkeypatch.setenv(speedups.VARIABLE, "all")
    assert speedups.describe().endswith(", ".join(speedups.SPEEDUPS))
    assert "fused_adamw, async_loss, chunked_loss" in speedups.describe()


@pytest.mark.parametrize(
    ("sets", "device", "compiled"),
    [
        (["model.name_or_path=m"], "cuda:0", True),
        (["model.name_or_path=m", "lora.enabled=true", "lora.qlora=true"], "cuda:0", True),
        (
            ["model.name_or_path=m", "distributed.engine=deepspeed", "distributed.zero_stage=2"],
            "cuda:0",
            True,
        ),
        (["model.name_or_path=m"], "cpu", False),
        ([], "cuda:0", False),  # the built-in GPT
        (
            ["model.name_or_path=m", "distributed.engine=deepspeed", "distributed.zero_stage=3"],
            "cuda:0",
            False,
        ),
        (["model.name_or_path=m", "train.gradient_checkpointing=true"], "cuda:0", False),
        (["model.name_or_path=m", "distributed.engine=accelerate"], "cuda:0", True),
        (["model.name_or_path=m", "distributed.engine=accelerate"], "cpu", False),
        (["model.name_or_path=m", "train.compile=true"], "cpu", True),
        (["model.name_or_path=m", "train.compile=false"], "cuda:0", False),
    ],
)
def test_compile_auto_compiles_a_hugging_face_model_on_a_gpu_where_it_was_measured(sets, device, compiled):
    from trainer.node.config import load_config
    from trainer.node.distributed import Topology
    from trainer.node.train import compile_wanted

    config = load_config(None, sets)
    assert config.train.compile == ("auto" if not any("compile" in s for s in sets) else config.train.compile)
    topology = Topology(
        rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1, node_rank=0,
        hostname="h", device=device, backend="gloo",
    )  # fmt: skip
    assert compile_wanted(config, topology) is compiled
