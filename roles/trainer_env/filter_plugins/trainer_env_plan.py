"""Which node builds each node environment, and what every other node does (trainer_env).

`{{ states | trainer_env_plan(head) }}`: `states` maps each node to {"key": the key of the
environment it needs, "base": that key without this project's wheel, "state": what node_env.py
state read there, "in_play": bool}; `head` is the head's name. Nodes with one key get one
environment, built once:

- its source is a node that already holds it whole (tree and ops as recorded) with its pack, the
  head first; else a node that holds it without its pack ("pack": packed, not built); else the head
  or the first node of that key ("build"). A node outside the play (a `--limit` run) can be the
  source only where it holds the environment and its pack: nothing is built there. Where only this
  project's wheel changed ("update"), the node holding the rest installs the wheel and packs again.
- where no node in the play holds it, the controller's kept pack of that key ("seed": copied to the
  source, checked, unpacked) or of the same stack with another wheel ("seed-update"), when the
  controller keeps packs (trainer_env_controller_keeps_envs), before a build.
- every other node of the key is "current" (it holds the same tree), "restore" (it holds the key's
  pack, verified before use, but its venv or ops changed since: unpacked again from its own copy) or
  "unpack" (it gets the source's pack through the shared dir).

Returns {"envs": {key: {"source", "source_action", "hosts", "publish", "keep"}}, "hosts": {node:
{"action", "why", "source", "seed"}}}: `why` is what `--check --diff` and the log say for the node.
"""

from __future__ import annotations

import json
from pathlib import Path


def _holds(state: dict, key: str) -> bool:
    installed = state.get("installed") or {}
    return installed.get("key") == key and bool(state.get("tree_ok")) and bool(state.get("ops_ok"))


def _holds_base(state: dict, base: str) -> bool:
    """Holds an environment of the same stack, OS, Python and accelerator: only this project's
    wheel differs, which is installed into it and packed again instead of building anew."""
    installed = state.get("installed") or {}
    return installed.get("base") == base and bool(state.get("tree_ok")) and bool(state.get("ops_ok"))


def _why_not_current(state: dict, key: str) -> str:
    installed = state.get("installed") or {}
    if not installed:
        return "no environment yet"
    if installed.get("key") != key:
        return f"its environment's key is {installed.get('key', '?')}, the inventory's is {key}"
    if not state.get("tree_ok"):
        return "its venv changed since it was installed (files edited, added or removed)"
    return "its DeepSpeed ops changed since they were installed"


def trainer_env_plan(states: dict, head: str, cached: dict | None = None) -> dict:
    cached = cached or {}
    by_key: dict[str, list[str]] = {}
    for host, entry in states.items():  # inventory order, the head first where it is in the play
        by_key.setdefault(entry["key"], []).append(host)
    envs, hosts = {}, {}
    for key, members in by_key.items():
        members = sorted(members, key=lambda h: (h != head, list(states).index(h)))
        playing = [h for h in members if states[h].get("in_play", True)]
        holders = [h for h in members if _holds(states[h]["state"], key)]
        with_pack = [h for h in holders if states[h]["state"].get("pack_cached")]
        seed = ""  # the controller's kept pack the source starts from
        same_base = [k for k, record in cached.items() if record.get("base") == states[members[0]]["base"]]
        if with_pack:
            source, action, why = with_pack[0], "current", "holds the environment and its pack"
        elif holders and holders[0] in playing:
            source, action, why = holders[0], "pack", "holds the environment; its pack is missing"
        elif updatable := [h for h in playing if _holds_base(states[h]["state"], states[h]["base"])]:
            source, action = updatable[0], "update"
            why = "installs this checkout's wheel into the environment it holds and packs it"
        elif key in cached and playing:
            source, action, seed = playing[0], "seed", key
            why = "takes it from the controller's kept pack"
        elif same_base and playing:
            source, action, seed = playing[0], "seed-update", same_base[-1]
            why = "takes the controller's kept pack of this stack, installs this checkout's wheel, packs it"
        elif playing:
            source, action = playing[0], "build"
            why = "builds it: " + _why_not_current(states[source]["state"], key)
        else:
            continue  # only out-of-play nodes have this key: nothing to do in this run
        source_tree = (states[source]["state"].get("installed") or {}).get("tree")
        fresh = action in ("build", "update", "seed", "seed-update")  # a pack no other node holds yet
        hosts[source] = {"action": action, "why": why, "source": source, "seed": seed}
        for host in playing:
            if host == source:
                continue
            state = states[host]["state"]
            installed = state.get("installed") or {}
            # The source's build (a fresh one is no other node's yet).
            same_build = not fresh and installed.get("key") == key and installed.get("tree") == source_tree
            if same_build and _holds(state, key):
                hosts[host] = {"action": "current", "why": "holds the environment", "source": source}
            elif same_build and state.get("pack_cached"):
                hosts[host] = {"action": "restore", "why": _why_not_current(state, key), "source": host}
            else:
                hosts[host] = {"action": "unpack", "why": _why_not_current(state, key), "source": source}
        envs[key] = {
            "source": source,
            "source_action": action,
            "hosts": [h for h in members if h in hosts],
            "publish": any(hosts[h]["action"] == "unpack" for h in members if h in hosts),
            # A new pack of a stack the controller keeps none of (trainer_env_controller_keeps_envs): one
            # per stack. Another wheel on a kept stack is not fetched again (a fetch of the pack cost more
            # than the seed-update it would save): the next cluster installs its wheel into the kept one.
            "keep": action in ("build", "update", "pack") and not same_base,
        }
    return {"envs": envs, "hosts": hosts}


def trainer_env_cached(directory: str) -> dict:
    """The controller's kept packs (trainer_env_controller_envs): key -> its record, for each record
    whose pack is there at the recorded size. Read on the controller, the operator's private dir."""
    kept = {}
    for record_path in sorted(Path(directory).glob("*.json")):
        try:
            record = json.loads(record_path.read_text())
            pack = record_path.with_suffix(".tar.zst")
            if pack.stat().st_size == record["size"] and record["key"] == record_path.stem:
                kept[record["key"]] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return kept


def trainer_env_plan_of_play(
    play_hosts: list, hostvars, head: str, head_state: dict | None = None, cached: dict | None = None
) -> dict:
    """The plan for this play's nodes, from each one's trainer_env_key, _base and _state facts. The
    head's state, read when the head is not in the play (`head_state`), makes it a candidate source
    for the environment it holds, whatever key the inventory would give it now."""
    states = {}
    if head_state and head not in play_hosts:
        installed = head_state.get("installed") or {}
        held = {"key": installed.get("key"), "base": installed.get("base")}
        states[head] = {**held, "state": head_state, "in_play": False}
    for host in play_hosts:
        facts = hostvars[host]
        states[host] = {
            "key": facts["trainer_env_key"],
            "base": facts["trainer_env_base"],
            "state": facts["trainer_env_state"],
            "in_play": True,
        }
    return trainer_env_plan(states, head, cached or {})


class FilterModule:
    def filters(self):
        return {"trainer_env_plan": trainer_env_plan_of_play, "trainer_env_cached": trainer_env_cached}
