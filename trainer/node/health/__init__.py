"""GPU health circuit breaker: watch this rank's GPU, send a `gpu.fault` webhook, stop with exit code 75.

See monitor.py for the flow, readings.py for the NVML source and the test fault file, webhook.py for
the payload formats.
"""

from trainer.node.health.breaker import CircuitBreaker, Fault
from trainer.node.health.config import HealthConfig
from trainer.node.health.monitor import GpuFaultError, HealthMonitor, fault_line, is_cuda_error, start_monitor
from trainer.node.health.webhook import WebhookSender, discord_payload, raw_payload

__all__ = [
    "CircuitBreaker",
    "Fault",
    "GpuFaultError",
    "HealthConfig",
    "HealthMonitor",
    "WebhookSender",
    "discord_payload",
    "fault_line",
    "is_cuda_error",
    "raw_payload",
    "start_monitor",
]
