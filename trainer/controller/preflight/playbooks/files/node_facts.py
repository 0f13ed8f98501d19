#!/usr/bin/env python3
"""Print this node's facts for preflight as JSON, everything the per-node checks need in one run.

    python3 node_facts.py --request JSON

Runs on the node with the system python3 (standard library only) as the training user, so files,
the venv, /dev/shm and the shared dir are seen with the permissions training will have. The request
(built on the controller, trainer.controller.preflight.probe.node_request) says what to look at:
venv, data_path, address (cluster_ip), shared_dir, marker ({name, token}: a file written into the
shared dir for the head to find), nfs ({role: server|client, server, service, mount_state, url}),
model_dir, extensions_dir (training_env's TORCH_EXTENSIONS_DIR), gpus, io_timeout_s, chrony. Anything
that can block (the venv's python, a hung NFS mount, chronyc, the NFS server) runs with a timeout,
the slow ones side by side. Never fails: problems are reported in the JSON so the controller can
name them with their fix.
"""

import argparse
import contextlib
import hashlib
import json
import os
import pwd
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# Asked of the training venv's python: importlib.metadata reads versions without importing torch.
VERSIONS_PROBE = r"""
import json, platform
from importlib import metadata
out = {"python": platform.python_version()}
for label, dist in (("torch", "torch"), ("deepspeed", "deepspeed"), ("accelerate", "accelerate"),
                    ("trainer", "clustertrain")):
    try:
        out[label] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        out[label] = None
# DeepSpeed's JIT ops: built at provisioning (the manifest), and build locks nobody holds.
try:
    from trainer.torch_extensions import check
    out["extensions"] = check()
except ImportError as err:
    out["extensions"] = {"error": f"the node's trainer package has no trainer.torch_extensions ({err})"}
# What the trainer will see: a CPU build of torch, or a driver older than the build's CUDA, shows
# 0 GPUs here while nvidia-smi lists them all. Only where the inventory gives the node GPUs
# (argv[1] == "gpu"): importing torch costs seconds, and a CPU node has nothing to compare.
import sys
if sys.argv[1:] == ["gpu"]:
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        out["torch_gpus"] = torch.cuda.device_count()
    except Exception as err:  # noqa: BLE001 - any failure to import torch is the finding
        out["torch_error"] = f"{type(err).__name__}: {err}"[:300]
try:
    import hashlib
    from pydoc_data.topics import topics
    # The exact text the trainer builds from the bundled corpus (trainer/data.py).
    text = "\n\n".join(topics[name] for name in sorted(topics)).encode()
    out["bundled_text"] = {"sha256": hashlib.sha256(text).hexdigest(), "bytes": len(text)}
except ImportError:
    out["bundled_text"] = None
print(json.dumps(out))
"""

# Run in a child process with a deadline: on a hard NFS mount whose server is gone, statvfs and
# writes block; the child is then killed and the mount reported as hung, never this script.
IO_PROBE = r"""
import json, os, sys
path, marker, token = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"error": ""}
try:
    st = os.statvfs(path)
    out["free_bytes"] = st.f_bavail * st.f_frsize
    out["total_bytes"] = st.f_blocks * st.f_frsize
    if marker:
        target = os.path.join(path, marker)
        with open(target, "w") as handle:
            handle.write(token)
            handle.flush()
            # The head must see it through the share: flush to the server, not just the page cache.
            os.fsync(handle.fileno())
        out["written"] = target
except OSError as err:
    out["error"] = f"{err.strerror}: {err.filename or path}"
print(json.dumps(out))
"""


