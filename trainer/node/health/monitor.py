"""The health monitor: a background thread per rank that reads this rank's GPU and opens the breaker.

The training loop calls `monitor.check(step)` once per step (two attribute reads while healthy) and
hands CUDA errors from the step to `monitor.cuda_error(...)`. On a fault:

1. the circuit opens and the `gpu.fault` webhook is queued (from the monitor thread, so it goes out
   even when the loop is stuck in a collective on the broken GPU);
2. the loop raises `GpuFaultError` at its next check; the trainer calls `monitor.finish(fault)`, which
   prints the one `GPU_FAULT host=... rank=... gpu=... uuid=... metric=... value=...` line to stderr,
   gives the webhook a bounded time, and returns exit code 75 (`exitcodes.GPU_FAULT`);
3. if the loop has not stopped within `health.fault_exit_grace_s`, the monitor thread does step 2
   itself and ends the process with code 75.

Without a GPU (and without a test fault source) nothing runs: no thread, `check` is a no-op.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from trainer import exitcodes
from trainer.node.health.breaker import CircuitBreaker, Fault
from trainer.node.health.config import HealthConfig
from trainer.node.health.readings import FileFaultSource, GpuReading, GpuSource, NvmlSource, SourceUnavailable
from trainer.node.health.webhook import WebhookSender

log = logging.getLogger(__name__)
# Seconds the fault path waits for the webhook beyond its delivery budget (see _report).
FLUSH_SLACK_S = 2.0

# Texts of errors the CUDA runtime, cuBLAS and cuDNN raise through torch. Out-of-memory is left out on
# purpose: it is a configuration problem (batch too large), not a broken GPU.
_CUDA_ERROR_PATTERN = re.compile(
    r"CUDA error|CUDA driver error|CUBLAS_STATUS_|CUDNN_STATUS_|cuDNN error|illegal memory access"
    r"|uncorrectable ECC|unspecified launch failure|device-side assert",
)


class GpuFaultError(RuntimeError):
    """Raised in the training loop once the breaker is open; carries the fault."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(fault_line(fault))
        self.fault = fault


def fault_line(fault: Fault) -> str:
    """The one stderr line the launcher parses to name the failing host and GPU."""
    value = re.sub(r"\s+", "_", str(fault.value).strip())[:120] or "-"
    return (
        f"GPU_FAULT host={fault.host} rank={fault.rank} gpu={fault.gpu} uuid={fault.uuid} "
        f"metric={fault.metric} value={value}"
    )


def is_cuda_error(error: BaseException) -> bool:
    """True for an error raised by the CUDA runtime or its libraries (not for out-of-memory)."""
    name = type(error).__name__
    if name == "OutOfMemoryError" or "out of memory" in str(error):
        return False
    return name == "AcceleratorError" or bool(_CUDA_ERROR_PATTERN.search(str(error)))


