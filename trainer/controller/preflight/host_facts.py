"""One node fact per host, for the judges that read node_facts.py's output: the hosts where it was read,
and a FAIL for each host where it was not, naming why and the fix.

Every such judge walked the hosts with its own copy of "fact missing -> FAIL, next host"; this is that
loop once (each_host_fact for one fact of node_facts.py, each_host_answer for a host's whole answer).
The FAILs land in the judge's own list as the walk reaches each host, so a report keeps the hosts'
order whatever the verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from trainer.controller.inventory import Cluster, Host
from trainer.controller.preflight.report import FAIL, Result


def each_host_answer(
    hosts: Iterable[Host],
    answers: Mapping[str, Any],
    why_missing: Callable[[str], str],
    results: list[Result],
    *,
    check: str,
    unreadable: Callable[[Host, str], str],
    fix: Callable[[Host], str],
) -> Iterator[tuple[Host, Any]]:
    """(host, its answer) for each of `hosts` with one in `answers` (host name -> what the probe
    returned there). Elsewhere a FAIL goes into `results`: `unreadable(host, why_missing(host))` with
    the fix `fix(host)`."""
    for host in hosts:
        answer = answers.get(host.name)
        if answer is None:
            results.append(
                Result(check, host.name, FAIL, unreadable(host, why_missing(host.name)), fix=fix(host))
            )
            continue
        yield host, answer


def each_host_fact(
    cluster: Cluster,
    facts: dict[str, Any],
    key: str,
    why_missing: Callable[[str], str],
    results: list[Result],
    *,
    check: str,
    unreadable: Callable[[Host, str], str],
    fix: Callable[[Host], str],
    error_is_unreadable: bool = True,
) -> Iterator[tuple[Host, Any]]:
    """(host, its `key` fact) for each host where the probe read it. Elsewhere a FAIL goes into
    `results`: `unreadable(host, reason)` with the fix `fix(host)`, the reason being the probe's own
    error or why the probe left no output there. `error_is_unreadable`: a fact holding an `error`
    counts as not read (False where the judge names the fact's errors itself)."""
    for host in cluster.hosts:
        fact = (facts.get(host.name) or {}).get(key)
        failed = error_is_unreadable and isinstance(fact, dict) and fact.get("error")
        if fact is None or failed:
            reason = fact["error"] if failed else why_missing(host.name)
            results.append(Result(check, host.name, FAIL, unreadable(host, reason), fix=fix(host)))
            continue
        yield host, fact
