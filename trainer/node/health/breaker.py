"""The circuit breaker: decides from a reading whether a GPU is faulty, and stays open once it is.

Closed = training may go on. Open = a fault was seen on this rank's GPU; it never closes again in
this process (a GPU that threw an uncorrectable ECC error is not trusted again until someone looks).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trainer.node.health.config import HealthConfig
from trainer.node.health.readings import GpuReading


@dataclass(frozen=True, slots=True)
class Fault:
    """Why the circuit opened: the metric that tripped, its value and threshold, and all metrics."""

    host: str
    rank: int
    local_rank: int
    gpu: int
    uuid: str
    gpu_name: str
    metric: str
    value: Any
    threshold: Any
    metrics: dict[str, Any]
    step: int
    timestamp: float = field(default_factory=time.time)


class CircuitBreaker:
    """Evaluates readings against the configured thresholds; the first fault opens it for good."""

    def __init__(self, config: HealthConfig, *, host: str, rank: int, local_rank: int) -> None:
        self._config = config
        self._host, self._rank, self._local_rank = host, rank, local_rank
        self._throttle_streak: dict[str, int] = {}
        self._lock = threading.Lock()
        self.fault: Fault | None = None

    @property
    def is_open(self) -> bool:
        return self.fault is not None

    def evaluate(self, reading: GpuReading, *, step: int) -> Fault | None:
        """Check one reading; returns the fault that opened the circuit (now or earlier), if any."""
        tripped = self._first_violation(reading.metrics)
        if tripped is None:
            return self.fault
        metric, value, threshold = tripped
        return self.trip(self._fault(reading, metric, value, threshold, step))

    def trip(self, fault: Fault) -> Fault:
        """Open the circuit with `fault` unless it is already open; returns the fault that opened it."""
        with self._lock:
            if self.fault is None:
                self.fault = fault
            return self.fault

    def error_fault(
        self, reading: GpuReading | None, error: BaseException, *, step: int, metric: str = "cuda_error"
    ) -> Fault:
        """A fault from an error (a CUDA error in the step, NVML losing the GPU); value = its first line."""
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        reading = reading or GpuReading(index=self._local_rank, uuid="unknown", name="unknown")
        return self._fault(reading, metric, message, "no error", step)

    def _fault(self, reading: GpuReading, metric: str, value: Any, threshold: Any, step: int) -> Fault:
        return Fault(
            host=self._host,
            rank=self._rank,
            local_rank=self._local_rank,
            gpu=reading.index,
            uuid=reading.uuid,
            gpu_name=reading.name,
            metric=metric,
            value=value,
            threshold=threshold,
            metrics=dict(reading.metrics),
            step=step,
        )

    def _first_violation(self, metrics: dict[str, Any]) -> tuple[str, Any, Any] | None:
        config = self._config
        ecc = metrics.get("ecc_uncorrectable")
        if ecc is not None and ecc > config.ecc_uncorrectable_max:
            return "ecc_uncorrectable", ecc, config.ecc_uncorrectable_max
        temperature = metrics.get("temperature_c")
        limit = metrics.get(f"temperature_{config.temperature_limit}_c")
        if temperature is not None and limit is not None:
            trip_at = limit - config.temperature_margin_c
            if temperature >= trip_at:
                return "temperature_c", temperature, trip_at
        active = set(metrics.get("throttle_reasons") or ()) & config.throttle_reason_set
        self._throttle_streak = {r: self._throttle_streak.get(r, 0) + 1 for r in active}
        for reason in sorted(active):
            if self._throttle_streak[reason] >= config.throttle_polls:
                return "throttle_reasons", reason, f"{config.throttle_polls} consecutive readings"
        return None
