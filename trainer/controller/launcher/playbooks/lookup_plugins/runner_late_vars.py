"""Lookup of trainer.controller.runner's prestarted runs: the value of a late extra variable.

ansible-playbook is started before `trainer launch` has its plan (runner.prestart_playbook), with
each of the plan's variables given as `{{ lookup('runner_late_vars', 'NAME') }}`. The first use waits
for the values file (JSON, written whole by the runner once the plan is made; its path is in the
environment), and reads it once per process. Its values are data: Ansible renders no template in a
lookup's result. A run the launcher does not use is canceled; the wait also ends when the runner's
private dir is gone, and after WAIT_S in any case, with an error before any host was contacted.
"""

from __future__ import annotations

import json
import os
import time

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: runner_late_vars
short_description: a late extra variable of a prestarted trainer launch
description: Waits for the launcher's values file and returns the named variable's value.
options:
  _terms:
    description: variable names
    required: true
"""

#: Where the runner writes the values (trainer.controller.runner.LATE_VALUES_ENV).
VALUES_ENV = "CLUSTERTRAIN_RUNNER_LATE_VALUES"
#: The launcher's plan takes a second or two; this is the bound for a stuck launcher.
WAIT_S = 600.0
POLL_S = 0.005

_loaded: dict[str, dict] = {}


def _values(path: str) -> dict:
    if path not in _loaded:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(path):
            if not os.path.isdir(os.path.dirname(path)):
                raise AnsibleError("the launcher canceled this run before its plan was made")
            if time.monotonic() > deadline:
                raise AnsibleError(f"the launcher wrote no plan within {WAIT_S:.0f} s ({path})")
            time.sleep(POLL_S)
        with open(path, encoding="utf-8") as handle:
            _loaded[path] = json.load(handle)
    return _loaded[path]


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        path = os.environ.get(VALUES_ENV)
        if not path:
            raise AnsibleError(f"runner_late_vars: {VALUES_ENV} is not set (only a prestarted run has it)")
        values = _values(path)
        missing = [term for term in terms if term not in values]
        if missing:
            raise AnsibleError(f"runner_late_vars: the launcher gave no value for {', '.join(missing)}")
        return [values[term] for term in terms]
