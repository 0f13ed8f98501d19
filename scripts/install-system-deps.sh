#!/usr/bin/env bash
# Debian packages the controller, the tests and the test bed need. Idempotent: installs only what is
# missing, so a second `make` costs nothing. Runs as root (CI and this machine) or through sudo.
set -euo pipefail

packages=(
  iperf3 libiperf0          # bandwidth checks (preflight) through the iperf3 Python wrapper
  podman runc                # the Molecule test bed: containers with systemd (runc: crun fails here)
  netavark aardvark-dns      # podman networking with DNS, so test-bed containers reach each other by name
  iptables                   # netavark programs the containers' NAT and forwarding rules with it
  debootstrap                # builds the test bed's base image; no registry is reachable
  openssh-client rsync       # Ansible over SSH, wheelhouse copies
  g++                        # DeepSpeed compiles a small shm op on first init
)

missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
