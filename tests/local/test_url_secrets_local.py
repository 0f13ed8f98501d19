"""Credentials inside URLs are secrets (issue 26, item 5), and no secret is taken from a command line.

A proxy URL with `user:pass@` in training_env, a signed URL (`?sig=`), or an MLflow tracking URI with
`?access_token=` in the trainer config were treated as public: they reached run.sh (0755), `trainer
plan`, run.json and the tracker's hyperparameters. What a user notices here, on a real launch on two
loopback hosts (ansible_connection local, the real playbooks, torchrun and the bundled trainer with
MLflow's file store): the training still gets every value (the secret variables in the 0600
secret-env file), and no secret is in run.sh, the launcher's output, the node logs, run.json, the
MLflow run's params or `trainer plan` (text and --json). A secret given as a value on the command
line (`--env NAME=VALUE`, `--set health.webhook_url=...`, a token in `--set metrics.tracking_uri`) is
visible in `ps` for the whole launch: it is refused with exit 2 and the fix, before anything starts.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import loopback

from trainer import exitcodes
from trainer.cli import main

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

PROXY_SECRET = "proxy-pass-4c1d"
SIG_SECRET = "sas-sig-88e2"
TRACKING_SECRET = "mlflow-token-0b7a"
SECRETS = (PROXY_SECRET, SIG_SECRET, TRACKING_SECRET)
#: Files that must hold a secret (the trainer reads them; readable by the training user only), and
#: MLflow's own store, which records the tracking URI it was given as its artifact location.
ALLOWED = ("launch/config.yaml", "secret-env", "mlruns/")


@pytest.fixture
def cluster(tmp_path) -> tuple[Path, Path, Path]:
    """(inventory, shared dir, trainer config) for two loopback hosts; the inventory's training_env
    holds a proxy URL with a password and a signed URL, the config an MLflow URI with a token."""
    inventory, shared = loopback.write_inventory(
        tmp_path,
        training_env={
            # Names that do not look secret: only the URL inside says so.
            "HTTPS_PROXY": f"http://proxyuser:{PROXY_SECRET}@127.0.0.1:9",
            "DATA_URL": f"https://data.example.invalid/train.txt?sv=2024&sig={SIG_SECRET}",
        },
    )
    config = tmp_path / "trainer.yaml"
    tracking_uri = f"{(shared / 'mlruns').as_uri()}?access_token={TRACKING_SECRET}"
    config.write_text(yaml.safe_dump({"metrics": {"report_to": ["mlflow"], "tracking_uri": tracking_uri}}))
    return inventory, shared, config


def trainer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, timeout=600, env=env
    )


def files_with_secrets(root: Path) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = path.read_bytes().decode("utf-8", "replace")
        if any(secret in text for secret in SECRETS):
            found.append(str(path.relative_to(root)))
    return found


@pytest.mark.slow
def test_url_credentials_reach_the_training_but_no_file_log_or_tracker_param(cluster):
    inventory, shared, config = cluster
    done = trainer(
        "launch", "-i", str(inventory), "--run-name", "urls", "--config", str(config), "--poll-interval", "1",
        "--set", "train.max_steps=2", "--set", "train.log_every=1", "--set", "checkpoint.save_steps=0",
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert not [s for s in SECRETS if s in out], "the launcher printed a secret"
    run = shared / "runs" / "urls"

    # Kept from every file but the ones the trainer reads them from (0600) and MLflow's own store.
    leaked = [f for f in files_with_secrets(run) if not any(a in f for a in ALLOWED)]
    assert leaked == [], f"a secret in {leaked}"
    for rank in (0, 1):
        node = run / "launch" / f"node-{rank}"
        run_sh = (node / "run.sh").read_text()
        assert "HTTPS_PROXY" not in run_sh and "DATA_URL" not in run_sh, run_sh
        secret_env = node / "secret-env"
        assert stat.S_IMODE(secret_env.stat().st_mode) == 0o600
        # Secret is not dropped: each node's training gets both variables, from secret-env.
        assert PROXY_SECRET in secret_env.read_text() and SIG_SECRET in secret_env.read_text()

    # run.json and the tracker keep the rest of the URI readable, the token redacted.
    redacted_uri = f"{(shared / 'mlruns').as_uri()}?access_token=<redacted>"
    assert json.loads((run / "run.json").read_text())["config"]["metrics"]["tracking_uri"] == redacted_uri
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(shared / "mlruns").as_uri())
    (tracked,) = client.search_runs([client.get_experiment_by_name("clustertrain").experiment_id])
    params = tracked.data.params
    assert params["metrics.tracking_uri"] == redacted_uri
    assert not [s for s in SECRETS if s in json.dumps(params)]


def test_plan_shows_url_credentials_redacted_in_text_and_json(cluster, capsys):
    inventory, _, config = cluster
    assert main(["plan", "-i", str(inventory), "--config", str(config)]) == exitcodes.OK
    text = capsys.readouterr().out
    assert main(["plan", "-i", str(inventory), "--config", str(config), "--json"]) == exitcodes.OK
    shown = capsys.readouterr().out
    for out in (text, shown):
        assert not [s for s in SECRETS if s in out], out
    assert "HTTPS_PROXY=<redacted>" in text and "DATA_URL=<redacted>" in text
    plan = json.loads(shown)
    assert plan["env"]["node1"]["HTTPS_PROXY"] == "<redacted>"
    assert plan["sources"]["metrics.tracking_uri"]["value"].endswith("?access_token=<redacted>")


def test_plan_redacts_a_token_in_the_tracking_uris_user_part(cluster, capsys):
    """MLflow's `https://TOKEN@host` form: the host stays readable, the token does not show."""
    inventory, _, config = cluster
    config.write_text(
        yaml.safe_dump({"metrics": {"tracking_uri": f"https://{TRACKING_SECRET}@mlflow.example.invalid/"}})
    )
    assert main(["plan", "-i", str(inventory), "--config", str(config), "--json"]) == exitcodes.OK
    shown = capsys.readouterr().out
    assert TRACKING_SECRET not in shown
    tracking_uri = json.loads(shown)["sources"]["metrics.tracking_uri"]
    assert tracking_uri["value"] == "https://<redacted>@mlflow.example.invalid/"


