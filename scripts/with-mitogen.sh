#!/usr/bin/env bash
# Runs a command (ansible-playbook ...) with Mitogen's `mitogen_linear` strategy: `make provision
# MITOGEN=1`. Opt-in: bench/provision.py measured it 1.5-1.8x faster than plain SSH on idempotent runs,
# with the same result (changed=0, verify passes). Refuses, naming the fix, when mitogen is missing.
set -euo pipefail
python="${VENV_PYTHON:-$(dirname "$0")/../.venv/bin/python}"
if ! strategy_dir=$("$python" -c 'import ansible_mitogen, os; print(os.path.join(os.path.dirname(ansible_mitogen.__file__), "plugins", "strategy"))' 2>/dev/null); then
  echo "MITOGEN=1: the mitogen package is not installed in $("$python" -c 'import sys; print(sys.prefix)'). Fix: make install-mitogen (or pip install -e '.[mitogen]'), or leave MITOGEN unset." >&2
  exit 2
fi
export ANSIBLE_STRATEGY_PLUGINS="$strategy_dir${ANSIBLE_STRATEGY_PLUGINS:+:$ANSIBLE_STRATEGY_PLUGINS}"
export ANSIBLE_STRATEGY=mitogen_linear
exec "$@"
