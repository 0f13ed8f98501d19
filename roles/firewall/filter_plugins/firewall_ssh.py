"""Filters for the firewall role: which SSH connection Ansible uses, and whether a rule covers it.

`firewall_ssh_session`: sshd puts "CLIENT_ADDRESS CLIENT_PORT SERVER_ADDRESS SERVER_PORT" in the
login's SSH_CONNECTION; the server port is the one this host's sshd accepted Ansible on, whatever
`ansible_port`, ~/.ssh/config or a port forward in between say.
`firewall_source_covers`: whether a ufw source ("any", an address or a network) admits an address.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any

_SESSION = re.compile(r"^\s*(\S+) (\d{1,5}) (\S+) (\d{1,5})\s*$")


def firewall_ssh_session(ssh_connection: Any) -> dict[str, Any]:
    """{"client": address, "port": server port} from SSH_CONNECTION, or {} (not an SSH login)."""
    match = _SESSION.match(str(ssh_connection or ""))
    if not match:
        return {}
    try:
        client = str(ipaddress.ip_address(match.group(1).split("%")[0]))
    except ValueError:
        return {}
    port = int(match.group(4))
    return {"client": client, "port": port} if 1 <= port <= 65535 else {}


def firewall_source_covers(sources: Iterable[Any], address: Any) -> bool:
    """True when one of the ufw sources admits `address` ("any", the address, or its network)."""
    try:
        wanted = ipaddress.ip_address(str(address))
    except ValueError:
        return False
    for source in sources:
        text = str(source).strip()
        if text == "any":
            return True
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        mapped = getattr(wanted, "ipv4_mapped", None)
        if wanted in network or (mapped is not None and mapped in network):
            return True
    return False


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "firewall_ssh_session": firewall_ssh_session,
            "firewall_source_covers": firewall_source_covers,
        }
