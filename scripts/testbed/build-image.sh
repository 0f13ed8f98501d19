#!/usr/bin/env bash
# Builds the Molecule test bed's base image, localhost/clustertrain-base:bookworm, from Debian
# packages (no container registry is reachable). Debian bookworm minbase with systemd as PID 1,
# sshd, python3, and every package the roles install, so converge never downloads in a container.
#
# Cached: skipped when the image exists with a recipe label equal to the hash of this script, so
# changing the package list below rebuilds it. FORCE=1 rebuilds anyway.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

image="${TESTBED_IMAGE:-localhost/clustertrain-base:bookworm}"

# What systemd, Ansible and Molecule need in every container. netbase: without /etc/services,
# rpcbind and ganesha fail with "RPC: Unknown host".
base_packages=systemd,systemd-sysv,python3,sudo,openssh-server,iproute2,procps,dbus,netbase
# What the roles install (timesync, firewall, nfs_server ganesha, nfs_client, trainer_env, preflight).
role_packages=(
  chrony ufw nfs-ganesha nfs-ganesha-vfs libnfs-utils nfs-common iperf3
  python3-venv python3-apt rsync acl openssh-client g++ python3-dev
)

recipe="$(sha256sum <"$0" | cut -c1-16)"
current="$(podman image inspect --format '{{ index .Config.Labels "clustertrain.recipe" }}' "$image" \
  2>/dev/null || true)"
if [ "${FORCE:-0}" != 1 ] && [ "$current" = "$recipe" ]; then
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "debootstrap and chroot need root"
command -v debootstrap >/dev/null || die "debootstrap is missing: run scripts/install-system-deps.sh"
mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
started=$SECONDS

workdir="$(mktemp -d "${TMPDIR:-/var/tmp}/clustertrain-image.XXXXXX")"
rootfs="$workdir/rootfs"
cleanup() {
  # debootstrap and this script mount /proc (and debootstrap /sys, /dev/pts) inside the rootfs:
  # unmount everything under it, deepest first, and never rm -rf through a live mount.
  local mnt
  for mnt in $(findmnt -rn -o TARGET | grep "^$rootfs/" | sort -r); do umount -l "$mnt" || true; done
  if findmnt -rn -o TARGET | grep -q "^$rootfs/"; then
    log "still mounted under $rootfs: left $workdir in place"
  else
    rm -rf "$workdir"
  fi
}
trap cleanup EXIT

log "debootstrap bookworm into $rootfs (a minute or two)"
debootstrap --variant=minbase --include="$base_packages" bookworm "$rootfs" "$mirror" \
  >"$workdir/debootstrap.log" 2>&1 || { tail -n 30 "$workdir/debootstrap.log" >&2; die "debootstrap failed"; }

log "installing the roles' packages: ${role_packages[*]}"
# No service may start inside the chroot while packages install.
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
mount -t proc proc "$rootfs/proc"
chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  "${role_packages[@]}" >"$workdir/apt.log" 2>&1 || { tail -n 30 "$workdir/apt.log" >&2; die "apt-get failed"; }
umount "$rootfs/proc"
rm -f "$rootfs/usr/sbin/policy-rc.d"

# Each container makes its own SSH host keys at boot, never shares the image's.
rm -f "$rootfs"/etc/ssh/ssh_host_*
mkdir -p "$rootfs/etc/systemd/system/ssh.service.d"
cat >"$rootfs/etc/systemd/system/ssh.service.d/host-keys.conf" <<'UNIT'
[Service]
# Reset the list: Debian's own `sshd -t` check must run after the keys exist, not before.
ExecStartPre=
ExecStartPre=/usr/bin/ssh-keygen -A
ExecStartPre=/usr/sbin/sshd -t
UNIT

# The test bed never contacts public time servers; the timesync role writes its own sources.
sed -i -E '/^(pool|server)[[:space:]]/d' "$rootfs/etc/chrony/chrony.conf"
rm -f "$rootfs"/etc/chrony/sources.d/*.sources

# Boot must come up clean ("running", not "degraded") with the capabilities a test container gets.
# /run/rpc_pipefs needs a kernel mount a container may not make (the kernel NFS client cannot
# run in a container anyway). nfs-ganesha stays off until the nfs_server role configures and
# enables it (it needs DAC_READ_SEARCH and an export).
chroot "$rootfs" systemctl mask run-rpc_pipefs.mount >/dev/null 2>&1
chroot "$rootfs" systemctl disable nfs-ganesha.service nfs-ganesha-lock.service >/dev/null 2>&1 || true

# systemd gives each container a fresh machine id.
: >"$rootfs/etc/machine-id"
rm -f "$rootfs/var/lib/dbus/machine-id"
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old

log "importing $image"
previous="$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
tar -C "$rootfs" -c . | podman import --quiet \
  --change 'CMD ["/sbin/init"]' \
  --change "LABEL clustertrain.recipe=$recipe" \
  - "$image" >/dev/null
# The replaced image is left untagged: drop it unless a container still uses it.
[ -n "$previous" ] && podman rmi "$previous" >/dev/null 2>&1 || true
log "built $image in $((SECONDS - started)) s ($(podman image inspect --format '{{.Size}}' "$image" \
  | awk '{ printf "%d MB", $1 / 1e6 }'))"
