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

import ipaddress
import shlex
from collections.abc import Iterable
from typing import Any


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


#: Targets that only drop, reject or log: a rule that ufw did not make with one of these, ahead of
#: ufw's chains, narrows what ufw allows and never lets traffic past it (fail2ban's bans, a block
#: put in for a test). Anything else (ACCEPT, RETURN, NFQUEUE, a goto, a jump to a chain that can
#: accept) can let traffic in that ufw's rules would drop.
BLOCKING_TARGETS = frozenset({"DROP", "REJECT", "LOG", "NFLOG"})
#: ufw's jumps from INPUT into its chains, in the order ufw-init makes them (the prefix is ufw6- for
#: ip6tables).
UFW_INPUT_JUMPS = (
    "before-logging-input", "before-input", "after-input", "after-logging-input",
    "reject-input", "track-input",
)  # fmt: skip
#: Long spellings of options iptables prints short.
_ALIASES = {
    "--protocol": "-p", "--source": "-s", "--destination": "-d", "--jump": "-j", "--goto": "-g",
    "--in-interface": "-i", "--out-interface": "-o", "--match": "-m",
    "--destination-port": "--dport", "--source-port": "--sport",
}  # fmt: skip
#: Values iptables prints that ufw's files leave to the default.
_KERNEL_DEFAULTS = {
    ("--name", ("DEFAULT",)), ("--mask", ("255.255.255.255",)), ("--rsource", ()),
    ("--reject-with", ("icmp-port-unreachable",)), ("--reject-with", ("icmp6-port-unreachable",)),
}  # fmt: skip
_RATE_UNITS = {"second": "sec", "minute": "min", "s": "sec", "m": "min", "h": "hour", "d": "day"}


def _options(rule: str) -> tuple[str, str, list[tuple[str, tuple[str, ...]]]]:
    """("-A", chain, [(option, values), ...]) of one `iptables -S` or ufw file line."""
    words = shlex.split(rule)
    if len(words) < 2 or not words[0].startswith("-"):
        raise ValueError(f"not an iptables rule: {rule!r}")
    options: list[tuple[str, tuple[str, ...]]] = []
    negate = False
    index = 2
    while index < len(words):
        word = words[index]
        if word == "!":
            negate = True
            index += 1
            continue
        values = []
        index += 1
        while (
            index < len(words)
            and (not words[index].startswith("-") or words[index] == "-")
            and words[index] != "!"
        ):
            values.append(words[index])
            index += 1
        options.append((("!" if negate else "") + _ALIASES.get(word, word), tuple(values)))
        negate = False
    return words[0], words[1], options


