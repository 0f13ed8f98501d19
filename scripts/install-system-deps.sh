#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages of the named groups from scripts/system-packages.txt (the one
# list), only those missing: a second run costs nothing. Root or sudo.
#   scripts/install-system-deps.sh controller train testbed
#   scripts/install-system-deps.sh --list GROUP...   print the groups' packages, install nothing
set -euo pipefail

list="$(dirname "$0")/system-packages.txt"
only_list=0
if [ "${1:-}" = --list ]; then only_list=1; shift; fi
[ $# -gt 0 ] || { echo "usage: $0 [--list] GROUP... (groups: $(awk '!/^#/ && NF { print $1 }' "$list" | sort -u | tr '\n' ' '))" >&2; exit 2; }

packages=()
for group in "$@"; do
  grep -qE "^$group[[:space:]]" "$list" || { echo "$0: no group '$group' in $list" >&2; exit 2; }
  while read -r pkg; do packages+=("$pkg"); done < <(awk -v g="$group" '$1 == g { print $2 }' "$list")
done
# Each package once, in list order.
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | awk '!seen[$0]++')
if [ "$only_list" = 1 ]; then printf '%s\n' "${packages[@]}"; exit 0; fi

missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Installing from the lists the machine has first: an offline or mirror-pinned machine with the
# packages' files cached needs no update.
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
