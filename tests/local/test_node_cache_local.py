"""The node helper runs only what the controller sent: no compiled copy in the node dir is ever run.

The launch's node dir belongs to the training account, and status, stop and pids run as that account;
they kept the compiled helper there (`.node_ctl-<digest>.<python version>.<uid>`), checked only for
being that account's own file, so the training account (a job) could plant one that the next poll ran.
Here the training account (this account, on a one-node loopback cluster) and another account (nobody)
each plant a cache whose `serve` answers with a made-up report, under every name the node's bootstrap
has looked for; then the real `trainer status` and `trainer stop` run. The planted code must not run:
status reports the trainer running, the stop really ends it, and no cache is written."""

from __future__ import annotations

import hashlib
import marshal
import os
import sys

import pytest
from helpers.fake_launch import fake_launch, one_node_cluster, trainer
from helpers.loopback import REPO

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

NODE_PROGRAM = REPO / "trainer" / "controller" / "launcher" / "playbooks" / "files" / "node_ctl.py"
#: The planting account: not the one the helper runs as.
NOBODY = 65534
#: A helper that says the trainer exited cleanly and was stopped, whatever the node's state (the
#: launch's own launch.json in its report, so the launcher takes it for the real one).
FAKE_HELPER = """
import json, os
def serve(request):
    with open(os.path.join(request["node_dir"], "launch.json")) as handle:
        info = json.load(handle)
    print(json.dumps({"state": "exited", "exit": {"exit_code": 0}, "lines": ["PLANTED"], "stopped": True,
                      "info": info, "stop_requested": False, "progress": [], "errors": [], "rank_exits": []}))
    return 0
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plants the cache as another account (needs root)")


def plant_cache(node_dir) -> list[str]:
    """What a job can put into its node dir: the fake helper compiled, under every name the node's
    bootstrap has looked for (raw, and with its header line). The one named for the helper's own uid
    is written by that account (the training account: status, stop and pids run as it), private, as
    the bootstrap wrote its own; the others by another account (NOBODY)."""
    digest = hashlib.sha256(NODE_PROGRAM.read_text().encode()).hexdigest()[:16]
    code = marshal.dumps(compile(FAKE_HELPER, "node_ctl.py", "exec"))
    old_name = f".node_ctl-{digest}.{sys.hexversion:x}"
    names = {old_name: code}
    for uid in (os.geteuid(), NOBODY):
        name = f"{old_name}.{uid}"
        names[name] = f"{name}\n".encode() + code
    own = f"{old_name}.{os.geteuid()}"
    fd = os.open(node_dir / own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, names[own])
    os.close(fd)
    os.chown(node_dir, NOBODY, NOBODY)  # the training account's dir
    # Opened here: pytest's tmp dirs above it are root's own (0700), which NOBODY cannot pass through.
    dir_fd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY)
    child = os.fork()
    if child == 0:  # the other account's step, done for real
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for name, data in names.items():
                if name != own:
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
                    os.write(fd, data)
                    os.close(fd)
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(dir_fd)
    assert os.waitpid(child, 0)[1] == 0, "the other account could not plant its cache"
    return sorted(names)


def test_a_cache_planted_in_the_node_dir_neither_fakes_the_status_nor_stops_the_stop(tmp_path):
    inventory, shared = one_node_cluster(tmp_path)
    launch = fake_launch(shared, "planted", "step 1\n")
    try:
        planted = plant_cache(launch.node_dir)
        status = trainer("status", inventory, "--run-name", "planted")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "[node0] node 0: running" in status.stdout, status.stdout
        assert "PLANTED" not in status.stdout and "    step 1" in status.stdout, status.stdout
        stop = trainer("stop", inventory, "--run-name", "planted", "--stop-grace", "5")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "[node0] node 0: stopped" in stop.stdout + stop.stderr, stop.stdout + stop.stderr
        # The trainer is really gone (TERM to its process group), not just reported so.
        assert launch.process.wait(timeout=30) == -15
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
            launch.process.wait()
    # No cache of the helper's own either: only what was planted is there.
    assert sorted(p.name for p in launch.node_dir.glob(".node_ctl-*")) == planted
