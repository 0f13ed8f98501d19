"""`trainer up` on the converged Molecule test bed (3 containers, reached over SSH): provisioning is
skipped by the converged check after one round trip per node, preflight's probe pass passes, and a
short run of the bundled trainer on the three nodes finishes; each phase's time is printed.

The bed's own inventory is used as it is, not a copy with a master port of this file's own: the
converged check digests every inventory variable, so a changed port would make the provisioning a
full run (and move the bed's firewall rule for the port under the other tests). The run holds the
bed's master port (29500) for a few seconds only. The bed's inventory sets converged_full_run: true
(every other bed run provisions fully); `--no-full` turns the check on, as a user's inventory has it.

The converged check digests the checkout itself (roles, playbooks, scripts, the trainer's sources,
README.md): a file edited between the run that writes the nodes' record and `up` makes `up` a full run.
Both run from a snapshot of the checkout taken at the test's start (`python -m trainer` in it imports
its trainer; `up` finds its site.yml next to it), so nothing edited meanwhile in the working tree
counts; the nodes get the snapshot's wheel, as a run from the working tree would give them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers.testbed_nodes import BED_TEST, ENV, INVENTORY, REPO, bed_shared_dir

pytestmark = BED_TEST
SKIPPED = "and this run is made from the same inputs: the roles are skipped"
STEPS = 4


#: What site.yml runs from and the converged check digests (roles/converged/filter_plugins/
#: converged.py SOURCE_PARTS), plus ansible.cfg; the bed's inventory is copied beside them.
CHECKOUT_PARTS = (
    "site.yml",
    "ansible.cfg",
    "playbooks",
    "roles",
    "scripts",
    "pyproject.toml",
    "README.md",
    "trainer",
)


def snapshot(root: Path) -> Path:
    """The checkout as it is now, in `root`; its .cache is the checkout's (the wheelhouse the bed's
    inventory finds through inventory_dir, resolved to the same real path)."""
    root.mkdir()
    for part in CHECKOUT_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, root / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, root / part)
    shutil.copytree(INVENTORY, bed_inventory(root))
    (root / ".cache").symlink_to(REPO / ".cache")
    return root


def bed_inventory(checkout: Path) -> Path:
    return checkout / INVENTORY.relative_to(REPO)


def write_record(checkout: Path) -> None:
    """site.yml from `checkout` with the converged check on, as `trainer up --no-full` runs it: when the
    nodes' record is not from this checkout's inputs (another test's full run from the working tree),
    the roles run and write one that is."""
    run = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(bed_inventory(checkout)),
         "site.yml", "-e", "converged_full_run=false"],
        cwd=checkout, capture_output=True, text=True, env={**ENV, "ANSIBLE_NOCOLOR": "1"}, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]


@pytest.fixture
def run_name():
    name = f"up-bed-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(bed_shared_dir() / "runs" / name, ignore_errors=True)


def test_up_on_the_converged_bed_skips_provisioning_and_finishes_a_short_run(tmp_path, run_name):
    checkout = snapshot(tmp_path / "checkout")
    write_record(checkout)
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "up", "-i", str(bed_inventory(checkout)), "--no-full",
         "--run-name", run_name, "--preflight-report", str(tmp_path / "preflight.json"),
         "--set", f"train.max_steps={STEPS}", "--set", "train.log_every=1"],
        cwd=checkout, capture_output=True, text=True, env=ENV, timeout=1800,
    )  # fmt: skip
    out = result.stdout
    print(out)  # the phase times, for -rP
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    assert "up: provision -> preflight -> launch on 3 node(s) (ct-head, ct-worker1, ct-worker2)" in out
    # The converged check's verdict, in site.yml's own words, and in the summary.
    assert SKIPPED in out, out[-4000:]
    assert re.search(r"is as the last full run left it \(\S+, \d+ items read on ct-head\)", out), out[:3000]
    summary = out[out.index("up: phase times") :]
    assert re.search(r"^  provision +\d+\.\d s  ok; converged: the roles were skipped$", summary, re.M), (
        summary
    )
    assert "preflight passed: 0 failure(s)" in out
    assert re.search(rf"^step {STEPS}/{STEPS} loss ", out, re.M), out[-3000:]
    assert f"done: run {run_name} finished on all 3 node(s)" in out
    assert (bed_shared_dir() / "runs" / run_name / "checkpoints" / f"step-{STEPS}").is_dir()
    seconds = {
        phase: float(re.search(rf"^  {phase} +(\d+\.\d) s  ok", out, re.M)[1])
        for phase in ("provision", "preflight", "launch")
    }
    # Skipped provisioning is one round trip per node plus ansible-playbook's start: seconds, where
    # the bed's every-role run takes more than a minute.
    assert seconds["provision"] < 60, seconds
