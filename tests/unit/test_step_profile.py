"""bench/step_profile.py and gpu_check's steady window: a profiled step's time is split by kind of
kernel (the matmuls named as such), and the profiled steps are left out of a run's tokens/s."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
from step_profile import StepProfiler, category  # noqa: E402


def test_a_profiled_cpu_step_is_split_by_kind_with_the_matmuls_named():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters())

    def train_step(batch):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    profiler = StepProfiler(2, 3)
    step = profiler.wrap(train_step)
    for _ in range(4):
        step(torch.randn(2048, 256))
    summary = profiler.summary
    assert summary is not None and summary["steps"] == 2
    # The largest single op of this step is its matmul (the optimizer's element-wise ops come after).
    assert summary["top_kernels_ms"][0][:1] == ["aten::mm"], summary["top_kernels_ms"]
    assert summary["top_kernels_ms"][0][2] == "matmul"
    assert summary["by_category_ms"]["matmul"] > 0
    assert category("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
    assert category("triton_poi_fused__unsafe_view_add_mul_native_dropout_silu_3") == "inductor"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"


def test_the_steady_tokens_per_s_leave_out_the_profiled_steps():
    records = [
        {"step": s, "tokens": 1000, "tokens_per_s": tps, "step_time_s": 1000 / tps / 5, "loss": 1.0}
        for s, tps in ((5, 100.0), (10, 200.0), (15, 200.0), (20, 50.0), (25, 200.0))
    ]
    assert gpu_check._steady(records)["tokens_per_s"] < 200  # the slow profiled interval counted
    steady = gpu_check._steady(records, skip=[17, 19])
    assert steady["steps_measured"] == [15, 25]
    assert steady["tokens_per_s"] == 200
