#!/usr/bin/env bash
# `make molecule`: the container scenario end to end, then the launcher and preflight tests on the
# live bed, then destroy whatever happened (the image and wheelhouse stay cached for the next run).
# CI shows only the end of the output, so the last lines say what failed: the first failing step's
# fatal lines are repeated after the (otherwise long) destroy output, which goes to a log file.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

logs="$repo_root/.cache/testbed-logs"
mkdir -p "$logs"
pytest_args=("$@")

destroy() {
  "$testbed_dir/molecule.sh" destroy -s default >"$logs/destroy.log" 2>&1 \
    || log "destroy failed, see $logs/destroy.log"
}

fail() {
  local what=$1 logfile=$2
  destroy
  log "FAILED: $what. Full output: $logfile. The failing lines:"
  grep -E 'fatal: |FAILED!|failed=[1-9]|ERROR|Error|Traceback|assert|^E  ' "$logfile" | tail -n 40 >&2
  exit 1
}

"$testbed_dir/molecule.sh" test -s default --destroy never 2>&1 | tee "$logs/molecule.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "molecule test -s default" "$logs/molecule.log"

"$repo_root/.venv/bin/pytest" -q -m testbed "${pytest_args[@]}" 2>&1 | tee "$logs/pytest-testbed.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "pytest -m testbed" "$logs/pytest-testbed.log"

destroy
log "test bed: molecule and the test-bed tests passed"
