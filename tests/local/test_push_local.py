"""`trainer push` against a real OpenSSH server on this machine (tests/helpers/local_sshd.py) with real rsync:
the head is reached over ssh as root, as an inventory reaches it, and the copy runs there as the
training account (`nobody` here) through sudo, as on a cluster. The shared dir is a directory only
that account may write. A one-host inventory with a local connection covers `inventory/local`."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from helpers.local_sshd import local_sshd
from helpers.loopback import write_inventory
from helpers.push_harness import digests, push

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

TRAINING_USER = "nobody"

pytestmark = pytest.mark.skipif(
    shutil.which("rsync") is None or shutil.which("sudo") is None,
    reason="needs rsync and sudo (scripts/system-packages.txt, group testbed)",
)


@pytest.fixture
def cluster(tmp_path):
    """(inventory, shared dir, sshd dir): one head reached over ssh; the shared dir belongs to the
    training account and no one else may write it (its parents open to it, as /srv would be)."""
    sshd = tmp_path / "sshd"
    head_vars = local_sshd(sshd)
    outside = Path(tempfile.mkdtemp(prefix="push-shared-", dir="/tmp"))
    outside.chmod(0o755)
    shared = outside / "shared"
    shared.mkdir(mode=0o755)
    account = pwd.getpwnam(TRAINING_USER)
    os.chown(shared, account.pw_uid, account.pw_gid)
    inventory, _ = write_inventory(
        tmp_path, nodes=1, cluster_training_user=TRAINING_USER, cluster_shared_dir=str(shared)
    )
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    node = hosts["cluster"]["children"]["head"]["hosts"]["node0"]
    node.pop("ansible_python_interpreter")
    node.update(head_vars, ansible_host="node0")
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    yield inventory, shared, sshd
    shutil.rmtree(outside, ignore_errors=True)


def tiny_model(root: Path) -> Path:
    """A model directory shaped like a Hugging Face cache snapshot: config, tokenizer, 2 MB of weights
    reached through a link into a blobs dir beside it, and a nested dir."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "weights").write_bytes(os.urandom(2_000_000))
    model = root / "snapshot" / "tiny-qwen"
    (model / "extra").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}\n')
    (model / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (model / "extra" / "notes.txt").write_text("made by the test\n")
    (model / "model.safetensors").symlink_to(os.path.relpath(blobs / "weights", model))
    return model


def test_push_copies_as_the_training_account_and_a_second_push_copies_nothing(cluster, tmp_path):
    inventory, shared, _ = cluster
    model = tiny_model(tmp_path / "hub")

    started = time.monotonic()
    first = push(inventory, str(model))
    first_s = time.monotonic() - started
    assert first.returncode == 0, first.stderr
    pushed = shared / "models" / "tiny-qwen"
    assert f"model.name_or_path: {pushed}" in first.stdout
    assert "copied 4 files (2.0 MB)" in first.stdout
    assert "checksums: all 4 file(s) on node0 match" in first.stdout
    # The weights behind the link arrived as a file (the link's target is outside what was pushed).
    assert not (pushed / "model.safetensors").is_symlink()
    assert digests(pushed) == digests(model)
    owners = {pwd.getpwuid(path.stat().st_uid).pw_name for path in [pushed, *pushed.rglob("*")]}
    assert owners == {TRAINING_USER}, "the copy must run as the training account"

    started = time.monotonic()
    second = push(inventory, str(model))
    second_s = time.monotonic() - started
    assert second.returncode == 0, second.stderr
    assert "nothing to copy: every file is already there" in second.stdout
    assert "checksums: all 4 file(s) on node0 match" in second.stdout
    print(f"first push {first_s:.1f} s, second push {second_s:.1f} s")


@pytest.mark.parametrize("how", ["ctrl-c", "term"])
def test_an_interrupted_push_resumes_where_it_stopped(cluster, tmp_path, how):
    """Ctrl-C at a terminal (SIGINT to the whole process group) or TERM to trainer push alone (a
    scheduler, `kill`): rsync keeps what it copied either way."""
    inventory, shared, _ = cluster
    data = tmp_path / "big.bin"
    data.write_bytes(os.urandom(16_000_000))
    # At 0.5 MB/s the copy takes 32 s, 30 of them after the first MB: time to interrupt it on the way
    # even where this test gets little CPU (at 2 MB/s, CI's niced queue once saw it end first).
    command = [sys.executable, "-m", "trainer", "push", "-i", str(inventory), str(data), "--bwlimit", "500"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    datasets = shared / "datasets"
    deadline = time.monotonic() + 60
    # rsync writes into a temporary file (.big.bin.XXXXXX) beside the destination while it copies.
    while not any(path.stat().st_size > 1_000_000 for path in datasets.glob(".big.bin.*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no partial file grew within 60 s"
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.terminate()
    out, err = proc.communicate(timeout=60)
    partial = datasets / ".push-partial" / "big.bin"
    # The far side's rsync keeps the partial file when the connection closes: moments after the local
    # rsync has ended, later on a loaded machine (a user's next push comes seconds later).
    deadline = time.monotonic() + 15
    while not partial.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # What the shared dir holds, for every assertion's message (a failure once in CI under load).
    held = sorted(f"{path.relative_to(datasets)} {path.stat().st_size}" for path in datasets.rglob("*"))
    said = f"{out}{err}\nshared datasets/: {held}"
    assert proc.returncode == 130, said
    assert "run the same command again" in err, said
    assert not (datasets / "big.bin").exists(), f"a half-copied file must not sit under its name; {said}"
    assert partial.is_file(), said
    kept = partial.stat().st_size
    assert kept > 1_000_000, said

    again = push(inventory, str(data))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already there (resumed" in again.stdout, again.stdout
    assert f"data.path: {shared / 'datasets' / 'big.bin'}" in again.stdout
    assert (
        hashlib.sha256((shared / "datasets" / "big.bin").read_bytes()).digest()
        == hashlib.sha256(data.read_bytes()).digest()
    )
    assert not partial.exists()
    print(f"interrupted with {kept / 1e6:.1f} MB of 16 MB copied; the second push resumed from it")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["{missing}"], "does not exist"),
        (["{model}", "a/b"], "no '/'"),
        (["{model}", ".."], "no '..'"),
        (["{model}", "x..y"], "no '..'"),
        (["{model}", "my model"], "no spaces"),
        (["{model}", "m;reboot"], "e.g. m-reboot"),
        (["{model}", "ok-name", "--bwlimit", "-1"], "--bwlimit"),
        (["{bad_inventory}", "{model}"], "cluster_shared_dir"),
    ],
)
def test_bad_input_is_refused_before_any_host_is_touched(cluster, tmp_path, args, said):
    inventory, shared, sshd = cluster
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    bad = tmp_path / "bad"
    shutil.copytree(inventory, bad)
    (bad / "group_vars" / "cluster" / "zz.yml").write_text("cluster_shared_dir: relative/dir\n")
    values = {"missing": str(tmp_path / "nothere"), "model": str(model)}
    filled = [arg.format(**values) for arg in args if arg != "{bad_inventory}"]
    done = push(bad if "{bad_inventory}" in args else inventory, *filled)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr
    assert not list((sshd / "sessions").iterdir()), "no connection may be made for bad input"
    assert not any(shared.iterdir())


def test_a_one_host_local_inventory_gets_the_file_as_this_account(tmp_path):
    """inventory/local's shape: the head is this machine (ansible_connection local); a single file."""
    inventory, shared = write_inventory(tmp_path, nodes=1)
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    done = push(inventory, str(data), "support-chats")
    assert done.returncode == 0, done.stderr
    assert f"data.path: {shared / 'datasets' / 'support-chats'}" in done.stdout
    assert (shared / "datasets" / "support-chats").read_text() == data.read_text()
