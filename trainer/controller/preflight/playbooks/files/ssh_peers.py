#!/usr/bin/env python3
"""SSH trust seen from this node, as the user running this script: what its keys say, and real logins.

keys (--peers-all): this account's public keys, the keys its authorized_keys accepts (with their
from= patterns), this node's host public keys, and for every peer the host keys pinned for it in the
known_hosts files ssh reads. The controller compares them across nodes (preflight.ssh_trust): every
pair's keys proven from N reads, without N(N-1) logins.

logins (--peers): `ssh -o BatchMode=yes true` to each peer, one at a time, in the order given (the
controller's rounds: each sshd gets one login of a round). Host keys must already be pinned:
StrictHostKeyChecking=yes, never "no". A connection dropped before authentication (sshd's
MaxStartups under load, a reset) is tried again after a pause, up to --tries times; an answer that
says why (refused, timed out, key or host key) is final at once.

Prints one JSON object: {"results": [{"peer", "address", "rc", "stderr", "tries", "start", "end"}],
"keys": {...}}. Never fails.
"""

import argparse
import base64
import glob
import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import sys
import time

#: Words in ssh's stderr that say why a login failed: such a failure is final, never retried.
FINAL = (
    "permission denied",
    "host key verification failed",
    "remote host identification has changed",
    "host key is known",
    "host key for",
    "connection refused",
    "timed out",
    "no route to host",
    "could not resolve",
    "network is unreachable",
)
KEY_TYPE = re.compile(r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp\d+|sk-\S+)(-cert-v01@openssh\.com)?$")


def login(user, name, address, timeout, tries):
    """One peer: (rc, stderr) of the last try, the number of tries, and when it started and ended."""
    command = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"ConnectTimeout={timeout}",
        "-o",
        "NumberOfPasswordPrompts=0",
        "-o",
        "ControlMaster=no",  # a real login each time, never a shared connection
        "-o",
        "ControlPath=none",
        f"{user}@{address}",
        "true",
    ]
    started = time.time()
    for attempt in range(1, tries + 1):
        try:
            out = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout + 10, stdin=subprocess.DEVNULL
            )
            rc, stderr = out.returncode, out.stderr.strip()[-800:]
        except subprocess.TimeoutExpired:
            rc, stderr = 255, "ssh timed out"
        if rc == 0 or any(word in stderr.lower() for word in FINAL) or attempt == tries:
            break
        # Dropped before any answer (reset, closed during the key exchange): sshd busy, try again.
        time.sleep(0.5 * 3 ** (attempt - 1))
    return {
        "peer": name,
        "address": address,
        "rc": rc,
        "stderr": stderr,
        "tries": attempt,
        "start": round(started, 3),
        "end": round(time.time(), 3),
    }


def read_lines(path):
    try:
        with open(os.path.expanduser(path), errors="replace") as handle:
            return [line.strip() for line in handle if line.strip() and not line.lstrip().startswith("#")]
    except OSError:
        return []


def split_options(line):
    """(options, rest) of an authorized_keys line: options run to the first space outside quotes."""
    first = line.split(None, 1)[0]
    if KEY_TYPE.match(first):
        return "", line
    quoted = False
    for index, char in enumerate(line):
        if char == '"':
            quoted = not quoted
        elif char in " \t" and not quoted:
            return line[:index], line[index:].strip()
    return line, ""


def key_of(text):
    """'type blob' of a public key line, or None."""
    parts = text.split()
    if len(parts) >= 2 and KEY_TYPE.match(parts[0]):
        return f"{parts[0]} {parts[1]}"
    return None


def authorized(home):
    found = []
    for name in ("authorized_keys", "authorized_keys2"):
        for line in read_lines(os.path.join(home, ".ssh", name)):
            options, rest = split_options(line)
            key = key_of(rest)
            if key:
                match = re.search(r'(?:^|,)from="([^"]*)"', options)
                found.append({"key": key, "from": match.group(1) if match else ""})
    return found


