"""NvmlSource's reading of NVML values. This machine has no NVIDIA GPU, so the NVML C calls are
replaced by a scripted GPU on the real `pynvml` module (its constants and error classes stay real):
this checks which calls, constants and units the source uses, not the driver."""

from __future__ import annotations

import pynvml
import pytest

from trainer.node.health import CircuitBreaker, HealthConfig
from trainer.node.health.readings import NvmlSource, SourceUnavailable


@pytest.fixture
def scripted_gpu(monkeypatch):
    gpu = {
        "ecc": 0,
        "temp": 60,
        "reasons": pynvml.nvmlClocksThrottleReasonGpuIdle,
        "power_mw": 312_500,
        "thresholds": {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 87,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92,
        },
    }

    def ecc(handle, error_type, counter):
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return gpu["ecc"]

    def temperature(handle, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return gpu["temp"]

    def power(handle):
        if gpu["power_mw"] is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu["power_mw"]

    calls = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda index: f"handle{index}",
        "nvmlDeviceGetUUID": lambda handle: b"GPU-5c1e3f7a",
        "nvmlDeviceGetName": lambda handle: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetTemperatureThreshold": lambda handle, kind: gpu["thresholds"][kind],
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetTemperature": temperature,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda handle: gpu["reasons"],
        "nvmlDeviceGetPowerUsage": power,
    }
    for name, fn in calls.items():
        monkeypatch.setattr(pynvml, name, fn)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return gpu


def test_a_healthy_gpu_reads_as_healthy(scripted_gpu):
    source = NvmlSource(cuda_index=0)
    reading = source.read()
    assert (reading.index, reading.uuid, reading.name) == (0, "GPU-5c1e3f7a", "NVIDIA H100 80GB HBM3")
    assert reading.metrics == {
        "temperature_slowdown_c": 87,
        "temperature_shutdown_c": 92,
        "ecc_uncorrectable": 0,
        "temperature_c": 60,
        "throttle_reasons": [],  # GPU idle is not a slowdown reason
        "power_w": 312.5,
    }
    breaker = CircuitBreaker(HealthConfig(), host="h", rank=0, local_rank=0)
    assert breaker.evaluate(reading, step=1) is None


def test_ecc_thermal_and_unsupported_values_map_to_metrics(scripted_gpu):
    source = NvmlSource(cuda_index=0)
    scripted_gpu.update(
        ecc=2,
        temp=88,
        reasons=pynvml.nvmlClocksThrottleReasonHwThermalSlowdown | pynvml.nvmlClocksThrottleReasonSwPowerCap,
        power_mw=None,
    )
    metrics = source.read().metrics
    assert "power_w" not in metrics  # NOT_SUPPORTED leaves the metric out instead of failing the read
    assert sorted(metrics["throttle_reasons"]) == ["hw_thermal_slowdown", "sw_power_cap"]
    fault = CircuitBreaker(HealthConfig(), host="h", rank=0, local_rank=0).evaluate(source.read(), step=3)
    assert (fault.metric, fault.value, fault.uuid) == ("ecc_uncorrectable", 2, "GPU-5c1e3f7a")


def test_cuda_visible_devices_picks_the_physical_gpu(scripted_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert NvmlSource(cuda_index=1).index == 3


def test_no_driver_means_unavailable_with_the_reason():
    with pytest.raises(SourceUnavailable, match="NVML unavailable"):
        NvmlSource(cuda_index=0)