def sha256_of(path):
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def run(command, timeout, env=None):
    """(rc, stdout, stderr); rc 127 when the program is missing, 124 on timeout."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        return 127, "", f"{command[0]} is not installed"
    except subprocess.TimeoutExpired:
        return 124, "", f"{command[0]} did not answer within {timeout:g} s"
    except OSError as err:
        return 126, "", str(err)
    return out.returncode, out.stdout, out.stderr


def accelerators():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"source": "no nvidia-smi", "count": 0, "models": []}
    rc, out, err = run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], 30)
    if rc != 0:
        return {"source": "nvidia-smi", "error": (err or out).strip()[-500:]}
    rows = [[part.strip() for part in line.rsplit(",", 1)] for line in out.splitlines() if line.strip()]
    models = [row[0] for row in rows]
    drivers = sorted({row[1] for row in rows if len(row) > 1})
    return {"source": "nvidia-smi", "count": len(models), "models": models, "driver": ", ".join(drivers)}


def versions(venv, extensions_dir="", gpus=0):
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return {"error": f"no python at {python}"}
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions_dir) if extensions_dir else None
    rc, out, err = run([python, "-c", VERSIONS_PROBE, "gpu" if gpus > 0 else "cpu"], 120, env)
    if rc != 0:
        return {"error": (err or out).strip()[-500:]}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unreadable answer from {python}: {out.strip()[-300:]}"}


def data_checksum(path, found_versions):
    if not path:
        bundled = found_versions.pop("bundled_text", None)
        if found_versions.get("error"):
            return {"path": "bundled text", "kind": "bundled", "error": found_versions["error"]}
        if not bundled:
            return {"path": "bundled text", "kind": "bundled", "error": "no pydoc_data in the training venv"}
        return {"path": "bundled text (pydoc_data.topics)", "kind": "bundled", **bundled}
    found_versions.pop("bundled_text", None)
    kind = "file"
    try:
        digest, size = sha256_of(path)
    except OSError as err:
        return {"path": path, "kind": kind, "error": f"{err.strerror}: {path}"}
    return {"path": path, "kind": kind, "sha256": digest, "bytes": size}


def infiniband():
    """InfiniBand/RoCE devices the kernel lists (NCCL_IB_DISABLE auto reads the same directory)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def interfaces():
    """Every interface: name, flags, operstate, MTU, addresses (from `ip -j addr`)."""
    rc, out, err = run(["ip", "-j", "addr", "show"], 10)
    if rc != 0:
        return {"error": (err or out).strip()[-300:] or f"ip exited {rc}"}
    found = []
    for link in json.loads(out or "[]"):
        found.append(
            {
                "name": link.get("ifname", ""),
                "flags": link.get("flags", []),
                "operstate": link.get("operstate", ""),
                "mtu": link.get("mtu"),
                "addresses": [
                    f"{a['local']}/{a.get('prefixlen', 32)}"
                    for a in link.get("addr_info", [])
                    if a.get("family") == "inet" and a.get("local")
                ],
            }
        )
    return {"interfaces": found}


def chrony():
    """chronyd's own view: is it running, synchronised, to what, how far off."""
    rc, out, err = run(["chronyc", "-n", "tracking"], 5)
    if rc != 0:
        return {"running": False, "error": (err or out).strip()[-300:] or f"chronyc exited {rc}", "rc": rc}
    fields = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return {"running": True, "tracking": fields}


def mount_of(path):
    """(mount point, fs type, source) of the mount holding `path`, from mountinfo; no stat of the
    path itself, which blocks on a hung NFS mount."""
    path = os.path.normpath(path)
    best = ("", "", "")
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                fstype, source = right.split()[:2]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype, source)
    except (OSError, IndexError, ValueError):
        pass
    return {"point": best[0], "fstype": best[1], "source": best[2]}


def fstab_entry(path):
    try:
        with open("/etc/fstab") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 3 and not fields[0].startswith("#") and fields[1] == os.path.normpath(path):
                    return {
                        "source": fields[0],
                        "fstype": fields[2],
                        "options": fields[3] if len(fields) > 3 else "",
                    }
    except OSError:
        pass
    return None


def timed_io(path, marker, token, timeout):
    """statvfs (and the marker write) of `path` in a child killed after `timeout` seconds."""
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", IO_PROBE, path, marker or "", token or ""],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        # A process blocked on a hard NFS mount may take a moment to die; never wait long.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.communicate(timeout=2)
        return {"hung": True, "error": f"no answer within {timeout:g} s", "seconds": timeout}
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"error": (err or out).strip()[-300:] or "the I/O probe printed nothing"}
    result["seconds"] = round(time.monotonic() - started, 2)
    result["hung"] = False
    return result


def rpc_null(address, port=2049, program=100003, version=4, timeout=5.0):
    """ONC RPC NULL call to the NFS program over TCP: does the server itself answer?"""
    xid = random.getrandbits(32)
    # xid, CALL, RPC version 2, program, version, procedure NULL, AUTH_NONE credential and verifier
    body = struct.pack(">10I", xid, 0, 2, program, version, 0, 0, 0, 0, 0)
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack(">I", 0x80000000 | len(body)) + body)
            header = _recv_exact(sock, 4)
            reply = _recv_exact(sock, struct.unpack(">I", header)[0] & 0x7FFFFFFF)
    except TimeoutError:
        return {"answered": False, "error": f"no answer within {timeout:g} s"}
    except OSError as err:
        return {"answered": False, "error": err.strerror or str(err)}
    try:
        rxid, mtype, reply_stat = struct.unpack(">3I", reply[:12])
        if rxid != xid or mtype != 1:
            return {"answered": False, "error": "the answer on port 2049 is not an RPC reply"}
        if reply_stat != 0:
            return {"answered": True, "accepted": False, "error": "the server denied the call"}
        verf_len = struct.unpack(">I", reply[16:20])[0]
        offset = 20 + (verf_len + 3) // 4 * 4
        accept = struct.unpack(">I", reply[offset : offset + 4])[0]
    except struct.error:
        return {"answered": False, "error": "truncated RPC reply"}
    if accept == 0:
        return {"answered": True, "accepted": True, "error": ""}
    if accept == 2:
        low, high = struct.unpack(">2I", reply[offset + 4 : offset + 12])
        return {
            "answered": True,
            "accepted": False,
            "error": f"NFS version {version} not served ({low}-{high})",
        }
    return {"answered": True, "accepted": False, "error": f"RPC accept status {accept}"}


