"""Each role's meta/argument_specs.yml lists exactly the variables its defaults define, with sane specs.

robertdebock's roles drifted here (specs naming variables the defaults no longer had); this keeps
the two in step: add a default, and this test asks for its spec, and the other way round.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[3] / "roles"
PY_TYPES = {"bool": bool, "int": int, "float": float, "list": list, "dict": dict, "str": str}


def role_defaults(role: Path) -> dict:
    return yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {}


def documented_roles() -> list[Path]:
    return sorted(p for p in ROLES.iterdir() if (p / "defaults").is_dir())


def test_every_role_keeps_its_defaults_in_one_file():
    """One skeleton: defaults/main.yml and nothing beside it, where a reader (and gen_docs.py) looks.
    A defaults/main/ directory would be loaded by Ansible as well, unseen by the docs and this test."""
    for role in documented_roles():
        found = sorted(p.relative_to(role).as_posix() for p in (role / "defaults").iterdir())
        assert found == ["defaults/main.yml"], (
            f"{role.name}: defaults in {found}: keep them in defaults/main.yml"
        )


def test_every_role_with_defaults_has_specs():
    roles = documented_roles()
    assert {r.name for r in roles} >= {
        "users",
        "ssh_trust",
        "timesync",
        "firewall",
        "nfs_server",
        "nfs_client",
        "trainer_env",
    }
    for role in roles:
        assert (role / "meta" / "argument_specs.yml").exists(), f"{role.name}: add meta/argument_specs.yml"


@pytest.mark.parametrize("role", documented_roles(), ids=lambda p: p.name)
def test_specs_and_defaults_agree(role: Path):
    defaults = role_defaults(role)
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"][
        "options"
    ]
    assert set(specs) == set(defaults), (
        f"{role.name}: only in specs: {sorted(set(specs) - set(defaults))}; "
        f"only in defaults: {sorted(set(defaults) - set(specs))}"
    )
    for name, value in defaults.items():
        spec = specs[name]
        assert name.startswith(role.name + "_"), f"{name}: defaults carry the role prefix"
        assert spec.get("description"), f"{role.name}.{name}: describe it"
        assert spec.get("type") in PY_TYPES, f"{role.name}.{name}: give it a type"
        assert "default" not in spec, f"{role.name}.{name}: the default lives in defaults/ only"
        templated = isinstance(value, str) and "{{" in value
        if templated:
            continue
        expected = PY_TYPES[spec["type"]]
        ok = isinstance(value, expected) or (expected is float and isinstance(value, int))
        assert ok, f"{role.name}.{name}: default {value!r} is not a {spec['type']}"
        if "choices" in spec:
            assert value in spec["choices"], f"{role.name}.{name}: default {value!r} not in {spec['choices']}"


def test_every_default_has_a_comment():
    """One line of comment above each default says what it is for (read in defaults/, not only here)."""
    for role in documented_roles():
        path = role / "defaults" / "main.yml"
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line and not line[0].isspace() and not line.startswith(("#", "---")) and ":" in line:
                name = line.split(":")[0]
                assert i > 0 and lines[i - 1].startswith("#"), f"{path}: comment the default {name}"
