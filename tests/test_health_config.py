"""`health.*` validation: a malformed webhook config is refused at load with the key named."""

from __future__ import annotations

import pytest

from trainer.health import HealthConfig, HealthConfigError
from trainer.health.config import FAULT_SOURCE_ENV


def test_defaults_are_valid_and_have_no_webhook():
    config = HealthConfig.from_mapping({}, environ={})
    assert config.enabled and config.webhook_url == "" and config.webhook_type == "raw"
    assert config.fault_source == "nvml" and config.poll_interval_s > 0


@pytest.mark.parametrize(
    ("values", "key", "hint"),
    [
        ({"webhook_url": "ftp://hooks.example.invalid/x"}, "health.webhook_url", "http:// or https://"),
        ({"webhook_url": "hooks.example.invalid/x"}, "health.webhook_url", "http:// or https://"),
        ({"webhook_url": "https:///no-host"}, "health.webhook_url", "no host"),
        ({"webhook_url": "https://h:99999999/x"}, "health.webhook_url", "not a valid URL"),
        ({"webhook_url": 12}, "health.webhook_url", "must be a string"),
        ({"webhook_type": "slack"}, "health.webhook_type", "raw, discord"),
        ({"webhook_timeout_s": -1}, "health.webhook_timeout_s", "> 0"),
        ({"webhook_timeout_s": 0}, "health.webhook_timeout_s", "> 0"),
        ({"webhook_retries": -2}, "health.webhook_retries", ">= 0"),
        ({"webhook_retries": 1.5}, "health.webhook_retries", "integer"),
        ({"poll_interval_s": "fast"}, "health.poll_interval_s", "number"),
        ({"ecc_uncorrectable_max": -1}, "health.ecc_uncorrectable_max", ">= 0"),
        ({"temperature_limit": "boiling"}, "health.temperature_limit", "shutdown, slowdown"),
        ({"throttle_reasons": ["gpu_idle"]}, "health.throttle_reasons", "hw_slowdown"),
        ({"fault_source": "dcgm"}, "health.fault_source", "nvml"),
        ({"fault_source": "file:/nonexistent/faults.jsonl"}, "health.fault_source", "does not exist"),
        ({"enabled": "yes"}, "health.enabled", "true or false"),
        ({"webhook_urll": "https://x"}, "health.webhook_urll", "known keys"),
    ],
)
def test_malformed_values_are_refused_naming_the_key(values, key, hint):
    with pytest.raises(HealthConfigError) as caught:
        HealthConfig.from_mapping(values, environ={})
    assert caught.value.key == key
    assert str(caught.value).startswith(f"{key}: ")
    assert hint in str(caught.value)


def test_a_refused_url_is_not_echoed():
    secret = "ftp://hooks.example.invalid/api/webhooks/s3cr3t"
    with pytest.raises(HealthConfigError) as caught:
        HealthConfig.from_mapping({"webhook_url": secret}, environ={})
    assert "s3cr3t" not in str(caught.value)


def test_fault_source_env_var_overrides_the_config(tmp_path):
    faults = tmp_path / "faults.jsonl"
    faults.write_text('{"step": 1, "gpu": 0, "metrics": {"ecc_uncorrectable": 1}}\n')
    config = HealthConfig.from_mapping({"fault_source": "nvml"}, environ={FAULT_SOURCE_ENV: f"file:{faults}"})
    assert config.fault_source == f"file:{faults}"


def test_delivery_budget_bounds_every_attempt_timing_out():
    config = HealthConfig(webhook_timeout_s=2, webhook_retries=2)
    # 3 attempts x 2 s + backoffs 0.5 s + 1 s
    assert config.delivery_budget_s() == pytest.approx(7.5)
