"""The shared dir (writable by the training uid everywhere, visible on the head with that owner) and
the training data (the same bytes on every node)."""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.compare import odd_ones
from trainer.controller.preflight.host_facts import each_host_answer
from trainer.controller.preflight.report import FAIL, PASS, Result


def shared_dir(
    cluster: Cluster, facts: dict[str, Any], verify: dict[str, Any] | None, why_missing, why_not_verified
) -> list[Result]:
    """Each node wrote a marker file into the shared dir as the training user (node facts); the
    head found each one with the training uid and the right content, and removed it."""
    check = "shared_dir"
    head = cluster.head
    shared = head.get("cluster_shared_dir", "?")
    user = head.get("cluster_training_user", "?")
    group = head.get("cluster_training_group") or user
    expected_uid = head.get("cluster_training_uid")
    if expected_uid is None:
        expected_uid = (facts.get(head.name) or {}).get("uid")
    seen_on_head = (verify or {}).get("results", {})
    results = []
    for host, fact in each_host_answer(
        cluster.hosts,
        facts,
        why_missing,
        results,
        check=check,
        unreadable=lambda host, why: f"could not write: {why}",
        fix=lambda host: (
            f"check that user {user} exists on {host.name} (ansible-playbook site.yml --tags users)"
        ),
    ):
        write = (fact.get("shared") or {}).get("io") or {}
        if write.get("hung") or write.get("error"):
            reason = (
                f"the write did not return within {write.get('seconds')} s"
                if write.get("hung")
                else write["error"]
            )
            if host.name == head.name:
                fix = (
                    f"on {head.name}: {shared} is the NFS export itself: chown {user}:{group} {shared} && "
                    f"chmod 2775 {shared} (the nfs_server role sets nfs_server_export_owner/mode: "
                    "ansible-playbook site.yml --tags nfs_server)"
                )
            elif write.get("hung"):
                fix = (
                    f"the NFS mount on {host.name} hangs: see the nfs check (server {head.name}); then on "
                    f"{host.name}: umount -f -l {shared} && mount {shared}"
                )
            else:
                fix = (
                    f"on {host.name}: mount the head's export at {shared} (mount {shared}; "
                    f"ansible-playbook site.yml --tags nfs_client), and give {user} (uid {expected_uid}) "
                    f"write access on {head.name}'s export (chown {user}:{group} {shared} there)"
                )
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"{user} cannot write to {shared} on {host.name}: {reason}",
                    fix=fix,
                )
            )
            continue
        if fact.get("uid") != expected_uid:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"{user} has uid {fact.get('uid')} on {host.name}, {expected_uid} expected",
                    fix=f"give {user} uid {expected_uid} on {host.name} (set cluster_training_uid, then "
                    "ansible-playbook site.yml --tags users: files on the share are owned by number)",
                )
            )
            continue
        if verify is None:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"{head.name} could not check: {why_not_verified(head.name)}",
                    fix=f"on {head.name}: {shared} must exist and be readable by {user}",
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
                    fix=f"{shared} on {host.name} is not the head's export: on {host.name}: mount {shared} "
                    "(its fstab entry: ansible-playbook site.yml --tags nfs_client)",
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
                    fix=f"give {user} uid {expected_uid} on {host.name} and {head.name} "
                    "(cluster_training_uid; ansible-playbook site.yml --tags users), and export without "
                    "squashing it to another uid (nfs_server_squash)",
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
                    fix=f"create the training venv on {host.name} "
                    "(ansible-playbook site.yml --tags trainer_env): it holds the bundled text"
                    if bundled
                    else f"put the data file at {path} on {host.name} (cluster_data_path), or keep it on the "
                    "shared dir",
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
