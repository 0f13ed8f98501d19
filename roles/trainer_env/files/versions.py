"""Print the versions of the trainer's stack in this venv as JSON (no heavy imports).

`torch_cuda` is the CUDA version torch was built for (None: the CPU build), read from torch's
version.py without importing torch. `ansible` says whether the controller's packages leaked in.
"""

import importlib.metadata
import importlib.util
import json
import platform
import re
import sys
from pathlib import Path


def torch_cuda():
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    match = re.search(r"^cuda(?::[^=]*)?\s*=\s*'([^']+)'", version_file.read_text(), re.MULTILINE)
    return match.group(1) if match else None


versions = {"python": platform.python_version()}
for name in sys.argv[1:]:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
facts = {"torch_cuda": torch_cuda(), "ansible_installed": importlib.util.find_spec("ansible") is not None}
print(json.dumps({"versions": versions, "facts": facts}, sort_keys=True))
