"""The package's two sides stay apart: the node side imports without Ansible, the controller side
without torch, neither reaches into the other, and no trainer module imports itself in a circle.

The nodes' venv has no Ansible and the controller's has no torch (pyproject's extras); an import
across the line would fail only there, on a real cluster. These tests block the other side's
packages in a fresh interpreter, so the failure shows up here instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trainer"
# Playbook files are scripts copied to the nodes, not modules of the package.
SCRIPT_DIRS = ("playbooks",)

NODE_ONLY = ("torch", "deepspeed", "accelerate", "transformers", "peft", "numpy", "pynvml", "bitsandbytes")
CONTROLLER_ONLY = ("ansible", "ansible_runner", "rich", "iperf3")

# Runs in a fresh interpreter: the blocked top-level packages look uninstalled (None in sys.modules:
# `import` raises ModuleNotFoundError and importlib.util.find_spec says None, as for a missing
# package, so optional-dependency probes in third-party code behave as on the real node or
# controller), then every module of the side is imported.
IMPORT_ALL = """
import importlib, pkgutil, sys
blocked = set(sys.argv[2].split(","))
sys.modules.update(dict.fromkeys(blocked))
package = importlib.import_module(sys.argv[1])
# trainer.ds_config, trainer.engine_names and trainer.run_paths are shared: both sides import them (the
# DeepSpeed config builder, the engine names, a run's paths), so both import them here.
names = [sys.argv[1], "trainer.cli", "trainer.exitcodes", "trainer.configerror", "trainer.redaction"]
names += ["trainer.ds_config", "trainer.engine_names", "trainer.run_paths"]
names += [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
loaded = sorted(name for name in blocked if sys.modules.get(name) is not None)
assert not loaded, loaded
print(len(names))
"""


def module_files() -> list[Path]:
    return [
        path
        for path in PACKAGE.rglob("*.py")
        if not any(part in SCRIPT_DIRS for part in path.relative_to(PACKAGE).parts)
    ]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def trainer_imports(path: Path) -> set[str]:
    """Every trainer module this file imports, at top level, in functions or under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
            found.add(node.module)
            # `from trainer.node import data` imports the module trainer.node.data
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    unknown = {m for m in found if m.startswith("trainer.") and not _exists(m)}
    assert not unknown, f"{path} imports modules that do not exist: {sorted(unknown)}"
    return found


def _exists(dotted: str) -> bool:
    """A module or package of the tree, or a name defined in one (`from trainer.x import name`)."""
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or _exists_as_name(dotted)


def _exists_as_name(dotted: str) -> bool:
    parent = REPO.joinpath(*dotted.split(".")[:-1])
    return parent.with_suffix(".py").exists() or (parent / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in module_files()}
    return {
        name: {m for m in trainer_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


@pytest.mark.parametrize(
    ("side", "blocked"),
    [("trainer.node", CONTROLLER_ONLY), ("trainer.controller", NODE_ONLY)],
    ids=["node-without-ansible", "controller-without-torch"],
)
def test_each_side_imports_without_the_other_sides_packages(side: str, blocked: tuple[str, ...]) -> None:
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, side, ",".join(blocked)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, f"importing {side} with {blocked} absent failed:\n{run.stderr[-3000:]}"
    assert int(run.stdout.split()[-1]) >= 10  # the walk found the side's modules


def test_controller_plans_the_embedded_default_without_torch() -> None:
    """`trainer plan` validates the training config on the controller: with torch absent it still works."""
    script = IMPORT_ALL.split("package = ")[0] + (
        "from trainer.cli import main\nsys.exit(main(['plan', '-i', 'inventory/local']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "trainer.controller", ",".join(NODE_ONLY)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torchrun" in run.stdout


def test_the_sides_never_import_each_other() -> None:
    crossings = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        for target in targets
        if (name.startswith("trainer.node") and target.startswith("trainer.controller"))
        # The controller validates training configs ahead of a launch: only the config loader.
        or (
            name.startswith("trainer.controller")
            and target.startswith("trainer.node")
            and target not in ("trainer.node", "trainer.node.config")
        )
    ]
    assert crossings == []


def test_no_import_circles() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            # A package's own __init__ importing its submodules lazily (create_engine) is not a circle
            # with the submodule importing the package's base class.
            if target.startswith(name + "."):
                continue
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)
