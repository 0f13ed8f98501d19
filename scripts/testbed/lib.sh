# Shared helpers for the test-bed scripts (sourced, not run).
# shellcheck shell=bash

testbed_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$testbed_dir/../.." && pwd)"
export CONTAINERS_CONF="$testbed_dir/containers.conf"

log() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The Debian mirror this machine's apt already uses, so the test bed needs no host name of its own.
# Reads deb822 .sources files and one-line sources.list entries; skips security and update suites.
debian_mirror() {
  local uri
  uri="$(
    {
      cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
        /^URIs:/ { uris = $0; sub(/^URIs:[ \t]*/, "", uris) }
        /^Suites:/ { if ($0 ~ /bookworm([ \t]|$)/ && uris !~ /security/) { split(uris, u, " "); print u[1] } }'
      grep -hE '^deb[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -v security | awk '{ for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { print $i; break } }'
    } | head -n 1
  )"
  [ -n "$uri" ] || die "no Debian mirror found in /etc/apt/sources.list*; set DEBIAN_MIRROR=URL"
  printf '%s\n' "$uri"
}

# Installs the named groups of scripts/system-packages.txt (the project's one package list) when
# any of their packages is missing; quiet and instant when all are there.
ensure_host_packages() {
  [ "$(id -u)" -eq 0 ] || {
    local missing
    missing="$("$repo_root/scripts/install-system-deps.sh" --list "$@" | while read -r pkg; do
      dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
    done | tr '\n' ' ')"
    [ -z "$missing" ] || die "missing Debian packages: $missing(run scripts/install-system-deps.sh $* as root)"
    return 0
  }
  "$repo_root/scripts/install-system-deps.sh" "$@"
}
