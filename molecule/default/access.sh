#!/bin/sh
# The controller's side of how the test bed reaches ct-worker2 (see inventory/hosts.yml): an SSH key
# for the `ops` account and the password its sudo asks for, in a directory only root can enter.
# Made once and kept (the containers are recreated, these stay); prepare.yml installs them in the
# container and pins its new host key in known_hosts here.
set -eu
dir=/var/tmp/clustertrain-testbed/access
umask 077
mkdir -p "$dir"
chmod 0700 "$dir"
[ -s "$dir/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "clustertrain test bed controller" -f "$dir/id_ed25519"
if [ ! -s "$dir/become-password" ]; then
    # 24 random letters and digits; never printed.
    LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24 >"$dir/become-password"
fi
touch "$dir/known_hosts"
