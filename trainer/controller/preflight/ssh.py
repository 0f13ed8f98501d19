"""SSH trust between every pair of nodes as the training user, BatchMode, host keys pinned."""

from __future__ import annotations

from typing import Any

from trainer.controller.preflight.report import FAIL, PASS, Result

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
    if "could not resolve" in text:
        return (
            f"{source} cannot resolve {address}",
            f"set cluster_ip of {peer} to its IP address, or add {address} to /etc/hosts on {source}",
        )
    return (
        f"ssh from {source} to {peer} failed: {stderr.strip()[-200:]}",
        f"run ssh -v {user}@{address} on {source}",
    )


def evaluate(nodes: list[str], user: str, outputs: dict[str, Any], why_missing) -> list[Result]:
    if len(nodes) < 2:
        return [Result(CHECK, nodes[0] if nodes else "cluster", "skip", "skipped: one node")]
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
        for attempt in output.get("results", []):
            peer, address = attempt["peer"], attempt["address"]
            subject = f"{source} -> {peer}"
            if attempt["rc"] == 0:
                results.append(Result(CHECK, subject, PASS, f"{user}@{address} BatchMode, host key pinned"))
                continue
            detail, fix = diagnose(source, peer, address, user, attempt.get("stderr", ""))
            results.append(
                Result(CHECK, subject, FAIL, detail, fix=fix, data={"stderr": attempt.get("stderr")})
            )
    return results
