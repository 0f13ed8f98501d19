#!/usr/bin/env bash
# Smoke test of the podman plumbing, independent of the roles: three containers from the base
# image on one network with systemd as PID 1 boot clean, reach each other by name, and ufw
# (NET_ADMIN, NET_RAW) enforces a deny rule in one container's own network namespace.
# Prints the boot time of each container. Cleans up after itself, also on failure.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

image="${TESTBED_IMAGE:-localhost/clustertrain-base:bookworm}"
network=ct-smoke
names=(ct-smoke-a ct-smoke-b ct-smoke-c)

"$testbed_dir/build-image.sh"

cleanup() {
  podman rm -f -t 0 "${names[@]}" >/dev/null 2>&1 || true
  podman network rm "$network" >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup
podman network create "$network" >/dev/null

for name in "${names[@]}"; do
  started=$(date +%s%N)
  podman run -d --name "$name" --hostname "$name" --network "$network" --systemd=always \
    --cap-add NET_ADMIN --cap-add NET_RAW --cap-add DAC_READ_SEARCH "$image" >/dev/null
  state=starting
  for _ in $(seq 1 150); do
    state="$(podman exec "$name" systemctl is-system-running 2>/dev/null || true)"
    case "$state" in running | degraded) break ;; esac
    sleep 0.1
  done
  echo "$name: systemd $state after $(( ($(date +%s%N) - started) / 1000000 )) ms"
  if [ "$state" != running ]; then
    podman exec "$name" systemctl --failed --no-legend >&2
    die "$name did not boot clean"
  fi
done

# sshd generated its own host keys at boot and answers by name from another container.
for _ in $(seq 1 50); do
  podman exec ct-smoke-b systemctl is-active -q ssh && break
  sleep 0.2
done
probe() { # probe FROM HOST PORT -> prints open|closed
  podman exec "$1" python3 -c "
import socket, sys
try:
    socket.create_connection(('$2', $3), 3).close(); print('open')
except OSError:
    print('closed')"
}
[ "$(probe ct-smoke-a ct-smoke-b 22)" = open ] || die "ct-smoke-a cannot reach ct-smoke-b:22 by name"

# ufw inside ct-smoke-b: deny by default, allow 22 and 29500; 8080 listens but must be blocked.
podman exec ct-smoke-b bash -c '
  ufw default deny incoming >/dev/null && ufw allow 22/tcp >/dev/null && ufw allow 29500/tcp >/dev/null &&
  ufw --force enable >/dev/null
  for port in 8080 29500; do setsid python3 -m http.server "$port" >/dev/null 2>&1 < /dev/null & done
  sleep 1'
for check in "22 open" "29500 open" "8080 closed"; do
  set -- $check
  got="$(probe ct-smoke-c ct-smoke-b "$1")"
  [ "$got" = "$2" ] || die "port $1 on ct-smoke-b is $got from ct-smoke-c, expected $2"
  echo "ufw: port $1 $got from another container (expected)"
done
echo "smoke test passed"
