"""tests/testbed: the tests that need the Molecule test bed (scripts/testbed/run-scenario.sh brings it
up and runs `pytest -m testbed`). Every test here is marked `testbed`, so `make test-fast`
(`-m "not testbed"`) leaves them out; the modules add `slow` and the skip while the bed is down."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


# First, so that `-m` (pytest's own hook) selects by the marker added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The hook sees the whole session's items, not only this folder's.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.testbed)
    # bed_last: a test that leaves the nodes' converged record so that the next converged run must be
    # a full one (about 95 s of CI's critical path) runs after every other, where nobody pays for it.
    items[:] = sorted(
        items,
        key=lambda item: (
            item.get_closest_marker("bed_last") is not None,
            FRESH_RECORD_FIRST.index(item.path.name)
            if item.path.name in FRESH_RECORD_FIRST
            else len(FRESH_RECORD_FIRST),
        ),
    )


#: The bed's modules that run first, in this order (the others keep theirs): each starts with a
#: site.yml run with the converged check on, a skip of seconds where the nodes' record is fresh and a
#: full run (about 1 to 1.5 min) where another test left it stale, and each leaves it fresh for the
#: next. Molecule's last converge (the idempotence run, a full run from the same inventory) writes it.
#: test_access_testbed.py, first by name before, provisions from another inventory (a password file),
#: which made test_converged_limits_testbed.py's first run a full one; test_up_testbed.py came after
#: tests that leave it stale (its first run took about 57 s).
FRESH_RECORD_FIRST = ("test_converged_limits_testbed.py", "test_converged_testbed.py", "test_up_testbed.py")
