"""SSH trust between every pair of nodes as the training user, BatchMode, host keys pinned.

Every pair's keys by content (preflight.ssh_keys: each node's keys read once, compared here), and
real logins on the pairs of preflight.schedule's rounds (O(log N) per node, one login per sshd per
round; every pair with --full-matrix). A login's own words name the cause of its failure.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.preflight import ssh_keys
from trainer.controller.preflight.report import FAIL, PASS, WARN, Result

CHECK = "ssh"


def diagnose(source: str, peer: str, address: str, user: str, stderr: str) -> tuple[str, str]:
    """(what went wrong, how to fix it) from ssh's own words."""
    text = stderr.lower()
    if (
        "host key verification failed" in text
        or "no ecdsa host key is known" in text
        or ("host key for" in text and "not known" in text)
    ):
        return (
            f"{peer}'s host key is not pinned for {user} on {source} (known_hosts)",
            f"pin {peer}'s host key ({address}) in /etc/ssh/ssh_known_hosts on {source} after checking its "
            "fingerprint (the ssh trust role pins every node: make provision); never use "
            "StrictHostKeyChecking=no",
        )
    if "remote host identification has changed" in text:
        return (
            f"{peer}'s host key changed since it was pinned on {source}",
            f"if {peer} was reinstalled, remove the old key (ssh-keygen -R {address} as {user} on {source}) "
            "and pin the new one; otherwise investigate before connecting",
        )
    if "permission denied" in text:
        return (
            f"{peer} refuses {user}'s key from {source}",
            f"add {source}'s public key for {user} to ~{user}/.ssh/authorized_keys on {peer} "
            "(the ssh trust role does: make provision)",
        )
    if "connection refused" in text:
        return (
            f"nothing listens for SSH on {peer} ({address})",
            f"start sshd on {peer} (systemctl start ssh)",
        )
    if "timed out" in text or "no route to host" in text:
        return (
            f"{source} cannot reach {peer} ({address}) on port 22",
            f"check the cluster network and that ufw on {peer} allows SSH from the cluster subnet",
        )
    if "connection closed" in text or "connection reset" in text or "kex_exchange" in text or not text:
        return (
            f"sshd on {peer} ({address}) dropped {source}'s connection before authentication, every try",
            f"read sshd's log on {peer} (journalctl -u ssh): MaxStartups (too many logins at once), the "
            f"load, or an AllowUsers/DenyUsers rule; then ssh -v {user}@{address} on {source}",
        )
    if "could not resolve" in text:
        return (
            f"{source} cannot resolve {address}",
            f"set cluster_ip of {peer} to its IP address, or add {address} to /etc/hosts on {source}",
        )
    return (
        f"ssh from {source} to {peer} failed: {stderr.strip()[-200:]}",
        f"run ssh -v {user}@{address} on {source}",
    )


MECHANISM = ("nothing listens", "cannot reach", "dropped", "cannot resolve", "failed:")


def evaluate(
    nodes: list[str],
    addresses: dict[str, str],
    user: str,
    outputs: dict[str, Any],
    why_missing,
    full: bool = False,
) -> tuple[list[Result], dict[str, Any]]:
    """Verdicts (one per login, one per pair the content finds wrong, one summary per source for
    the pairs proven by content alone) and what was done, for the report."""
    summary: dict[str, Any] = {"mode": "full" if full else "sampled", "logins": 0, "tries": 0}
    if len(nodes) < 2:
        return [Result(CHECK, nodes[0] if nodes else "cluster", "skip", "skipped: one node")], summary
    keys = {
        n: o["keys"]
        for n, o in outputs.items()
        if isinstance(o, dict) and "error" not in (o.get("keys") or {"error": 1})
    }
    logins = {
        (source, a["peer"]): a
        for source, output in outputs.items()
        if isinstance(output, dict)
        for a in output.get("results", [])
    }
    untrusted, blocked = _content_limits(nodes, addresses, user, keys, logins)
    keys = _with_logins(keys, logins)
    results = []
    for source in nodes:
        output = outputs.get(source)
        if output is None or output.get("error"):
            reason = output["error"] if output else why_missing(source)
            results.append(
                Result(
                    CHECK,
                    f"{source} -> *",
                    FAIL,
                    f"could not test SSH from {source}: {reason}",
                    fix=f"install openssh-client on {source} and check Ansible reaches it",
                )
            )
            continue
        results += _logins(source, user, output.get("results", []))
        results += _by_content(source, nodes, addresses, user, keys, logins, untrusted, blocked)
    summary.update(_login_numbers(logins))
    return results, summary


def _logins(source: str, user: str, attempts: list[dict[str, Any]]) -> list[Result]:
    results = []
    for attempt in attempts:
        peer, address = attempt["peer"], attempt["address"]
        subject = f"{source} -> {peer}"
        tries = int(attempt.get("tries", 1))
        again = f" (after {tries} tries: dropped before authentication)" if tries > 1 else ""
        data = {"tries": tries}
        if attempt["rc"] == 0:
            results.append(
                Result(CHECK, subject, PASS, f"{user}@{address} BatchMode, host key pinned{again}", data=data)
            )
            continue
        detail, fix = diagnose(source, peer, address, user, attempt.get("stderr", ""))
        data["stderr"] = attempt.get("stderr")
        results.append(Result(CHECK, subject, FAIL, detail, fix=fix, data=data))
    return results


