"""`trainer train --set health.webhook_url=<url with a token>` on a node is refused as `trainer plan` and
`trainer launch` refuse it: a value on the command line shows in `ps` to every account on the node for
the whole run. The refusal comes before anything is read or trained, and never repeats the value."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

TOKEN = "T0KEN-4d9c1e"


@pytest.mark.parametrize(
    "setting",
    [
        f"health.webhook_url=https://hooks.example.invalid/api/{TOKEN}",
        f"metrics.tracking_uri=https://u:{TOKEN}@mlflow.invalid",
    ],
)
def test_a_secret_in_set_is_refused_by_trainer_train(setting, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--dry-run",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            setting,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "on the command line shows in `ps`" in done.stderr and "fix:" in done.stderr, done.stderr
    assert TOKEN not in done.stdout + done.stderr
