"""trainer.safe_files: one way to write a file in a directory another account can write, used by the
package and (as a copy, checked identical here) by the node helper, which runs without the package."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from trainer import safe_files

REPO = Path(__file__).resolve().parents[2]
NODE_HELPER = REPO / "trainer" / "controller" / "launcher" / "playbooks" / "files" / "node_ctl.py"


def function_source(path: Path, name: str) -> str:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.dump(node)


def test_the_node_helper_writes_files_with_the_same_function():
    assert function_source(NODE_HELPER, "write_file") == function_source(
        REPO / "trainer" / "safe_files.py", "write_file"
    ), "node_ctl.write_file drifted from trainer.safe_files.write_file: copy it again"


def test_links_at_the_temporary_name_and_the_target_are_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("victim's\n")
    target = tmp_path / "report.json"
    (tmp_path / ".report.json.tmp").symlink_to(victim)
    target.symlink_to(victim)
    safe_files.write_file(target, "new\n", mode=0o640)
    assert victim.read_text() == "victim's\n"
    assert not target.is_symlink() and target.read_text() == "new\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "victim"]
    (tmp_path / "linked").symlink_to(victim)
    with pytest.raises(OSError):
        safe_files.read_text(tmp_path / "linked")
    assert os.path.exists(victim)
