#!/usr/bin/env python3
"""Print this node's facts for preflight as JSON: user, accelerators, versions, data checksum.

Runs on the node with the system python3 (standard library only) as the training user, so the data
file and the venv are read with the permissions training will have. Never fails: problems are
reported in the JSON so the controller can name them with their fix.
"""

import argparse
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys

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
# What the trainer will see: a CPU build of torch, or a driver older than the build's CUDA, shows
# 0 GPUs here while nvidia-smi lists them all.
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


def sha256_of(path):
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def accelerators():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"source": "no nvidia-smi", "count": 0, "models": []}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"source": "nvidia-smi", "error": str(err)}
    if out.returncode != 0:
        return {"source": "nvidia-smi", "error": (out.stderr or out.stdout).strip()[-500:]}
    rows = [
        [part.strip() for part in line.rsplit(",", 1)] for line in out.stdout.splitlines() if line.strip()
    ]
    models = [row[0] for row in rows]
    drivers = sorted({row[1] for row in rows if len(row) > 1})
    return {"source": "nvidia-smi", "count": len(models), "models": models, "driver": ", ".join(drivers)}


def versions(venv):
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return {"error": f"no python at {python}"}
    try:
        out = subprocess.run([python, "-c", VERSIONS_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": str(err)}
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    return json.loads(out.stdout)


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", required=True)
    parser.add_argument("--data-path", default="")
    args = parser.parse_args()
    user = pwd.getpwuid(os.getuid())
    found_versions = versions(args.venv)
    print(
        json.dumps(
            {
                "user": user.pw_name,
                "uid": os.getuid(),
                "gid": os.getgid(),
                "accelerators": accelerators(),
                "infiniband": infiniband(),
                "versions": found_versions,
                "data": data_checksum(args.data_path, found_versions),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
