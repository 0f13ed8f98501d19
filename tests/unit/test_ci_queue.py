"""CI runs the bed-free tests as a queue of chunks both of its sides take from (scripts/ci_queue.py):
the chunks together must be what `make test` selects bed-free, each test file once, and none of the
bed's; a test left out as a twin (bed_twin) names a test that exists and that CI runs on real hosts
over real SSH (the bed's, or simulated nodes')."""

from __future__ import annotations

import importlib.util
import re
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
        # The selection make test makes (make test-fast leaves bed_twin in, for machines without the bed).
        assert command[command.index("-m") + 1] == "not testbed and not bed_twin"
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


def test_lint_comes_first_the_docs_last_and_the_fresh_install_is_in_the_queue():
    """The fresh install (minutes) is taken among the long chunks, not last, where one worker ran it
    for 8.5 min while the others had nothing left; the docs (seconds) are last."""
    queue = load_queue()
    names = [name for name, _ in queue.chunks()]
    assert names[0] == "lint" and names[-1] == "docs"
    assert names.count("fresh-install") == 1
    assert names.index("fresh-install") < names.index("local-1")


def test_every_bed_twin_names_a_bed_test_that_exists_and_make_test_selects_as_ci_does():
    twins = []
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        for match in re.finditer(r"@pytest\.mark\.bed_twin\(\s*((?:\"[^\"]*\"\s*)+)\)", text):
            twins.append((path, "".join(re.findall(r'"([^"]*)"', match.group(1)))))
    assert twins, "no bed_twin found: the pattern no longer matches how they are written"
    for path, named in twins:
        file, test = named.split("::")
        bed_file = REPO / file
        # A test on real hosts over real SSH: the bed's, or one on simulated nodes (tests/local/*_sim.py,
        # which CI runs: scripts/ci_queue.py).
        on_real_ssh = "testbed" in bed_file.parts or bed_file.name.endswith("_sim.py")
        assert on_real_ssh and bed_file.is_file(), f"{path.name} names {named}"
        assert "bed_twin" not in bed_file.read_text(), f"{named} is itself left out of CI"
        defined = re.search(rf"^def {re.escape(test)}\(", bed_file.read_text(), re.M)
        assert defined, f"{path.name} names {named}"
    makefile = (REPO / "Makefile").read_text()
    assert f'TEST_FAST_MARKS="{load_queue().SELECTION}"' in makefile
