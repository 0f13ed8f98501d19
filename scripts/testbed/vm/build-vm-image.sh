#!/usr/bin/env bash
# Builds the base disk and kernel for the real-kernel VM scenario (molecule/vm), once per machine:
#   $CACHE/base-<recipe>.qcow2, $CACHE/vmlinuz-<recipe>, $CACHE/initrd-<recipe>
# where CACHE is $CLUSTERTRAIN_VM_CACHE (default /var/cache/clustertrain-vm) and <recipe> the hash
# of this script and the guest files, so changing either builds a new image. Prints the recipe.
# Guests cannot reach a package mirror: everything converge installs is baked in here.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
vm_dir="$testbed_dir/vm"
cache="${CLUSTERTRAIN_VM_CACHE:-/var/cache/clustertrain-vm}"

# Kernel, init, sshd and Ansible's needs, then what the roles install on real hosts with the
# production settings (kernel NFS server and client, chrony with clock control, ufw).
base_packages=linux-image-amd64,systemd,systemd-sysv,udev,dbus,kmod,openssh-server,python3,sudo,iproute2,procps,netbase
role_packages=(
  nfs-kernel-server nfs-common chrony ufw libnfs-utils iperf3
  python3-venv python3-apt rsync acl openssh-client
)

recipe="$(cat "$0" "$vm_dir"/guest/* | sha256sum | cut -c1-16)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$cache/base-$recipe.qcow2" ] && [ -f "$cache/vmlinuz-$recipe" ] \
  && [ -f "$cache/initrd-$recipe" ]; then
  echo "$recipe"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "debootstrap and chroot need root"
ensure_host_packages vm
for tool in debootstrap mkfs.ext4 qemu-img; do
  command -v "$tool" >/dev/null || die "$tool is missing"
done
mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
mkdir -p "$cache"
started=$SECONDS

workdir="$(mktemp -d "${TMPDIR:-/var/tmp}/clustertrain-vm-image.XXXXXX")"
rootfs="$workdir/rootfs"
cleanup() {
  # Never rm -rf through a live mount (debootstrap and this script mount /proc in the rootfs).
  local mnt
  for mnt in $(findmnt -rn -o TARGET | grep "^$rootfs/" | sort -r); do umount -l "$mnt" || true; done
  if findmnt -rn -o TARGET | grep -q "^$rootfs/"; then
    log "still mounted under $rootfs: left $workdir in place"
  else
    rm -rf "$workdir"
  fi
}
trap cleanup EXIT

log "debootstrap bookworm with a kernel into $rootfs (2-4 minutes)"
debootstrap --variant=minbase --include="$base_packages" bookworm "$rootfs" "$mirror" \
  >"$workdir/debootstrap.log" 2>&1 || { tail -n 30 "$workdir/debootstrap.log" >&2; die "debootstrap failed"; }

log "installing the roles' packages: ${role_packages[*]}"
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
mount -t proc proc "$rootfs/proc"
chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  "${role_packages[@]}" >"$workdir/apt.log" 2>&1 || { tail -n 30 "$workdir/apt.log" >&2; die "apt-get failed"; }
umount "$rootfs/proc"
rm -f "$rootfs/usr/sbin/policy-rc.d"

# Identity per VM at boot: hostname and cluster address from the kernel command line, SSH host
# keys and root's authorized_keys from the seed disk; no host keys and no machine id in the image.
install -m 0755 "$vm_dir/guest/vm-identity" "$rootfs/usr/local/sbin/vm-identity"
install -m 0644 "$vm_dir/guest/vm-identity.service" "$rootfs/etc/systemd/system/vm-identity.service"
install -m 0644 "$vm_dir/guest/10-nat.network" "$rootfs/etc/systemd/network/10-nat.network"
chroot "$rootfs" systemctl enable vm-identity.service systemd-networkd.service >/dev/null 2>&1
rm -f "$rootfs"/etc/ssh/ssh_host_*
: >"$rootfs/etc/machine-id"
rm -f "$rootfs/var/lib/dbus/machine-id"
echo vm >"$rootfs/etc/hostname"
printf '/dev/vda / ext4 defaults,errors=remount-ro 0 1\n' >"$rootfs/etc/fstab"
# The test bed never contacts public time servers; the timesync role writes the sources.
sed -i -E '/^(pool|server)[[:space:]]/d' "$rootfs/etc/chrony/chrony.conf"
rm -f "$rootfs"/etc/chrony/sources.d/*.sources
chroot "$rootfs" apt-get clean
cp "$(ls "$rootfs"/boot/vmlinuz-* | sort -V | tail -n 1)" "$workdir/vmlinuz"
cp "$(ls "$rootfs"/boot/initrd.img-* | sort -V | tail -n 1)" "$workdir/initrd"

log "making the 4 GiB disk"
truncate -s 4G "$workdir/base.raw"
mkfs.ext4 -q -F -L root -d "$rootfs" "$workdir/base.raw"
qemu-img convert -O qcow2 "$workdir/base.raw" "$workdir/base.qcow2"

mv "$workdir/vmlinuz" "$cache/vmlinuz-$recipe"
mv "$workdir/initrd" "$cache/initrd-$recipe"
mv "$workdir/base.qcow2" "$cache/base-$recipe.qcow2"
# Older recipes' files: no overlay outlives a scenario run, so nothing still needs them.
find "$cache" -maxdepth 1 \( -name 'base-*.qcow2' -o -name 'vmlinuz-*' -o -name 'initrd-*' \) \
  ! -name "*$recipe*" -delete
log "built the VM image $recipe in $((SECONDS - started)) s ($(du -m "$cache/base-$recipe.qcow2" | cut -f1) MiB)"
echo "$recipe"
