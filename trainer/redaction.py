"""Secrets in configs, command lines and node environments: which are secret and how they are shown.

Shared by both sides: the node's config writer redacts run.json, the controller's plan and launch
redact what they print. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

REDACTED = "<redacted>"

#: Trainer config keys whose values are secrets (never printed, logged or written to run.json).
SECRET_KEYS = ("health.webhook_url",)

#: Environment variable names that hold credentials by convention (WANDB_API_KEY, HF_TOKEN,
#: AWS_SECRET_ACCESS_KEY, ...): secret unless the inventory marks them `secret: false`.
SECRET_ENV_NAME = re.compile(
    r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|AUTH)(_|$)", re.IGNORECASE
)


def redact_override(item: str) -> str:
    """`--set KEY=VALUE` as it may be shown or logged: the value of a secret key is replaced."""
    key, sep, _ = item.partition("=")
    return f"{key}={REDACTED}" if sep and key.strip() in SECRET_KEYS else item


def looks_secret(env_name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return bool(SECRET_ENV_NAME.search(env_name))


def redact_env(env: Mapping[str, str], secret_names: Collection[str]) -> dict[str, str]:
    """`env` as it may be shown or logged: the values of `secret_names` are replaced."""
    return {name: REDACTED if name in secret_names else value for name, value in env.items()}
