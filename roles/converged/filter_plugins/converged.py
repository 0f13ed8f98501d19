"""Filters of the converged check (roles/converged/README.md), run on the controller.

`converged_inputs`: one digest of everything a full site.yml run is made from, other than the
nodes' own state: this checkout's roles, playbooks, scripts and trainer sources (the wheel the nodes
get), the wheelhouse's listing, Ansible's version, and every cluster host's inventory variables.
When it differs from the digest a node's record holds, the roles run.

`converged_spec`: the items the roles named for the record (their `<role>_converged_watch` facts), merged.
`converged_cluster_digest`: the inputs and every node's state digest, as one digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]
#: What a run is made from (the wheel's own parts included: scripts/build-node-wheel.py builds it
#: from pyproject.toml, README.md and trainer/).
SOURCE_PARTS = ("site.yml", "playbooks", "roles", "scripts", "pyproject.toml", "README.md", "trainer")
#: Connection variables that decide what a role writes (ufw's SSH rule, known_hosts' ports); the
#: other ansible_* names are Ansible's own, facts, or secrets.
CONNECTION_VARS = {"ansible_host", "ansible_port", "ansible_user"}
#: Ansible's magic variables that say where or how this run started, not what it provisions.
#: converged_full_run only says whether to use the record, not what the roles write.
RUN_VARS = {
    "inventory_file",
    "inventory_dir",
    "playbook_dir",
    "omit",
    "groups",
    "role_names",
    "play_hosts",
    "converged_full_run",
}
#: Molecule's own variables (molecule_file, molecule_yml, molecule_ephemeral_directory, ...), which it
#: writes into every inventory it runs with: they say where the test harness keeps its files, not what
#: a role writes. Kept in, a record written under Molecule never matched a plain ansible-playbook run
#: of the same inventory (CI's first checked run after `molecule test` was a full one, ~2 min).
HARNESS_PREFIXES = ("molecule_",)
#: Secrets never enter the digest (it is stored on every node); none of them decides what a role
#: writes (become and SSH passwords only open the connection).
SECRET_NAME = re.compile(r"pass(word|wd)?$|passphrase|secret|token|credential", re.I)
SPEC_KINDS = ("paths", "listings", "services", "packages", "users", "groups", "mounts")
#: Kinds that are on or off (library/converged_state.py reads them): ufw's rules, sshd's ports.
FLAG_KINDS = ("ufw", "sshd")


def flag(value) -> bool:
    """A role's on/off value; a template may hand it over as the text "False"."""
    return value.strip().lower() in ("true", "yes", "1") if isinstance(value, str) else bool(value)


def source_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for part in SOURCE_PARTS:
        path = root / part
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            ]
    return sorted(files)


def wheelhouse_listing(path: str) -> list[list]:
    """Name, size and mtime of each file (what scripts/pack-wheelhouse.py keys its tar on)."""
    if not path or not os.path.isdir(path):
        return []
    return sorted(
        [entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
        for entry in os.scandir(path)
        if entry.is_file()
    )


def host_inputs(variables: Mapping) -> dict:
    """The host's inventory variables, without facts, Ansible's own variables and secrets."""
    facts = variables.get("ansible_facts") or {}
    kept = {}
    for name in sorted(variables.keys()):
        if name in RUN_VARS or name in facts or SECRET_NAME.search(name):
            continue
        if name.startswith(HARNESS_PREFIXES):
            continue
        if name.startswith("ansible_") and name not in CONNECTION_VARS:
            continue
        try:
            kept[name] = variables[name]
        except Exception as err:  # an undefined or broken template: its text decides nothing new
            kept[name] = f"<{type(err).__name__}>"
    return kept


def converged_inputs(hostvars: Mapping, groups: Mapping, ansible_version: str) -> str:
    digest = hashlib.sha256()
    for path in source_files(CHECKOUT):
        digest.update(str(path.relative_to(CHECKOUT)).encode() + b"\0" + path.read_bytes() + b"\0")
    cluster = sorted(groups.get("cluster", []))
    hosts = {host: host_inputs(hostvars[host]) for host in cluster}
    wheelhouses = sorted({str(hosts[host].get("training_wheelhouse") or "") for host in cluster})
    extra = {
        "ansible": ansible_version,
        "hosts": hosts,
        "groups": {name: sorted(groups.get(name, [])) for name in ("cluster", "head", "workers")},
        "wheelhouses": {path: wheelhouse_listing(path) for path in wheelhouses},
    }
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def converged_spec(watches: Iterable[Mapping]) -> dict:
    """The roles' watch lists, merged into one spec (each list sorted, without repeats)."""
    merged: dict = {kind: set() for kind in SPEC_KINDS}
    flags = dict.fromkeys(FLAG_KINDS, False)
    for watch in watches:
        for kind, items in watch.items():
            if kind in flags:
                flags[kind] = flags[kind] or flag(items)
            elif kind in merged:
                merged[kind].update(str(item) for item in items or [] if str(item))
            else:
                raise ValueError(
                    f"converged_spec: unknown kind {kind!r} (known: {', '.join(SPEC_KINDS + FLAG_KINDS)})"
                )
    spec: dict = {kind: sorted(items) for kind, items in merged.items()}
    spec.update(flags)
    return spec


def converged_cluster_digest(host_digests: Mapping, inputs: str) -> str:
    """One digest of the inputs and every node's state: the same in every node's record of one run."""
    text = json.dumps(
        {"inputs": inputs, "hosts": {str(h): str(d) for h, d in host_digests.items()}}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()


class FilterModule:
    def filters(self) -> dict[str, Callable]:
        return {
            "converged_inputs": converged_inputs,
            "converged_spec": converged_spec,
            "converged_cluster_digest": converged_cluster_digest,
        }
