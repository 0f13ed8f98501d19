"""Everything `trainer launch` checks on a node before starting anything, in one run (JSON out).

    python node_probe.py '{"venv": ..., "need": [...], "address": ..., "port": 0|N, "node_dir": ...}'

Run with the training venv's python (so a missing venv shows as this command failing). One process
instead of one Ansible task per check: on a busy machine each task costs seconds.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path


def interface_of_by_ioctl(address: str) -> str:
    """The interface whose primary IPv4 address is `address`, asked of the kernel directly: for nodes
    without iproute2 (a minimal image), where `ip` cannot be run."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return ""


def interface_of(address: str) -> str:
    """The interface holding `address` ('' if none), from `ip -o addr show`."""
    try:
        listing = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True
        ).stdout
    except FileNotFoundError:
        return interface_of_by_ioctl(address)
    except (OSError, subprocess.CalledProcessError):
        return ""
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] in ("inet", "inet6") and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return ""


def port_error(address: str, port: int) -> str:
    """'' if `port` can be bound on `address` (the rendezvous can listen there), else why not."""
    with socket.socket() as sock:
        # As torch's TCPStore does: connections of a finished run in TIME_WAIT do not block it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as err:
            return err.strerror or str(err)
    return ""


def previous_state(node_dir: Path) -> str:
    """'running' if a trainer of this run's previous launch still runs on this node."""
    try:
        pid = int((node_dir / "pid").read_text())
        launch_id = (node_dir / "launch-id").read_text().strip()
    except (OSError, ValueError):
        return "none"
    if (node_dir / "exit").exists():
        return "exited"
    marker = f"CLUSTERTRAIN_LAUNCH_ID={launch_id}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                return "running"
        except OSError:
            continue
    return "vanished" if pid else "none"


def infiniband_devices() -> list[str]:
    """The InfiniBand/RoCE devices the kernel lists (mlx5_0, ...): NCCL_IB_DISABLE=auto reads them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def main() -> int:
    request = json.loads(sys.argv[1])
    venv = Path(request["venv"])
    # The bundled trainer needs torchrun and trainer; a user's own command only the venv's python
    # (the launcher's helper runs with it) and whatever the command itself starts.
    need = request.get("need") or ("python", "torchrun", "trainer")
    missing = [name for name in need if not os.access(venv / "bin" / name, os.X_OK)]
    result = {
        "user": pwd.getpwuid(os.geteuid()).pw_name,
        "venv_missing": missing,
        "iface": interface_of(request["address"]) if request.get("iface_auto") else "",
        "port_error": port_error(request["address"], int(request["port"])) if request.get("port") else "",
        "previous": previous_state(Path(request["node_dir"])),
        "ib_devices": infiniband_devices(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
