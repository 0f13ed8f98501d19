"""The `health` section of the trainer config: GPU monitor thresholds and the fault webhook.

Everything is checked here, at config load, so a malformed webhook is refused before training starts
(a fault hours later must not be the moment the user learns the URL was mistyped).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from trainer.configerror import ConfigError
from trainer.redaction import REDACTED

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
#: Webhook retry pauses: the first, doubled after each attempt up to the cap. The config owns them
#: because `delivery_budget_s` (checked at load) and the sender both follow the same schedule.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 4.0


def backoff_s(attempt: int) -> float:
    """Pause before retry number `attempt` (0-based)."""
    return min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S)


def backoff_total_s(retries: int) -> float:
    return sum(backoff_s(n) for n in range(retries))


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """GPU health circuit breaker settings (`health.*` in the trainer config)."""

    enabled: bool = True
    """Run the monitor at all. It is off by itself (no thread) on a node without an NVIDIA GPU."""
    webhook_url: str = field(default="", repr=False)
    """Where `gpu.fault` events go; '' = no webhook. A secret: never logged, redacted in run.json; but
    a `--set` value shows in `ps` for the whole run, so prefer webhook_url_file or webhook_url_env."""
    webhook_url_file: str = ""
    """A file on each node holding the webhook URL (one line; e.g. 0600 in the training user's home):
    the way to pass the secret. Read by `trainer train` on the node; '' = not used."""
    webhook_url_env: str = ""
    """The name of an environment variable holding the webhook URL (e.g. a secret `--env`); '' = not
    used."""
    webhook_type: str = "raw"
    """`raw` (JSON for an orchestrator) or `discord` (a Discord webhook message)."""
    webhook_timeout_s: float = 5.0
    """Seconds one delivery attempt may take (connect + response)."""
    webhook_retries: int = 3
    """Extra attempts after a failed one (connection error, timeout, HTTP 429 or 5xx)."""
    poll_interval_s: float = 5.0
    """Seconds between two readings of the GPU (NVML calls take about a millisecond)."""
    ecc_uncorrectable_max: int = 0
    """Uncorrectable ECC errors (volatile count, since the driver loaded) tolerated before a fault."""
    temperature_limit: str = "shutdown"
    """Which of the GPU's own temperature thresholds the margin is measured against."""
    temperature_margin_c: float = 5.0
    """Fault when the temperature reaches (GPU's own `temperature_limit` threshold - this margin), in
    °C."""
    throttle_reasons: str = "hw_slowdown,hw_thermal_slowdown,hw_power_brake_slowdown"
    """Comma-separated clock-event reasons that are a fault when seen in `throttle_polls` consecutive
    readings ('' = ignore throttling)."""
    throttle_polls: int = 3
    """Consecutive readings a throttle reason must persist (hardware slowdown can blink at power
    steps)."""
    fault_exit_grace_s: float = 120.0
    """After a fault, seconds the training loop has to stop by itself before the monitor ends the
    process (a broken GPU can leave the loop stuck inside a collective)."""
    fault_source: str = "nvml"
    """`nvml` (production), or `file:/path/faults.jsonl`: the documented test hook that feeds
    recorded GPU readings into the same monitor -> breaker -> webhook -> exit path (see
    readings.py)."""

    def __post_init__(self) -> None:
        _check_bool("enabled", self.enabled)
        _check_url(self.webhook_url)
        _check_url_source(self.webhook_url, self.webhook_url_file, self.webhook_url_env)
        if self.webhook_type not in WEBHOOK_TYPES:
            raise ConfigError(
                "webhook_type",
                f"unknown type {self.webhook_type!r}; use one of {', '.join(WEBHOOK_TYPES)}",
            )
        _check_number("webhook_timeout_s", self.webhook_timeout_s, minimum=0, inclusive=False)
        _check_int("webhook_retries", self.webhook_retries, minimum=0)
        _check_number("poll_interval_s", self.poll_interval_s, minimum=0, inclusive=False)
        _check_int("ecc_uncorrectable_max", self.ecc_uncorrectable_max, minimum=0)
        if self.temperature_limit not in TEMPERATURE_LIMITS:
            raise ConfigError(
                "temperature_limit",
                f"unknown limit {self.temperature_limit!r}; use one of {', '.join(TEMPERATURE_LIMITS)}",
            )
        _check_number("temperature_margin_c", self.temperature_margin_c, minimum=0)
        unknown = [r for r in sorted(self.throttle_reason_set) if r not in THROTTLE_REASONS]
        if unknown:
            raise ConfigError(
                "throttle_reasons",
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

    @property
    def throttle_reason_set(self) -> frozenset[str]:
        return frozenset(r.strip() for r in self.throttle_reasons.split(",") if r.strip())

    def to_public_dict(self) -> dict[str, Any]:
        """The settings as plain data for run.json and logs, with the webhook URL redacted."""
        data = dataclasses.asdict(self)
        if self.webhook_url:
            data["webhook_url"] = REDACTED
        return data

    def webhook_target(self) -> str:
        """The webhook URL from webhook_url, webhook_url_file or webhook_url_env ('' = none), checked like
        webhook_url. Called where the trainer runs (the file and the variable are the node's); a
        ConfigError names the key (health.*), never the value."""
        try:
            return self._webhook_target()
        except ConfigError as err:
            raise err.under("health") from None

    def _webhook_target(self) -> str:
        if self.webhook_url_file:
            key = "webhook_url_file"
            try:
                url = open(self.webhook_url_file, encoding="utf-8").read().strip()  # noqa: SIM115
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    key, f"cannot read {self.webhook_url_file} ({type(exc).__name__}); a file with one URL"
                ) from None
        elif self.webhook_url_env:
            key = "webhook_url_env"
            url = os.environ.get(self.webhook_url_env, "").strip()
            if not url:
                raise ConfigError(key, f"the environment variable {self.webhook_url_env} is not set or empty")
        else:
            return self.webhook_url
        if not url:
            raise ConfigError(key, f"{self.webhook_url_file} is empty; put the webhook URL in it")
        _check_url(url, key=key)
        return url

    def delivery_budget_s(self) -> float:
        """Upper bound of the time one event's delivery can take (every attempt times out)."""
        return (self.webhook_retries + 1) * self.webhook_timeout_s + backoff_total_s(self.webhook_retries)


def _check_url_source(url: str, path: Any, variable: Any) -> None:
    given = [name for name, value in (("webhook_url", url), ("webhook_url_file", path),
                                      ("webhook_url_env", variable)) if value]  # fmt: skip
    if len(given) > 1:
        raise ConfigError(given[1], f"set only one of {', '.join(given)} (they all name the webhook URL)")
    if not isinstance(path, str) or (path and not os.path.isabs(path)):
        raise ConfigError("webhook_url_file", "must be an absolute path (the file is read on every node)")
    if not isinstance(variable, str) or (variable and not variable.isidentifier()):
        raise ConfigError(
            "webhook_url_env", "must be an environment variable's name, e.g. TRAINER_WEBHOOK_URL"
        )


def _check_url(url: Any, *, key: str = "webhook_url") -> None:
    if not isinstance(url, str):
        raise ConfigError(key, "must be a string (an http:// or https:// URL, or '' for no webhook)")
    if not url:
        return
    if url == REDACTED:
        raise ConfigError(
            key,
            f"is the placeholder {REDACTED!r} from a copy of the config with the secret removed "
            "(run.json, a printed config); set the real URL",
        )
    # Never echo the URL itself in an error: it carries the webhook's token.
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ConfigError(key, "is not a valid URL (the value is not shown: it is a secret)") from None
    if parts.scheme not in ("http", "https"):
        scheme = parts.scheme or "none"
        raise ConfigError(key, f"scheme {scheme!r} is not supported; use an http:// or https:// URL")
    if not parts.hostname:
        raise ConfigError(key, "has no host; use a full URL such as https://HOST/PATH")
    if any(ch.isspace() for ch in url):
        raise ConfigError(key, "contains whitespace (the value is not shown: it is a secret)")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise ConfigError(key, "contains a control character (the value is not shown: it is a secret)")
    if not url.isascii():
        raise ConfigError(key, "contains non-ASCII characters; percent-encode them (%XX)")
    if "@" in parts.netloc:
        raise ConfigError(
            key,
            "carries a user name or password (user:password@host): they would show in error texts; "
            "use a URL with the token in its path, passed through webhook_url_file or webhook_url_env",
        )


def _check_fault_source(source: Any) -> None:
    key = "fault_source"
    if source == "nvml":
        return
    if isinstance(source, str) and source.startswith("file:"):
        path = source[len("file:") :]
        if not path:
            raise ConfigError(key, "file: needs a path, e.g. file:/tmp/faults.jsonl")
        if not os.path.isfile(path):
            raise ConfigError(key, f"fault file {path} does not exist")
        from trainer.node.health.readings import FaultFileError, load_fault_file

        try:
            load_fault_file(path)
        except (FaultFileError, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(key, str(exc)) from None
        return
    raise ConfigError(key, f"unknown source {source!r}; use 'nvml' or 'file:/path/faults.jsonl'")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be true or false, got {value!r}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any, *, minimum: float, inclusive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if value < minimum or (not inclusive and value == minimum):
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ConfigError(name, f"must be {bound}, got {value}")
