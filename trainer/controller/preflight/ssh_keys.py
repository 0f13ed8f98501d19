"""SSH trust by content: whether node A's key opens node B, and whether A has B's host key pinned,
decided on the controller from what each node's probe read (ssh_peers.py's "keys"). N reads prove
all N(N-1) pairs' keys; the sampled logins (preflight.schedule) prove the rest of the path.

What content cannot see (an AuthorizedKeysCommand, certificates, a known_hosts file elsewhere) is
caught by the logins: where a real login succeeded although the content said it would not, the
content is not trusted for that node, and its content-only verdicts become warnings, not failures.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from dataclasses import dataclass
from typing import Any

#: A pair's verdict by content: None when fine.
AUTH = "auth"
HOST_KEY = "host_key"


def from_allows(patterns: str, address: str) -> bool:
    """sshd's from="..." rule for a source address: a negated match refuses, else any match admits
    (patterns are CIDRs or wildcards; an empty option admits everyone)."""
    if not patterns:
        return True
    allowed = False
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        try:
            matched = ipaddress.ip_address(address) in ipaddress.ip_network(pattern, strict=False)
        except ValueError:
            matched = fnmatch.fnmatchcase(address.lower(), pattern.lower())
        if matched and negated:
            return False
        allowed = allowed or matched
    return allowed


@dataclass(frozen=True)
class Problem:
    kind: str
    """AUTH (the key does not open the peer) or HOST_KEY (not pinned, changed, revoked)."""
    detail: str
    fix: str


def auth_problem(
    source: str, address: str, peer: str, user: str, mine: dict[str, Any], theirs: dict[str, Any]
) -> Problem | None:
    """Why `source`'s key would not open `user` on `peer`, from their keys (None: it would);
    `address` is the source's, the one a from= pattern is matched against."""
    keys = set(mine.get("identities") or [])
    if not keys:
        return Problem(
            AUTH,
            f"{user} on {source} has no SSH key pair (no ~/.ssh/id_*.pub beside an identity ssh offers)",
            f"install the cluster key pair for {user} on {source}: "
            "ansible-playbook site.yml --tags ssh_trust",
        )
    entries = [e for e in theirs.get("authorized") or [] if e.get("key") in keys]
    if not entries:
        return Problem(
            AUTH,
            f"{peer} refuses {user}'s key from {source}: not in ~{user}/.ssh/authorized_keys on {peer}",
            f"add {source}'s public key for {user} to ~{user}/.ssh/authorized_keys on {peer} "
            "(the ssh trust role does: ansible-playbook site.yml --tags ssh_trust)",
        )
    if not any(from_allows(str(e.get("from") or ""), address) for e in entries):
        shown = "; ".join(sorted({str(e.get("from")) for e in entries}))
        return Problem(
            AUTH,
            f"{peer} accepts {user}'s key only from {shown}, not from {source} ({address})",
            f"add {address} to the key's from= on {peer}: ansible-playbook site.yml --tags ssh_trust "
            "(ssh_trust_key_from lists every node's cluster_ip)",
        )
    return None


def host_key_problem(
    source: str, peer: str, user: str, pinned: dict[str, Any] | None, host_keys: list[str]
) -> Problem | None:
    """Why `source` would refuse `peer`'s host key (None: one of the peer's keys is pinned there)."""
    pinned = pinned or {}
    host = str(pinned.get("host") or peer)
    known = set(pinned.get("keys") or [])
    if pinned.get("revoked"):
        return Problem(
            HOST_KEY,
            f"{peer}'s host key is marked @revoked in known_hosts on {source}",
            f"investigate {peer} before connecting; if it was reinstalled, replace the revoked entry in "
            f"/etc/ssh/ssh_known_hosts on {source} (ansible-playbook site.yml --tags ssh_trust)",
        )
    if known & set(host_keys) or (pinned.get("ca") and not known):
        return None  # a certificate authority vouches: only a login shows whether it signed the key
    if known:
        return Problem(
            HOST_KEY,
            f"{peer}'s host key changed since it was pinned on {source} (known_hosts for {host})",
            f"if {peer} was reinstalled, remove the old key (ssh-keygen -R {host} as {user} on {source}) and "
            "pin the new one (ansible-playbook site.yml --tags ssh_trust); otherwise investigate before "
            "connecting",
        )
    return Problem(
        HOST_KEY,
        f"{peer}'s host key is not pinned for {user} on {source} (known_hosts has no {host})",
        f"pin {peer}'s host key ({host}) in /etc/ssh/ssh_known_hosts on {source} after checking its "
        "fingerprint (the ssh trust role pins every node: ansible-playbook site.yml --tags ssh_trust); "
        "never use StrictHostKeyChecking=no",
    )


def pair_problems(
    source: str, address: str, peer: str, user: str, keys: dict[str, dict[str, Any]]
) -> list[Problem]:
    """What the content says would stop `source` (at `address`) logging in to `peer` ([] when nothing)."""
    mine, theirs = keys[source], keys[peer]
    pinned = (mine.get("known") or {}).get(peer)
    found = [
        auth_problem(source, address, peer, user, mine, theirs),
        host_key_problem(source, peer, user, pinned, theirs.get("host_keys") or []),
    ]
    return [p for p in found if p is not None]
