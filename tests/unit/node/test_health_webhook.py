"""Webhook delivery against a real HTTP server on 127.0.0.1: formats, retries, down and slow servers,
and the URL (a secret) never showing up in logs or reprs."""

from __future__ import annotations

import logging
import time

import pytest
from helpers.health_webhook_server import WebhookServer, closed_port_url

from trainer.node.health import Fault, HealthConfig, WebhookSender
from trainer.node.health.config import backoff_total_s

SECRET = "s3cr3t-token-do-not-log"


def make_fault(**overrides) -> Fault:
    values = dict(
        host="node7",
        rank=3,
        local_rank=1,
        gpu=1,
        uuid="GPU-1234",
        gpu_name="NVIDIA H100 80GB HBM3",
        metric="ecc_uncorrectable",
        value=3,
        threshold=0,
        metrics={"ecc_uncorrectable": 3, "temperature_c": 51, "throttle_reasons": []},
        step=42,
        timestamp=1_700_000_000.25,
    )
    values.update(overrides)
    return Fault(**values)


def test_raw_payload_reaches_the_server_with_every_field():
    with WebhookServer() as server:
        sender = WebhookSender(server.url(), kind="raw", timeout_s=2, retries=0)
        sender.send_fault(make_fault())
        assert sender.flush(5)
        [request] = server.wait_for(1, 5)
    assert request["headers"]["Content-Type"] == "application/json"
    assert request["json"] == {
        "event": "gpu.fault",
        "host": "node7",
        "rank": 3,
        "local_rank": 1,
        "gpu": 1,
        "uuid": "GPU-1234",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "metric": "ecc_uncorrectable",
        "value": 3,
        "threshold": 0,
        "metrics": {"ecc_uncorrectable": 3, "temperature_c": 51, "throttle_reasons": []},
        "step": 42,
        "exit_code": 75,
        "timestamp": "2023-11-14T22:13:20.250Z",
    }
    assert sender.delivered == 1


def test_discord_payload_is_a_message_with_an_embed():
    with WebhookServer() as server:
        sender = WebhookSender(server.url(), kind="discord", timeout_s=2, retries=0)
        sender.send_fault(make_fault())
        assert sender.flush(5)
        [request] = server.wait_for(1, 5)
    body = request["json"]
    assert set(body) == {"content", "embeds"}
    assert "gpu.fault" in body["content"] and "node7" in body["content"]
    [embed] = body["embeds"]
    fields = {f["name"]: f["value"] for f in embed["fields"]}
    assert fields["host"] == "node7" and fields["gpu"] == "1" and fields["uuid"] == "GPU-1234"
    assert fields["metric"] == "ecc_uncorrectable" and fields["value"] == "3"
    assert embed["timestamp"] == "2023-11-14T22:13:20.250Z"
    assert len(body["content"]) <= 2000 and len(embed["fields"]) <= 25


def test_server_errors_are_retried_until_delivered():
    # Two HTTP 500s, then success: three attempts, one delivery.
    with WebhookServer(lambda attempt: (500, 0) if attempt < 2 else (204, 0)) as server:
        sender = WebhookSender(server.url(), kind="raw", timeout_s=2, retries=3)
        sender.send_fault(make_fault())
        assert sender.flush(10)
        assert server.attempts == 3
        assert len(server.requests) == 1 and sender.delivered == 1


def test_client_errors_are_not_retried():
    with WebhookServer(lambda attempt: (404, 0)) as server:
        sender = WebhookSender(server.url(), kind="raw", timeout_s=2, retries=3)
        sender.send_fault(make_fault())
        assert sender.flush(5)
        assert server.attempts == 1 and sender.failed == 1


def test_down_server_never_blocks_the_caller_and_gives_up_within_the_budget(caplog):
    caplog.set_level(logging.DEBUG)
    sender = WebhookSender(closed_port_url(), kind="raw", timeout_s=1, retries=2)
    started = time.monotonic()
    sender.send_fault(make_fault())
    assert time.monotonic() - started < 0.05  # send only queues
    assert sender.flush(3 * 1 + backoff_total_s(2) + 1)
    assert sender.failed == 1 and sender.delivered == 0
    assert "not delivered after 3 attempt(s)" in caplog.text
    assert SECRET not in caplog.text and "127.0.0.1" not in caplog.text


def test_slow_server_times_out_per_attempt_and_never_blocks_the_caller(caplog):
    caplog.set_level(logging.DEBUG)
    with WebhookServer(lambda attempt: (204, 5.0)) as server:
        sender = WebhookSender(server.url(), kind="raw", timeout_s=0.3, retries=1)
        started = time.monotonic()
        sender.send_fault(make_fault())
        assert time.monotonic() - started < 0.05
        assert sender.flush(0.3 * 2 + backoff_total_s(1) + 1)
        elapsed = time.monotonic() - started
        assert server.attempts == 2
    assert elapsed < 2.5, f"gave up after {elapsed:.1f}s, the server sleeps 5s per request"
    assert sender.failed == 1
    assert SECRET not in caplog.text


def test_the_url_is_redacted_in_reprs_and_public_config():
    url = f"https://hooks.example.invalid/api/webhooks/{SECRET}"
    config = HealthConfig(webhook_url=url, webhook_type="discord")
    sender = WebhookSender(url, kind="discord", timeout_s=1, retries=0)
    for text in (repr(config), str(config), repr(sender), str(config.to_public_dict())):
        assert SECRET not in text and "hooks.example" not in text
        assert "<redacted>" in text


@pytest.mark.parametrize("kind", ["raw", "discord"])
def test_cuda_error_text_with_spaces_and_newlines_is_delivered_intact(kind):
    message = "CUDA error: uncorrectable ECC error encountered"
    with WebhookServer() as server:
        sender = WebhookSender(server.url(), kind=kind, timeout_s=2, retries=0)
        sender.send_fault(make_fault(metric="cuda_error", value=message, threshold="no error"))
        assert sender.flush(5)
        [request] = server.wait_for(1, 5)
    assert message in str(request["json"])
