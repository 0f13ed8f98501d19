"""The trainer's speed-ups (issue 41): one entry each, all on by default, each switched off by name for
a measurement or a workaround: TRAINER_SPEEDUPS_OFF=name[,name...] (or `all`) in the training
processes' environment. None changes what is trained: with one off, the loss agrees with it on within
rounding (tests/unit/node/test_speedups.py switches each one, tests/local/test_speedups_local.py all
of them). Read when the model and the loop are built, so a process that trains several times (a
bench) can switch them between runs. Kept where a measurement supported them (docs/performance.md,
2026-11-27 and 2026-11-28); a fused LoRA forward and gc.freeze after start-up were measured and
dropped.

A leaf module: no torch, no other trainer module (but the shared ConfigError).
"""

from __future__ import annotations

import os

from trainer.configerror import ConfigError

VARIABLE = "TRAINER_SPEEDUPS_OFF"

#: Name -> what it does (the words docs/performance.md and the log use).
SPEEDUPS: dict[str, str] = {
    "fused_adamw": "train.optimizer=adamw runs torch's fused AdamW kernel where torch has one for the "
    "device (CUDA; the CPU in torch 2.4 and later): one kernel over all parameters instead of a loop "
    "of small ones",
    "async_loss": "no host-device synchronisation in a step: the loss stays on the device and is read "
    "on logged steps only; the per-step stop vote (the GPU health check) is read one step late on GPUs",
    "chunked_loss": "the output head and the cross-entropy of a Hugging Face model run over chunks of "
    "tokens where a micro batch has more than 2^30 logits (tokens x vocabulary), each chunk's logits "
    "recomputed in the backward pass, so they are never held whole; on the CPU only the labelled "
    "positions go through the head",
    "compiled_head": "with train.compile, the output head and the cross-entropy are compiled too, beside "
    "each decoder layer: the logits' upcast to fp32 is fused into the softmax instead of written whole",
    "qlora_bf16_rest": "Q-LoRA leaves the base's weights that are not quantized (norms, embeddings, the "
    "output head) in the compute dtype (bf16) where peft's prepare_model_for_kbit_training casts them to "
    "fp32 (for fp16 training): they are frozen, so their values are the same, and the activations stay "
    "bf16 as in LoRA",
    "bf16_master": "full fine-tuning under ddp on a bf16 GPU keeps the model's weights in bf16 and an "
    "fp32 master copy of them in the optimizer (its moments fp32 as before): no weight cast per forward, "
    "gradients made and all-reduced in bf16 (half the bytes on the network), the update in fp32; "
    "checkpoints hold the fp32 master weights, as before",
}


def off() -> set[str]:
    """The names switched off in this process's environment (ConfigError for an unknown name)."""
    raw = os.environ.get(VARIABLE, "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    if "all" in names:
        return set(SPEEDUPS)
    unknown = names - set(SPEEDUPS)
    if unknown:
        raise ConfigError(
            VARIABLE, f"unknown speed-up {', '.join(sorted(unknown))}; known: {', '.join(SPEEDUPS)}, all"
        )
    return names


def enabled(name: str) -> bool:
    if name not in SPEEDUPS:
        raise KeyError(name)
    return name not in off()


def describe() -> str | None:
    """A log line when some are off (None when all are on, the default)."""
    names = off()
    if not names:
        return None
    return f"speed-ups off ({VARIABLE}): {', '.join(n for n in SPEEDUPS if n in names)}"
