"""No function of the launcher (trainer/controller/launcher, its playbooks' plugins and node helper
included) runs over LIMIT lines: one a reader can hold. A longer one wants its phases as functions of
their own, or an object per concern (issue 38)."""

from __future__ import annotations

import ast
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[3] / "trainer" / "controller" / "launcher"
#: Lines from `def` to the function's last line, its docstring and comments included.
LIMIT = 80


def test_no_launcher_function_is_over_the_limit():
    long = []
    for path in sorted(LAUNCHER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LIMIT:
                    long.append(f"{path.relative_to(LAUNCHER)}:{node.lineno} {node.name} ({length} lines)")
    assert long == [], f"split these (at most {LIMIT} lines each):\n" + "\n".join(long)