def ssh_settings(target):
    """`ssh -G` for one target: {keyword: [values]} (identity files, known hosts files, port)."""
    try:
        out = subprocess.run(["ssh", "-G", "--", target], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    settings = {}
    for line in out.stdout.splitlines():
        keyword, _, value = line.partition(" ")
        settings.setdefault(keyword.lower(), []).append(value)
    return settings


def identities(settings):
    """This account's public keys: the .pub beside each identity file ssh would offer."""
    found = []
    for path in settings.get("identityfile", []):
        for line in read_lines(os.path.expanduser(path) + ".pub"):
            key = key_of(line)
            if key:
                found.append(key)
    return sorted(set(found))


def host_matches(pattern_field, host):
    """Whether a known_hosts host field (patterns, negations, a hashed name) names `host`."""
    if pattern_field.startswith("|1|"):
        try:
            _, _, salt, digest = pattern_field.split("|")
            mac = hmac.new(base64.b64decode(salt), host.encode(), hashlib.sha1).digest()
            return base64.b64encode(mac).decode() == digest
        except ValueError:
            return False
    matched = False
    for pattern in pattern_field.split(","):
        negated = pattern.startswith("!")
        regex = "^" + re.escape(pattern.lstrip("!")).replace(r"\*", ".*").replace(r"\?", ".") + "$"
        if re.match(regex, host, re.IGNORECASE):
            if negated:
                return False
            matched = True
    return matched


def known_keys(lines, host):
    """Keys pinned for `host`, and whether a CA or a revocation speaks for it."""
    keys, marks = [], set()
    for line in lines:
        parts = line.split()
        marker = parts.pop(0) if parts and parts[0].startswith("@") else ""
        if len(parts) < 3 or not host_matches(parts[0], host):
            continue
        if marker:
            marks.add(marker)
        elif key_of(" ".join(parts[1:3])):
            keys.append(f"{parts[1]} {parts[2]}")
    return {"keys": sorted(set(keys)), "ca": "@cert-authority" in marks, "revoked": "@revoked" in marks}


def sets_port(paths):
    """Whether any ssh client config may give a peer another port than 22 (then ask ssh per peer)."""
    for path in paths:
        for found in glob.glob(os.path.expanduser(path)):
            if any(re.match(r"^\s*port\b", line, re.IGNORECASE) for line in read_lines(found)):
                return True
    return False


def keys(user, peers):
    """What this node holds for SSH trust, and what its known_hosts pin for each peer."""
    home = os.path.expanduser("~")
    general = ssh_settings(f"{user}@{peers[0][1]}" if peers else "localhost")
    per_peer = sets_port(["/etc/ssh/ssh_config", "/etc/ssh/ssh_config.d/*.conf", "~/.ssh/config"])
    pinned = {}
    files = {}
    for name, address in peers:
        settings = ssh_settings(f"{user}@{address}") if per_peer else general
        port = (settings.get("port") or ["22"])[0]
        host = address if port == "22" else f"[{address}]:{port}"
        fields = ("userknownhostsfile", "globalknownhostsfile")
        paths = [p for field in fields for value in settings.get(field, []) for p in value.split()]
        lines = [line for path in paths for line in files.setdefault(path, read_lines(path))]
        pinned[name] = {"host": host, **known_keys(lines, host)}
    host_keys = sorted({key for path in glob.glob("/etc/ssh/ssh_host_*_key.pub") for key in
                        map(key_of, read_lines(path)) if key})  # fmt: skip
    return {
        "identities": identities(general),
        "authorized": authorized(home),
        "host_keys": host_keys,
        "known": pinned,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--user", required=True)
    parser.add_argument("--peers", default="[]", help="JSON list of [name, address] to log in to, in order")
    parser.add_argument(
        "--peers-all", default="", help="JSON list of [name, address]: read the keys for them"
    )
    parser.add_argument("--timeout", type=int, default=5)
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    if not shutil.which("ssh"):
        print(json.dumps({"error": "no ssh client on this node", "results": []}))
        return 0
    out = {}
    if args.peers_all:
        try:
            out["keys"] = keys(args.user, json.loads(args.peers_all))
        except Exception as err:  # a key file we could not parse must not hide the logins
            out["keys"] = {"error": f"{type(err).__name__}: {err}"}
    out["results"] = [login(args.user, name, address, args.timeout, args.tries)
                      for name, address in json.loads(args.peers)]  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
