"""The firewall role's reading of the controller's SSH connection, and whether a rule source admits it.

The role refuses to enable ufw when the SSH rules would not admit the connection Ansible is using
(the test bed checks that on a host reached on port 2222); these are the parsing and matching rules
behind that decision, for the cases the bed cannot show (IPv6, networks, zone ids, garbage).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[3] / "roles" / "firewall" / "filter_plugins" / "firewall_ssh.py"
spec = importlib.util.spec_from_file_location("firewall_ssh", PLUGIN)
firewall_ssh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(firewall_ssh)
session, covers = firewall_ssh.firewall_ssh_session, firewall_ssh.firewall_source_covers


def test_the_server_port_and_client_come_from_ssh_connection():
    assert session("10.89.42.1 51234 10.89.42.12 2222") == {"client": "10.89.42.1", "port": 2222}
    assert session("fe80::1%eth0 40000 fe80::2%eth0 22\n") == {"client": "fe80::1", "port": 22}
    # No SSH login (a container or local connection), or something that is not SSH_CONNECTION.
    for text in ("", None, "10.0.0.1 1 10.0.0.2", "host 1 10.0.0.2 22", "10.0.0.1 1 10.0.0.2 70000"):
        assert session(text) == {}


def test_a_source_admits_the_controller_when_it_is_any_its_address_or_its_network():
    assert covers(["any"], "192.0.2.7")
    assert covers(["10.0.0.0/8", "192.0.2.7"], "192.0.2.7")
    assert covers(["192.0.2.0/24"], "192.0.2.7")
    assert covers(["2001:db8::/32"], "2001:db8::5")
    assert covers(["192.0.2.0/24"], "::ffff:192.0.2.7"), "an IPv4 client seen on an IPv6 socket"
    assert not covers(["10.89.42.10"], "10.89.42.1")
    assert not covers(["10.0.0.0/8"], "2001:db8::5")
    assert not covers([], "10.0.0.1")
    assert not covers(["not-an-address"], "10.0.0.1")
