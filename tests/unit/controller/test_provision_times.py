"""trainer.controller.provision_times: what `trainer up` prints of where a provision's time went, read
from the events of a real ansible-playbook run (inventory/local, this machine) whose plays and tasks
are laid out as site.yml's: a play per role, the environment's build in trainer_env/tasks/install.yml,
the pack and the unpack as environment.yml names them, printing what node_env.py prints."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from trainer.controller.provision_times import ENV_TASKS, ProvisionClock
from trainer.controller.runner import run_playbook

REPO = Path(__file__).resolve().parents[3]
LOCAL_INVENTORY = REPO / "inventory" / "local"
_, _, PACK, _, UNPACK, _ = list(ENV_TASKS)


def command(name: str, *argv: str, changed: bool = True) -> dict:
    return {"name": name, "ansible.builtin.command": {"argv": list(argv)}, "changed_when": changed}


def write_site(root: Path) -> Path:
    tasks = root / "roles" / "trainer_env" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "install.yml").write_text(yaml.safe_dump([command("Install torch", "sleep", "1.2")]))
    said = {"did": "unpack", "seconds": {"copy": 0.4, "unpack": 2.5}}
    main = [
        {"name": "Build", "ansible.builtin.import_tasks": "install.yml"},
        command(PACK, "echo", json.dumps({"did": "pack"})),
        command(f"{UNPACK} (from the shared dir)", "echo", json.dumps(said)),
    ]
    (tasks / "main.yml").write_text(yaml.safe_dump(main))
    plays = [
        {"name": "Time sync", "hosts": "cluster", "gather_facts": False,
         "tasks": [command("Wait", "sleep", "1.1", changed=False)]},
        {"name": "Trainer venv", "hosts": "cluster", "gather_facts": False, "roles": ["trainer_env"]},
    ]  # fmt: skip
    site = root / "site.yml"
    site.write_text(yaml.safe_dump(plays, sort_keys=False))
    return site


def test_the_breakdown_names_each_play_and_the_environments_phases(tmp_path):
    clock = ProvisionClock()
    result = run_playbook(write_site(tmp_path), LOCAL_INVENTORY, on_event=clock.on_event)
    assert result.succeeded, result.output
    lines = clock.lines()
    plays = dict(clock.play_seconds())
    assert plays["Time sync"] >= 1.1 and plays["Trainer venv"] >= 1.2, plays
    assert any(line.endswith("Time sync") for line in lines), lines
    build = next(line for line in lines if "environment build:" in line)
    assert float(build.split()[0]) >= 1.2, "the build's seconds are the install tasks' own"
    assert any(
        "environment unpack:" in line and "[unpack (copy 0.4 s, unpack 2.5 s)]" in line for line in lines
    )
    assert any("environment pack:" in line and "[pack]" in line for line in lines), lines
