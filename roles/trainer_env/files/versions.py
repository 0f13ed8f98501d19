"""Print the versions of the trainer's stack in this venv as JSON (no heavy imports)."""

import importlib.metadata
import json
import platform
import sys

versions = {"python": platform.python_version()}
for name in sys.argv[1:]:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
print(json.dumps(versions, sort_keys=True))