def _address(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        return value  # a host name or anything else: compared as written


def _rate(value: str) -> str:
    count, _, unit = value.partition("/")
    return f"{count}/{_RATE_UNITS.get(unit, unit)}" if unit else value


def rule_key(rule: str) -> tuple:
    """One rule as a comparable value: what it matches and does, whatever the spelling. iptables -S
    prints `-s 10.0.0.2/32 -p tcp -m tcp --dport 22 -j ACCEPT` for ufw's file line
    `-p tcp --dport 22 -s 10.0.0.2 -j ACCEPT`: the implied protocol match, the prefix length and the
    defaults it adds are left out, and the options compared as a set."""
    _, chain, options = _options(rule)
    protocols = {values[0] for option, values in options if option == "-p" and values}
    key = []
    for option, values in options:
        if option == "-m" and values and values[0] in protocols:
            continue  # `-m tcp` is what `-p tcp --dport` loads
        if (option, values) in _KERNEL_DEFAULTS:
            continue
        if option.lstrip("!") in ("-s", "-d"):
            values = tuple(_address(value) for value in values)
        if option.lstrip("!") == "--limit":
            values = tuple(_rate(value) for value in values)
        key.append((option, values))
    return (chain, tuple(sorted(key)))


def _target(options: list[tuple[str, tuple[str, ...]]]) -> tuple[str, str]:
    for option, values in options:
        if option in ("-j", "-g") and values:
            return option, values[0]
    return "", ""


def _can_accept(
    option: str, target: str, chains: dict[str, list[str]], seen: frozenset = frozenset()
) -> bool:
    """Whether a rule with this target can let a packet through INPUT: it accepts, or skips the rest
    of INPUT (RETURN, a goto), or jumps to a chain one of whose rules can."""
    if not target or target in BLOCKING_TARGETS:
        return False
    if option == "-g" or target not in chains or target in seen:
        return True  # ACCEPT, RETURN, NFQUEUE, a goto, a chain not in the filter table, a loop
    for rule in chains[target]:
        inner_option, inner_target = _target(_options(rule)[2])
        if inner_target == "RETURN":
            continue  # back to INPUT's next rule
        if _can_accept(inner_option, inner_target, chains, seen | {target}):
            return True
    return False


def _family_check(tool: str, kernel: list[str], files: list[str], policy: str) -> dict[str, list]:
    prefix = "ufw6-" if tool == "ip6tables" else "ufw-"
    user_input = f"{prefix}user-input"
    chains: dict[str, list[str]] = {}
    policies: dict[str, str] = {}
    for line in kernel:
        words = line.split()
        if len(words) >= 3 and words[0] == "-P":
            policies[words[1]] = words[2]
        elif len(words) >= 2 and words[0] == "-N":
            chains.setdefault(words[1], [])
        elif len(words) >= 2 and words[0] == "-A":
            chains.setdefault(words[1], []).append(line)
    reload: list[str] = []
    remove: list[dict] = []
    kept: list[str] = []

    # ufw's own rules: the kernel's user chain against the file, rule by rule, in order.
    in_files = [line for line in files if line.split()[:2] == ["-A", user_input]]
    in_kernel = chains.get(user_input, [])
    if [rule_key(rule) for rule in in_kernel] != [rule_key(rule) for rule in in_files]:
        file_keys = {rule_key(rule) for rule in in_files}
        kernel_keys = {rule_key(rule) for rule in in_kernel}
        extra = [rule for rule in in_kernel if rule_key(rule) not in file_keys]
        lacking = [rule for rule in in_files if rule_key(rule) not in kernel_keys]
        said = f"{user_input}: {len(in_files)} rules in ufw's files, {len(in_kernel)} in the kernel ({tool})"
        details = [f"the kernel has `{rule}`, ufw's files do not" for rule in extra[:3]]
        details += [f"the kernel lacks `{rule}`" for rule in lacking[:3]]
        if not details:
            details = ["the same rules in another order"]
        reload.append(said if len(in_kernel) == 0 else f"{said}: {', '.join(details)}")

    # INPUT: ufw's jumps, in ufw's order, and nothing else that can let traffic past them.
    wanted_jumps = [prefix + name for name in UFW_INPUT_JUMPS]
    jumps = [
        target
        for rule in chains.get("INPUT", [])
        if (target := _target(_options(rule)[2])[1]).startswith(prefix)
    ]
    if jumps != wanted_jumps:
        reload.append(
            f"INPUT does not pass through ufw's chains as ufw made them ({tool}: "
            f"{', '.join(jumps) or 'no jump into them'})"
        )
    if policy and policies.get("INPUT", policy) != policy:
        reload.append(f"INPUT's policy is {policies.get('INPUT')}, ufw's is {policy} ({tool})")
    ahead = True
    for rule in chains.get("INPUT", []):
        option, target = _target(_options(rule)[2])
        if target.startswith(prefix):
            ahead = False
            continue
        where = "ahead of ufw's chains" if ahead else "after ufw's chains"
        if _can_accept(option, target, chains):
            # Deleting it cannot cut what ufw allows (SSH, the cluster's ports, loopback and replies
            # are ufw's own rules); keeping it lets traffic past them.
            argv = [tool, "-w", "10", "-D", *shlex.split(rule)[1:]]
            remove.append({"tool": tool, "rule": rule, "argv": argv})
        elif ahead:
            kept.append(f"`{rule}` ({tool}) comes {where}; it only drops, rejects or logs: kept")
    return {"reload": reload, "remove": remove, "kept": kept}


def firewall_kernel_check(lines: Iterable[Any]) -> dict[str, list]:
    """From the role's read of each family (lines `TOOL kernel: RULE` from `TOOL -S`, `TOOL file: RULE`
    from ufw's user rules file, `TOOL policy: POLICY` from /etc/default/ufw):
    reload: what `ufw reload` puts right (its user chain differs from its file, INPUT's jumps into
    its chains or INPUT's policy are not as ufw made them), one line each;
    remove: the rules in INPUT ufw did not make that can let traffic past its chains (tool, rule,
    argv that deletes it);
    kept: the rules ufw did not make ahead of its chains that only drop, reject or log."""
    families: dict[str, dict[str, Any]] = {}
    for line in lines:
        tool, _, rest = str(line).partition(" ")
        kind, _, value = rest.partition(": ")
        if tool not in ("iptables", "ip6tables") or kind not in ("kernel", "file", "policy"):
            continue
        family = families.setdefault(tool, {"kernel": [], "file": [], "policy": ""})
        if kind == "policy":
            # ufw's DROP and REJECT both leave INPUT's policy at DROP (REJECT is ufw's last rule)
            said = value.strip().strip('"')
            family["policy"] = ("ACCEPT" if said == "ACCEPT" else "DROP") if said else ""
        elif value.strip():
            family[kind].append(value.strip())
    result: dict[str, list] = {"reload": [], "remove": [], "kept": []}
    for tool, family in families.items():
        if not family["kernel"]:
            continue  # this family is not in the kernel
        checked = _family_check(tool, family["kernel"], family["file"], family["policy"])
        for key in result:
            result[key] += checked[key]
    return result


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "firewall_ufw_line": firewall_ufw_line,
            "firewall_unwanted_rules": firewall_unwanted_rules,
            "firewall_delete_argv": firewall_delete_argv,
            "firewall_kernel_check": firewall_kernel_check,
        }