def _content_limits(nodes, addresses, user, keys, logins) -> tuple[set[tuple[str, str]], set[str]]:
    """(kinds of content not to be trusted, as (kind, node)) and the peers whose sshd failed a login
    for a reason of its own (down, unreachable, dropping): their content-only pairs prove nothing."""
    untrusted: set[tuple[str, str]] = set()
    blocked: set[str] = set()
    for (source, peer), attempt in logins.items():
        if attempt["rc"] != 0:
            detail, _ = diagnose(source, peer, attempt["address"], user, attempt.get("stderr", ""))
            if any(word in detail for word in MECHANISM):
                blocked.add(peer)
            continue
        if source not in keys or peer not in keys:
            continue
        # A real login worked where the content said it would not: the content misses something
        # there (an AuthorizedKeysCommand, a certificate, a known_hosts file elsewhere).
        for problem in ssh_keys.pair_problems(source, addresses[source], peer, user, keys):
            untrusted.add((problem.kind, peer if problem.kind == ssh_keys.AUTH else source))
    return untrusted, blocked


def _with_logins(keys: dict[str, dict[str, Any]], logins) -> dict[str, dict[str, Any]]:
    """Each node's keys plus what the logins proved: a login from A to B shows that B accepts A's
    key and presents the host key A pinned for it (when A pins one). sshd may read keys from
    elsewhere than ~/.ssh (AuthorizedKeysFile) and serve another host key than /etc/ssh's files."""
    found = {name: dict(held) for name, held in keys.items()}
    for (source, peer), attempt in logins.items():
        if attempt["rc"] != 0 or source not in keys or peer not in keys:
            continue
        theirs = found[peer]
        listed = {e.get("key") for e in theirs.get("authorized") or []}
        extra = [k for k in keys[source].get("identities") or [] if k not in listed]
        theirs["authorized"] = [*(theirs.get("authorized") or []), *({"key": k, "from": ""} for k in extra)]
        pinned = ((keys[source].get("known") or {}).get(peer) or {}).get("keys") or []
        if len(pinned) == 1:
            theirs["host_keys"] = sorted({*(theirs.get("host_keys") or []), pinned[0]})
    return found


def _by_content(source, nodes, addresses, user, keys, logins, untrusted, blocked) -> list[Result]:
    """The pairs from `source` that were not logged in to, judged by their keys."""
    results, proven, unproven = [], [], []
    for peer in nodes:
        if peer == source or (source, peer) in logins:
            continue
        if source not in keys or peer not in keys or peer in blocked:
            unproven.append(peer)
            continue
        problems = ssh_keys.pair_problems(source, addresses[source], peer, user, keys)
        trusted = [
            p for p in problems
            if (p.kind, peer if p.kind == ssh_keys.AUTH else source) not in untrusted
        ]  # fmt: skip
        if trusted:
            results.append(
                Result(
                    CHECK,
                    f"{source} -> {peer}",
                    FAIL,
                    "; ".join(p.detail for p in trusted) + " (read from both nodes' key files)",
                    fix="; ".join(p.fix for p in trusted),
                    data={"by": "content"},
                )
            )
        elif problems:
            unproven.append(peer)
        else:
            proven.append(peer)
    if proven:
        results.append(
            Result(
                CHECK,
                f"{source} -> *",
                PASS,
                f"keys open and host keys pinned for {len(proven)} more peer(s), read from both ends",
                data={"by": "content", "peers": proven},
            )
        )
    if unproven:
        why = "its key files could not be read" if source not in keys else "their logins or key files"
        results.append(
            Result(
                CHECK,
                f"{source} -> *",
                WARN,
                f"not proven to {', '.join(unproven)}: {why} left it open",
                fix=f"see the other ssh lines for {', '.join(unproven)}; to log in to every pair: "
                "trainer preflight --full-matrix",
                data={"by": "content", "peers": unproven},
            )
        )
    return results


def _login_numbers(logins: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """How many logins, tries and retries, and the most logins any sshd had open at once (from the
    probes' own start and end times: the bound the rounds keep below sshd's MaxStartups)."""
    by_target: dict[str, list[tuple[float, float]]] = {}
    for (_, peer), attempt in logins.items():
        if "start" in attempt:
            by_target.setdefault(peer, []).append((float(attempt["start"]), float(attempt["end"])))
    concurrent = {}
    for peer, spans in by_target.items():
        edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
        running = most = 0
        for _, step in edges:
            running += step
            most = max(most, running)
        concurrent[peer] = most
    return {
        "logins": len(logins),
        "tries": sum(int(a.get("tries", 1)) for a in logins.values()),
        "retried": sorted([s, p] for (s, p), a in logins.items() if int(a.get("tries", 1)) > 1),
        "max_concurrent_logins_per_sshd": max(concurrent.values(), default=0),
        "logins_per_sshd": max((len(v) for v in by_target.values()), default=0),
    }
