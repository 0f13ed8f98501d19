"""The node environment on the bed (roles/trainer_env, issue 35): a node whose venv was changed by hand
and a replacement node with no environment at all get it back from packs, without a build.

Molecule's converge built the environment once, on the head, and the workers unpacked it (verify.yml
checks that). Here ct-worker1's venv gets a file edited, as a `pip install` by hand would, and
ct-worker2 loses its venv, its ops and its pack, as a spot node replaced by a fresh host does. Then:
`site.yml --check --diff` names both and why, and changes nothing; `site.yml --limit
ct-worker1,ct-worker2 --tags trainer_env` (the head left out, as for a replacement node) restores
ct-worker1 from its own pack and gives ct-worker2 the head's, each checked against the head's sha256,
with no build anywhere.
"""

from __future__ import annotations

import json
import subprocess
import time

from helpers.testbed_nodes import BED_TEST, ENV, site

pytestmark = BED_TEST

VENV = "/opt/clustertrain/venv"
RECORD = "/var/cache/clustertrain/envs/installed.json"
#: A file of the project's own package in the venv (any file of the venv would do).
EDITED = f"{VENV}/lib/python3.11/site-packages/trainer/__init__.py"


def on_node(host: str, script: str) -> str:
    done = subprocess.run(
        ["podman", "exec", host, "sh", "-euc", script], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def record(host: str) -> dict:
    return json.loads(on_node(host, f"cat {RECORD}"))


def test_a_changed_venv_and_a_replacement_node_get_the_environment_back_without_a_build():
    # The head must hold this checkout's environment (the converge's, unless the tree changed since):
    # a no-op where it does, seconds.
    site("--tags", "trainer_env")
    head = record("ct-head")
    worker1 = record("ct-worker1")
    on_node("ct-worker1", f"echo '# edited by hand' >> {EDITED}")
    # Moved aside, then removed in the background: removing a 1.6 GB venv took over 2 min on the loaded bed.
    gone = f"{VENV} /var/cache/clustertrain/torch_extensions /var/cache/clustertrain/envs"
    on_node(
        "ct-worker2",
        f"mkdir -p /var/tmp/gone; for p in {gone}; do [ ! -e $p ] || mv $p /var/tmp/gone/; done;"
        " (setsid rm -rf /var/tmp/gone &)",
    )

    out, _ = site("--check", "--diff", "--tags", "trainer_env")
    assert "ct-head: current (holds the environment and its pack)" in out, out[-3000:]
    assert "ct-worker1: restore (its venv changed since it was installed" in out
    assert "ct-worker2: unpack from ct-head (no environment yet)" in out
    assert "edited by hand" in on_node("ct-worker1", f"tail -n 1 {EDITED}"), "--check changed nothing"
    assert on_node("ct-worker2", f"test -e {VENV} && echo there || echo absent").strip() == "absent"

    started = time.monotonic()
    # --tags trainer_env: a full site.yml limited to workers fails in ssh_trust, which reads the head's
    # facts (a limitation of that role, left for its own fix); the environment's part needs no head.
    out, _ = site("--limit", "ct-worker1,ct-worker2", "--tags", "trainer_env")
    took = time.monotonic() - started
    restored, unpacked = record("ct-worker1"), record("ct-worker2")
    # The environment ct-worker1's record describes is back: its record is left as it was (the converged
    # check hashes it); the run's line said `restore` (the --check above).
    assert restored == worker1 and unpacked["how"] == "unpacked from ct-head"
    for got in (restored, unpacked):
        assert (got["key"], got["sha256"], got["tree"]) == (head["key"], head["sha256"], head["tree"])
    assert record("ct-head") == head, "the head was only read, and published its pack"
    assert "edited by hand" not in on_node("ct-worker1", f"tail -n 1 {EDITED}")
    assert "Successfully installed" not in out, "nothing was built: no pip ran"
    versions = on_node(
        "ct-worker2", f"{VENV}/bin/python -c 'import torch, deepspeed; print(torch.__version__)'"
    )
    assert "+cpu" in versions, "the replacement node's venv works"
    print(f"site.yml --limit the two workers --tags trainer_env (the environment back on both): {took:.0f} s")
