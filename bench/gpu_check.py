"""Helpers of bench/gpu_check.sh, the one-shot GPU check of `trainer train` (full, LoRA, Q-LoRA under
DDP; DeepSpeed ZeRO-2/3; accelerate) on a borrowed single-GPU machine. The shell script runs the steps,
each under `timeout`; this file does what is easier in Python:

    gpu_check.py env FILE                      # GPU, driver, torch/CUDA/NCCL, bf16, packages, a bf16 matmul
    gpu_check.py health FILE                   # the health monitor's NVML readings (trainer.node.health)
    gpu_check.py data FILE --records N --chars C   # JSON lines of `text` records cut from pydoc_data
    gpu_check.py worker RESULT -- train ...    # under torchrun: `trainer train ...` in this process,
                                               # then its peak memory into RESULT (rank 0)
    gpu_check.py summary WORK OUT              # one table on stdout, OUT/gpu_check.json
    gpu_check.py variants --plan JSON [--budget-s S] [--no-save] RESULT -- SET...
                                               # under torchrun: `trainer train` once per variant
                                               # (speed-ups off by name, extra sets) in this process
    gpu_check.py variants-summary WORK OUT     # the variants' table (before/after), OUT/speedups.json
    gpu_check.py slim-wheel WHEEL --keep GLOB...  # drop the shared libraries not kept (bitsandbytes)

MFU = model FLOPs per token × tokens/s / peak, with N the model's parameters (the tied embedding counted
once: it is the output head's matmul): 6·N per token for full fine-tuning (forward 2N + backward 4N),
4·N for LoRA and Q-LoRA (forward 2N + the input gradients 2N; the adapters' own weight gradients are
left out); attention's own FLOPs are left out, as usual. Peak: --peak-tflops, default 989 (H100 SXM,
bf16 dense).
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEAK_TFLOPS = 989.0  # H100 SXM5, bf16 dense, no sparsity
WARMUP_STEPS = 10  # steady state: the logged intervals after this step


def _json_write(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _try_import(name: str) -> str:
    try:
        module = __import__(name)
        return f"ok ({getattr(module, '__file__', '?')})"
    except Exception as error:  # any failure is the finding
        return f"FAILED: {type(error).__name__}: {str(error).strip().splitlines()[:1]}"


# --------------------------------------------------------------------------------------------- env


def env(args: argparse.Namespace) -> int:
    import torch

    info: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": {
            name: _version(name)
            for name in (
                "transformers",
                "peft",
                "accelerate",
                "deepspeed",
                "bitsandbytes",
                "datasets",
                "dill",
                "multiprocess",
                "pydantic",
                "pydantic-core",
                "hjson",
                "typing-extensions",
                "pyarrow",
                "fsspec",
                "huggingface-hub",
                "tokenizers",
                "safetensors",
                "nvidia-ml-py",
                "triton",
            )
        },
    }
    try:
        info["nvidia_smi_L"] = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        info["nvidia_smi_L"] = f"unavailable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            {
                "gpu": props.name,
                "capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count,
                "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "bf16_supported": torch.cuda.is_bf16_supported(),
                "cudnn": torch.backends.cudnn.version(),
            }
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as error:
            info["driver"] = f"unavailable: {error}"
        # What a dense bf16 matmul reaches here: the ceiling the MFU figures are to be read against.
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start, repeats = time.perf_counter(), 20
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize()
        info["matmul_bf16_8192_tflops"] = round(
            2 * 8192**3 * repeats / (time.perf_counter() - start) / 1e12, 1
        )
        del a, b
    else:
        info["bf16_supported"] = False
    # The carried packages must import here (bitsandbytes on a GPU only: its CUDA library is the point).
    info["imports"] = {name: _try_import(name) for name in ("deepspeed", "datasets", "pydantic", "hjson")}
    if torch.cuda.is_available():
        info["imports"]["bitsandbytes"] = _try_import("bitsandbytes")
        # Which of its libraries bitsandbytes loaded (libbitsandbytes_cuda130.so for torch cu130).
        maps = Path("/proc/self/maps").read_text()
        info["bitsandbytes_lib"] = sorted(set(re.findall(r"libbitsandbytes_\w+\.so", maps))) or "none loaded"
    for key, value in info.items():
        print(f"{key}: {value}")
    _json_write(args.file, info)
    return 0


# ------------------------------------------------------------------------------------------ health


def health(args: argparse.Namespace) -> int:
    """The project's own NVML source (what the monitor polls during a run), read three times."""
    sys.path.insert(0, str(REPO))
    from trainer.node.health.readings import NvmlSource, SourceUnavailable

    result: dict = {}
    try:
        source = NvmlSource(0)
    except SourceUnavailable as error:
        result["source"] = f"unavailable: {error}"
        print(result)
        _json_write(args.file, result)
        return 0
    readings = []
    for _ in range(3):
        reading = source.read()
        readings.append(reading.metrics)
        time.sleep(0.5)
    result.update({"index": source.index, "uuid": source.uuid, "name": source.name, "readings": readings})
    # Not read by the project: what NVML also offers (memory; XID errors come as events only).
    nvml = source._nvml
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(source._handle)
        result["nvml_memory_used_mib"] = memory.used // 2**20
        result["nvml_memory_total_mib"] = memory.total // 2**20
    except Exception as error:
        result["nvml_memory"] = f"unavailable: {error}"
    source.close()
    print(json.dumps(result, indent=1))
    _json_write(args.file, result)
    return 0


