"""Which ufw rules the firewall role removes, and when it repairs the kernel behind ufw's back.

The bed shows them on real nodes (tests/testbed/test_converged_limits_testbed.py,
tests/testbed/test_converged_testbed.py); these are the decisions behind them for the rule shapes the
bed does not add: route and limit rules, deny rules kept, a comment with spaces, and a kernel with no
IPv6 family; and the kernel's rules of a provisioned bed node (read there with the role's own read
script) against ufw's files, rule by rule, with one thing changed at a time.
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


#: What the role reads on a provisioned node (the bed's head, ufw 0.36.2, iptables-nft): every family's
#: `-S` rules, ufw's user rules files and its input policy, in the read script's form
#: (roles/firewall/vars/main.yml firewall_kernel_read_script).
NODE = (
    (Path(__file__).resolve().parents[2] / "data" / "firewall" / "ct-head-ufw-0.36.2.txt")
    .read_text()
    .splitlines()
)


def changed(*, before_input: str = "", after_input: str = "", drop: str = "", extra: tuple = ()) -> list[str]:
    """The node's read with a rule put into INPUT ahead of ufw's jumps, or after them, or one line
    dropped, or more lines (another chain) added."""
    lines = [line for line in NODE if line != drop]
    first = next(i for i, line in enumerate(lines) if line.startswith("iptables kernel: -A INPUT"))
    last = max(i for i, line in enumerate(lines) if line.startswith("iptables kernel: -A INPUT"))
    if after_input:
        lines.insert(last + 1, f"iptables kernel: {after_input}")
    if before_input:
        lines.insert(first, f"iptables kernel: {before_input}")
    return lines + list(extra)


def test_a_provisioned_node_is_in_sync():
    assert rules.firewall_kernel_check(NODE) == {"reload": [], "remove": [], "kept": []}


def test_an_accept_ahead_of_ufws_chains_is_deleted_by_its_own_words():
    found = rules.firewall_kernel_check(changed(before_input="-A INPUT -j ACCEPT"))
    assert found["remove"] == [
        {
            "tool": "iptables",
            "rule": "-A INPUT -j ACCEPT",
            "argv": ["iptables", "-w", "10", "-D", "INPUT", "-j", "ACCEPT"],
        }
    ]
    assert found["reload"] == [], "ufw's own chains are as its files say: no reload needed"


def test_rules_that_can_let_traffic_past_ufw_are_deleted_wherever_they_sit():
    # appended after ufw's jumps: with ufw's default deny, what its rules do not allow was dropped by
    # INPUT's policy, and now is accepted
    found = rules.firewall_kernel_check(changed(after_input="-A INPUT -p tcp -m tcp --dport 8080 -j ACCEPT"))
    assert [item["rule"] for item in found["remove"]] == ["-A INPUT -p tcp -m tcp --dport 8080 -j ACCEPT"]
    # RETURN ahead of ufw skips its chains (and its deny rules) for what it matches
    found = rules.firewall_kernel_check(
        changed(before_input='-A INPUT -s 192.0.2.7/32 -m comment --comment "x y" -j RETURN')
    )
    assert found["remove"][0]["argv"] == [
        "iptables", "-w", "10", "-D", "INPUT", "-s", "192.0.2.7/32",
        "-m", "comment", "--comment", "x y", "-j", "RETURN",
    ]  # fmt: skip
    # a jump to a chain of someone else's that accepts
    chain = ["iptables kernel: -N mine", "iptables kernel: -A mine -p tcp -m tcp --dport 9000 -j ACCEPT"]
    found = rules.firewall_kernel_check(changed(before_input="-A INPUT -j mine", extra=chain))
    assert [item["rule"] for item in found["remove"]] == ["-A INPUT -j mine"]


def test_rules_ahead_that_only_drop_reject_or_log_are_named_and_kept():
    """fail2ban's chain (reject a banned address, else back to INPUT), or a block put in by hand:
    deleting them would only open what someone closed."""
    f2b = [
        "iptables kernel: -N f2b-sshd",
        "iptables kernel: -A f2b-sshd -s 203.0.113.5/32 -j REJECT --reject-with icmp-port-unreachable",
        "iptables kernel: -A f2b-sshd -j RETURN",
    ]
    drop = "-A INPUT -p tcp -m tcp --dport 2222 -j DROP"
    lines = changed(before_input=drop, extra=f2b)
    lines.insert(
        lines.index(f"iptables kernel: {drop}"),
        "iptables kernel: -A INPUT -p tcp -m multiport --dports 22 -j f2b-sshd",
    )
    found = rules.firewall_kernel_check(lines)
    assert found["remove"] == [] and found["reload"] == []
    said = "(iptables) comes ahead of ufw's chains; it only drops, rejects or logs: kept"
    assert found["kept"] == [
        f"`-A INPUT -p tcp -m multiport --dports 22 -j f2b-sshd` {said}",
        f"`{drop}` {said}",
    ]


def test_ufws_own_chain_is_compared_rule_by_rule_not_by_count():
    # the same number of rules, one of them opened to the world: the counts agree, the rules do not
    narrowed = "iptables kernel: -A ufw-user-input -s 10.89.42.10/32 -p tcp -m tcp --dport 2049 -j ACCEPT"
    lines = [
        line
        if line != narrowed
        else "iptables kernel: -A ufw-user-input -p tcp -m tcp --dport 2049 -j ACCEPT"
        for line in NODE
    ]
    found = rules.firewall_kernel_check(lines)
    assert found["remove"] == []
    assert found["reload"] == [
        "ufw-user-input: 13 rules in ufw's files, 13 in the kernel (iptables): the kernel has"
        " `-A ufw-user-input -p tcp -m tcp --dport 2049 -j ACCEPT`, ufw's files do not, the kernel lacks"
        " `-A ufw-user-input -p tcp --dport 2049 -s 10.89.42.10 -j ACCEPT`"
    ]


def test_a_flushed_chain_a_flushed_input_and_an_open_policy_are_reloaded():
    flushed = [line for line in NODE if not line.startswith("iptables kernel: -A ufw-user-input ")]
    assert rules.firewall_kernel_check(flushed)["reload"] == [
        "ufw-user-input: 13 rules in ufw's files, 0 in the kernel (iptables)"
    ]
    no_jumps = [line for line in NODE if not line.startswith("iptables kernel: -A INPUT ")]
    assert rules.firewall_kernel_check(no_jumps)["reload"] == [
        "INPUT does not pass through ufw's chains as ufw made them (iptables: no jump into them)"
    ]
    open_policy = [
        "iptables kernel: -P INPUT ACCEPT" if line == "iptables kernel: -P INPUT DROP" else line
        for line in NODE
    ]
    assert rules.firewall_kernel_check(open_policy)["reload"] == [
        "INPUT's policy is ACCEPT, ufw's is DROP (iptables)"
    ]


def test_a_family_the_kernel_does_not_have_is_left_out():
    v4_only = [line for line in NODE if not line.startswith("ip6tables kernel: ")]
    assert rules.firewall_kernel_check(v4_only) == {"reload": [], "remove": [], "kept": []}
    v6_flushed = [line for line in NODE if not line.startswith("ip6tables kernel: -A ufw6-user-input ")]
    assert rules.firewall_kernel_check(v6_flushed)["reload"] == [
        "ufw6-user-input: 1 rules in ufw's files, 0 in the kernel (ip6tables)"
    ]
