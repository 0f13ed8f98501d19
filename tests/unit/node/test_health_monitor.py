"""The monitor -> breaker -> webhook -> exit path, driven by the documented fault file (no trainer)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers.health_webhook_server import WebhookServer

from trainer import exitcodes
from trainer.node.health import (
    CircuitBreaker,
    GpuFaultError,
    HealthConfig,
    fault_line,
    is_cuda_error,
    start_monitor,
)
from trainer.node.health.readings import FaultFileError, FileFaultSource, GpuReading


def fault_file(tmp_path, *lines: dict) -> str:
    path = tmp_path / "faults.jsonl"
    path.write_text("# injected readings\n" + "".join(json.dumps(line) + "\n" for line in lines))
    return f"file:{path}"


def test_without_a_gpu_the_monitor_is_off_says_why_once_and_costs_nothing():
    said: list[str] = []
    threads_before = threading.active_count()
    # cuda_device=0 asks NVML for a GPU; this machine has no NVIDIA driver.
    monitor = start_monitor(HealthConfig(), rank=0, local_rank=0, cuda_device=0, host="h", say=said.append)
    assert said == [
        "GPU health monitor off: NVML unavailable (NVML Shared Library Not Found): "
        "no NVIDIA driver on this node"
    ]
    cpu_monitor = start_monitor(HealthConfig(), rank=0, local_rank=0, cuda_device=None, say=said.append)
    assert said[1] == "GPU health monitor off: this rank trains on the CPU (no NVIDIA GPU to watch)"
    assert not monitor.active and not cpu_monitor.active
    assert threading.active_count() == threads_before, "no thread without a GPU"
    assert cpu_monitor.step_hooks(on_gpu=False) == (), "no per-step check (and no collective) on a CPU run"
    # On a GPU run the hook is there even where NVML fails, so every rank joins the same collective.
    assert monitor.step_hooks(on_gpu=True) == (monitor.step_hook,)
    started = time.perf_counter()
    for step in range(100_000):
        monitor.check(step)  # a no-op: never raises
    assert time.perf_counter() - started < 0.5


def test_injected_ecc_fault_trips_at_its_step_sends_the_webhook_and_exits_75(tmp_path):
    source = fault_file(tmp_path, {"step": 5, "gpu": 0, "metrics": {"ecc_uncorrectable": 3}})
    with WebhookServer() as server:
        config = HealthConfig(fault_source=source, poll_interval_s=0.02, webhook_url=server.url())
        monitor = start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="nodeA")
        assert monitor.active
        stopped_at = None
        for step in range(1, 200):
            try:
                monitor.check(step)
            except GpuFaultError as fault:
                stopped_at = step
                err = io.StringIO()
                code = monitor.finish(fault.fault, stream=err)
                break
            time.sleep(0.01)
        [request] = server.wait_for(1, 5)
    assert stopped_at is not None and 5 < stopped_at < 30
    assert code == exitcodes.GPU_FAULT == 75
    assert (
        err.getvalue()
        == "GPU_FAULT host=nodeA rank=0 gpu=0 uuid=GPU-test-nodeA-0 metric=ecc_uncorrectable value=3\n"
    )
    payload = request["json"]
    assert payload["event"] == "gpu.fault" and payload["metric"] == "ecc_uncorrectable"
    assert payload["value"] == 3 and payload["threshold"] == 0 and payload["step"] >= 5
    assert payload["metrics"]["temperature_c"] == 40


def test_a_fault_the_loop_sees_first_is_still_sent_before_the_exit(tmp_path):
    """The loop can see the open circuit before the monitor thread has queued the event (a loaded
    node: the thread descheduled between the breaker's trip and its send). finish() sends it then,
    once, and waits for it; before, the sender was idle and the process exited without sending."""
    healthy = fault_file(tmp_path)  # the monitor thread runs and never trips on its own
    with WebhookServer() as server:
        config = HealthConfig(fault_source=healthy, poll_interval_s=0.05, webhook_url=server.url())
        monitor = start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="nodeC")
        breaker = CircuitBreaker(config, host="nodeC", rank=0, local_rank=0)
        fault = breaker.evaluate(reading(ecc_uncorrectable=3), step=4)
        err = io.StringIO()
        assert monitor.finish(fault, stream=err) == 75
        delivered = list(server.requests)  # finish() waited for the delivery
        assert monitor.finish(fault, stream=err) == 75  # twice: still one event, one line
        time.sleep(0.2)  # a second event, if one were sent, would have arrived by now
        requests = list(server.requests)
    assert len(delivered) == 1 and requests == delivered, requests
    assert requests[0]["json"]["metric"] == "ecc_uncorrectable" and requests[0]["json"]["step"] == 4
    assert err.getvalue().count("GPU_FAULT") == 1


def test_faults_for_another_gpu_host_or_rank_do_not_trip(tmp_path):
    source = fault_file(
        tmp_path,
        {"step": 0, "gpu": 1, "metrics": {"ecc_uncorrectable": 3}},
        {"step": 0, "gpu": 0, "host": "other", "metrics": {"ecc_uncorrectable": 3}},
        {"step": 0, "gpu": 0, "rank": 4, "metrics": {"ecc_uncorrectable": 3}},
    )
    config = HealthConfig(fault_source=source, poll_interval_s=0.01)
    monitor = start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="nodeA")
    time.sleep(0.2)
    monitor.check(10)
    assert monitor.fault is None
    monitor.stop()


def test_malformed_fault_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "faults.jsonl"
    path.write_text('{"step": 1, "gpu": 0, "metrics": {}}\n{"gpu": 0}\n')
    with pytest.raises(FaultFileError, match=r"faults.jsonl:2: .*integer \"step\""):
        FileFaultSource(str(path), gpu_index=0, host="h", rank=0, current_step=lambda: 0)


def reading(**metrics) -> GpuReading:
    base = {
        "ecc_uncorrectable": 0,
        "temperature_c": 50,
        "temperature_slowdown_c": 87,
        "temperature_shutdown_c": 92,
    }
    return GpuReading(0, "GPU-x", "test", {**base, **metrics})


def test_temperature_trips_at_the_margin_below_the_gpus_own_threshold():
    breaker = CircuitBreaker(HealthConfig(temperature_margin_c=5), host="h", rank=0, local_rank=0)
    assert breaker.evaluate(reading(temperature_c=86), step=1) is None
    fault = breaker.evaluate(reading(temperature_c=87), step=2)
    assert (fault.metric, fault.value, fault.threshold) == ("temperature_c", 87, 87)
    slowdown = CircuitBreaker(
        HealthConfig(temperature_limit="slowdown", temperature_margin_c=0), host="h", rank=0, local_rank=0
    )
    assert slowdown.evaluate(reading(temperature_c=86), step=1) is None
    assert slowdown.evaluate(reading(temperature_c=87), step=1).threshold == 87


def test_throttle_must_persist_for_the_configured_readings_and_the_circuit_stays_open():
    breaker = CircuitBreaker(HealthConfig(throttle_polls=3), host="h", rank=0, local_rank=0)
    hot = reading(throttle_reasons=["hw_thermal_slowdown", "sw_power_cap"])
    assert breaker.evaluate(hot, step=1) is None
    assert breaker.evaluate(reading(throttle_reasons=[]), step=2) is None  # the streak resets
    assert breaker.evaluate(hot, step=3) is None and breaker.evaluate(hot, step=4) is None
    fault = breaker.evaluate(hot, step=5)
    assert (fault.metric, fault.value) == ("throttle_reasons", "hw_thermal_slowdown")
    assert breaker.evaluate(reading(), step=6) is fault  # never closes again


def test_cuda_errors_are_faults_but_out_of_memory_is_not():
    assert is_cuda_error(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert is_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_cuda_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"))
    assert not is_cuda_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_cuda_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_cuda_error(ValueError("loss is nan"))


def test_a_cuda_error_from_the_step_sends_the_event_and_makes_one_line(tmp_path):
    source = fault_file(tmp_path)  # a healthy GPU: the breaker is opened by the CUDA error alone
    with WebhookServer() as server:
        config = HealthConfig(fault_source=source, poll_interval_s=0.05, webhook_url=server.url())
        monitor = start_monitor(config, rank=1, local_rank=1, cuda_device=None, host="nodeB")
        error = monitor.cuda_error(RuntimeError("CUDA error: unspecified launch failure\nmore text"), step=7)
        err = io.StringIO()
        assert monitor.finish(error.fault, stream=err) == 75
        assert monitor.finish(error.fault, stream=err) == 75  # reporting twice still prints one line
        [request] = server.wait_for(1, 5)
    assert err.getvalue() == (
        "GPU_FAULT host=nodeB rank=1 gpu=1 uuid=GPU-test-nodeB-1 metric=cuda_error "
        "value=CUDA_error:_unspecified_launch_failure\n"
    )
    assert request["json"]["value"] == "CUDA error: unspecified launch failure"
    assert fault_line(error.fault).count("\n") == 0


def test_a_loop_stuck_after_a_fault_is_ended_by_the_monitor_with_75(tmp_path):
    # The main thread never calls check() again (stuck, as in a collective on a dead GPU).
    source = fault_file(tmp_path, {"step": 0, "gpu": 0, "metrics": {"ecc_uncorrectable": 1}})
    script = textwrap.dedent(
        f"""
        import time
        from trainer.node.health import HealthConfig, start_monitor
        config = HealthConfig(fault_source={source!r}, poll_interval_s=0.05, fault_exit_grace_s=0.5)
        start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="stuck")
        time.sleep(60)
        """
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 75
    assert time.monotonic() - started < 15
    lines = [line for line in result.stderr.splitlines() if line.startswith("GPU_FAULT ")]
    assert lines == [
        "GPU_FAULT host=stuck rank=0 gpu=0 uuid=GPU-test-stuck-0 metric=ecc_uncorrectable value=1"
    ]


def test_errors_escaping_the_loop_map_to_75_only_when_they_are_gpu_faults(tmp_path, capsys):
    source = fault_file(tmp_path)  # healthy readings
    config = HealthConfig(fault_source=source, poll_interval_s=0.05)
    cuda = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    # On a CPU rank, even a CUDA-looking error is an ordinary failure: no GPU of ours broke.
    cpu_rank = start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="h", say=lambda m: None)
    assert cpu_rank.exit_code_for(cuda, on_gpu=False) is None
    assert cpu_rank.exit_code_for(ValueError("bad batch"), on_gpu=False) is None
    cpu_rank.stop()
    # On a GPU rank the CUDA error opens the circuit: 75 and the one line.
    gpu_rank = start_monitor(config, rank=2, local_rank=0, cuda_device=None, host="h", say=lambda m: None)
    gpu_rank.check(9)
    assert gpu_rank.exit_code_for(cuda, on_gpu=True) == 75
    # Once open, any later error (e.g. the collective failing on the broken GPU) is the same fault.
    assert gpu_rank.exit_code_for(RuntimeError("Connection reset by peer"), on_gpu=True) == 75
    assert gpu_rank.fault.metric == "cuda_error" and gpu_rank.fault.step == 10
    # The one GPU_FAULT line (a log line may come beside it where logging writes to stderr too).
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("GPU_FAULT")]
    assert lines == [
        "GPU_FAULT host=h rank=2 gpu=0 uuid=GPU-test-h-0 metric=cuda_error "
        "value=CUDA_error:_uncorrectable_ECC_error_encountered"
    ]
