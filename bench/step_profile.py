"""Where a training step's GPU time goes: torch.profiler over a few steps of `trainer train`, summed by
kernel and by kind of kernel (matmuls, attention, Inductor's fused kernels, the optimizer, copies...).
Used by bench/gpu_check.py's variants (a variant with "profile": [FIRST, LAST]); the steps profiled are
left out of that variant's tokens/s.

Why its own module: the categories are the answer to "where does LoRA's time go" (issue 41) and the
same table serves every variant; kernel names differ between cuBLAS/cuDNN/Triton versions, so the
patterns below are a best guess that leaves the unmatched in `other` (listed by name in the top).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

#: Kind of kernel -> a pattern on its name (first match wins, in this order).
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated|_attn", re.I)),
    ("bnb_4bit", re.compile(r"dequant|kgemm_4bit|kQuantize|4bit|nf4", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)),
    (
        "matmul",
        re.compile(
            r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|ampere_|hopper|^aten::(mm|addmm|bmm|baddbmm)$", re.I
        ),
    ),
    ("inductor", re.compile(r"^triton_", re.I)),
    ("loss", re.compile(r"softmax|nll_loss|cross_entropy|log_softmax", re.I)),
    ("dropout", re.compile(r"bernoulli|dropout|philox|curand", re.I)),
    ("copy_cast", re.compile(r"copy|memcpy|memset|cast|convert|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce|unrolled|index|scatter|gather|cat", re.I)),
]


def category(name: str) -> str:
    for kind, pattern in CATEGORIES:
        if pattern.search(name):
            return kind
    return "other"


class StepProfiler:
    """Wraps an engine's train_step: profiles the steps FIRST..LAST (counted from 1 as run), then
    `summary` holds per-step milliseconds by category and the top kernels."""

    def __init__(self, first: int, last: int, *, top: int = 15):
        self.first, self.last, self.top = first, last, top
        self.summary: dict[str, Any] | None = None
        self._count = 0
        self._profile = None
        self._started = 0.0

    def wrap(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        def profiled(micro_batches: Any) -> Any:
            self._count += 1
            if self._count == self.first:
                self._start()
            result = train_step(micro_batches)
            if self._count == self.last:
                self._stop()
            return result

        return profiled

    def _start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._started = time.perf_counter()

    def _stop(self) -> None:
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        assert self._profile is not None
        self._profile.__exit__(None, None, None)
        steps = self.last - self.first + 1
        self.summary = summarize(self._profile, steps=steps, wall_s=wall, cuda=cuda, top=self.top)


def summarize(profile: Any, *, steps: int, wall_s: float, cuda: bool, top: int) -> dict[str, Any]:
    """Per step: the wall, the kernels' summed time by category, the time no kernel ran (the GPU idle:
    launch overhead, host waits), the top kernels. On the CPU: aten ops by self CPU time instead."""
    from torch.autograd import DeviceType

    kernels: dict[str, float] = {}
    for event in profile.key_averages():
        if cuda:
            # A user annotation (DistributedDataParallel.forward, Optimizer.step#AdamW.step) spans the
            # kernels launched inside it on the GPU's timeline too: counted, it would count them twice.
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            if "#" in event.key or event.key.endswith(".forward"):  # torch without is_user_annotation
                continue
            total_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        else:
            if not event.key.startswith("aten::"):
                continue
            total_us = event.self_cpu_time_total
        kernels[event.key] = kernels.get(event.key, 0.0) + total_us / 1000 / steps
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        kind = category(name)
        by_category[kind] = by_category.get(kind, 0.0) + ms
    wall_ms = 1000 * wall_s / steps
    busy_ms = sum(kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 2),
        "kernel_ms_per_step": round(busy_ms, 2),
        "idle_ms_per_step": round(max(0.0, wall_ms - busy_ms), 2) if cuda else None,
        "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [[name[:120], round(ms, 3), category(name)] for name, ms in ranked],
    }


def format_summary(name: str, summary: dict[str, Any]) -> str:
    wall = summary["wall_ms_per_step"]
    lines = [
        f"profile {name}: {summary['steps']} steps, {wall:.1f} ms a step, "
        f"kernels {summary['kernel_ms_per_step']:.1f} ms, idle {summary['idle_ms_per_step']} ms"
    ]
    for kind, ms in summary["by_category_ms"].items():
        lines.append(f"  {kind:<12}{ms:8.2f} ms  {100 * ms / wall if wall else 0:5.1f} %")
    for kernel, ms, kind in summary["top_kernels_ms"]:
        lines.append(f"    {ms:8.3f} ms  {kind:<11} {kernel}")
    return "\n".join(lines)