class HealthMonitor:
    """Watches one GPU. Build with `start_monitor`; `active` is False when there is nothing to watch."""

    def __init__(
        self,
        config: HealthConfig,
        *,
        host: str,
        rank: int,
        local_rank: int,
        source: GpuSource | None,
        sender: WebhookSender | None,
    ) -> None:
        self.config = config
        self.host, self.rank, self.local_rank = host, rank, local_rank
        self.step = 0
        self._source = source
        self._sender = sender
        self._breaker = CircuitBreaker(config, host=host, rank=rank, local_rank=local_rank)
        self._last_reading: GpuReading | None = None
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._report_lock = threading.Lock()
        self._reported = False
        self._notified = False
        self._read_failed = False
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._source is not None

    @property
    def fault(self) -> Fault | None:
        return self._breaker.fault

    def start(self) -> HealthMonitor:
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
            self._thread.start()
        return self

    def check(self, step: int) -> None:
        """Per training step: note the step; raise GpuFaultError if the circuit is open."""
        self.step = step
        fault = self._breaker.fault
        if fault is not None:
            raise GpuFaultError(fault)

    def step_hook(self, result: Any) -> int | None:
        """A `trainer.node.loop.StepHook`: after each optimizer step, stop with 75 if the circuit is open."""
        try:
            self.check(result.step)
        except GpuFaultError as error:
            return self.finish(error.fault)
        return None

    def step_hooks(self, *, on_gpu: bool) -> tuple[Callable[[Any], int | None], ...]:
        """The per-step check for the loop, on every rank or on none: the loop all-reduces the hooks'
        results, so having the hook must depend only on the config and the device type (the same on
        all ranks), never on whether NVML happens to work on this node."""
        wanted = self.config.enabled and (on_gpu or self.config.fault_source != "nvml")
        return (self.step_hook,) if wanted else ()

    def exit_code_for(self, error: BaseException, *, on_gpu: bool) -> int | None:
        """For an exception that escaped the training loop: 75 if it is (or follows) a GPU fault on this
        rank (a GpuFaultError, a CUDA error on a GPU rank, or any error once the circuit is open, such
        as a collective failing on the broken GPU), after reporting it; None for any other error."""
        if isinstance(error, GpuFaultError):
            return self.finish(error.fault)
        if on_gpu and self.fault is None and is_cuda_error(error):
            return self.finish(self.cuda_error(error, step=self.step + 1).fault)
        if self.fault is not None:
            return self.finish(self.fault)
        return None

    def cuda_error(self, error: BaseException, *, step: int) -> GpuFaultError:
        """Turn a CUDA error from the training step into a fault (opens the circuit, sends the event)."""
        fault = self._breaker.trip(self._breaker.error_fault(self._last_reading, error, step=step))
        self._notify(fault)
        return GpuFaultError(fault)

    def finish(self, fault: Fault, *, stream: TextIO | None = None) -> int:
        """Report the fault (one stderr line), give the webhook its bounded time, return exit code 75."""
        self._finished.set()
        self._report(fault, stream or sys.stderr)
        self.stop()
        return exitcodes.GPU_FAULT

    def stop(self) -> None:
        """The trainer is leaving: end the thread (and its stuck-loop watchdog)."""
        self._stop.set()
        self._finished.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._source is not None:
            self._source.close()
            self._source = None

    # ---------------------------------------------------------------------------------- monitor thread

    def _run(self) -> None:
        # The first reading is taken at once: a GPU that is already faulty never starts training.
        while not self._stop.is_set():
            fault = self._poll()
            if fault is not None:
                self._notify(fault)
                self._wait_for_loop_then_exit(fault)
                return
            self._stop.wait(self.config.poll_interval_s)

    def _poll(self) -> Fault | None:
        source = self._source
        if source is None:
            return None
        try:
            reading = source.read()
        except Exception as exc:
            if type(exc).__name__ == "NVMLError_GPUIsLost":  # the board fell off the bus
                fault = self._breaker.error_fault(self._last_reading, exc, step=self.step, metric="gpu_lost")
                return self._breaker.trip(fault)
            if not self._read_failed:  # once: a GPU that cannot be read every 5 s must not flood the log
                log.warning("GPU health reading failed (will keep trying): %s", exc)
                self._read_failed = True
            return None
        self._last_reading = reading
        return self._breaker.evaluate(reading, step=self.step)

    def _notify(self, fault: Fault) -> None:
        # Under the lock until the event is queued (send never blocks): a caller that finds it already
        # notified knows the event is in the sender's queue, so _report's flush waits for it.
        with self._report_lock:
            if self._notified:
                return
            self._notified = True
            # Not the GPU_FAULT line itself: that one is printed exactly once, by _report.
            log.error(
                "GPU %s on %s (rank %s) faulted: %s=%s, threshold %s; sending the gpu.fault event",
                fault.gpu,
                fault.host,
                fault.rank,
                fault.metric,
                fault.value,
                fault.threshold,
            )
            if self._sender is not None:
                self._sender.send_fault(fault)

    def _wait_for_loop_then_exit(self, fault: Fault) -> None:
        if self._finished.wait(self.config.fault_exit_grace_s):
            return
        log.error(
            "training loop did not stop within %.0f s of the GPU fault; exiting",
            self.config.fault_exit_grace_s,
        )
        self._report(fault, sys.stderr)
        os._exit(exitcodes.GPU_FAULT)

    def _report(self, fault: Fault, stream: TextIO) -> None:
        # The loop sees the open circuit as soon as the monitor thread's breaker trips, which may be
        # before that thread has queued the event: queue it here if not yet, or the flush below finds
        # the sender idle and the process exits without sending it.
        self._notify(fault)
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        print(fault_line(fault), file=stream, flush=True)
        if self._sender is not None:
            # The budget bounds the attempts themselves; the slack lets the sender thread, which may
            # wait for a core on a loaded node, finish its last attempt and say why it gave up.
            budget = self.config.delivery_budget_s() + FLUSH_SLACK_S
            if not self._sender.flush(budget):
                log.warning("gpu.fault webhook still undelivered after %.1f s; exiting anyway", budget)


def start_monitor(
    config: HealthConfig,
    *,
    rank: int,
    local_rank: int,
    cuda_device: int | None,
    host: str | None = None,
    say: Callable[[str], None] | None = None,
) -> HealthMonitor:
    """Build and start the monitor for this rank. `cuda_device` is the CUDA index it trains on, or None
    on a CPU rank. `say` (e.g. rank 0's printer) gets one line telling whether the monitor is on."""
    say = say or log.info
    host = host or socket.gethostname()
    monitor = HealthMonitor(config, host=host, rank=rank, local_rank=local_rank, source=None, sender=None)
    source, why_off = _open_source(config, monitor, cuda_device=cuda_device)
    if source is None:
        say(f"GPU health monitor off: {why_off}")
        return monitor
    sender = None
    if url := config.webhook_target():
        sender = WebhookSender(
            url,
            kind=config.webhook_type,
            timeout_s=config.webhook_timeout_s,
            retries=config.webhook_retries,
        )
    monitor._source, monitor._sender = source, sender
    say(
        f"GPU health monitor on: {config.fault_source.split(':', 1)[0]} source, GPU {source.index} "
        f"({source.name}), reading every {config.poll_interval_s:g}s, "
        f"webhook {config.webhook_type if sender else 'none'}"
    )
    return monitor.start()


def _open_source(config: HealthConfig, monitor: HealthMonitor, *, cuda_device: int | None) -> tuple[Any, str]:
    if not config.enabled:
        return None, "health.enabled is false"
    if config.fault_source.startswith("file:"):
        # The test hook runs on CPU ranks too: each rank pretends to own GPU index LOCAL_RANK.
        gpu_index = monitor.local_rank if cuda_device is None else cuda_device
        source = FileFaultSource(
            config.fault_source[len("file:") :],
            gpu_index=gpu_index,
            host=monitor.host,
            rank=monitor.rank,
            current_step=lambda: monitor.step,
        )
        return source, ""
    if cuda_device is None:
        return None, "this rank trains on the CPU (no NVIDIA GPU to watch)"
    try:
        return NvmlSource(cuda_device), ""
    except SourceUnavailable as exc:
        return None, str(exc)
