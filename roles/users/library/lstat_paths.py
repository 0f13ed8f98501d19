#!/usr/bin/python
"""Look at several paths without following symbolic links, in one round trip (users/tasks/links.yml).

Read-only, so it runs in check mode. For each path: whether it exists, whether it is a symbolic
link and where the link points, or the error that kept it from being looked at. The stat module
does one path per call; five per host, twice per run (users and ssh_trust), was seconds of an
idempotent run.
"""

from __future__ import annotations

import os
import stat

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: lstat_paths
short_description: lstat several paths in one call, never following a link
options:
  paths:
    description: Absolute paths to look at.
    type: list
    elements: path
    required: true
"""

RETURN = r"""
results:
  description: One entry per path, in order - path, exists, islnk, lnk_target (links only), msg (errors only).
  type: list
  returned: always
"""


def look(path: str) -> dict:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # absent, or below something that is not a dir
        return {"path": path, "exists": False, "islnk": False}
    except OSError as err:
        return {"path": path, "msg": f"{err.strerror}: {path}"}
    entry = {"path": path, "exists": True, "islnk": stat.S_ISLNK(st.st_mode)}
    if entry["islnk"]:
        entry["lnk_target"] = os.readlink(path)
    return entry


def main() -> None:
    module = AnsibleModule(
        argument_spec={"paths": {"type": "list", "elements": "path", "required": True}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, results=[look(path) for path in module.params["paths"]])


if __name__ == "__main__":
    main()
