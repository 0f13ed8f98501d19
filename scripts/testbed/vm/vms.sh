#!/usr/bin/env bash
# Starts and stops the QEMU VMs of the real-kernel scenario (molecule/vm's create/destroy call it).
#   vms.sh prepare                           base image, namespace, controller key (cached)
#   vms.sh start NAME ADDR/PREFIX SSH_PORT   boot one VM (returns once QEMU runs; SSH comes later)
#   vms.sh stop NAME                         power it off and drop its overlay
#   vms.sh stop-all                          every VM of this test bed, then the namespace
#   vms.sh known-hosts                       print the pinned known_hosts file's path
# State (keys, overlays, console logs, pids) lives in $CLUSTERTRAIN_VM_STATE
# (default /var/tmp/clustertrain-vm); the base image in $CLUSTERTRAIN_VM_CACHE (build-vm-image.sh).
#
# Network: every VM's QEMU runs in the network namespace `clustertrain-vm` that this script
# creates, with two NICs: eth0 = user-mode net, restrict=on (reaches nothing), hostfwd
# 127.0.0.1:SSH_PORT -> 22 inside the namespace; eth1 = the private cluster segment, a multicast
# socket on the namespace's loopback (the host's routes stay untouched). The controller's ssh
# reaches the VMs through netns-relay.py as ProxyCommand, with the host keys generated here and
# pinned in known_hosts (injected through a seed disk before the first boot).
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
vm_dir="$testbed_dir/vm"

netns=clustertrain-vm
segment=230.77.0.1:7700
state="${CLUSTERTRAIN_VM_STATE:-/var/tmp/clustertrain-vm}"
cache="${CLUSTERTRAIN_VM_CACHE:-/var/cache/clustertrain-vm}"

ensure_netns() {
  ip netns list | grep -qx "$netns\( .*\)\?" || ip netns add "$netns"
  ip -n "$netns" link set lo up multicast on
  ip -n "$netns" route replace 224.0.0.0/4 dev lo
}

prepare() {
  ensure_host_packages vm
  recipe="$("$vm_dir/build-vm-image.sh")"
  ensure_netns
  mkdir -p "$state"
  chmod 0700 "$state"
  [ -f "$state/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C clustertrain-vm-controller -f "$state/id_ed25519"
  touch "$state/known_hosts"
  # ssh's ProxyCommand (inventory/hosts.yml) runs the relay from here: one fixed path.
  install -m 0755 "$vm_dir/netns-relay.py" "$state/netns-relay.py"
}

start_vm() {
  local name="$1" address="$2" port="$3"
  [[ "$name" =~ ^[a-z][a-z0-9-]*$ ]] || die "bad VM name '$name' (lower-case letters, digits, '-')"
  [[ "$address" =~ ^([0-9]+\.){3}([0-9]+)/[0-9]+$ ]] || die "bad address '$address' for $name (want A.B.C.D/PREFIX)"
  local last_octet="${BASH_REMATCH[2]}"
  [[ "$port" =~ ^[0-9]+$ ]] || die "bad SSH port '$port' for $name"
  local dir="$state/$name"
  if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    log "$name already runs (pid $(cat "$dir/pid"))"
    return 0
  fi
  local recipe
  prepare
  rm -rf "$dir"
  mkdir -p "$dir/seed/ssh"

  # The VM's host key is made here, so known_hosts can pin it before the VM ever boots.
  ssh-keygen -q -t ed25519 -N '' -C "$name" -f "$dir/seed/ssh/ssh_host_ed25519_key"
  cp "$state/id_ed25519.pub" "$dir/seed/authorized_keys"
  local pinned
  pinned="$(grep -v "^\[127.0.0.1\]:$port " "$state/known_hosts" || true)"
  {
    [ -n "$pinned" ] && printf '%s\n' "$pinned"
    echo "[127.0.0.1]:$port $(cut -d' ' -f1,2 "$dir/seed/ssh/ssh_host_ed25519_key.pub")"
  } >"$state/known_hosts.new"
  mv "$state/known_hosts.new" "$state/known_hosts"
  truncate -s 16M "$dir/seed.img"
  mkfs.ext4 -q -F -L vmseed -d "$dir/seed" "$dir/seed.img"
  rm -rf "$dir/seed"

  qemu-img create -q -f qcow2 -F qcow2 -b "$cache/base-$recipe.qcow2" "$dir/overlay.qcow2"
  # TCG, not KVM: -enable-kvm aborts on these hosts. tb-size caps the translation cache (without
  # it each VM takes about twice the memory).
  ip netns exec "$netns" qemu-system-x86_64 \
    -name "$name" -machine q35 -accel tcg,tb-size=256 -cpu max -smp 1 -m 768 \
    -kernel "$cache/vmlinuz-$recipe" -initrd "$cache/initrd-$recipe" \
    -append "root=/dev/vda rw console=ttyS0 net.ifnames=0 vm.hostname=$name vm.ip=$address" \
    -drive "file=$dir/overlay.qcow2,if=virtio,format=qcow2" \
    -drive "file=$dir/seed.img,if=virtio,format=raw,readonly=on" \
    -netdev "user,id=nat,restrict=on,hostfwd=tcp:127.0.0.1:$port-:22" \
    -device virtio-net-pci,netdev=nat \
    -netdev "socket,id=cluster,mcast=$segment,localaddr=127.0.0.1" \
    -device "virtio-net-pci,netdev=cluster,mac=52:54:00:77:00:$(printf '%02x' "$last_octet")" \
    -display none -vga none -serial "file:$dir/console.log" \
    -daemonize -pidfile "$dir/pid"
  log "$name started (pid $(cat "$dir/pid")), cluster address $address, SSH via 127.0.0.1:$port in netns $netns"
}

stop_vm() {
  local name="$1" dir="$state/$1" pid
  if [ -f "$dir/pid" ]; then
    pid="$(cat "$dir/pid")"
    # Only a QEMU of ours: the pid file may be stale after a host reboot.
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = qemu-system-x86 ]; then
      kill "$pid"
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
  fi
  rm -rf "$dir"
}

case "${1:-}" in
  prepare) prepare ;;
  start) [ $# -eq 4 ] || die "usage: $0 start NAME ADDR/PREFIX SSH_PORT"; start_vm "$2" "$3" "$4" ;;
  stop) [ $# -eq 2 ] || die "usage: $0 stop NAME"; stop_vm "$2" ;;
  stop-all)
    for dir in "$state"/*/; do [ -d "$dir" ] && stop_vm "$(basename "$dir")"; done
    ip netns list | grep -qx "$netns\( .*\)\?" && ip netns delete "$netns"
    rm -f "$state/known_hosts"
    ;;
  known-hosts) echo "$state/known_hosts" ;;
  *) die "usage: $0 prepare | start NAME ADDR/PREFIX SSH_PORT | stop NAME | stop-all | known-hosts" ;;
esac
