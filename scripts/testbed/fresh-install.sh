#!/usr/bin/env bash
# Proves the README's set-up on a fresh Debian 12 machine, in a bare container: nothing installed
# but what debootstrap's minbase gives, plus python3, make and CA certificates (a fresh machine's
# Python and make). Inside it, from a copy of this checkout's files (what a clone holds):
#   1. scripts/install-system-deps.sh for the controller, train and testbed groups: every listed
#      package installs, and every command the project and its test bed run is then present
#      (netavark's iptables among them: a package missing from the list fails here, not on a
#      user's machine);
#   2. `make install`: the controller's venv has Ansible and ansible-runner and no torch, and
#      `trainer plan` works on the embedded default;
#   3. `make train`: the README's first command trains the embedded default (4 steps).
# The machine's pip settings (find-links to the local torch wheel, CA bundle) are passed in, so pip
# behaves as on this machine. Run by .ci/run; about 5-8 min.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

image="${FRESH_IMAGE:-localhost/clustertrain-bare:bookworm}"
recipe="$(sha256sum <"$0" | cut -c1-16)"
ensure_host_packages testbed
current="$(podman image inspect --format '{{ index .Config.Labels "clustertrain.recipe" }}' "$image" 2>/dev/null || true)"
started=$SECONDS
if [ "$current" != "$recipe" ]; then
  [ "$(id -u)" -eq 0 ] || die "debootstrap needs root"
  workdir="$(mktemp -d "${TMPDIR:-/var/tmp}/clustertrain-bare.XXXXXX")"
  trap 'rm -rf "$workdir"' EXIT
  log "debootstrap a bare bookworm (minbase + python3, make, ca-certificates)"
  debootstrap --variant=minbase --include=python3,make,ca-certificates bookworm "$workdir/rootfs" \
    "${DEBIAN_MIRROR:-$(debian_mirror)}" >"$workdir/debootstrap.log" 2>&1 \
    || { tail -n 30 "$workdir/debootstrap.log" >&2; die "debootstrap failed"; }
  chroot "$workdir/rootfs" apt-get clean
  tar -C "$workdir/rootfs" -c . | podman import --quiet --change "LABEL clustertrain.recipe=$recipe" - "$image" >/dev/null
  rm -rf "$workdir"
  trap - EXIT
fi

# What a clone of this checkout holds: tracked files and new files that git does not ignore.
tree="$(mktemp -d "${TMPDIR:-/var/tmp}/clustertrain-fresh.XXXXXX")"
trap 'rm -rf "$tree"' EXIT
(cd "$repo_root" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -c 2>/dev/null) | tar -C "$tree" -x

pip_mounts=()
for path in /opt/wheels /opt/pypi /opt/pypi-more /etc/xdg/pip /etc/ssl/certs/ca-certificates.crt; do
  [ -e "$path" ] && pip_mounts+=(-v "$path:$path:ro")
done
pip_env=()
for name in $(env | grep -oE '^PIP_[A-Z_]+' || true); do pip_env+=(-e "$name"); done

log "fresh Debian 12 container: system packages, make install, make train"
podman run --rm "${pip_mounts[@]}" "${pip_env[@]}" \
  -e DEBIAN_FRONTEND=noninteractive -e USER=root -v "$tree:/src:ro" "$image" bash -euo pipefail -c '
    cp -a /src /work && cd /work
    scripts/install-system-deps.sh controller train testbed
    for pkg in $(scripts/install-system-deps.sh --list controller train testbed); do
      dpkg-query -W -f="\${Status}" "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || { echo "FAILED: $pkg is listed but not installed"; exit 1; }
    done
    for cmd in python3 ssh g++ iperf3 podman runc iptables debootstrap slurmctld slurmd sbatch munged; do
      command -v "$cmd" >/dev/null || { echo "FAILED: no $cmd after installing the list"; exit 1; }
    done
    /usr/lib/podman/netavark --version >/dev/null || { echo "FAILED: netavark does not run"; exit 1; }
    test -f /usr/include/python3.11/Python.h || { echo "FAILED: no Python.h (DeepSpeed op build)"; exit 1; }
    echo "fresh-install: system packages OK"
    make install
    .venv/bin/python -c "import ansible, ansible_runner, yaml, rich"
    if .venv/bin/python -c "import torch" 2>/dev/null; then echo "FAILED: the controller install has torch"; exit 1; fi
    .venv/bin/trainer plan -i inventory/local >/dev/null
    echo "fresh-install: controller venv OK (Ansible, no torch)"
    make train ARGS="--set train.max_steps=4 --set train.log_every=2"
    test -f output/runs/default/summary.json || { echo "FAILED: make train wrote no summary.json"; exit 1; }
    echo "fresh-install: make train OK"
  '
log "passed in $((SECONDS - started)) s"
