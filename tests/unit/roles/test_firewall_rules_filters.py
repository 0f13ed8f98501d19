"""Which ufw rules the firewall role removes, and when it reloads ufw into the kernel.

The bed shows both on real nodes (tests/testbed/test_converged_limits_testbed.py); these are the decisions
behind them for the rule shapes the bed does not add: route and limit rules, deny rules kept, a
comment with spaces, and a kernel with no IPv6 family.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[3] / "roles" / "firewall" / "filter_plugins" / "firewall_rules.py"
spec = importlib.util.spec_from_file_location("firewall_rules", PLUGIN)
rules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rules)

SSH = {"port": 22, "proto": "tcp", "source": "any", "comment": "firewall: SSH"}
NFS = {"port": "2049", "proto": "tcp", "source": "10.0.0.2", "comment": "nfs_server: NFS"}


def test_the_line_is_spelled_as_ufw_show_added_prints_it():
    assert rules.firewall_ufw_line(SSH) == "ufw allow 22/tcp comment 'firewall: SSH'"
    assert (
        rules.firewall_ufw_line(NFS)
        == "ufw allow from 10.0.0.2 to any port 2049 proto tcp comment 'nfs_server: NFS'"
    )


def test_only_allow_and_limit_rules_the_role_does_not_want_are_removed():
    wanted = [rules.firewall_ufw_line(SSH), rules.firewall_ufw_line(NFS)]
    added = [
        "Added user rules (see 'ufw status' for running firewall):",
        *wanted,
        "ufw allow 8888/tcp comment 'by hand'",
        "ufw limit 2222/tcp",
        "ufw route allow in on eth0 out on eth1",
        "ufw deny 23",
        "ufw reject from 192.0.2.1",
        "ufw allow from 10.0.0.9 to any port 2049 proto tcp comment 'nfs_server: NFS'",  # a removed node
    ]
    assert rules.firewall_unwanted_rules(added, wanted) == [
        "ufw allow 8888/tcp comment 'by hand'",
        "ufw limit 2222/tcp",
        "ufw route allow in on eth0 out on eth1",
        "ufw allow from 10.0.0.9 to any port 2049 proto tcp comment 'nfs_server: NFS'",
    ]


def test_a_rule_is_deleted_with_its_own_words_comment_included():
    assert rules.firewall_delete_argv("ufw allow 8888/tcp comment 'by hand'") == [
        "ufw", "delete", "allow", "8888/tcp", "comment", "by hand",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a ufw rule line"):
        rules.firewall_delete_argv("Added user rules")


def test_the_kernel_is_reloaded_only_where_it_lacks_ufws_rules():
    in_sync = ["iptables ufw-user-input files=5 kernel=5", "INPUT jumps=1"]
    assert rules.firewall_kernel_drift(in_sync) == []
    flushed = ["iptables ufw-user-input files=5 kernel=0", "ip6tables ufw6-user-input files=2 kernel=2"]
    assert rules.firewall_kernel_drift([*flushed, "INPUT jumps=0"]) == [
        "ufw-user-input: 5 rules in ufw's files, 0 in the kernel (iptables)",
        "INPUT does not pass through ufw's chains",
    ]