@pytest.mark.parametrize(
    ("option", "fix"),
    [
        (
            ["--env", f"HTTPS_PROXY=http://proxyuser:{PROXY_SECRET}@127.0.0.1:3128"],
            "fix: export HTTPS_PROXY in this shell and give --env HTTPS_PROXY",
        ),
        (["--env", f"HF_TOKEN={PROXY_SECRET}"], "fix: export HF_TOKEN in this shell and give --env HF_TOKEN"),
        (
            ["--set", f"health.webhook_url=https://hooks.example.invalid/{SIG_SECRET}"],
            "fix: set the inventory's training_health_webhook_url (vaulted)",
        ),
        (
            ["--set", f"metrics.tracking_uri=https://mlflow.example.invalid/?access_token={TRACKING_SECRET}"],
            "through MLFLOW_TRACKING_TOKEN",
        ),
    ],
    ids=["env-proxy-url", "env-token-name", "set-webhook", "set-tracking-token"],
)
def test_a_secret_given_as_a_value_on_the_command_line_is_refused_before_anything_starts(
    cluster, option, fix
):
    inventory, shared, _ = cluster
    done = trainer("launch", "-i", str(inventory), "--run-name", "cli", *option)
    assert done.returncode == exitcodes.CONFIG_ERROR, done.stdout + done.stderr
    assert "on the command line shows in `ps`" in done.stderr and fix in done.stderr, done.stderr
    assert not [s for s in SECRETS if s in done.stdout + done.stderr], "the refusal repeated the secret"
    assert not shared.exists(), "the launch started"


def test_env_name_alone_takes_the_secret_from_the_shell(cluster):
    """The fix the refusal names works: the same proxy URL from the shell is planned, redacted."""
    inventory, _, _ = cluster
    shell = {**os.environ, "HTTPS_PROXY": f"http://proxyuser:{PROXY_SECRET}@127.0.0.1:3128"}
    done = trainer("plan", "-i", str(inventory), "--json", "--env", "HTTPS_PROXY", env=shell)
    assert done.returncode == exitcodes.OK, done.stderr
    assert json.loads(done.stdout)["env"]["node0"]["HTTPS_PROXY"] == "<redacted>"
    assert PROXY_SECRET not in done.stdout + done.stderr
