"""`trainer push` of a directory someone else prepared reads nothing of the operator's through its links.

A second account (made with useradd) prepares a model directory, as an unpacked archive or a clone with
committed links would be, whose tokenizer.json links to the operator's credentials (root's file here),
and a dir link to root's key directory. The operator (root) pushes it to a one-host local inventory:
the push is refused before any copy, naming each link and where it points, and nothing lands on the
share. A Hugging Face cache snapshot (links into ../../blobs) still pushes."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers.accounts import as_account, local_account, open_dir, private_file
from helpers.loopback import write_inventory
from helpers.push_harness import digests, push

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")


@pytest.fixture(scope="module")
def preparer():
    with local_account("ct-r4-other") as account:
        yield account


def test_a_pushed_tree_whose_links_lead_outside_it_is_refused_naming_them(preparer, tmp_path):
    inventory, shared = write_inventory(tmp_path, nodes=1)
    with open_dir(owner=preparer) as base:
        credentials = private_file(base / "root-home", "credentials", "aws_secret_access_key = ROOT-SECRET\n")
        model = base / "model"

        def prepare() -> None:  # the other account's step, done as it
            model.mkdir()
            (model / "config.json").write_text('{"model_type": "qwen2"}\n')
            (model / "tokenizer.json").symlink_to(credentials)
            (model / "keys").symlink_to(credentials.parent)

        as_account(preparer, prepare)
        done = push(inventory, str(model), "planted")
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{model / 'tokenizer.json'} is a link to {credentials}" in done.stderr, done.stderr
        assert f"{model / 'keys'} is a link to {credentials.parent}" in done.stderr, done.stderr
        copied = shared / "models" / "planted"
        assert not copied.exists() or not any("ROOT-SECRET" in p.read_text() for p in copied.rglob("*"))
        assert not copied.exists(), "nothing may be copied from a refused tree"


def test_a_hugging_face_cache_snapshot_pushes_with_its_blobs(tmp_path):
    inventory, shared = write_inventory(tmp_path, nodes=1)
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(os.urandom(1000))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}\n")
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    done = push(inventory, str(snapshot), "tiny")
    assert done.returncode == 0, done.stdout + done.stderr
    assert digests(shared / "models" / "tiny")["model.safetensors"] == digests(repo / "blobs")["abc123"]
