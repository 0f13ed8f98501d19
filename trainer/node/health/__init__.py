"""GPU health circuit breaker: watch this rank's GPU, send a `gpu.fault` webhook, stop with exit code 75.

See monitor.py for the flow, readings.py for the NVML source and the test fault file, webhook.py for
the payload formats.

The names below are loaded when first used (PEP 562): `trainer.node.config` imports
`trainer.node.health.config` for `HealthConfig`, and the controller imports that config to plan a
launch; loading the monitor and the webhook sender with it (urllib.request, http.client, email) cost
`trainer launch` about 0.05 s of CPU before its first line, beside ansible-playbook's start on the same
cores, for code that only runs in a training rank.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each exported name and the submodule that defines it.
_EXPORTS = {
    "CircuitBreaker": "breaker",
    "Fault": "breaker",
    "HealthConfig": "config",
    "GpuFaultError": "monitor",
    "HealthMonitor": "monitor",
    "fault_line": "monitor",
    "is_cuda_error": "monitor",
    "start_monitor": "monitor",
    "WebhookSender": "webhook",
    "discord_payload": "webhook",
    "raw_payload": "webhook",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
