#!/usr/bin/env bash
# Runs Molecule for this project's scenarios: `scripts/testbed/molecule.sh test -s default`.
# Sets up what every run needs, each step cached and quiet when nothing changed:
#   the project-local podman settings (CONTAINERS_CONF: runc, ulimits, netavark),
#   the repo's venv first on PATH (Molecule needs ansible-config there),
#   the base image localhost/clustertrain-base:bookworm (build-image.sh),
#   the offline wheelhouse in .cache/wheelhouse (wheelhouse.sh), exported as CLUSTERTRAIN_WHEELHOUSE.
# The vm scenario builds its own VM image in its create step and needs no container image.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

export PATH="$repo_root/.venv/bin:$PATH"
export CLUSTERTRAIN_WHEELHOUSE="${CLUSTERTRAIN_WHEELHOUSE:-$repo_root/.cache/wheelhouse}"

scenario=default
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    -s | --scenario-name) scenario="${args[$((i + 1))]:-default}" ;;
    --scenario-name=*) scenario="${args[$i]#*=}" ;;
  esac
done

ensure_host_packages testbed
if [ "$scenario" != vm ]; then
  "$testbed_dir/build-image.sh"
fi
"$repo_root/scripts/wheelhouse.sh" "$CLUSTERTRAIN_WHEELHOUSE"

cd "$repo_root"
exec molecule "$@"
