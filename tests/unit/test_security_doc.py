"""docs/security.md's threat table names, for each threat, the tests that guard it: each must exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_test_the_threat_table_names_exists():
    text = (REPO / "docs" / "security.md").read_text()
    table = text[text.index("### Threats and the tests that guard them") :]
    named = re.findall(r"`(tests/[\w/]+\.py)`", table)
    assert len(named) >= 8, named
    missing = [path for path in named if not (REPO / path).is_file()]
    assert missing == [], f"docs/security.md names tests that do not exist: {missing}"
