"""Secrets in configs and command lines: which keys are secret and how they are shown.

Shared by both sides: the node's config writer redacts run.json, the controller's plan and launch
redact what they print. Standard library only.
"""

from __future__ import annotations

REDACTED = "<redacted>"

#: Trainer config keys whose values are secrets (never printed, logged or written to run.json).
SECRET_KEYS = ("health.webhook_url",)


def redact_override(item: str) -> str:
    """`--set KEY=VALUE` as it may be shown or logged: the value of a secret key is replaced."""
    key, sep, _ = item.partition("=")
    return f"{key}={REDACTED}" if sep and key.strip() in SECRET_KEYS else item
