"""roles/trainer_env/files/requirements_met.py: provisioning skips `pip install` only when the venv has
every requirement and everything they depend on, in range. Run as the role runs it, with a venv's
python, against distributions found on its path (a made-up one in a temporary dir for the cases
this venv cannot show)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "roles" / "trainer_env" / "files" / "requirements_met.py"


def met(*args: str, path: Path | None = None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = str(path)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return json.loads(out.stdout)


def fake_distribution(root: Path, name: str, version: str, requires: list[str]) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {req}" for req in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_installed_stack_is_met_and_a_requirement_file_is_read(tmp_path):
    requirements = tmp_path / "node-requirements.txt"
    requirements.write_text("# the train extra\npyyaml>=6\n\ntorch>=2.3  # pinned separately\n")
    assert met("-r", str(requirements), "packaging") == {"met": True, "unmet": []}


def test_missing_or_out_of_range_requirements_are_named(tmp_path):
    result = met("pyyaml>=999", "clustertrain-no-such-distribution")
    assert result["met"] is False
    assert "clustertrain-no-such-distribution (not installed)" in result["unmet"]
    assert any(item.startswith("pyyaml>=999 (installed: ") for item in result["unmet"])


def test_a_missing_dependency_of_an_installed_distribution_is_unmet(tmp_path):
    fake_distribution(
        tmp_path,
        "ct-fake-stack",
        "1.0",
        ["clustertrain-absent-dep>=1", "clustertrain-absent-extra; extra == 'gpu'", "pyyaml>=6"],
    )
    plain = met("ct-fake-stack", path=tmp_path)
    assert plain["unmet"] == ["clustertrain-absent-dep>=1 (not installed)"]
    with_extra = met("ct-fake-stack[gpu]==1.0", path=tmp_path)
    assert sorted(with_extra["unmet"]) == [
        "clustertrain-absent-dep>=1 (not installed)",
        'clustertrain-absent-extra; extra == "gpu" (not installed)',
    ]


def test_an_unreadable_requirement_list_leaves_the_decision_to_pip(tmp_path):
    result = met("-r", str(tmp_path / "not-copied-yet.txt"))
    assert result["met"] is False and "not-copied-yet.txt" in result["unmet"][0]
