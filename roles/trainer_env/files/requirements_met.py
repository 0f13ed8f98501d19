"""Say whether this venv already has everything a pip requirement list asks for (trainer_env).

    python requirements_met.py [-r FILE ...] [REQUIREMENT ...]

Run with the venv's python. Walks the requirements and everything they depend on, as installed
(markers evaluated for this interpreter, extras followed), and prints JSON {"met": bool, "unmet":
[...]}: an installed distribution whose version is outside a range asked for, or a missing one, is
unmet. A met list lets provisioning skip `pip install`, whose start-up and resolve took 10-25 s per
node on every idempotent run; anything unmet, or no `packaging` to read the requirements with (a
venv not yet installed), leaves the decision to pip.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys


def read_requirements(argv: list[str]) -> list[str]:
    lines, args = [], iter(argv)
    for arg in args:
        if arg == "-r":
            with open(next(args), encoding="utf-8") as handle:
                lines += [line.split("#", 1)[0].strip() for line in handle]
        else:
            lines.append(arg)
    return [line for line in lines if line]


def unmet(requirements: list[str]) -> list[str]:
    from packaging.requirements import Requirement

    problems, seen = [], set()
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = (req.name.lower().replace("_", "-"), tuple(sorted(req.extras)), str(req.specifier))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req} (installed: {dist.version})")
            continue
        for text in dist.requires or []:
            dependency = Requirement(text)
            for wanted in ("", *req.extras):
                todo.append((dependency, wanted))
    return problems


def main() -> int:
    try:
        problems = unmet(read_requirements(sys.argv[1:]))
    except ImportError as err:  # no packaging in this venv yet: pip decides
        problems = [f"cannot read requirements here ({err})"]
    except OSError as err:  # a requirement list not copied yet (check mode): pip decides
        problems = [f"cannot read {err.filename} ({err.strerror})"]
    print(json.dumps({"met": not problems, "unmet": problems}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
