"""The shared dir (writable by the training uid everywhere, visible on the head with that owner) and
the training data (the same bytes on every node)."""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.compare import odd_ones
from trainer.controller.preflight.report import FAIL, PASS, Result


def shared_dir(
    cluster: Cluster, writes: dict[str, Any], verify: dict[str, Any] | None, why_missing
) -> list[Result]:
    check = "shared_dir"
    head = cluster.head
    shared = head.get("cluster_shared_dir", "?")
    user = head.get("cluster_training_user", "?")
    expected_uid = head.get("cluster_training_uid")
    head_write = writes.get(head.name) or {}
    if expected_uid is None:
        expected_uid = head_write.get("uid")
    seen_on_head = (verify or {}).get("results", {})
    results = []
    for host in cluster.hosts:
        write = writes.get(host.name)
        if write is None:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"could not write: {why_missing(host.name)}",
                    fix=f"check that user {user} exists on {host.name}",
                )
            )
            continue
        if write.get("error"):
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"{user} cannot write to {shared}: {write['error']}",
                    fix=f"mount the head's export at {shared} on {host.name} (the NFS client role), and give "
                    f"{user} (uid {expected_uid}) write access on the head's export",
                )
            )
            continue
        if write["uid"] != expected_uid:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"{user} has uid {write['uid']} on {host.name}, {expected_uid} expected",
                    fix=f"give {user} uid {expected_uid} on every node "
                    "(files on the share are owned by number)",
                )
            )
            continue
        if verify is None:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"head could not check: {why_missing(head.name)}",
                    fix=f"check that {shared} exists on the head",
                )
            )
            continue
        seen = seen_on_head.get(host.name, {})
        if not seen.get("visible"):
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"file written on {host.name} is not visible on {head.name} "
                    f"({seen.get('error', 'missing')})",
                    fix=f"{shared} on {host.name} is not the head's export: mount it (fstab entry, mount -a)",
                )
            )
        elif seen.get("uid") != expected_uid or not seen.get("content_ok"):
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"file from {host.name} shows owner uid {seen.get('uid')} on {head.name}, "
                    f"{expected_uid} expected" + ("" if seen.get("content_ok") else ", content differs"),
                    fix="align the training uid/gid on all nodes; export without squashing to another uid",
                )
            )
        else:
            results.append(
                Result(
                    check,
                    host.name,
                    PASS,
                    f"{user} (uid {expected_uid}) wrote {shared}; seen on {head.name}, removed",
                )
            )
    return results


def data(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    check = "data"
    digests: dict[str, str] = {}
    results: list[Result] = []
    for host in cluster.hosts:
        found = (facts.get(host.name) or {}).get("data")
        if found is None or found.get("error"):
            reason = found["error"] if found else why_missing(host.name)
            path = (found or {}).get("path", host.get("cluster_data_path") or "bundled text")
            bundled = not host.get("cluster_data_path")
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"cannot read the training data {path}: {reason}",
                    fix="create the training venv on this node (make provision): it holds the bundled text"
                    if bundled
                    else "put the data file on every node at cluster_data_path (or on the share)",
                )
            )
            continue
        digests[host.name] = found["sha256"]
    reference, odd = odd_ones(digests, cluster.head.name)
    for name, digest in digests.items():
        path = facts[name]["data"]["path"]
        if name in odd:
            results.append(
                Result(
                    check,
                    name,
                    FAIL,
                    f"{path} differs: sha256 {digest[:16]}…, the other nodes have {str(reference)[:16]}…",
                    fix=f"copy the data from the head to {name} (or keep it on the shared dir) so every rank "
                    "trains on the same bytes",
                    data={"sha256": digest},
                )
            )
        else:
            results.append(
                Result(check, name, PASS, f"{path} sha256 {digest[:16]}…", data={"sha256": digest})
            )
    return results
