"""The webhook URL is a secret: a URL that would put it in an error text is refused at load, a failure
at fault time is reported by its type alone and never kills the sender, and the URL can come from a
file or an environment variable instead of the command line (where `ps` shows it)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml
from helpers.health_webhook_server import WebhookServer

from trainer import exitcodes
from trainer.configerror import ConfigError
from trainer.node.config import load_config
from trainer.node.health import GpuFaultError, HealthConfig, WebhookSender, start_monitor

SECRET = "s3cr3t-token-do-not-log"


def dry_run(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`trainer train --dry-run` with these settings; the webhook's URL goes into a --config file, as a
    user's would (`trainer train` refuses it in --set, where it would show in `ps`)."""
    url = [item for item in overrides if item.startswith("health.webhook_url=")]
    sets = [arg for pair in overrides if pair not in url for arg in ("--set", pair)]
    with tempfile.TemporaryDirectory() as scratch:
        config = []
        if url:
            path = Path(scratch) / "webhook.yaml"
            path.write_text(yaml.safe_dump({"health": {"webhook_url": url[0].partition("=")[2]}}))
            config = ["--config", str(path)]
        return subprocess.run(
            [sys.executable, "-m", "trainer", "train", "--dry-run", *config, *sets],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        (f"https://hooks:{SECRET}@hooks.example.invalid/api", "user name or password"),
        (f"https://hooks.example.invalid/api/{SECRET}\x1b[2J", "control character"),
        (f"https://hooks.example.invalid/api/{SECRET}\x7f", "control character"),
        (f"https://hooks.example.invalid/api/{SECRET}é", "non-ASCII"),
    ],
)
def test_a_url_that_would_leak_or_break_at_fault_time_is_refused_at_load(url, hint):
    done = dry_run(f"health.webhook_url={url}")
    assert done.returncode == exitcodes.CONFIG_ERROR, done.stderr
    assert "health.webhook_url: " in done.stderr and hint in done.stderr
    assert SECRET not in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_a_failing_url_is_reported_by_type_only_and_the_sender_lives_on(caplog):
    caplog.set_level(logging.DEBUG)
    escaped: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda hook: escaped.append(hook.exc_value)
    try:
        with WebhookServer() as server:
            # What the load refuses, given to the sender directly: http.client refuses it with an
            # InvalidURL whose text quotes the URL.
            sender = WebhookSender(server.url(f"/hooks/{SECRET}\x01"), kind="raw", timeout_s=2, retries=2)
            sender.send({"event": "gpu.fault"})
            assert sender.flush(5), "the sender's thread died"
            sender.send({"event": "gpu.fault"})
            assert sender.flush(5), "the sender's thread died on the second payload"
            assert server.attempts == 0
    finally:
        threading.excepthook = previous
    assert escaped == []
    assert sender.failed == 2 and sender.delivered == 0
    assert "not delivered after 1 attempt(s): InvalidURL" in caplog.text
    assert SECRET not in caplog.text and "hooks" not in caplog.text


def _fault_file(tmp_path) -> str:
    path = tmp_path / "faults.jsonl"
    path.write_text(json.dumps({"step": 1, "gpu": 0, "metrics": {"ecc_uncorrectable": 3}}) + "\n")
    return f"file:{path}"


def _trip(config: HealthConfig, server: WebhookServer) -> dict:
    monitor = start_monitor(config, rank=0, local_rank=0, cuda_device=None, host="nodeA")
    try:
        with pytest.raises(GpuFaultError):
            for step in range(1, 500):
                monitor.check(step)
                threading.Event().wait(0.01)
        [request] = server.wait_for(1, 5)
    finally:
        # As the trainer's loop does on its way out: a tripped monitor left running exits the
        # process with 75 after fault_exit_grace_s (here: this pytest process, tests later).
        monitor.stop()
    return request


def test_the_url_from_a_file_reaches_the_server(tmp_path):
    with WebhookServer() as server:
        secret_file = tmp_path / "webhook-url"
        secret_file.write_text(server.url() + "\n")
        secret_file.chmod(0o600)
        config = load_config(
            None,
            [
                f"health.webhook_url_file={secret_file}",
                f"health.fault_source={_fault_file(tmp_path)}",
                "health.poll_interval_s=0.02",
            ],
        ).health
        assert SECRET not in repr(config) + json.dumps(config.to_public_dict())
        request = _trip(config, server)
    assert request["path"] == f"/hooks/{SECRET}" and request["json"]["event"] == "gpu.fault"


def test_the_url_from_an_environment_variable_reaches_the_server(tmp_path, monkeypatch):
    with WebhookServer() as server:
        monkeypatch.setenv("CT_TEST_WEBHOOK", server.url())
        config = HealthConfig(
            webhook_url_env="CT_TEST_WEBHOOK", fault_source=_fault_file(tmp_path), poll_interval_s=0.02
        )
        request = _trip(config, server)
    assert request["path"] == f"/hooks/{SECRET}"


def test_a_missing_or_bad_url_source_stops_the_trainer_naming_the_key(tmp_path):
    missing = dry_run(f"health.webhook_url_file={tmp_path / 'nope'}")
    assert missing.returncode == exitcodes.CONFIG_ERROR
    assert f"health.webhook_url_file: cannot read {tmp_path / 'nope'}" in missing.stderr

    bad = tmp_path / "webhook-url"
    bad.write_text(f"https://u:{SECRET}@hooks.example.invalid/x\n")
    in_file = dry_run(f"health.webhook_url_file={bad}")
    assert in_file.returncode == exitcodes.CONFIG_ERROR
    assert "health.webhook_url_file: carries a user name or password" in in_file.stderr
    assert SECRET not in in_file.stderr + in_file.stdout

    unset = dry_run("health.webhook_url_env=CT_TEST_UNSET_WEBHOOK")
    assert unset.returncode == exitcodes.CONFIG_ERROR
    assert "health.webhook_url_env: the environment variable CT_TEST_UNSET_WEBHOOK is not set" in unset.stderr

    with pytest.raises(ConfigError, match="set only one of webhook_url, webhook_url_env") as both:
        load_config(None, ["health.webhook_url=https://h.invalid/x", "health.webhook_url_env=X"])
    assert both.value.key == "health.webhook_url_env"
    with pytest.raises(ConfigError, match="absolute path"):
        load_config(None, ["health.webhook_url_file=relative/url"])
