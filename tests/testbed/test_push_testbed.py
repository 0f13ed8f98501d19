"""`trainer push` on the Molecule test bed: a tiny Hugging Face model (scripts/build_tiny_hf_model.py)
copied from this machine to the head's shared dir over SSH as the inventory reaches ct-head (root, the
pinned host key), written there by the training account; read back by a worker over NFS (libnfs as the
training UID: containers cannot mount NFS); a second push copies nothing; an interrupted push resumes.
Every test removes what it pushed."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.push_harness import digests, push
from helpers.testbed_nodes import BED_TEST, ENV, HEAD, INVENTORY, _inventory, podman

REPO = Path(__file__).resolve().parents[2]
WORKER = "ct-worker1"

pytestmark = BED_TEST


def over_nfs(tool: str, path: str, settings: dict, timeout: float = 90) -> str:
    """`nfs-ls`/`nfs-cat` of a path on the head's export, from the worker as the training UID; retried
    while the server is in its grace period."""
    hosts, _ = _inventory()
    head_ip = hosts[HEAD]["cluster_ip"]
    ids = f"version=4&uid={settings['cluster_training_uid']}&gid={settings['cluster_training_gid']}"
    url = f"nfs://{head_ip}{path}?{ids}"
    deadline = time.monotonic() + timeout
    while True:
        done = podman("exec", "--user", settings["cluster_training_user"], WORKER, tool, url, check=False)
        if done.returncode == 0:
            return done.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"{tool} {url} from {WORKER}: {done.stderr.strip()}")
        time.sleep(2)


@pytest.fixture
def bed():
    """(settings of the bed's inventory, a unique name); what the test pushed is removed afterwards."""
    _, settings = _inventory()
    name = f"push-{uuid.uuid4().hex[:8]}"
    yield settings, name
    shared = Path(settings["cluster_shared_dir"])
    for kind in ("models", "datasets"):
        pushed = shared / kind / name
        if pushed.is_dir():
            shutil.rmtree(pushed)
        pushed.unlink(missing_ok=True)
        for leftover in (shared / kind).glob(f".{name}.*"):
            leftover.unlink()
        shutil.rmtree(shared / kind / ".push-partial", ignore_errors=True)


def test_a_pushed_model_is_the_training_accounts_and_a_worker_reads_it_over_nfs(bed, tmp_path):
    settings, name = bed
    model = tmp_path / "tiny"
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_tiny_hf_model.py"), "model", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr

    started = time.monotonic()
    first = push(INVENTORY, str(model), name, env=ENV, timeout=300)
    first_s = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    pushed = f"{settings['cluster_shared_dir']}/models/{name}"
    assert f"model.name_or_path: {pushed}" in first.stdout
    assert f"checksums: all {len(digests(model))} file(s) on {HEAD} match" in first.stdout

    # On the head, as the head sees it: every file the training account's, the same bytes.
    owners = podman("exec", HEAD, "find", pushed, "-printf", "%u:%g\n").stdout.split()
    assert set(owners) == {f"{settings['cluster_training_user']}:{settings['cluster_training_group']}"}
    assert digests(Path(pushed)) == digests(model)

    # From a worker over NFS (the export the nodes mount), as the training UID.
    listing = over_nfs("nfs-ls", pushed, settings)
    assert "config.json" in listing and "model.safetensors" in listing, listing
    assert over_nfs("nfs-cat", f"{pushed}/config.json", settings) == (model / "config.json").read_text()

    started = time.monotonic()
    second = push(INVENTORY, str(model), name, env=ENV, timeout=300)
    second_s = time.monotonic() - started
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to copy: every file is already there" in second.stdout
    size = sum(path.stat().st_size for path in model.rglob("*") if path.is_file())
    print(
        f"tiny model, {size / 1e6:.2f} MB: first push {first_s:.1f} s, second push (nothing) {second_s:.1f} s"
    )


def test_an_interrupted_push_to_the_head_resumes(bed, tmp_path):
    settings, name = bed
    data = tmp_path / "shard.bin"
    data.write_bytes(os.urandom(16_000_000))
    datasets = Path(settings["cluster_shared_dir"]) / "datasets"
    command = [
        sys.executable,
        "-m",
        "trainer",
        "push",
        "-i",
        str(INVENTORY),
        str(data),
        name,
        "--bwlimit",
        "500",  # 32 s for the 16 MB: ample time to interrupt it after the first MB, however loaded
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    )
    deadline = time.monotonic() + 120
    # The bind-mounted shared dir shows rsync's temporary file (.NAME.XXXXXX) growing on the head.
    while not any(path.stat().st_size > 1_000_000 for path in datasets.glob(f".{name}.*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary file grew on the head within 120 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert not (datasets / name).exists()
    kept = (datasets / ".push-partial" / name).stat().st_size

    started = time.monotonic()
    again = push(INVENTORY, str(data), name, env=ENV, timeout=300)
    resume_s = time.monotonic() - started
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already there (resumed" in again.stdout, again.stdout
    assert f"data.path: {datasets / name}" in again.stdout
    assert (
        hashlib.sha256((datasets / name).read_bytes()).digest() == hashlib.sha256(data.read_bytes()).digest()
    )
    print(f"interrupted at {kept / 1e6:.1f} MB of 16 MB; the resumed push took {resume_s:.1f} s")