# -------------------------------------------------------------------------------------------- data


def data(args: argparse.Namespace) -> int:
    """`text` records long enough that every one fills model.max_length (truncated): full rows."""
    from pydoc_data.topics import topics

    corpus = re.sub(r"\s+", " ", " ".join(topics[name] for name in sorted(topics)))
    step = max(1, (len(corpus) - args.chars) // args.records)
    with open(args.file, "w") as out:
        for index in range(args.records):
            start = (index * step) % max(1, len(corpus) - args.chars)
            out.write(json.dumps({"text": corpus[start : start + args.chars]}) + "\n")
    print(f"{args.file}: {args.records} text records of {args.chars} characters")
    return 0


# ------------------------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> int:
    """`trainer train ...` (the project's entry point, in this process), then this rank's peak memory."""
    import torch

    from trainer.cli import main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    started = time.perf_counter()
    code: int | str | None = None
    try:
        code = main(rest)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        result = {
            "exit_code": code,
            "wall_s": round(time.perf_counter() - started, 1),
            "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        if os.environ.get("RANK", "0") == "0":
            _json_write(args.result, result)
    return int(code) if isinstance(code, int) else 1


# ---------------------------------------------------------------------------------------- variants


def variants(args: argparse.Namespace) -> int:
    """Several `trainer train` runs in this one process (torch, CUDA and the data loaded once), one per
    variant of --plan: [{"name", "off": TRAINER_SPEEDUPS_OFF, "sets": [...]}]. Each gets its own
    output dir under RESULT's folder and its peak memory; the result file is rewritten after each, so a
    run cut short by its limit keeps what it measured. Variants that would start past --budget-s are
    skipped. --no-save: no checkpoint, final model or parameter checksum (GBs at full size, and not
    what is measured)."""
    import gc

    import torch

    from trainer.cli import main

    if args.no_save:
        from trainer.node.engines import Engine
        from trainer.node.hf.job import FineTune
        from trainer.node.loop import Trainer

        Trainer._save = lambda self, step, loss: None
        FineTune.save_final = lambda self, *a, **k: None
        Engine.parameter_checksum = lambda self: "not computed (bench)"
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    plan = json.loads(args.plan)
    result_path = Path(args.result)
    results: dict[str, dict] = {}
    started = time.monotonic()
    cuda = torch.cuda.is_available()
    for variant in plan:
        name = variant["name"]
        if time.monotonic() - started > args.budget_s:
            results[name] = {"status": "skipped", "note": f"past --budget-s {args.budget_s:g}"}
            continue
        out = result_path.parent / "runs" / name
        os.environ["TRAINER_SPEEDUPS_OFF"] = variant.get("off", "")
        sets = [
            *rest,
            *(a for s in variant.get("sets", []) for a in ("--set", s)),
            "--set",
            f"output_dir={out}",
        ]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        profiler = _profile_steps(variant.get("profile"))
        t0 = time.perf_counter()
        try:
            code: int | str | None = main(["train", *sets])
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:  # the next variant still runs
            code = f"{type(error).__name__}: {error}"[:500]
        finally:
            _unprofile()
        record: dict = {
            "status": "ok" if code == 0 else f"rc={code}",
            "seconds": round(time.perf_counter() - t0, 1),
            "off": variant.get("off", ""),
            "sets": variant.get("sets", []),
        }
        if cuda:
            record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            record.update(_steady(records, skip=variant.get("profile")))
            record["first_step_s"] = records[0].get("step_time_s")
        if profiler is not None and profiler.summary is not None:
            record["profile"] = profiler.summary
        results[name] = record
        if os.environ.get("RANK", "0") == "0":
            _json_write(result_path, results)
            shown = {key: value for key, value in record.items() if key != "profile"}
            print(f"variant {name}: {json.dumps(shown)}", flush=True)
            if profiler is not None and profiler.summary is not None:
                from step_profile import format_summary

                print(format_summary(name, profiler.summary), flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if os.environ.get("RANK", "0") == "0":
        _json_write(result_path, results)
    return 0


_TRAIN = None


def _profile_steps(steps: list[int] | None):
    """A StepProfiler around the engine's train_step of the next `trainer train` in this process (steps
    FIRST..LAST of it), or None."""
    global _TRAIN
    if not steps:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_profile import StepProfiler

    from trainer.node.loop import Trainer

    profiler = StepProfiler(int(steps[0]), int(steps[1]))
    _TRAIN = Trainer.train

    def train(self):
        self.engine.train_step = profiler.wrap(self.engine.train_step)
        return _TRAIN(self)

    Trainer.train = train
    return profiler


def _unprofile() -> None:
    global _TRAIN
    if _TRAIN is not None:
        from trainer.node.loop import Trainer

        Trainer.train, _TRAIN = _TRAIN, None


def variants_summary(args: argparse.Namespace) -> int:
    """One table of every WORK/variants/*.json: tokens/s, step, peak memory, MFU, the loss, and
    each run's tokens/s against its group's `*_before` run."""
    work, out = Path(args.work), Path(args.out)
    parameters = _parameters(work)
    peak = args.peak_tflops * 1e12
    table: dict[str, dict] = {}
    for path in sorted((work / "variants").glob("*.json")):
        table.update(json.loads(path.read_text()))
    attention = _attention_flops_per_token(work, args.seq_len)
    for name, run in table.items():
        lora = any(s.startswith("lora.enabled=true") for s in run.get("sets", []))
        if parameters and run.get("tokens_per_s"):
            run["mfu_pct"] = round(100 * (4 if lora else 6) * parameters * run["tokens_per_s"] / peak, 2)
            if attention:  # forward 1/3 and backward 2/3 of it; LoRA's backward without weight grads alike
                model_flops = (4 if lora else 6) * parameters + attention * (2 / 3 if lora else 1)
                run["mfu_attention_pct"] = round(100 * model_flops * run["tokens_per_s"] / peak, 2)
        before = table.get(name.split("__")[0].rsplit("_", 1)[0] + "_before", {})
        if run.get("tokens_per_s") and before.get("tokens_per_s"):
            run["vs_before"] = round(run["tokens_per_s"] / before["tokens_per_s"], 3)
    env_info = json.loads((work / "env.json").read_text()) if (work / "env.json").is_file() else {}
    out.mkdir(parents=True, exist_ok=True)
    _json_write(out / "speedups.json", {"env": env_info, "model_parameters": parameters, "runs": table})
    print(
        f"\n== speed-ups: {env_info.get('gpu', 'no GPU')}, torch {env_info.get('torch')}, "
        f"matmul {env_info.get('matmul_bf16_8192_tflops')} TFLOP/s; model {parameters} parameters; "
        f"MFU against {args.peak_tflops:g} TFLOP/s (6N full, 4N LoRA; +attn: with attention's "
        f"12·L·d·T a token at T={args.seq_len}, PaLM's count)"
    )
    header = (
        f"{'run':<28}{'status':<9}{'tok/s':>10}{'x before':>9}{'step ms':>9}{'peak GiB':>9}{'MFU %':>7}"
        f"{'+attn':>7}  loss"
    )
    print(header)
    print("-" * len(header))
    for name, run in table.items():
        loss = (
            f"{run['loss_first']:.4f}->{run['loss_last']:.4f}" if "loss_first" in run else run.get("note", "")
        )
        cells = [
            f"{run.get('tokens_per_s'):10,.0f}" if run.get("tokens_per_s") else f"{'-':>10}",
            f"{run.get('vs_before'):9.3f}" if run.get("vs_before") else f"{'-':>9}",
            f"{run.get('step_time_ms'):9.1f}" if run.get("step_time_ms") else f"{'-':>9}",
            f"{run.get('peak_allocated_gib'):9.2f}" if run.get("peak_allocated_gib") else f"{'-':>9}",
            f"{run.get('mfu_pct'):7.2f}" if run.get("mfu_pct") else f"{'-':>7}",
            f"{run.get('mfu_attention_pct'):7.2f}" if run.get("mfu_attention_pct") else f"{'-':>7}",
        ]
        print(f"{name:<28}{run.get('status', '?'):<9}{''.join(cells)}  {loss}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_profile import format_summary

    for name, run in table.items():
        if run.get("profile"):
            print(format_summary(name, run["profile"]))
    return 0


def _attention_flops_per_token(work: Path, seq_len: int) -> float | None:
    """Attention's matmul FLOPs per token, forward and backward (12·layers·hidden·T, PaLM appendix B),
    from the built model's config.json."""
    config = work / "model" / "config.json"
    if not config.is_file():
        return None
    model = json.loads(config.read_text())
    return 12 * model["num_hidden_layers"] * model["hidden_size"] * seq_len


# ----------------------------------------------------------------------------------------- summary


def _steady(records: list[dict], skip: list[int] | None = None) -> dict:
    """Tokens/s and step time over the logged intervals after WARMUP_STEPS, leaving out any interval
    that holds a step of `skip` ([FIRST, LAST]: profiled steps run slower)."""
    intervals = zip([0, *(r["step"] for r in records)], records, strict=False)
    steady = [
        r
        for previous, r in intervals
        if r["step"] > WARMUP_STEPS and not (skip and previous < skip[1] and r["step"] >= skip[0])
    ] or records[-1:]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steady if r["tokens_per_s"])
    tokens = sum(r["tokens"] for r in steady)
    return {
        "steps_measured": [r["step"] for r in steady],
        "tokens_per_s": tokens / seconds if seconds else None,
        "step_time_ms": 1000 * sum(r["step_time_s"] for r in steady) / len(steady),
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
    }


def _parameters(work: Path) -> int | None:
    log = work / "logs" / "build_model.log"
    if log.is_file() and (match := re.search(r"([\d,]+) parameters", log.read_text())):
        return int(match.group(1).replace(",", ""))
    return None


def _smi_peak(path: Path) -> dict:
    """Peaks of the nvidia-smi samples (memory.used MiB, utilization %, power W, temperature C)."""
    peaks: dict = {}
    if not path.is_file():
        return peaks
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        for key, value in zip(
            ("smi_mem_mib", "smi_util_pct", "smi_power_w", "smi_temp_c"), fields, strict=False
        ):
            try:
                peaks[key] = max(peaks.get(key, 0.0), float(value))
            except ValueError:
                continue
    return peaks


def summary(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    peak = args.peak_tflops * 1e12
    parameters = _parameters(work)
    steps: dict[str, dict] = {}
    steps_file = work / "steps.tsv"
    for line in steps_file.read_text().splitlines() if steps_file.is_file() else []:
        name, status, seconds, *note = line.split("\t")
        steps[name] = {"status": status, "seconds": float(seconds), **({"note": note[0]} if note else {})}
    runs: dict[str, dict] = {}
    order = list(steps)
    run_dirs = sorted((work / "runs").glob("*"), key=lambda d: order.index(d.name) if d.name in order else 99)
    for run_dir in run_dirs:
        name = run_dir.name
        run: dict = {**steps.get(name, {}), **_smi_peak(run_dir / "smi.csv")}
        worker_file = run_dir / "worker.json"
        if worker_file.is_file():
            run.update(json.loads(worker_file.read_text()))
        settings = (run_dir / "sets.txt").read_text().split() if (run_dir / "sets.txt").is_file() else []
        run["sets"] = [
            s for s in settings if not s.startswith(("model.name_or_path", "data.path", "output_dir"))
        ]
        lora = "lora.enabled=true" in settings
        run["mfu_flops_per_token"] = "4N (LoRA: forward + input grads)" if lora else "6N (full)"
        metrics = run_dir / "out" / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            run.update(_steady(records))
            if parameters and run.get("tokens_per_s"):
                run["mfu_pct"] = round(100 * (4 if lora else 6) * parameters * run["tokens_per_s"] / peak, 2)
        log = run_dir / "train.log"
        if log.is_file():
            text = log.read_text(errors="replace")
            if match := re.search(r"GPU health monitor (on|off)[^\n]*", text):
                run["health_monitor"] = match.group(0)
            if match := re.search(r"training [^\n]*", text):
                run["training_line"] = match.group(0)
            if run.get("status") not in ("ok", None):
                run["log_tail"] = text[-1500:]
        runs[name] = run
    result = {
        "mode": "cpu" if os.environ.get("GPU_CHECK_CPU") == "1" else "gpu",
        "peak_tflops_used_for_mfu": args.peak_tflops,
        "mfu_formula": "flops_per_token(6N full, 4N LoRA/Q-LoRA) * tokens_per_s / peak; N = all model "
        "parameters (tied embedding once), attention FLOPs left out; tokens/s over steps > "
        f"{WARMUP_STEPS}",
        "model_parameters": parameters,
        "steps": steps,
        "runs": runs,
    }
    for name in ("env", "health"):
        path = work / f"{name}.json"
        if path.is_file():
            result[name] = json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    _json_write(out / "gpu_check.json", result)

    env_info = result.get("env", {})
    print(
        f"\n== gpu_check ({result['mode']}): {env_info.get('gpu', 'no GPU')}, torch {env_info.get('torch')}, "
        f"CUDA {env_info.get('torch_cuda')}, NCCL {env_info.get('nccl')}, "
        f"bf16 {env_info.get('bf16_supported')}, matmul {env_info.get('matmul_bf16_8192_tflops')} TFLOP/s; "
        f"model {parameters} parameters; MFU against {args.peak_tflops:g} TFLOP/s"
    )
    columns = [("run", "<20"), ("status", "<10"), ("wall s", ">7"), ("tok/s", ">11"), ("step ms", ">9")]
    columns += [("peak GiB", ">9"), ("smi MiB", ">9"), ("MFU %", ">7")]
    header = "".join(format(title, spec) for title, spec in columns) + "  loss"
    print(header)
    print("-" * len(header))

    def fmt(value, spec: str) -> str:
        width = re.match(r"\d*", spec).group(0)
        return format(value, spec) if isinstance(value, int | float) else format("-", f">{width}")

    for name, run in runs.items():
        loss = (
            f"{run['loss_first']:.3f}->{run['loss_last']:.3f}" if "loss_first" in run else run.get("note", "")
        )
        print(
            f"{name:<20}{run.get('status', '?'):<10}{fmt(run.get('seconds'), '7.0f')}"
            f"{fmt(run.get('tokens_per_s'), '11,.0f')}{fmt(run.get('step_time_ms'), '9.1f')}"
            f"{fmt(run.get('peak_allocated_gib', run.get('max_rss_gib')), '9.2f')}"
            f"{fmt(run.get('smi_mem_mib'), '9.0f')}{fmt(run.get('mfu_pct'), '7.2f')}  {loss}"
        )
    for name, step in steps.items():
        if name not in runs:
            print(f"step {name}: {step['status']} ({step['seconds']:.0f} s){' ' + step.get('note', '')}")
    if "health" in result:
        readings = result["health"].get("readings") or [result["health"]]
        print(f"health (trainer.node.health.readings.NvmlSource): {readings[-1]}")
    print(f"written: {out / 'gpu_check.json'}")
    return 0


# -------------------------------------------------------------------------------------- slim-wheel


def slim_wheel(args: argparse.Namespace) -> int:
    """Rewrite WHEEL in place without the shared libraries (*.so) no --keep pattern names; RECORD
    follows. (bitsandbytes ships one library per CUDA/ROCm version; one GPU needs one.)"""
    path = Path(args.wheel)
    temporary = path.with_suffix(".tmp")
    dropped = []
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
        record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        kept_lines = []
        for item in source.infolist():
            name = item.filename
            if name == record_name:
                continue
            if name.endswith(".so") and not any(fnmatch.fnmatch(Path(name).name, k) for k in args.keep):
                dropped.append(name)
                continue
            body = source.read(item)
            target.writestr(item, body)
            digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
            kept_lines.append(f"{name},sha256={digest},{len(body)}")
        kept_lines.append(f"{record_name},,")
        target.writestr(record_name, "\n".join(kept_lines) + "\n")
    temporary.replace(path)
    print(f"{path.name}: dropped {len(dropped)} libraries, {path.stat().st_size / 2**20:.1f} MiB left")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env").add_argument("file")
    commands.add_parser("health").add_argument("file")
    data_parser = commands.add_parser("data")
    data_parser.add_argument("file")
    data_parser.add_argument("--records", type=int, default=520)
    data_parser.add_argument("--chars", type=int, default=5000)
    worker_parser = commands.add_parser("worker")
    worker_parser.add_argument("result")
    worker_parser.add_argument("rest", nargs=argparse.REMAINDER)
    summary_parser = commands.add_parser("summary")
    summary_parser.add_argument("work")
    summary_parser.add_argument("out")
    summary_parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    variants_parser = commands.add_parser("variants")
    variants_parser.add_argument("result")
    variants_parser.add_argument("--plan", required=True, help="JSON list of {name, off, sets}")
    variants_parser.add_argument("--budget-s", type=float, default=1e9)
    variants_parser.add_argument("--no-save", action="store_true")
    variants_parser.add_argument("rest", nargs=argparse.REMAINDER)
    variants_summary_parser = commands.add_parser("variants-summary")
    variants_summary_parser.add_argument("work")
    variants_summary_parser.add_argument("out")
    variants_summary_parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    variants_summary_parser.add_argument("--seq-len", type=int, default=1024, help="tokens a row")
    slim = commands.add_parser("slim-wheel")
    slim.add_argument("wheel")
    slim.add_argument("--keep", nargs="+", required=True)
    args = parser.parse_args(argv)
    handler = {
        "env": env,
        "health": health,
        "data": data,
        "worker": worker,
        "summary": summary,
        "variants": variants,
        "variants-summary": variants_summary,
        "slim-wheel": slim_wheel,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
