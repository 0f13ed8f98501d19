"""`trainer up` provisions only with its own checkout's site.yml (issue 37, item 6): a trainer package
installed without a checkout (as from a wheel), run in a directory that holds another project's
site.yml and roles, refuses before any phase and names the fix; the planted playbook is never run.

The install is real: the package copied into a site-packages-like directory of its own, imported from
there by a fresh interpreter, with the working directory holding the planted playbook."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_up_from_a_wheel_install_refuses_the_working_directorys_playbook(tmp_path):
    site_packages = tmp_path / "site-packages"
    shutil.copytree(REPO / "trainer", site_packages / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    other_project = tmp_path / "other-project"
    (other_project / "roles" / "evil" / "tasks").mkdir(parents=True)
    marker = tmp_path / "planted-playbook-ran"
    (other_project / "site.yml").write_text(
        "- hosts: all\n  gather_facts: false\n  tasks:\n"
        f"    - ansible.builtin.command: touch {marker}\n      delegate_to: localhost\n"
    )
    inventory = REPO / "inventory" / "local"
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "up", "-i", str(inventory), "--run-name", "planted"],
        cwd=other_project,
        env={**os.environ, "PYTHONPATH": str(site_packages)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not in one (a wheel install)" in done.stderr and "never used" in done.stderr, done.stderr
    assert "pip install -e CHECKOUT" in done.stderr
    assert not marker.exists(), "the working directory's playbook ran"


def test_up_from_its_checkout_finds_the_checkouts_playbook():
    code = "import trainer.controller.up as up; print(up.site_playbook())"
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO / "site.yml"
