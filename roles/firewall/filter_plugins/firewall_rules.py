"""Filters for the firewall role: ufw's rule lines, the rules to remove, and the kernel's drift.

`firewall_ufw_line`: the line `ufw show added` prints for an allow rule community.general.ufw made
from a port, proto, source and comment; the one spelling both the "already there" test and the
"not wanted" test compare with.
`firewall_unwanted_rules`: the allow and limit rules ufw has that the role did not ask for (added by
hand, or left by an earlier inventory). Deny and reject rules only narrow what is open: kept.
`firewall_delete_argv`: the `ufw delete ...` argv that removes one such line (ufw accepts the rule as
`show added` prints it, comment included).
`firewall_kernel_drift`: from the role's count of ufw's rules in its files and in the kernel, what
the kernel lacks: rules flushed with iptables or nft behind ufw's back, which ufw's own status (read
from its files) does not show.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from typing import Any

_COUNTS = re.compile(r"^(\S+) (\S+) files=(\d+) kernel=(\d+)$")
_JUMPS = re.compile(r"^INPUT jumps=(\d+)$")


def firewall_ufw_line(rule: dict[str, Any]) -> str:
    """ "ufw allow from 10.0.0.2 to any port 2049 proto tcp comment 'nfs_server: NFS'", or
    "ufw allow 22/tcp comment 'firewall: SSH'" when the source is "any"."""
    port, proto, source = str(rule["port"]), str(rule["proto"]), str(rule["source"])
    where = f"{port}/{proto}" if source == "any" else f"from {source} to any port {port} proto {proto}"
    return f"ufw allow {where} comment '{rule['comment']}'"


def firewall_unwanted_rules(added: Iterable[Any], wanted: Iterable[Any]) -> list[str]:
    keep = {str(line) for line in wanted}
    unwanted = []
    for line in added:
        words = str(line).split()
        action = words[2] if len(words) > 2 and words[1] == "route" else (words[1] if len(words) > 1 else "")
        if words[:1] == ["ufw"] and action in ("allow", "limit") and str(line) not in keep:
            unwanted.append(str(line))
    return unwanted


def firewall_delete_argv(line: Any) -> list[str]:
    words = shlex.split(str(line))
    if words[:1] != ["ufw"] or len(words) < 2:
        raise ValueError(f"not a ufw rule line: {line!r}")
    return ["ufw", "delete", *words[1:]]


def firewall_kernel_drift(lines: Iterable[Any]) -> list[str]:
    drift = []
    for line in lines:
        text = str(line).strip()
        counts = _COUNTS.match(text)
        if counts and counts.group(3) != counts.group(4):
            tool, chain, files, kernel = counts.groups()
            drift.append(f"{chain}: {files} rules in ufw's files, {kernel} in the kernel ({tool})")
        jumps = _JUMPS.match(text)
        if jumps and jumps.group(1) == "0":
            drift.append("INPUT does not pass through ufw's chains")
    return drift


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "firewall_ufw_line": firewall_ufw_line,
            "firewall_unwanted_rules": firewall_unwanted_rules,
            "firewall_delete_argv": firewall_delete_argv,
            "firewall_kernel_drift": firewall_kernel_drift,
        }
