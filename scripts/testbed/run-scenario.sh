#!/usr/bin/env bash
# `make molecule` and `make test-vm`: one Molecule scenario end to end, then destroy whatever happened
# (images and the wheelhouse stay cached for the next run).
#   run-scenario.sh default [PYTEST_ARGS...]   containers; between verify and destroy, the launcher
#                                              and preflight tests run on the live bed (pytest -m testbed)
#   run-scenario.sh vm                         QEMU VMs with real kernels
# CI shows only the end of the output, so the last lines say what failed: the failing step's fatal
# lines are repeated after the (otherwise long) destroy output, which goes to a log file.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

scenario="${1:?usage: $0 default|vm [PYTEST_ARGS...]}"
shift
logs="$repo_root/.cache/testbed-logs/$scenario"
mkdir -p "$logs"

destroy() {
  # Test-bed tests run only while this file says "up": never against a bed being torn down.
  [ "$scenario" != default ] || echo down >/tmp/clustertrain-testbed.status
  "$testbed_dir/molecule.sh" destroy -s "$scenario" >"$logs/destroy.log" 2>&1 \
    || log "destroy failed, see $logs/destroy.log"
}

fail() {
  local what=$1 logfile=$2
  destroy
  log "FAILED: $what. Full output: $logfile. The failing lines:"
  grep -E -A3 'fatal: |\[ERROR\]|^ERROR|Traceback|^E  |^FAILED ' "$logfile" | tail -n 40 >&2
  exit 1
}

started=$SECONDS
: >"$logs/times.txt"
phase_done() {  # one line per phase in times.txt, which .ci/run prints last (CI shows only the tail)
  echo "$1: $(( (SECONDS - phase_started) / 60 )) min $(( (SECONDS - phase_started) % 60 )) s" | tee -a "$logs/times.txt"
  phase_started=$SECONDS
}
phase_started=$SECONDS
# `--destroy never` also skips the sequence's first destroy: a bed left by an aborted run (or a
# hand-made one) would be reused as is, so start from nothing explicitly.
destroy
"$testbed_dir/molecule.sh" test -s "$scenario" --destroy never 2>&1 | tee "$logs/molecule.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "molecule test -s $scenario" "$logs/molecule.log"
phase_done "molecule test -s $scenario"
# Where the converge's time went (each role, the node environment's build, pack and unpack).
"$repo_root/.venv/bin/python" "$testbed_dir/converge_times.py" "$logs/molecule.log" | sed 's/^/  /' | tee -a "$logs/times.txt"

if [ "$scenario" = default ]; then
  # -rP: what passing tests print (preflight's wall times on the bed); --durations: where the time goes.
  "$repo_root/.venv/bin/pytest" -q -rP --durations=0 -m testbed "$@" 2>&1 | tee "$logs/pytest-testbed.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "pytest -m testbed" "$logs/pytest-testbed.log"
  phase_done "pytest -m testbed"
fi

destroy
log "scenario $scenario passed in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
