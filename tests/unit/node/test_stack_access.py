"""A launch's processes let their own account's py-spy attach where Yama restricts ptrace to
descendants (trainer/stack_access.py, called by trainer_env's .pth in the training venv): asked only
inside a launch (its tag in the environment) and only under ptrace_scope 1. The attach itself is
proven where the kernel has Yama at scope 1 (a py-spy that is not the rank's ancestor reads the stack
of a tagged process and is refused an untagged one); elsewhere that test says why it cannot run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer import stack_access

REPO = Path(__file__).resolve().parents[3]
INSTALL_TASKS = REPO / "roles" / "trainer_env" / "tasks" / "install.yml"


def test_only_a_launch_process_under_ptrace_scope_1_asks(tmp_path):
    assert stack_access.allow_stack_reads({}) is False, "outside a launch nothing is asked"
    scope = tmp_path / "ptrace_scope"
    assert stack_access.ptrace_scope(str(scope)) is None, "no Yama: nothing to ask"
    for value in ("0", "1", "2", "3"):
        scope.write_text(f"{value}\n")
        assert stack_access.ptrace_scope(str(scope)) == int(value)
    if stack_access.ptrace_scope() != 1:
        # Here (no Yama, or another scope) a launch's process asks nothing either.
        assert stack_access.allow_stack_reads({stack_access.TAG_VARIABLE: "L1"}) is False


def test_the_venv_pth_file_calls_the_hook():
    """trainer_env writes the .pth line that runs the hook at every start of the venv's python: the
    line names this module's function, so a rename breaks here rather than on a cluster's stalls."""
    tasks = yaml.safe_load(INSTALL_TASKS.read_text())
    copies = [t["ansible.builtin.copy"] for t in tasks if "ansible.builtin.copy" in t]
    pth = next(c for c in copies if str(c.get("dest", "")).endswith("/clustertrain-stack-access.pth"))
    line = pth["content"].strip()
    assert line == "import trainer.stack_access; trainer.stack_access.allow_stack_reads()", line
    exec(compile(line, "clustertrain-stack-access.pth", "exec"), {})  # runs as site would run it


TRACEE = (
    "import sys, time; from trainer import stack_access; "
    "print(stack_access.allow_stack_reads(), flush=True); time.sleep(60)"
)


def orphan(tag: str) -> int:
    """A python that is not this test's descendant (its parent shell exits: it is re-parented), so
    only its own leave lets this account's py-spy attach under ptrace_scope 1. Its pid."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if tag:
        env[stack_access.TAG_VARIABLE] = tag
    shell = subprocess.Popen(
        ["bash", "-c", f'{sys.executable} -c "{TRACEE}" & echo $!'],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert shell.stdout is not None
    pid = int(shell.stdout.readline())
    shell.wait(timeout=30)
    return pid


@pytest.mark.skipif(
    stack_access.ptrace_scope() != 1 or os.geteuid() == 0,
    reason="needs Yama at ptrace_scope 1 (this kernel has "
    + ("none" if stack_access.ptrace_scope() is None else f"scope {stack_access.ptrace_scope()}")
    + ") and an unprivileged account (root attaches to anything: CAP_SYS_PTRACE)",
)
def test_under_ptrace_scope_1_a_launch_process_lets_its_accounts_py_spy_attach():
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        pytest.fail("py-spy is not in the test venv: make install-train installs it (the train extra)")
    pids = []
    try:
        for tag in ("L1", ""):
            pids.append(orphan(tag))
        time.sleep(2)  # both have made their prctl call (or not) and sleep
        tagged = subprocess.run(
            [spy, "dump", "--json", "--pid", str(pids[0])], capture_output=True, text=True
        )
        assert tagged.returncode == 0 and json.loads(tagged.stdout), tagged.stderr
        untagged = subprocess.run([spy, "dump", "--pid", str(pids[1])], capture_output=True, text=True)
        assert untagged.returncode != 0, "outside a launch the kernel's default stays: refused"
    finally:
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], check=False)
