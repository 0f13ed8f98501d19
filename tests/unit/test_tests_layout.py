"""tests/ stays laid out by tier: a test module sits in its tier's folder (unit/, local/, testbed/),
imports helpers from tests/helpers and never another test module, and its basename is its own.

Why each matters: pytest imports test modules by basename (the default import mode; the folders are
not packages), so two modules of one name fail the whole collection; a test module imported by
another runs its module-level marks and fixtures where nobody reads them; and the `testbed` marker
comes from tests/testbed/conftest.py alone, so a bed test outside that folder would run in
`make test-fast` against a bed that is not there."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = {"unit", "unit/controller", "unit/node", "unit/roles", "local", "testbed"}


def modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_module_or_helper_imports_a_test_module():
    offenders = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path in [*modules(), *(TESTS / "helpers").glob("*.py")]
        for name in sorted(imported_modules(path))
        if name.split(".")[-1].startswith("test_") or name.split(".")[0] == "conftest"
    ]
    assert offenders == [], "move what is shared into tests/helpers/:\n" + "\n".join(offenders)


def test_every_test_module_sits_in_a_tier_folder():
    misplaced = [
        str(path.relative_to(TESTS))
        for path in modules()
        if path.parent.relative_to(TESTS).as_posix() not in TIERS
    ]
    assert misplaced == [], f"put these under one of tests/{{{', '.join(sorted(TIERS))}}}: {misplaced}"
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["conftest.py"], (
        "tests/ itself holds conftest.py only"
    )


def test_basenames_are_unique():
    counts = Counter(path.name for path in modules())
    assert [name for name, n in counts.items() if n > 1] == []


def test_a_suffix_agrees_with_the_folder():
    disagree = [
        str(path.relative_to(TESTS))
        for path in modules()
        for suffix, tier in (("_testbed", "testbed"), ("_local", "local"))
        if path.stem.endswith(suffix) and path.parent.name != tier
    ]
    assert disagree == [], f"rename or move: {disagree}"


def test_only_the_testbed_conftest_marks_testbed():
    """A module that marks itself `testbed` outside tests/testbed is a bed test in the wrong folder;
    inside it, the mark is the conftest's to add."""
    marking = [
        str(path.relative_to(TESTS))
        for path in [*modules(), *(TESTS / "helpers").glob("*.py")]
        if path != Path(__file__).resolve() and "mark.testbed" in path.read_text()
    ]
    assert marking == [], f"move these to tests/testbed/ and drop their own testbed mark: {marking}"
