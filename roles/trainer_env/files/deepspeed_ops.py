"""Build DeepSpeed's JIT ops on this node now, so no training start compiles (trainer_env).

    python deepspeed_ops.py EXTENSIONS_DIR [BUILDER_NAME ...]

Run with the training venv's python as the training user. Always builds the communication op
DeepSpeed's own init builds on this node's accelerator (deepspeed.comm.torch.build_shm_op: the
shared-memory op on the CPU), then each extra op builder named (e.g. CPUAdamBuilder), into
EXTENSIONS_DIR (the venv sets TORCH_EXTENSIONS_DIR to it). Stale build locks there (a build killed
midway) are removed first. Writes clustertrain-ops.json (op -> built library) and prints JSON
{"changed", "built", "removed_stale", "seconds"}; changed is false when every library was already
up to date (ninja rebuilt nothing), so provisioning stays idempotent.

Importing torch and DeepSpeed only to find nothing to build took 10-18 s per node on every
idempotent run, so the manifest also records what the build depended on (python, torch and
DeepSpeed versions, the op builders asked for) and each library's size and mtime: when all of them
are as recorded and no stale lock was found, nothing is imported and nothing is built.
"""

import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path


def libraries(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.glob("*/*.so")}


def build_inputs(extra: list[str]) -> dict:
    """What a rebuild depends on, read without importing torch or DeepSpeed."""
    return {
        "python": sys.version,
        "torch": importlib.metadata.version("torch"),
        "deepspeed": importlib.metadata.version("deepspeed"),
        "builders": sorted(extra),
    }


def library_stamps(built: dict[str, str]) -> dict[str, list[float]]:
    stamps = {}
    for library in built.values():
        info = os.stat(library)
        stamps[library] = [info.st_size, info.st_mtime]
    return stamps


def up_to_date(manifest_path: Path, inputs: dict) -> bool:
    try:
        manifest = json.loads(manifest_path.read_text())
        same_libraries = manifest.get("libraries") == library_stamps(manifest["ops"])
        return manifest.get("inputs") == inputs and same_libraries
    except (OSError, ValueError, KeyError, TypeError):
        return False


def main() -> int:
    root = Path(sys.argv[1])
    extra = sys.argv[2:]
    from trainer.extensions_dir import owned_dir

    # torch would load whatever another account left in a dir it does not own (trainer.extensions_dir):
    # the role makes the dir the training user's and builds as it, so anything else is a mistake.
    if not owned_dir(str(root), os.geteuid()):
        raise SystemExit(f"refusing to build in {root}: not a directory of uid {os.geteuid()}, the builder")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    # torch's JIT build runs `ninja` from PATH; the venv has it.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from trainer.torch_extensions import MANIFEST, remove_stale

    removed = remove_stale({"TORCH_EXTENSIONS_DIR": str(root), "XDG_CACHE_HOME": str(root / ".none")})
    manifest_path = root / MANIFEST
    inputs = build_inputs(extra)
    if not removed and up_to_date(manifest_path, inputs):
        built = json.loads(manifest_path.read_text())["ops"]  # for the converged check's record
        answer = {"changed": False, "built": built, "removed_stale": [], "seconds": 0.0, "up_to_date": True}
        print(json.dumps(answer))
        return 0
    before = libraries(root)
    started = time.monotonic()

    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    built: dict[str, str] = {}
    module = build_shm_op()  # None where this accelerator's DeepSpeed init builds no comm op
    if module is not None:
        built[Path(module.__file__).parent.name] = module.__file__
    for name in extra:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            raise SystemExit(f"DeepSpeed has no op builder {name!r} for this node's accelerator")
        module = builder.load()
        built[Path(module.__file__).parent.name] = module.__file__
    after = libraries(root)
    manifest = {
        "ops": built,
        "accelerator": get_accelerator()._name,
        "inputs": inputs,
        "libraries": library_stamps(built),
    }
    old = manifest_path.read_text() if manifest_path.exists() else ""
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    if text != old:
        manifest_path.write_text(text)
    changed = after != before or text != old or bool(removed)
    print(
        json.dumps(
            {
                "changed": changed,
                "built": built,
                "removed_stale": [lock["path"] for lock in removed],
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
