"""The `health` section of the trainer config: GPU monitor thresholds and the fault webhook.

Everything is checked here, at config load, so a malformed webhook is refused before training starts
(a fault hours later must not be the moment the user learns the URL was mistyped).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

WEBHOOK_TYPES = ("raw", "discord")
TEMPERATURE_LIMITS = ("shutdown", "slowdown")
#: NVML clock-event reasons the breaker can treat as faults (names used in config and payloads).
THROTTLE_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
    "sw_power_cap",
)
#: Overrides `health.fault_source` (test hook for runs started by a launcher that only forwards env vars).
FAULT_SOURCE_ENV = "CLUSTERTRAIN_HEALTH_FAULT_SOURCE"
REDACTED = "<redacted>"


class HealthConfigError(ValueError):
    """A `health.*` key is invalid; `key` names it (e.g. `health.webhook_url`)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """GPU health circuit breaker settings (`health.*` in the trainer config)."""

    #: Run the monitor at all. It is off by itself (no thread) on a node without an NVIDIA GPU.
    enabled: bool = True
    #: Where `gpu.fault` events go; '' = no webhook. A secret: never logged, redacted in run.json.
    webhook_url: str = field(default="", repr=False)
    #: `raw` (JSON for an orchestrator) or `discord` (a Discord webhook message).
    webhook_type: str = "raw"
    #: Seconds one delivery attempt may take (connect + response).
    webhook_timeout_s: float = 5.0
    #: Extra attempts after a failed one (connection error, timeout, HTTP 429 or 5xx).
    webhook_retries: int = 3
    #: Seconds between two readings of the GPU (NVML calls take about a millisecond).
    poll_interval_s: float = 5.0
    #: Uncorrectable ECC errors (volatile count, since the driver loaded) tolerated before a fault.
    ecc_uncorrectable_max: int = 0
    #: Which of the GPU's own temperature thresholds the margin is measured against.
    temperature_limit: str = "shutdown"
    #: Fault when the temperature reaches (GPU's own `temperature_limit` threshold - this margin), in °C.
    temperature_margin_c: float = 5.0
    #: Clock-event reasons that count as a fault when seen in `throttle_polls` consecutive readings.
    throttle_reasons: tuple[str, ...] = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
    #: Consecutive readings a throttle reason must persist (hardware slowdown can blink at power steps).
    throttle_polls: int = 3
    #: After a fault, seconds the training loop has to stop by itself before the monitor ends the
    #: process (a broken GPU can leave the loop stuck inside a collective).
    fault_exit_grace_s: float = 120.0
    #: `nvml` (production), or `file:/path/faults.jsonl`: the documented test hook that feeds recorded
    #: GPU readings into the same monitor -> breaker -> webhook -> exit path (see readings.py).
    fault_source: str = "nvml"

    def __post_init__(self) -> None:
        self.throttle_reasons = tuple(self.throttle_reasons)
        _check_bool("enabled", self.enabled)
        _check_url(self.webhook_url)
        if self.webhook_type not in WEBHOOK_TYPES:
            raise HealthConfigError(
                "health.webhook_type",
                f"unknown type {self.webhook_type!r}; use one of {', '.join(WEBHOOK_TYPES)}",
            )
        _check_number("webhook_timeout_s", self.webhook_timeout_s, minimum=0, inclusive=False)
        _check_int("webhook_retries", self.webhook_retries, minimum=0)
        _check_number("poll_interval_s", self.poll_interval_s, minimum=0, inclusive=False)
        _check_int("ecc_uncorrectable_max", self.ecc_uncorrectable_max, minimum=0)
        if self.temperature_limit not in TEMPERATURE_LIMITS:
            raise HealthConfigError(
                "health.temperature_limit",
                f"unknown limit {self.temperature_limit!r}; use one of {', '.join(TEMPERATURE_LIMITS)}",
            )
        _check_number("temperature_margin_c", self.temperature_margin_c, minimum=0)
        unknown = [r for r in self.throttle_reasons if r not in THROTTLE_REASONS]
        if unknown:
            raise HealthConfigError(
                "health.throttle_reasons",
                f"unknown reason(s) {', '.join(map(repr, unknown))}; known: {', '.join(THROTTLE_REASONS)}",
            )
        _check_int("throttle_polls", self.throttle_polls, minimum=1)
        _check_number("fault_exit_grace_s", self.fault_exit_grace_s, minimum=0, inclusive=False)
        _check_fault_source(self.fault_source)

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.webhook_url:
            shown["webhook_url"] = REDACTED
        return "HealthConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, *, environ: Mapping[str, str] = os.environ):
        """Build from the YAML `health:` mapping; unknown keys are refused with the list of known ones."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise HealthConfigError(
                    f"health.{key}", f"unknown key; known keys: {', '.join(sorted(known))}"
                )
        if values.get("webhook_url") is None:
            values.pop("webhook_url", None)
        if isinstance(values.get("throttle_reasons"), str):
            values["throttle_reasons"] = [r for r in values["throttle_reasons"].split(",") if r.strip()]
        if environ.get(FAULT_SOURCE_ENV):
            values["fault_source"] = environ[FAULT_SOURCE_ENV]
        return cls(**values)

    def to_public_dict(self) -> dict[str, Any]:
        """The settings as plain data for run.json and logs, with the webhook URL redacted."""
        data = dataclasses.asdict(self)
        data["throttle_reasons"] = list(self.throttle_reasons)
        if self.webhook_url:
            data["webhook_url"] = REDACTED
        return data

    def delivery_budget_s(self) -> float:
        """Upper bound of the time one event's delivery can take (every attempt times out)."""
        from trainer.health.webhook import backoff_total_s

        return (self.webhook_retries + 1) * self.webhook_timeout_s + backoff_total_s(self.webhook_retries)


def _check_url(url: Any) -> None:
    key = "health.webhook_url"
    if not isinstance(url, str):
        raise HealthConfigError(key, "must be a string (an http:// or https:// URL, or '' for no webhook)")
    if not url:
        return
    # Never echo the URL itself in an error: it carries the webhook's token.
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise HealthConfigError(key, "is not a valid URL (the value is not shown: it is a secret)") from None
    if parts.scheme not in ("http", "https"):
        scheme = parts.scheme or "none"
        raise HealthConfigError(key, f"scheme {scheme!r} is not supported; use an http:// or https:// URL")
    if not parts.hostname:
        raise HealthConfigError(key, "has no host; use a full URL such as https://HOST/PATH")
    if any(ch.isspace() for ch in url):
        raise HealthConfigError(key, "contains whitespace (the value is not shown: it is a secret)")


def _check_fault_source(source: Any) -> None:
    key = "health.fault_source"
    if source == "nvml":
        return
    if isinstance(source, str) and source.startswith("file:"):
        path = source[len("file:") :]
        if not path:
            raise HealthConfigError(key, "file: needs a path, e.g. file:/tmp/faults.jsonl")
        if not os.path.isfile(path):
            raise HealthConfigError(key, f"fault file {path} does not exist")
        return
    raise HealthConfigError(key, f"unknown source {source!r}; use 'nvml' or 'file:/path/faults.jsonl'")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise HealthConfigError(f"health.{name}", f"must be true or false, got {value!r}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HealthConfigError(f"health.{name}", f"must be an integer, got {value!r}")
    if value < minimum:
        raise HealthConfigError(f"health.{name}", f"must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any, *, minimum: float, inclusive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HealthConfigError(f"health.{name}", f"must be a number, got {value!r}")
    if value < minimum or (not inclusive and value == minimum):
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise HealthConfigError(f"health.{name}", f"must be {bound}, got {value}")
