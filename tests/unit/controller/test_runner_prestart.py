"""trainer.controller.runner: extra variables are values, and a playbook started before its values
are known (prestart_playbook, what `trainer launch` does while it makes its plan). Real
ansible-playbook runs against inventory/local (this machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from trainer.controller.runner import PRIVATE_DIR_PREFIX, prestart_playbook, run_playbook

REPO = Path(__file__).resolve().parents[3]
LOCAL_INVENTORY = REPO / "inventory" / "local"
LOOKUP = REPO / "trainer" / "controller" / "launcher" / "playbooks" / "lookup_plugins" / "runner_late_vars.py"
#: Ansible would render these if they were given as templates: a sum, and a command run on the controller.
AS_WRITTEN = "{{ 1 + 1 }} | {{ lookup('pipe', 'id -un') }} | 4 | True"
TEMPLATES = {"sum": "{{ 1 + 1 }}", "nested": {"items": ["{{ lookup('pipe', 'id -un') }}", 3, ""]}}


def write_playbook(directory: Path) -> Path:
    (directory / "lookup_plugins").mkdir()
    shutil.copy(LOOKUP, directory / "lookup_plugins" / LOOKUP.name)
    playbook = directory / "play.yml"
    playbook.write_text(
        '---\n- name: Test play\n  hosts: "{{ target_hosts }}"\n  gather_facts: false\n  tasks:\n'
        "    - name: Show the values\n"
        "      ansible.builtin.debug:\n"
        "        msg: \"{{ sum }} | {{ nested['items'][0] }} | {{ nested['items'][1] + 1 }} | "
        "{{ nested['items'][2] is string and nested['items'][2] == '' }}\"\n"
    )
    return playbook


def shown(result) -> str:
    item = result.task_result("localhost", "Show the values")
    assert item is not None and item.status == "ok", result.output
    return item.result["msg"]


def processes_of(playbook: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(playbook)], capture_output=True, text=True).stdout.split()


def wait_for_processes(playbook: Path) -> list[str]:
    deadline = time.monotonic() + 60
    while not (found := processes_of(playbook)):
        assert time.monotonic() < deadline, "the prestarted ansible-playbook did not start"
        time.sleep(0.05)
    return found


def created(event: dict) -> float:
    """An event's time of creation (ansible-runner writes it in UTC, without a zone)."""
    return datetime.fromisoformat(event["created"]).replace(tzinfo=timezone.utc).timestamp()


def private_dirs() -> set[Path]:
    """The runner's private dirs of this test process (other runs on the machine have their own)."""
    mine = set()
    for path in Path("/tmp").glob(PRIVATE_DIR_PREFIX + "*"):
        try:
            if (path / "owner").read_text().split()[0] == str(os.getpid()):
                mine.add(path)
        except (OSError, IndexError):
            continue
    return mine


def test_extra_variables_reach_the_play_as_written_never_rendered(tmp_path):
    playbook = write_playbook(tmp_path)
    result = run_playbook(playbook, LOCAL_INVENTORY, extravars={"target_hosts": "cluster", **TEMPLATES})
    assert result.succeeded, result.output
    assert shown(result) == AS_WRITTEN, "values stay values"


def test_a_prestarted_playbook_waits_for_its_values_then_runs_with_them(tmp_path):
    playbook = write_playbook(tmp_path)
    early = prestart_playbook(playbook, LOCAL_INVENTORY, {"target_hosts", "sum", "nested"})
    wait_for_processes(playbook)
    time.sleep(2)  # whatever ansible-playbook does meanwhile, it must not run a task
    waiting = processes_of(playbook)  # ansible-playbook's process and the one it runs the play in
    handed_over = time.time()
    events = []
    result = run_playbook(
        playbook,
        LOCAL_INVENTORY,
        extravars={"target_hosts": ["localhost"], **TEMPLATES},
        on_event=events.append,
        prestarted=early,
    )
    assert result.succeeded, result.output
    assert shown(result) == AS_WRITTEN, "late values are values too"
    started = next(e for e in events if e.get("event") == "playbook_on_start")
    task = next(e for e in events if e.get("event") == "playbook_on_task_start")
    assert str(started["pid"]) in waiting, "the run given the values is the one started earlier"
    assert created(task) >= handed_over, "no task ran before the values were given"
    assert processes_of(playbook) == []


def test_a_prestarted_run_started_otherwise_is_replaced_by_a_new_one(tmp_path):
    playbook = write_playbook(tmp_path)
    before = private_dirs()
    # Started with a --skip-tags the call does not ask for: it cannot be the call's run.
    early = prestart_playbook(playbook, LOCAL_INVENTORY, {"target_hosts", "sum", "nested"}, skip_tags="never")
    waiting = wait_for_processes(playbook)
    events = []
    result = run_playbook(
        playbook,
        LOCAL_INVENTORY,
        extravars={"target_hosts": "cluster", **TEMPLATES},
        on_event=events.append,
        prestarted=early,
    )
    assert result.succeeded, result.output
    assert shown(result).startswith("{{ 1 + 1 }}")
    started = next(e for e in events if e.get("event") == "playbook_on_start")
    assert str(started["pid"]) not in waiting, "a new run was started"
    assert processes_of(playbook) == [], "the prestarted ansible-playbook is gone"
    assert private_dirs() - before == set(), "and so is its private dir"


def test_an_unused_prestarted_run_is_ended_at_once_and_leaves_nothing(tmp_path):
    playbook = write_playbook(tmp_path)
    before = private_dirs()
    early = prestart_playbook(playbook, LOCAL_INVENTORY, {"target_hosts", "sum", "nested"})
    wait_for_processes(playbook)  # ansible-playbook runs, waiting for its values
    time.sleep(1)
    started = time.monotonic()
    early.cancel()
    assert time.monotonic() - started < 15, "the wait for values does not hold the cancel up"
    assert processes_of(playbook) == []
    assert private_dirs() - before == set()


def test_a_late_variable_name_must_be_an_identifier(tmp_path):
    playbook = write_playbook(tmp_path)
    with pytest.raises(ValueError, match="lower-case identifiers"):
        prestart_playbook(playbook, LOCAL_INVENTORY, {"x') }}{{ lookup('pipe', 'id"})
