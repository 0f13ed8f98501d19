"""The NFS share, live: the server answers on every node, and each worker's mount works right now.

The head runs the server (nfs_server_backend: kernel = nfs-server, ganesha = nfs-ganesha): its
service must be active, and an RPC NULL call to the NFS program (port 2049) must be answered, from
the head and from every worker. A worker's shared dir must be a kernel NFS mount of the head's
export that answers a statvfs and a write within --io-timeout seconds (a `hard` mount to a dead
server blocks forever; preflight reports it as hung, naming the server). Where
nfs_client_mount_state is `present` (containers, which cannot mount NFS), the fstab entry must exist
and the export is listed over NFSv4 with libnfs instead, the check the nfs_client role makes there.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster, Host
from trainer.controller.preflight.host_facts import each_host_fact
from trainer.controller.preflight.report import FAIL, PASS, SKIP, Result

CHECK = "nfs"
NFS_PORT = 2049
SERVICES = {"kernel": "nfs-server", "ganesha": "nfs-ganesha"}


def server_service(head: Host) -> str:
    return SERVICES.get(str(head.get("nfs_server_backend") or "kernel"), "nfs-server")


def server_address(cluster: Cluster) -> str:
    return str(cluster.head.get("nfs_client_server_address") or cluster.head.address)


def mount_state(host: Host) -> str:
    return str(host.get("nfs_client_mount_state") or "mounted")


def libnfs_url(cluster: Cluster, host: Host) -> str:
    """The URL the nfs_client role checks the share with where it cannot mount (NFSv4, the
    training account's uid/gid)."""
    head = cluster.head
    export = str(head.get("cluster_shared_dir") or "")
    url = f"nfs://{server_address(cluster)}{export}?version=4"
    uid, gid = host.get("cluster_training_uid"), host.get("cluster_training_gid")
    if uid is not None and gid is not None:
        url += f"&uid={uid}&gid={gid}"
    return url


def node_request(cluster: Cluster, host: Host) -> dict[str, Any] | None:
    """What node_facts.py should ask of the NFS server from `host`."""
    if cluster.is_single_host:
        return None
    if host.name == cluster.head.name:
        return {"role": "server", "server": server_address(cluster), "service": server_service(host)}
    request: dict[str, Any] = {"role": "client", "server": server_address(cluster)}
    if mount_state(host) == "present":
        request["url"] = libnfs_url(cluster, host)
    return request


def evaluate(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    head = cluster.head
    if cluster.is_single_host:
        return [Result(CHECK, head.name, SKIP, "skipped: one node (the shared dir is local)")]
    shared = str(head.get("cluster_shared_dir") or "?")
    address = server_address(cluster)
    service = server_service(head)
    results: list[Result] = []
    for host, state in each_host_fact(
        cluster,
        facts,
        "nfs",
        why_missing,
        results,
        check=CHECK,
        unreadable=lambda host, reason: f"could not check NFS from {host.name}: {reason}",
        fix=lambda host: f"check that Ansible reaches {host.name} and python3 runs there",
        error_is_unreadable=False,  # the NFS state's errors are named below, per side
    ):
        rpc = state.get("rpc") or {}
        if host.name == head.name:
            results.append(_server(head, state, rpc, address, service))
        else:
            results.append(
                _client(cluster, host, facts.get(host.name) or {}, state, rpc, address, service, shared)
            )
    return results


def _server(head: Host, state: dict, rpc: dict, address: str, service: str) -> Result:
    unit = (state.get("service") or {}).get("state", "unknown")
    restart = (
        f"on {head.name}: systemctl restart {service} (journalctl -u {service} says why it stopped); "
        "ansible-playbook site.yml --tags nfs_server sets it up"
    )
    if unit != "active":
        return Result(
            CHECK, head.name, FAIL, f"the NFS server {service} is {unit} on {head.name}", fix=restart
        )
    if not rpc.get("answered"):
        return Result(
            CHECK,
            head.name,
            FAIL,
            f"{service} is active on {head.name} but does not answer at {address}:{NFS_PORT} "
            f"({rpc.get('error', 'no answer')})",
            fix=restart,
        )
    return Result(CHECK, head.name, PASS, f"{service} active, answers NFS at {address}:{NFS_PORT}")


def _client(
    cluster: Cluster,
    host: Host,
    fact: dict,
    state: dict,
    rpc: dict,
    address: str,
    service: str,
    shared: str,
) -> Result:
    head = cluster.head
    if not rpc.get("answered"):
        return Result(
            CHECK,
            host.name,
            FAIL,
            f"the NFS server on {head.name} ({address}:{NFS_PORT}) does not answer {host.name}: "
            f"{rpc.get('error', 'no answer')}",
            fix=f"on {head.name}: systemctl status {service} (start it: systemctl restart {service}); if it "
            f"runs, allow {NFS_PORT}/tcp from {host.address} in ufw on {head.name} "
            "(ansible-playbook site.yml --tags nfs_server,firewall)",
        )
    shared_fact = fact.get("shared") or {}
    mount = shared_fact.get("mount") or {}
    io = shared_fact.get("io") or {}
    fstype = str(mount.get("fstype") or "")
    if fstype.startswith("nfs"):
        source = str(mount.get("source") or "")
        expected = f"{address}:{head.get('cluster_shared_dir')}"
        if source.rstrip("/") != expected.rstrip("/"):
            return Result(
                CHECK,
                host.name,
                FAIL,
                f"{shared} on {host.name} is mounted from {source}, not from the head's export {expected}",
                fix=f"on {host.name}: umount {shared} && mount {shared} (the fstab entry from "
                "ansible-playbook site.yml --tags nfs_client)",
            )
        if io.get("hung"):
            return Result(
                CHECK,
                host.name,
                FAIL,
                f"the NFS mount {shared} on {host.name} hangs: a statvfs and a write did not return in "
                f"{io.get('seconds')} s (server {head.name}, {address}); training would block on its "
                "first checkpoint",
                fix=f"bring the server back (on {head.name}: systemctl status {service}), then on "
                f"{host.name}: umount -f -l {shared} && mount {shared}",
            )
        if io.get("error"):
            return Result(
                CHECK,
                host.name,
                FAIL,
                f"the NFS mount {shared} on {host.name} fails: {io['error']}",
                fix=f"on {host.name}: umount -f -l {shared} && mount {shared}; on {head.name}: exportfs -v "
                f"must list {shared} for {host.address} (ansible-playbook site.yml --tags nfs)",
            )
        return Result(
            CHECK,
            host.name,
            PASS,
            f"{shared}: {fstype} from {source}, live (statvfs and write in {io.get('seconds')} s); "
            f"server answers",
        )
    if mount_state(host) == "present":
        if not shared_fact.get("fstab"):
            return Result(
                CHECK,
                host.name,
                FAIL,
                f"no fstab entry for {shared} on {host.name}",
                fix=f"add the entry on {host.name}: ansible-playbook site.yml --tags nfs_client "
                f"(nfs_client_mount_state: present keeps {address}:{shared} in fstab without mounting)",
            )
        libnfs = state.get("libnfs") or {}
        url = libnfs_url(cluster, host)
        if not libnfs.get("ok"):
            return Result(
                CHECK,
                host.name,
                FAIL,
                f"the server answers but listing the export from {host.name} failed ({url}): "
                f"{libnfs.get('error', 'not tried')}",
                fix=f"on {head.name}: the export of {shared} must allow {host.address} "
                f"(ansible-playbook site.yml --tags nfs_server); check on {host.name}: nfs-ls '{url}'",
            )
        return Result(
            CHECK,
            host.name,
            PASS,
            f"server answers; export listed over NFSv4 with libnfs ({shared} is not kernel-mounted here: "
            "nfs_client_mount_state present, as in containers)",
        )
    where = f"{fstype or 'an unknown filesystem'} at {mount.get('point') or '?'}"
    return Result(
        CHECK,
        host.name,
        FAIL,
        f"{shared} is not an NFS mount on {host.name} (it is on {where}): what training writes there "
        f"stays on {host.name}",
        fix=f"on {host.name}: mount {shared} (its fstab entry comes from ansible-playbook site.yml "
        "--tags nfs_client)",
    )
