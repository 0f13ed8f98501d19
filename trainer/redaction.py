"""Secrets in configs, command lines and node environments: which are secret and how they are shown.

Shared by both sides: the node's config writer redacts run.json and the trackers' hyperparameters,
the controller's plan and launch redact what they print and keep secret variables out of run.sh.
This module is the one place that decides what is secret:

- a config key in SECRET_KEYS (the webhook URL);
- an environment variable named like a credential (SECRET_ENV_NAME);
- a credential inside a URL, wherever the URL is: the userinfo (`http://user:pass@proxy`,
  `https://TOKEN@host`) and token-like query or fragment parameters (`?access_token=`, `token=`,
  `key=`, `sig=`, `X-Amz-Signature=`, ...). Such a URL in a variable (HTTPS_PROXY,
  MLFLOW_TRACKING_URI) makes the variable secret; in a config value (metrics.tracking_uri) the
  credential is shown as <redacted> and the rest of the URL kept.

Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

REDACTED = "<redacted>"

#: Trainer config keys whose values are secrets (never printed, logged or written to run.json).
SECRET_KEYS = ("health.webhook_url",)

#: Environment variable names that hold credentials by convention (WANDB_API_KEY, HF_TOKEN,
#: AWS_SECRET_ACCESS_KEY, ...): secret unless the inventory marks them `secret: false`.
SECRET_ENV_NAME = re.compile(
    r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|AUTH)(_|$)", re.IGNORECASE
)


#: Query (or fragment) parameters that carry a credential by convention: OAuth's access_token, API
#: keys (key, api_key, apiKey), signed URLs (sig, signature, X-Amz-Signature, X-Goog-Credential,
#: X-Amz-Security-Token), client secrets, passwords. Matched on the parameter's name, any case.
SECRET_QUERY_NAME = re.compile(
    r"(token|key|secret|sig|signature|password|passwd|pwd|auth|authorization|credentials?)$", re.IGNORECASE
)
#: A URL inside a longer value (NO_PROXY-like lists, a command line): scheme://, then no blank or quote.
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def _split(url: str) -> SplitResult | None:
    try:
        return urlsplit(url)
    except ValueError:  # e.g. an unclosed [ in the host: not a URL anything could log in with
        return None


def _secret_params(text: str) -> bool:
    return any(
        SECRET_QUERY_NAME.search(name.strip()) and value
        for name, _, value in (pair.partition("=") for pair in re.split(r"[&;]", text))
    )


def _url_has_credentials(url: str) -> bool:
    parts = _split(url)
    if parts is None:
        return False
    return "@" in parts.netloc or _secret_params(parts.query) or _secret_params(parts.fragment)


def has_url_credentials(value: Any) -> bool:
    """Whether `value` holds a URL with a credential in it: userinfo, or a token-like parameter."""
    return isinstance(value, str) and any(_url_has_credentials(m.group()) for m in URL.finditer(value))


def _redact_params(text: str) -> str:
    pairs = []
    for pair in re.split(r"([&;])", text):
        name, sep, value = pair.partition("=")
        secret = sep and value and SECRET_QUERY_NAME.search(name.strip())
        pairs.append(f"{name}={REDACTED}" if secret else pair)
    return "".join(pairs)


def _redact_url(url: str) -> str:
    parts = _split(url)
    if parts is None or not _url_has_credentials(url):
        return url
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{REDACTED}@{host}" if "@" in parts.netloc else host
    return parts._replace(
        netloc=netloc, query=_redact_params(parts.query), fragment=_redact_params(parts.fragment)
    ).geturl()


def redact_urls(value: Any) -> Any:
    """`value` as it may be shown or logged: in every URL in it, the userinfo and the values of
    token-like parameters replaced by <redacted> (`https://<redacted>@host/p?access_token=<redacted>`);
    the host and path stay readable. Anything but a string is returned as it is."""
    if not isinstance(value, str):
        return value
    return URL.sub(lambda m: _redact_url(m.group()), value)


def redact_tree(data: Any) -> Any:
    """Plain data (a config as dicts and lists) with every string passed through redact_urls."""
    if isinstance(data, Mapping):
        return {key: redact_tree(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return type(data)(redact_tree(value) for value in data)
    return redact_urls(data)


def secret_setting(key: str, value: Any) -> bool:
    """Whether a config value is secret: its key is (SECRET_KEYS, when set) or the value holds a URL
    credential."""
    return (key.strip() in SECRET_KEYS and value not in (None, "")) or has_url_credentials(value)


def redact_override(item: str) -> str:
    """`--set KEY=VALUE` as it may be shown or logged: the value of a secret key is replaced, and a
    credential inside a URL."""
    key, sep, value = item.partition("=")
    if sep and key.strip() in SECRET_KEYS:
        return f"{key}={REDACTED}"
    return f"{key}={redact_urls(value)}" if sep else item


def looks_secret(env_name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return bool(SECRET_ENV_NAME.search(env_name))


def secret_env(name: str, value: str) -> bool:
    """Whether a variable is secret by its name or its value: a credential inside a URL, or a proxy
    variable's `user:pass@host:port` written without a scheme (curl and pip take it so)."""
    if looks_secret(name) or has_url_credentials(value):
        return True
    return name.lower().endswith("_proxy") and "://" not in value and has_url_credentials(f"http://{value}")


def redact_env(env: Mapping[str, str], secret_names: Collection[str]) -> dict[str, str]:
    """`env` as it may be shown or logged: the values of `secret_names` are replaced."""
    return {name: REDACTED if name in secret_names else value for name, value in env.items()}


#: Where a secret config value goes instead of the command line, by key (else SECRET_ELSEWHERE).
SECRET_SET_FIX = {
    "health.webhook_url": (
        "set the inventory's training_health_webhook_url (vaulted), or health.webhook_url in the "
        "--config file, or --set health.webhook_url_env=NAME with --env NAME (NAME exported in this "
        "shell), or --set health.webhook_url_file=PATH (a 0600 file on the nodes)"
    ),
    "metrics.tracking_uri": (
        "give the URI without the credential and the token through MLFLOW_TRACKING_TOKEN (or "
        "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD): export it in this shell and add --env "
        "MLFLOW_TRACKING_TOKEN, or set it in the inventory's training_env (vaulted); or put the URI in "
        "the --config file"
    ),
}
SECRET_ELSEWHERE = (
    "put the value in the --config file or the inventory (vaulted), or pass the credential as an "
    "environment variable with --env NAME (NAME exported in this shell)"
)


def secret_set_problem(item: str) -> str | None:
    """Why a `--set KEY=VALUE` cannot be given (None if it can): a secret on the command line shows
    in `ps` to every account on the machine for the whole run (the controller's launch, a node's
    `trainer train`), and in the shell's history. The value itself is never repeated. Every verb's
    --set is checked with it (trainer.cli) before the verb runs."""
    key, _, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not secret_setting(key, value):
        return None
    what = "a secret" if key in SECRET_KEYS else "a URL with a credential in it"
    return (
        f"--set {key}=...: {what} on the command line shows in `ps` and your shell history; "
        f"fix: {SECRET_SET_FIX.get(key, SECRET_ELSEWHERE)}"
    )
