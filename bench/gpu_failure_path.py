"""What only a GPU node shows of the failure path and of a resume after a node loss (run on one GPU):

    python bench/gpu_failure_path.py [--workdir DIR]

1. A real NVML fault: the bundled trainer under torchrun with the health check's temperature margin
   so wide that the GPU's current temperature trips it. Prints torchrun's own exit code (1, whatever
   its worker's was) and the rank's exit record (trainer.node.exit_record), which `trainer launch`
   reads instead: its code (75) and its one line naming the GPU, its uuid and the metric.
2. A resume at another batch split in bf16 on CUDA, as after a node loss (micro batch 16 x
   accumulation 1 -> micro batch 8 x accumulation 2, effective batch kept): the final loss of the
   uninterrupted run, of the resumed one, and their relative difference (on the CPU in fp32 the two
   agree to about 1e-7; bf16 autocast sums the micro-batches' gradients in another order).

Prints numbers measured in this one run; exits 1 when a check cannot run (no GPU) or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def trainer(workdir: Path, run: str, *overrides: str, progress: Path | None = None) -> tuple[int, float]:
    """`torchrun --nproc-per-node 1 -m trainer train` with `overrides`; (its exit code, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if progress is not None:
        env["CLUSTERTRAIN_PROGRESS_DIR"] = str(progress)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "-m",
        "trainer",
        "train",
        "--set",
        f"output_dir={workdir / run}",
        "--set",
        "train.log_every=10",
        *[item for override in overrides for item in ("--set", override)],
    ]
    started = time.monotonic()
    with open(workdir / f"{run}.log", "w") as log:
        done = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, timeout=480
        )
    return done.returncode, time.monotonic() - started


def final_loss(run_dir: Path) -> float:
    return float(json.loads((run_dir / "summary.json").read_text())["final_loss"])


def nvml_fault(workdir: Path) -> bool:
    progress = workdir / "progress"
    code, seconds = trainer(
        workdir,
        "fault",
        "train.max_steps=100000",
        "health.poll_interval_s=0.2",
        "health.temperature_margin_c=200",
        progress=progress,
    )
    records = sorted(progress.glob("exit-*.json"))
    print(f"nvml fault: torchrun exit code {code} after {seconds:.1f} s; exit records: {len(records)}")
    if not records:
        print((workdir / "fault.log").read_text()[-3000:])
        return False
    record = json.loads(records[0].read_text())
    print(f"  rank {record['rank']}: code {record['code']}, message: {record['message']}")
    return code != 0 and record["code"] == 75 and "GPU fault: GPU 0 (uuid GPU-" in record["message"]


def bf16_resume(workdir: Path) -> bool:
    common = ("train.max_steps=60", "checkpoint.save_steps=30", "train.mixed_precision=bf16")
    code, straight_s = trainer(workdir, "straight", *common)
    if code != 0:
        print((workdir / "straight.log").read_text()[-3000:])
        return False
    resumed = workdir / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(workdir / "straight" / "checkpoints" / "step-30", resumed / "checkpoints" / "step-30")
    (resumed / "checkpoints" / "latest").write_text("step-30\n")
    code, resumed_s = trainer(
        workdir, "resumed", *common, "train.micro_batch_size=8", "train.gradient_accumulation_steps=2"
    )
    if code != 0:
        print((workdir / "resumed.log").read_text()[-3000:])
        return False
    a, b = final_loss(workdir / "straight"), final_loss(resumed)
    resume_line = next(
        (line for line in (workdir / "resumed.log").read_text().splitlines() if "resuming" in line), ""
    )
    print(f"bf16 resume: {resume_line.strip()}")
    print(
        f"  final loss at step 60: uninterrupted {a:.6f} ({straight_s:.1f} s), resumed with micro 8 x "
        f"accumulation 2 {b:.6f} ({resumed_s:.1f} s), relative difference {abs(a - b) / abs(a):.2e}"
    )
    return abs(a - b) / abs(a) < 1e-2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: these checks need one")
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-failure-path-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {"nvml_fault": nvml_fault(workdir), "bf16_resume": bf16_resume(workdir)}
    print(json.dumps(results))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
