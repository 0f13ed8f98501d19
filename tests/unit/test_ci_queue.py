"""CI runs the bed-free tests as a queue of chunks both of its sides take from (scripts/ci_queue.py):
the chunks together must be what `make test-fast` selects, each test file once, and none of the bed's."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_queue():
    spec = importlib.util.spec_from_file_location("ci_queue", REPO / "scripts" / "ci_queue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chunks_hold_every_bed_free_test_file_once_and_no_bed_test():
    queue = load_queue()
    named = Counter()
    for _, command in queue.chunks():
        if "pytest" not in command[0]:
            continue
        assert command[command.index("-m") + 1] == "not testbed"  # the selection make test-fast makes
        for arg in command:
            path = REPO / arg
            if arg.startswith("tests/"):
                files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
                named.update(str(f.relative_to(REPO)) for f in files)
    wanted = {
        str(f.relative_to(REPO))
        for f in (REPO / "tests").rglob("test_*.py")
        if "testbed" not in f.relative_to(REPO / "tests").parts
    }
    assert set(named) == wanted, set(named) ^ wanted
    assert [f for f, n in named.items() if n > 1] == []


def test_the_docs_and_the_fresh_install_are_in_the_queue_after_the_tests():
    names = [name for name, _ in load_queue().chunks()]
    assert names[-2:] == ["docs", "fresh-install"]
