"""`health.*` validation at config load: a malformed webhook config is refused with the key named."""

from __future__ import annotations

import pytest
import yaml

from trainer.configerror import ConfigError
from trainer.node.config import load_config
from trainer.node.health import HealthConfig

SECRET = "s3cr3t"


def test_defaults_are_valid_and_have_no_webhook():
    config = load_config(None, []).health
    assert config.enabled and config.webhook_url == "" and config.webhook_type == "raw"
    assert config.fault_source == "nvml" and config.poll_interval_s > 0


def test_a_valid_webhook_section_loads():
    config = load_config(
        None,
        [
            f"health.webhook_url=https://hooks.example.invalid:8443/api/webhooks/{SECRET}?wait=true",
            "health.webhook_type=discord",
            "health.webhook_timeout_s=2.5",
            "health.webhook_retries=0",
            "health.throttle_reasons=hw_slowdown,sw_thermal_slowdown",
        ],
    ).health
    assert config.webhook_type == "discord" and config.webhook_timeout_s == 2.5
    assert config.throttle_reason_set == {"hw_slowdown", "sw_thermal_slowdown"}


@pytest.mark.parametrize(
    ("setting", "key", "hint"),
    [
        (
            f"health.webhook_url=ftp://hooks.example.invalid/{SECRET}",
            "health.webhook_url",
            "http:// or https://",
        ),
        (f"health.webhook_url=hooks.example.invalid/{SECRET}", "health.webhook_url", "http:// or https://"),
        (f"health.webhook_url=https:///{SECRET}", "health.webhook_url", "no host"),
        (f"health.webhook_url=https://h:99999999/{SECRET}", "health.webhook_url", "not a valid URL"),
        ("health.webhook_type=slack", "health.webhook_type", "raw, discord"),
        ("health.webhook_timeout_s=-1", "health.webhook_timeout_s", "> 0"),
        ("health.webhook_timeout_s=0", "health.webhook_timeout_s", "> 0"),
        ("health.webhook_retries=-2", "health.webhook_retries", ">= 0"),
        ("health.webhook_retries=1.5", "health.webhook_retries", "int"),
        ("health.poll_interval_s=fast", "health.poll_interval_s", "float"),
        ("health.ecc_uncorrectable_max=-1", "health.ecc_uncorrectable_max", ">= 0"),
        ("health.temperature_limit=boiling", "health.temperature_limit", "shutdown, slowdown"),
        ("health.throttle_reasons=gpu_idle", "health.throttle_reasons", "hw_slowdown"),
        ("health.fault_source=dcgm", "health.fault_source", "nvml"),
        ("health.fault_source=file:/nonexistent/faults.jsonl", "health.fault_source", "does not exist"),
        ("health.enabled=maybe", "health.enabled", "bool"),
        ("health.webhook_urll=https://x", "health.webhook_urll", "did you mean health.webhook_url"),
    ],
)
def test_malformed_values_are_refused_naming_the_key(setting, key, hint):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [setting])
    assert caught.value.key == key
    assert str(caught.value).startswith(f"{key}: ")
    assert hint in str(caught.value)
    assert SECRET not in str(caught.value), "a refused URL is never echoed (it carries the token)"


def test_a_malformed_fault_file_is_refused_at_load_with_its_line(tmp_path):
    path = tmp_path / "faults.jsonl"
    path.write_text('{"step": 1, "gpu": 0, "metrics": {}}\n{"gpu": 0}\n')
    with pytest.raises(ConfigError, match=r'health.fault_source: .*faults.jsonl:2: .*integer "step"'):
        load_config(None, [f"health.fault_source=file:{path}"])


def test_the_url_is_redacted_in_the_resolved_config():
    config = load_config(None, [f"health.webhook_url=https://hooks.example.invalid/{SECRET}"])
    assert config.to_dict()["health"]["webhook_url"] == "<redacted>"
    assert SECRET not in repr(config) and SECRET not in str(config.to_dict())
    assert config.health.webhook_url.endswith(SECRET)  # the real value is kept for delivery


def test_delivery_budget_bounds_every_attempt_timing_out():
    config = HealthConfig(webhook_timeout_s=2, webhook_retries=2)
    # 3 attempts x 2 s + backoffs 0.5 s + 1 s
    assert config.delivery_budget_s() == pytest.approx(7.5)


def test_only_an_explicit_request_keeps_the_url_and_a_redacted_copy_is_refused(tmp_path):
    config = load_config(None, [f"health.webhook_url=https://hooks.example.invalid/{SECRET}"])
    assert config.to_dict(secrets=True)["health"]["webhook_url"].endswith(SECRET)
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(config.to_dict()))
    with pytest.raises(ConfigError, match=r"health.webhook_url: is the placeholder '<redacted>'"):
        load_config(copy, [])


def test_overrides_shown_to_a_user_hide_the_webhook_url():
    from trainer.redaction import redact_override

    assert redact_override(f"health.webhook_url=https://h.example.invalid/{SECRET}") == (
        "health.webhook_url=<redacted>"
    )
    assert redact_override("train.max_steps=5") == "train.max_steps=5"
