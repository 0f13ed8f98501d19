"""scripts/pack-wheelhouse.py, as trainer_env runs it on the controller: the same wheelhouse gives the
same tar and checksum without packing again; any change to it is packed and gets a new checksum
(which makes provisioning copy it to the nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "pack-wheelhouse.py"


def pack(wheelhouse: Path, out: Path) -> dict:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--wheelhouse", str(wheelhouse), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout)


def test_unchanged_wheelhouse_is_not_packed_again_and_a_change_is(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "a-1.0-py3-none-any.whl").write_bytes(b"wheel a")
    out = tmp_path / "cache" / "wheelhouse.tar"
    first = pack(wheelhouse, out)
    assert first["packed"] is True and Path(first["tar"]) == out
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == [".", "./a-1.0-py3-none-any.whl"]
        assert {member.mtime for member in tar.getmembers()} == {0}  # reproducible
    second = pack(wheelhouse, out)
    assert second == {**first, "packed": False}

    (wheelhouse / "b-2.0-py3-none-any.whl").write_bytes(b"wheel b")
    third = pack(wheelhouse, out)
    assert third["packed"] is True and third["sha1"] != first["sha1"]

    (wheelhouse / "b-2.0-py3-none-any.whl").unlink()  # back to the first contents: the first bytes
    fourth = pack(wheelhouse, out)
    assert fourth["packed"] is True and fourth["sha1"] == first["sha1"]