def _recv_exact(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("the server closed the connection")
        data += chunk
    return data


def nfs(request, timeout):
    """The NFS server answers (RPC NULL), its service runs (on the server), the libnfs round trip
    where this node cannot mount (containers)."""
    if not request:
        return None
    out = {"role": request.get("role")}
    if request.get("server"):
        out["rpc"] = rpc_null(request["server"], timeout=min(timeout, 5.0))
    if request.get("service"):
        rc, text, err = run(["systemctl", "is-active", request["service"]], 10)
        words = text.split()
        state = (
            words[0]
            if len(words) == 1
            else f"not known (systemctl: {(err or text).strip().splitlines()[:1]})"
        )
        out["service"] = {"name": request["service"], "state": state}
    if request.get("url") and out.get("rpc", {}).get("answered"):
        rc, text, err = run(["nfs-ls", request["url"]], timeout)
        out["libnfs"] = {
            "ok": rc == 0,
            "error": "" if rc == 0 else (err or text).strip()[-300:] or f"rc {rc}",
        }
    return out


def shm(path="/dev/shm"):
    out = {"path": path, "error": ""}
    try:
        st = os.statvfs(path)
        out["free_bytes"] = st.f_bavail * st.f_frsize
        out["total_bytes"] = st.f_blocks * st.f_frsize
        name = os.path.join(path, f".clustertrain-preflight-{os.getpid()}")
        with open(name, "wb") as handle:
            handle.write(b"x" * 4096)
        os.unlink(name)
    except OSError as err:
        out["error"] = f"{err.strerror}: {err.filename or path}"
    return out


def model_weights(model_dir):
    """Bytes of the model's weight files and their dtype (config.json), to size a checkpoint."""
    if not model_dir:
        return None
    out = {"dir": model_dir, "bytes": 0, "files": 0, "dtype": None, "error": ""}
    try:
        for name in os.listdir(model_dir):
            if name.endswith((".safetensors", ".bin", ".pt", ".pth")):
                out["bytes"] += os.path.getsize(os.path.join(model_dir, name))
                out["files"] += 1
        with open(os.path.join(model_dir, "config.json")) as handle:
            config = json.load(handle)
        out["dtype"] = config.get("torch_dtype") or config.get("dtype")
    except (OSError, ValueError, AttributeError) as err:
        out["error"] = str(getattr(err, "strerror", None) or err)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--request", required=True, help="JSON: what to look at (see the docstring)")
    request = json.loads(parser.parse_args().request)
    timeout = float(request.get("io_timeout_s") or 10)
    user = pwd.getpwuid(os.getuid())
    shared = request.get("shared_dir") or ""
    marker = request.get("marker") or {}
    with ThreadPoolExecutor(max_workers=6) as pool:
        found_versions = pool.submit(
            versions, request["venv"], request.get("extensions_dir") or "", int(request.get("gpus") or 0)
        )
        shared_io = (
            pool.submit(timed_io, shared, marker.get("name"), marker.get("token"), timeout)
            if shared
            else None
        )
        nfs_state = pool.submit(nfs, request.get("nfs"), timeout)
        time_sync = pool.submit(chrony) if request.get("chrony") else None
        gpus = pool.submit(accelerators)
        links = pool.submit(interfaces)
        found = found_versions.result()
        facts = {
            "user": user.pw_name,
            "uid": os.getuid(),
            "gid": os.getgid(),
            "accelerators": gpus.result(),
            "infiniband": infiniband(),
            "interfaces": links.result(),
            "chrony": time_sync.result() if time_sync else None,
            "versions": found,
            "extensions": found.pop("extensions", None) if isinstance(found, dict) else None,
            "data": data_checksum(request.get("data_path") or "", found),
            "shm": shm(),
            "model": model_weights(request.get("model_dir") or ""),
            "shared": {
                "dir": shared,
                "mount": mount_of(shared) if shared else None,
                "fstab": fstab_entry(shared) if shared else None,
                "io": shared_io.result() if shared_io else None,
            },
            "nfs": nfs_state.result(),
        }
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
