"""`trainer report` in a run dir the training account owns never writes or reads through a link it planted.

The training account (a second account made with useradd) owns the run dir, as on the share; it links
the report's temporary names to files only root may write, and run.json to a file only root may read.
Then root runs `trainer report RUN_DIR`, as an operator on a node does: root's files keep their bytes,
the report is written, and nothing of root's file reaches report.html (which the training account can
read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.accounts import as_account, local_account, open_dir, private_file

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def training_account():
    with local_account("ct-r4-train") as account:
        yield account


def test_trainer_report_as_root_neither_overwrites_nor_inlines_what_planted_links_point_at(training_account):
    with open_dir() as base:
        secrets_dir = base / "root-only"
        victims = {
            name: private_file(secrets_dir, f"victim-{name.strip('.')}", f"root's {name}\n")
            for name in (".report.html.tmp", ".report.json.tmp", ".loss.png.tmp")
        }
        secret = private_file(secrets_dir, "secret.json", json.dumps({"config": {"token": "ROOT-SECRET"}}))
        run_dir = base / "run"
        run_dir.mkdir()
        records = [{"step": step, "loss": 3.0 - step / 10, "lr": 1e-3} for step in range(1, 6)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        os.chown(run_dir, training_account.pw_uid, training_account.pw_gid)

        def plant() -> None:  # the training account's step, done as it
            for name, target in victims.items():
                (run_dir / name).symlink_to(target)
            (run_dir / "run.json").symlink_to(secret)

        as_account(training_account, plant)
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "report", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        for name, target in victims.items():
            assert target.read_text() == f"root's {name}\n", f"{name} was written through its link"
        html = (run_dir / "report.html").read_text()
        assert "ROOT-SECRET" not in html, "root's file, linked as run.json, was copied into report.html"
        assert not (run_dir / "report.html").is_symlink() and "<html" in html
        assert json.loads((run_dir / "report.json").read_text())["records"] == 5
        assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
