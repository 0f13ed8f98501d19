"""Fault webhooks: `gpu.fault` events as raw JSON or as a Discord message, sent from a background thread.

Delivery never blocks the caller: `send` only queues. Each attempt has a timeout; failed attempts
(connection refused, timeout, HTTP 429/5xx) are retried with a capped exponential backoff. The URL
carries the webhook's token, so it is never logged, printed or put in an exception message: a failed
attempt is reported by the error's type only (an exception's text can quote the URL, e.g.
http.client.InvalidURL), and no exception ever leaves the sender's thread.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from trainer import exitcodes
from trainer.node.health.breaker import Fault
from trainer.node.health.config import backoff_s
from trainer.redaction import REDACTED

log = logging.getLogger(__name__)

EVENT_GPU_FAULT = "gpu.fault"
_DISCORD_RED = 0xE74C3C


def iso_utc(timestamp: float) -> str:
    return (
        datetime.fromtimestamp(timestamp, tz=timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def raw_payload(fault: Fault) -> dict[str, Any]:
    """The `raw` format: one flat JSON object an orchestrator can act on (e.g. drain `host`)."""
    return {
        "event": EVENT_GPU_FAULT,
        "host": fault.host,
        "rank": fault.rank,
        "local_rank": fault.local_rank,
        "gpu": fault.gpu,
        "uuid": fault.uuid,
        "gpu_name": fault.gpu_name,
        "metric": fault.metric,
        "value": fault.value,
        "threshold": fault.threshold,
        "metrics": fault.metrics,
        "step": fault.step,
        "exit_code": exitcodes.GPU_FAULT,
        "timestamp": iso_utc(fault.timestamp),
    }


def discord_payload(fault: Fault) -> dict[str, Any]:
    """The `discord` format: a message with one embed (Discord's webhook execute body)."""
    summary = (
        f"**{EVENT_GPU_FAULT}** on `{fault.host}` rank {fault.rank}, GPU {fault.gpu}: "
        f"{fault.metric} = {fault.value} (threshold {fault.threshold}). Training stopped on this rank."
    )
    fields = [
        {"name": "host", "value": str(fault.host), "inline": True},
        {"name": "rank", "value": str(fault.rank), "inline": True},
        {"name": "gpu", "value": str(fault.gpu), "inline": True},
        {"name": "uuid", "value": str(fault.uuid), "inline": False},
        {"name": "metric", "value": str(fault.metric), "inline": True},
        {"name": "value", "value": str(fault.value)[:1024], "inline": True},
        {"name": "threshold", "value": str(fault.threshold)[:1024], "inline": True},
        {"name": "step", "value": str(fault.step), "inline": True},
    ]
    metrics = json.dumps(fault.metrics, sort_keys=True)
    fields.append({"name": "metrics", "value": f"```{metrics[:1000]}```", "inline": False})
    embed = {
        "title": f"GPU fault: {fault.host} GPU {fault.gpu}",
        "description": f"{fault.gpu_name} ({fault.uuid})",
        "color": _DISCORD_RED,
        "fields": fields,
        "timestamp": iso_utc(fault.timestamp),
    }
    return {"content": summary[:2000], "embeds": [embed]}


PAYLOAD_FORMATS = {"raw": raw_payload, "discord": discord_payload}


class WebhookSender:
    """Posts JSON payloads to one URL from a daemon thread; `send` returns at once."""

    def __init__(self, url: str, *, kind: str, timeout_s: float, retries: int) -> None:
        if kind not in PAYLOAD_FORMATS:
            raise ValueError(f"unknown webhook type {kind!r}")
        self.__url = url
        self.kind = kind
        self.timeout_s = timeout_s
        self.retries = retries
        self.delivered = 0
        self.failed = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"WebhookSender(url={REDACTED!r}, kind={self.kind!r}, "
            f"timeout_s={self.timeout_s}, retries={self.retries})"
        )

    def send_fault(self, fault: Fault) -> None:
        self.send(PAYLOAD_FORMATS[self.kind](fault))

    def send(self, payload: dict[str, Any]) -> None:
        """Queue one payload for delivery; never blocks, never raises."""
        with self._lock:
            self._idle.clear()
            self._queue.put(payload)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="health-webhook", daemon=True)
                self._thread.start()

    def flush(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for queued payloads to be delivered or given up; True if done."""
        return self._idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            try:
                self._deliver(payload)
            except Exception as exc:  # the thread must outlive any payload; the text may hold the URL
                self.failed += 1
                log.warning("%s webhook not delivered: %s", EVENT_GPU_FAULT, type(exc).__name__)
            with self._lock:
                if self._queue.empty():
                    self._idle.set()

    def _deliver(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        event = payload.get("event", EVENT_GPU_FAULT) if self.kind == "raw" else EVENT_GPU_FAULT
        attempts = self.retries + 1
        for attempt in range(attempts):
            outcome, retry = self._attempt(body)
            outcome = outcome and self._scrub(outcome)
            if outcome is None:
                self.delivered += 1
                log.info("%s webhook delivered (%s, attempt %d/%d)", event, self.kind, attempt + 1, attempts)
                return
            if not retry or attempt + 1 == attempts:
                self.failed += 1
                log.warning("%s webhook not delivered after %d attempt(s): %s", event, attempt + 1, outcome)
                return
            time.sleep(backoff_s(attempt))

    def _attempt(self, body: bytes) -> tuple[str | None, bool]:
        """One POST. Returns (None, _) on success, else (reason without the URL, worth retrying)."""
        try:
            request = urllib.request.Request(
                self.__url,
                data=body,
                method="POST",
                headers={"Content-Type": "application/json", "User-Agent": "clustertrain-health"},
            )
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read(65536)
                return None, False
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}", exc.code == 429 or exc.code >= 500
        except urllib.error.URLError as exc:
            return f"URLError ({_reason(exc.reason)})", True
        except (TimeoutError, OSError) as exc:
            return _reason(exc), True
        except Exception as exc:  # e.g. http.client.InvalidURL: retrying cannot help
            return _reason(exc), False

    def _scrub(self, text: str) -> str:
        return text.replace(self.__url, REDACTED)


def _reason(reason: Any) -> str:
    """The error's type only: some exception texts quote the URL (http.client.InvalidURL does)."""
    if isinstance(reason, BaseException):
        return type(reason).__name__
    return "no reason given" if not isinstance(reason, str) else "URL error"
