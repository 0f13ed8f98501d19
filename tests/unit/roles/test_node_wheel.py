"""The wheel the nodes get: built from this checkout on the controller, byte-identical when nothing
changed (a second site.yml run copies nothing), with the `train` extra as the nodes' requirement
list (torch and friends, none of the controller's packages), in a cache only its owner can write."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "build-node-wheel.py"


def build(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300
    )


def test_the_node_wheel_is_reproducible_and_lists_only_the_training_stack(tmp_path) -> None:
    first = build(tmp_path / "a")
    assert first.returncode == 0, first.stderr
    built = json.loads(first.stdout)
    second = json.loads(build(tmp_path / "b").stdout)  # a separate build in another cache
    digest = [hashlib.sha256(Path(b["wheel"]).read_bytes()).hexdigest() for b in (built, second)]
    assert digest[0] == digest[1], "two builds of the same sources differ: every run would reinstall"
    assert oct((tmp_path / "a").stat().st_mode & 0o777) == "0o700"

    requirements = Path(built["requirements"]).read_text().split()
    train_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "train"
    ]
    names = [r.split("<")[0].split(">")[0].split("=")[0].split(";")[0].strip().lower() for r in requirements]
    assert len(requirements) == len(train_extra) and "torch" in names and "deepspeed" in names
    assert not {"ansible", "ansible-runner", "rich"} & set(names)

    with zipfile.ZipFile(built["wheel"]) as wheel:
        files = wheel.namelist()
    assert "trainer/node/train.py" in files and "trainer/controller/launcher/playbooks/start.yml" in files
    # The launcher needs its action plugin; a non-editable install without it cannot launch.
    assert "trainer/controller/launcher/playbooks/action_plugins/launch_node.py" in files
    # And the lookup its prestarted start reads the plan with (without it no launch overlaps them).
    assert "trainer/controller/launcher/playbooks/lookup_plugins/runner_late_vars.py" in files
    # And the helper it ships to every node (start, status, stop, the run lock).
    assert "trainer/controller/launcher/playbooks/files/node_ctl.py" in files


def test_a_cache_others_can_write_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    run = build(shared)
    assert run.returncode != 0
    assert "must belong to you and not be writable by others" in run.stderr
