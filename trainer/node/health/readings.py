"""Where GPU readings come from: NVML in production, a fault file in tests.

Both sources hand the monitor the same `GpuReading`, so a test drives exactly the path a real GPU
drives (breaker -> webhook -> exit). Each rank watches the one GPU it trains on: a fault is then seen
and reported once, by the rank that owns the GPU, not by every rank of the node.

Test hook, `health.fault_source: "file:/path/faults.jsonl"` (e.g. `--set health.fault_source=file:...`):
one JSON object per line,

    {"step": 5, "gpu": 0, "metrics": {"ecc_uncorrectable": 3}}
    {"step": 8, "gpu": 1, "host": "node2", "metrics": {"temperature_c": 91}}

A line applies from training step `step` on, to the rank whose GPU index is `gpu` (on a CPU run each
rank pretends to own GPU index LOCAL_RANK), optionally only on `host` (hostname) or `rank`. Its
`metrics` replace those of a healthy reading (ecc_uncorrectable 0, temperature_c 40,
temperature_slowdown_c 87, temperature_shutdown_c 92, throttle_reasons []); `uuid` may be given too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One reading of one GPU. `metrics` holds everything the breaker looks at, plus context."""

    index: int
    uuid: str
    name: str
    metrics: dict[str, Any] = field(default_factory=dict)


class GpuSource(Protocol):
    """Reads the GPU this rank trains on."""

    index: int
    name: str

    def read(self) -> GpuReading: ...

    def close(self) -> None: ...


class SourceUnavailable(Exception):
    """The source cannot read a GPU here (no NVIDIA driver, no GPU); the monitor is then off."""


# --------------------------------------------------------------------------------------------- NVML

_THROTTLE_BITS = {
    # name -> pynvml constant name (the bit is looked up at runtime so old/new bindings both work)
    "sw_power_cap": "nvmlClocksThrottleReasonSwPowerCap",
    "hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
    "sw_thermal_slowdown": "nvmlClocksThrottleReasonSwThermalSlowdown",
    "hw_thermal_slowdown": "nvmlClocksThrottleReasonHwThermalSlowdown",
    "hw_power_brake_slowdown": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
}


class NvmlSource:
    """Reads one GPU through NVML (`nvidia-ml-py`). Metrics a GPU does not support are left out."""

    def __init__(self, cuda_index: int) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise SourceUnavailable("nvidia-ml-py is not installed") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise SourceUnavailable(f"NVML unavailable ({exc}): no NVIDIA driver on this node") from exc
        try:
            self._handle, self.index = _nvml_handle_for_cuda_device(pynvml, cuda_index)
            self.uuid = _text(pynvml.nvmlDeviceGetUUID(self._handle))
            self.name = _text(pynvml.nvmlDeviceGetName(self._handle))
            # The thresholds are properties of the board: read them once, not at every poll.
            self._thresholds = {
                "temperature_slowdown_c": self._optional(
                    pynvml.nvmlDeviceGetTemperatureThreshold, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                ),
                "temperature_shutdown_c": self._optional(
                    pynvml.nvmlDeviceGetTemperatureThreshold, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
                ),
            }
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise SourceUnavailable(f"NVML cannot open CUDA device {cuda_index}: {exc}") from exc

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self._handle, *args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def read(self) -> GpuReading:
        nvml = self._nvml
        metrics: dict[str, Any] = dict(self._thresholds)
        metrics["ecc_uncorrectable"] = self._optional(
            nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        metrics["temperature_c"] = self._optional(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        mask = self._optional(reasons_fn)
        if mask is not None:
            metrics["throttle_reasons"] = [
                name for name, const in _THROTTLE_BITS.items() if mask & getattr(nvml, const, 0)
            ]
        power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage)
        if power_mw is not None:
            metrics["power_w"] = round(power_mw / 1000, 1)
        return GpuReading(
            self.index, self.uuid, self.name, {k: v for k, v in metrics.items() if v is not None}
        )

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_handle_for_cuda_device(pynvml: Any, cuda_index: int) -> tuple[Any, int]:
    """NVML numbers GPUs in PCI order over all GPUs; CUDA's index is relative to CUDA_VISIBLE_DEVICES
    and may be ordered differently. Match by UUID (from torch) so the right board is watched."""
    uuid = None
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # torch without CUDA, or an old torch without `.uuid`: fall back to the env var
        uuid = None
    if uuid:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            return handle, pynvml.nvmlDeviceGetIndex(handle)
        except pynvml.NVMLError:  # e.g. a MIG slice, whose UUID NVML spells differently
            pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and cuda_index < len(visible):
        entry = visible[cuda_index]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry)), int(entry)
        handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
        return handle, pynvml.nvmlDeviceGetIndex(handle)
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index), cuda_index


# ------------------------------------------------------------------------------------ test fault file

HEALTHY_METRICS: dict[str, Any] = {
    "ecc_uncorrectable": 0,
    "temperature_c": 40,
    "temperature_slowdown_c": 87,
    "temperature_shutdown_c": 92,
    "throttle_reasons": [],
}


class FaultFileError(ValueError):
    """The fault file of the test hook is malformed."""


class FileFaultSource:
    """Readings recorded in a JSONL file, applied by training step (the documented test hook)."""

    def __init__(self, path: str, *, gpu_index: int, host: str, rank: int, current_step: Callable[[], int]):
        self.index = gpu_index
        self.uuid = f"GPU-test-{host}-{gpu_index}"
        self.name = "test fault source"
        self._current_step = current_step
        self._entries = [
            entry
            for entry in load_fault_file(path)
            if _applies(entry, gpu_index=gpu_index, host=host, rank=rank)
        ]
        self._entries.sort(key=lambda entry: entry["step"])

    def read(self) -> GpuReading:
        step = self._current_step()
        metrics = {k: (list(v) if isinstance(v, list) else v) for k, v in HEALTHY_METRICS.items()}
        uuid = self.uuid
        for entry in self._entries:
            if entry["step"] <= step:
                metrics.update(entry.get("metrics", {}))
                uuid = entry.get("uuid", uuid)
        return GpuReading(self.index, uuid, self.name, metrics)

    def close(self) -> None:
        pass


def load_fault_file(path: str) -> list[dict[str, Any]]:
    entries = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FaultFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                raise FaultFileError(f'{path}:{number}: each line needs an integer "step"')
            if not isinstance(entry.get("gpu"), int) or not isinstance(entry.get("metrics", {}), dict):
                raise FaultFileError(
                    f'{path}:{number}: each line needs an integer "gpu" and a "metrics" object'
                )
            entries.append(entry)
    return entries


def _applies(entry: dict[str, Any], *, gpu_index: int, host: str, rank: int) -> bool:
    return entry["gpu"] == gpu_index and entry.get("host", host) == host and entry.get("rank", rank) == rank
