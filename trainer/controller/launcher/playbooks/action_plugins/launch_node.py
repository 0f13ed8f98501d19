"""Action plugin of `trainer launch`: one round trip to a node per step, each with a timeout.

    - name: Read the node's state
      launch_node:
        op: status           # launch | probe | lock | check | status | watch | stop | pids | whoami
        python: /srv/venv/bin/python
        request: {...}       # the JSON request for files/node_ctl.py (see its docstring)
        call: {...}          # or: request, timeout_s, secret, follow in one value (the launcher's)

Every op but `whoami` runs the node's python with a short bootstrap and the request on stdin, the
helper's own text included: no module is built (AnsiballZ costs a second or more per task on a busy
machine), no file is copied first, and no secret is on a command line. Each call is bounded twice:
`timeout` on the node, and a wall-clock wait here, so a node whose shared dir hangs (a `hard` NFS
mount) or whose SSH stalls cannot hang the launcher.

`watch` follows the node until its trainer ends: a long poll (the node answers when there are new
lines, or after `quiet_s`, `poll_s` unless given; with the request's `quiet`, a worker's, only its
trainer's end cuts the wait short), one poll per `poll_s` on average with a burst of BURST_POLLS back to back
(the few bursts of a start-up, the first step among them, are each shown at once rather than at the
next interval), each answer sent at once to the launcher through `channel` (a Unix
socket of trainer.controller.runner, one JSON line per message) instead of an Ansible event: a watch
of days writes no event files and grows no event list. A poll that fails or gets no answer is sent
as a miss (`since`: when the node stopped answering); the launcher decides when a node has been
unreachable for too long (--unreachable-grace) and cancels the run. The task itself ends once the
node's trainer has ended, with the last report as its result.

`launch` (with `probe`, `start` and `venv`: the launcher's, wire.start_calls) is a node's whole
launch in one task, since Ansible forks a worker per host and task, the controller's main cost per
node: the probe, its answer sent through the channel (`probed`), the launcher's word once every
node's probe passed (the reply on the same connection: `go` and the job's NCCL_IB_DISABLE, or why
not), the start, its answer sent (`started`), then the watch.

`become_auto` (with `training_user`): the task's become is used only where Ansible connects as
another account than the training user, found out in the same task (`id -un`, a round trip) rather
than by a `whoami` task of its own. The probe always runs as the connecting account (its answer says
whether the trainer must become the training user); where it must, the command check follows as the
training user, in the same task.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.action import ActionBase

NODE_PROGRAM = (Path(__file__).resolve().parent.parent / "files" / "node_ctl.py").read_text()
#: Reads the request (with the helper's text) from stdin and hands it to node_ctl.serve. The helper
#: needs only the standard library: `-S` skips site-packages (their .pth files cost more than the
#: rest of a status poll). `-I` keeps the working directory off the import path: it may be the login's
#: home (where Ansible logs in as the training account and becomes root), and a json.py planted there
#: would run as root.
#: The text sent is compiled on every call, and nothing compiled is kept on the node: status, stop and
#: pids run as the training account in its own node dir, so a kept copy was the job's to replace (a
#: planted one answered "running, all fine" and stopped nothing). Compiling costs 14 ms of a 52 ms poll
#: (medians on a loaded 2-core machine).
#: The request comes on stdin where the connection passes it (ssh, local); podman exec does not: there
#: it is an argument, or, when it holds secrets (the start's), a private file in Ansible's remote tmp
#: dir (`@PATH`), made readable to the training user the way Ansible does it for modules.
BOOTSTRAP = """import json, sys
given = sys.argv[1] if len(sys.argv) > 1 else ''
if given.startswith('@'):
    with open(given[1:]) as handle:
        given = handle.read()
request = json.loads(given or sys.stdin.read())
scope = {'__name__': 'node_ctl'}
exec(compile(request['program'], 'node_ctl.py', 'exec'), scope)
sys.exit(scope['serve'](request))
"""
#: A request longer than this goes in a file even without secrets (one argument may hold 128 KiB).
ARGUMENT_LIMIT = 100_000
#: Interface names as the kernel allows them: safe to write into run.sh unquoted.
IFACE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
FINAL_STATES = ("exited", "vanished", "none")
#: Polls a watch may send back to back before it waits for the interval: a quiet node's poll waits on
#: the node and earns its credit back; a chatty log still gets one poll per `poll_s` on average.
BURST_POLLS = 3


def node_command(python: str, timeout_s: float) -> str:
    """The shell command a node runs for one call (the request goes on its stdin or after it)."""
    return f"timeout -k 5 {int(timeout_s)} {shlex.quote(python)} -I -S -c {shlex.quote(BOOTSTRAP)}"


class NoAnswer(Exception):
    """The node did not answer within the time given (or its answer was not a report)."""


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(
        (
            "op",
            "python",
            "request",
            "timeout_s",
            "poll_s",
            "quiet_s",
            "channel",
            "give_up_s",
            "iface",
            "ib_disable",
            "secret",
            "become_auto",
            "training_user",
            "follow",
            "call",
            "venv",
            "probe",
            "start",
        )
    )
    #: What `call` (a template's value: this node's arguments, made by the launcher) may hold.
    _CALL_ARGS = frozenset(("request", "timeout_s", "secret", "follow"))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        # `call`: this node's request and timeouts as the launcher made them (wire.start_calls), one
        # template where the task had a template per value: Ansible compiles each template of a task's
        # arguments again in every host's worker, the controller's main cost per node.
        call = args.pop("call", None) or {}
        if unknown := sorted(set(call) - self._CALL_ARGS):
            result.update(failed=True, msg=f"launch_node: unknown call arguments {', '.join(unknown)}")
            return result
        args.update(call)
        op = args["op"]
        self._pending: threading.Thread | None = None
        self._box: dict[str, Any] = {}
        self._hostname = str((task_vars or {}).get("inventory_hostname") or "the node")
        timeout_s = float(args.get("timeout_s") or 60)
        request = dict(args.get("request") or {})
        # Whether a call uses the task's become: `become_auto` asks who Ansible connects as first (a
        # round trip in this task, where a `whoami` task of its own cost the controller a worker per
        # node) and becomes the training user only from another account.
        self._sudoable = True
        if op == "launch":
            return {**result, **self._launch(args)}
        if op == "probe":
            probed = self._probe_only(args["python"], {**request, "venv": args["venv"]}, timeout_s)
            return {**result, **probed}
        try:
            if op == "whoami":
                result["user"] = self._whoami(timeout_s)
                return result
            if args.get("become_auto") and self._connection.become is not None:
                result["user"] = self._whoami(timeout_s)
                self._sudoable = result["user"] != str(args.get("training_user") or "")
            if op == "watch":
                return {**result, **self._watch(args, request)}
            answer = self._call(args["python"], {**request, "op": op}, timeout_s, bool(args.get("secret")))
        except NodeError as err:
            result.update(failed=True, msg=err.text or str(err), rc=err.rc)
            return result
        except NoAnswer as err:
            result.update(failed=True, msg=f"{self._hostname}: {err}")
            return result
        result.update(answer)
        if op == "check" and answer.get("check_error"):
            result.update(failed=True, msg=answer["check_error"])
        elif op == "lock" and request.get("action") == "acquire" and not answer.get("acquired"):
            result.update(failed=True, msg=self._lock_refusal(request, answer))
        result["changed"] = bool(answer.get("stopped") or answer.get("released") or answer.get("acquired"))
        return result

    # --- the launch: probe, wait for every node's, start, follow -------------------------------------

    def _launch(self, args: dict) -> dict:
        """One node's whole launch in one task (a worker per node where the probe and the start were a
        task each): the probe (with the head's lock), its answer sent to the launcher through the
        channel, then the launcher's word once every node's probe has passed (`go`, with the job's
        NCCL_IB_DISABLE), then the start and the watch. A node whose probe fails ends its task failed
        (`phase` probe), and the launcher tells every other node not to start (the task ends
        skipped), as the play's any_errors_fatal did between two tasks. The launcher follows every node
        in a worker of its own at once (forks >= nodes, launch_cli.follow_problem), so a node never waits
        on a node that has not been probed for want of a worker."""
        python, probe_call, start_call = args["python"], dict(args["probe"]), dict(args["start"])
        request = {**(probe_call.get("request") or {}), "venv": args["venv"]}
        timeout_s = float(probe_call.get("timeout_s") or 60)
        channel = _Channel()
        try:
            channel.open(args.get("channel") or "")
        except _LauncherGone:
            return {"failed": True, "phase": "probe", "msg": "the launcher stopped listening (the probe)"}
        try:
            try:
                answer = self._probe(python, request, timeout_s)
                failure = self._probe_failure(request, answer)
                if failure is None and answer.get("lock_deferred"):
                    answer["lock"] = self._deferred_lock(python, request["lock"], timeout_s)
                    failure = self._probe_failure(request, answer)
            except NodeError as err:
                err.text = (
                    f"the trainer's venv {request['venv']} on {self._hostname} cannot run its python "
                    f"({err.text[-200:] or f'exit code {err.rc}'}): install the trainer there "
                    "(make provision) or fix training_venv"
                )
                return self._failed("probe", err)
            except (NoAnswer, AnsibleError) as err:  # e.g. "Missing sudo password" for the command check
                return self._failed("probe", err)
            if failure is not None:
                return {**answer, "failed": True, "phase": "probe", "msg": failure}
            channel.send({"type": "probed", "host": self._hostname, "answer": answer})
            wait_s = 3 * timeout_s + 60
            try:
                word = channel.receive(wait_s)
            except TimeoutError:
                # Not started, while the launcher may start the others: a start failure of this node.
                return self._failed("start", NoAnswer(f"no word to start within {wait_s:.0f} s of its probe"))
            if not word.get("go"):
                why = f"not started: {word.get('why') or 'the launcher said not to'}"
                return {"skipped": True, "changed": False, "phase": "probe", "msg": why}
            # As the training user from here on where Ansible connects as another account.
            self._sudoable = bool(answer.get("become"))
            start_request = dict(start_call.get("request") or {})
            try:
                found = {"iface": answer.get("iface"), "ib_disable": word.get("ib_disable")}
                start_request["run_sh"] = self._resolved_run_sh(start_request["run_sh"], found)
                started = self._call(
                    python,
                    {**start_request, "op": "start"},
                    float(start_call.get("timeout_s") or 60),
                    bool(start_call.get("secret")),
                )
            except (NoAnswer, AnsibleError) as err:
                # e.g. "Missing sudo password": the probe runs as the account Ansible connects as,
                # the start becomes the training user. A start failure: the nodes that started stop.
                return self._failed("start", err)
            follow = dict(start_call.get("follow") or {})
            watched = self._watch(
                {"python": python, **follow},
                dict(follow.get("request") or {}),
                started=started,
                channel=channel,
            )
            return {**watched, "phase": "watch", "changed": True}
        except _LauncherGone:
            return {"failed": True, "phase": "probe", "msg": "the launcher stopped listening (the start)"}
        finally:
            channel.close()

    def _probe_only(self, python: str, request: dict, timeout_s: float) -> dict:
        """The start's probe alone (probe.yml: a node left out, probed while the job runs without it):
        its answer, failed with the start's own problem text where the node could not start now."""
        try:
            answer = self._probe(python, request, timeout_s)
        except NodeError as err:
            return self._failed(
                "probe",
                NodeError(
                    err.rc,
                    f"the trainer's venv {request['venv']} on {self._hostname} cannot run its python "
                    f"({err.text[-200:] or f'exit code {err.rc}'}): install the trainer there "
                    "(make provision) or fix training_venv",
                ),
            )
        except (NoAnswer, AnsibleError) as err:
            return self._failed("probe", err)
        if problem := self._probe_problem(request, answer):
            return {**answer, "failed": True, "phase": "probe", "msg": problem}
        return {**answer, "phase": "probe"}

    def _failed(self, phase: str, err: Exception) -> dict:
        """A `launch` that failed at `phase` (probe or start: the launcher reads it), worded as before:
        a node that cannot be reached is unreachable, as Ansible's task executor words it."""
        if isinstance(err, AnsibleConnectionFailure):
            return {"unreachable": True, "phase": phase, "msg": str(err)}
        if isinstance(err, NodeError):
            return {"failed": True, "phase": phase, "msg": err.text or str(err), "rc": err.rc}
        if isinstance(err, NoAnswer):
            return {"failed": True, "phase": phase, "msg": f"{self._hostname}: {err}"}
        return {"failed": True, "phase": phase, "msg": str(err)}

    def _probe_failure(self, request: dict, answer: dict) -> str | None:
        """Why this node's probe (or the head's lock) fails the launch, or None."""
        if request.get("lock") and not (answer.get("lock") or {}).get("acquired", True):
            # The head's probe took no lock and probed nothing: another launch holds it.
            return self._lock_refusal(request["lock"], answer["lock"])
        return self._probe_problem(request, answer) or None

    def _deferred_lock(self, python: str, lock_request: dict, timeout_s: float) -> dict:
        """The run's lock, as the training user, where the head's probe could not take it (Ansible
        reached the head as another account than the launcher expected: become set outside the
        inventory). Before the probed message, so no node starts unless this launcher holds it."""
        self._sudoable = True
        return self._call(python, {**lock_request, "op": "lock"}, timeout_s)

    def _probe(self, python: str, request: dict, timeout_s: float) -> dict:
        """The probe, as the account Ansible connects as (its answer says whether the trainer must
        become the training user); where it must, the command check as the training user follows in
        the same task (the task's become), a round trip instead of a task and a worker per node."""
        self._sudoable = False
        answer = self._call(python, {**request, "op": "probe"}, timeout_s)
        self._sudoable = True
        check_request = request.get("check") or {}
        if check_request and answer.get("become") and not answer.get("checked"):
            if self._connection.become is None:
                raise NoAnswer("the command check needs become to the training user: the task has none")
            checked = self._call(python, {"op": "check", "check": check_request}, timeout_s)
            answer.update(checked=True, check_error=checked.get("check_error") or "")
        return answer

    def _whoami(self, timeout_s: float) -> str:
        """Who Ansible connects to the node as (never through become)."""
        res = self._exec(f"timeout -k 5 {int(timeout_s)} id -un", None, timeout_s, sudoable=False)
        if res["rc"] != 0:
            raise NoAnswer(f"id -un failed (rc {res['rc']}): {res['stderr'].strip()[:300]}")
        return res["stdout"].strip()

    # --- one call ----------------------------------------------------------------------------------

    def _exec(self, cmd: str, in_data: bytes | None, timeout_s: float, sudoable: bool | None = None) -> dict:
        """_low_level_execute_command, waited for at most timeout_s + 5 s. A call still running after
        that stays the one pending call (the next call waits for it rather than piling up another)."""
        if self._pending is None or not self._pending.is_alive():
            box: dict[str, Any] = {}
            use_become = self._sudoable if sudoable is None else sudoable

            def work() -> None:
                try:
                    box["res"] = self._low_level_execute_command(cmd, sudoable=use_become, in_data=in_data)
                except BaseException as err:  # handed to the waiting thread below
                    box["err"] = err

            self._box = box
            self._pending = threading.Thread(target=work, daemon=True)
            self._pending.start()
        self._pending.join(timeout_s + 5)
        if self._pending.is_alive():
            raise NoAnswer(f"no answer within {timeout_s + 5:.0f} s")
        box, self._pending = self._box, None
        if "err" in box:
            raise box["err"]
        return box["res"]

    def _call(self, python: str, request: dict, timeout_s: float, secret: bool = False) -> dict:
        """Run node_ctl.serve(request) on the node; its JSON answer (a `failed` answer raises)."""
        payload = json.dumps({**request, "program": NODE_PROGRAM})
        cmd = node_command(python, timeout_s)
        if self._connection.has_pipelining:
            res = self._exec(cmd, payload.encode(), timeout_s)
        elif not secret and len(payload) < ARGUMENT_LIMIT:
            res = self._exec(f"{cmd} {shlex.quote(payload)}", None, timeout_s)
        else:
            tmpdir = self._make_tmp_path()
            path = self._connection._shell.join_path(tmpdir, "request.json")
            self._transfer_data(path, payload)
            self._fixup_perms2((tmpdir, path), execute=False)
            try:
                res = self._exec(f"{cmd} {shlex.quote('@' + path)}", None, timeout_s)
            finally:
                self._remove_tmp_path(tmpdir)
        lines = [line for line in res["stdout"].splitlines() if line.startswith("{")]
        if res["rc"] == 124:
            raise NoAnswer(f"the node's helper did not finish within {timeout_s:.0f} s (timeout on the node)")
        if not lines:
            stderr = (res.get("stderr") or res.get("stdout") or "").strip()
            raise NodeError(res["rc"], stderr[-500:])
        answer = json.loads(lines[-1])
        if answer.get("failed"):
            raise NoAnswer(answer.get("msg") or "the node's helper failed")
        return answer

    def _resolved_run_sh(self, text: str, args: dict) -> str:
        """run.sh with what the probes found: this node's interface, the job's NCCL_IB_DISABLE."""
        iface = str(args.get("iface") or "")
        if "@CLUSTERTRAIN_IFACE@" in text and not IFACE_NAME.fullmatch(iface):
            raise NoAnswer(f"the probe found no usable interface name ({iface!r})")
        return text.replace("@CLUSTERTRAIN_IFACE@", iface).replace(
            "@CLUSTERTRAIN_IB_DISABLE@", str(int(args.get("ib_disable") or 0))
        )

    @staticmethod
    def _lock_refusal(request: dict, answer: dict) -> str:
        # The launcher words the refusal (it can tell whether the holder still runs).
        holder = answer.get("holder") or {}
        return (
            f"the run's lock {request['launch_dir']}/lock is held by pid {holder.get('pid')} on "
            f"{holder.get('controller')}"
        )

    def _probe_problem(self, request: dict, answer: dict) -> str:
        host, venv = self._hostname, request["venv"]
        problems = []
        if answer.get("venv_missing"):
            problems.append(
                f"the trainer's venv {venv} on {host} lacks {', '.join(answer['venv_missing'])}: install the "
                "trainer there (make provision) or fix training_venv"
            )
        if request.get("iface_auto") and not answer.get("iface"):
            problems.append(
                f"cluster_nccl_socket_ifname is auto but no interface of {host} holds {request['address']}: "
                "fix cluster_ip or set cluster_nccl_socket_ifname to an interface name"
            )
        if answer.get("port_error"):
            problems.append(
                f"MASTER_PORT {request['port']} on {host} is in use by another process (another job, or a "
                f"trainer left running): stop it, or set cluster_master_port to a free port "
                f"({answer['port_error']})"
            )
        if answer.get("previous") == "running":
            problems.append(
                f"run {request.get('run_name')} is still running on {host}; stop it with `trainer launch -i "
                f"INVENTORY --run-name {request.get('run_name')} --stop` or pick another --run-name"
            )
        if answer.get("check_error"):
            problems.append(answer["check_error"])
        return "; ".join(problems)

    # --- the watch ---------------------------------------------------------------------------------

    def _watch(
        self, args: dict, request: dict, started: dict | None = None, channel: _Channel | None = None
    ) -> dict:
        poll_s = max(0.05, float(args.get("poll_s") or 2.0))
        # How long a poll waits on the node when nothing happens there (a round trip per poll is the
        # controller's cost of following a node; news cuts the wait short).
        quiet_s = max(poll_s, float(args.get("quiet_s") or poll_s))
        timeout_s = float(args.get("timeout_s") or 20.0)
        give_up_s = float(args.get("give_up_s") or 0)
        host = self._hostname
        offset = request.get("offset")
        first_miss: float | None = None
        confirming = False

        def unconfirmed_end(report: dict) -> bool:
            failed_end = report.get("state") == "vanished" or (
                report.get("state") == "exited" and (report.get("exit") or {}).get("exit_code") != 0
            )
            return bool(request.get("quiet")) and failed_end

        # Polls that may start at once (a token bucket refilled at one per poll_s, BURST_POLLS deep).
        credit, credit_at = float(BURST_POLLS), time.monotonic()
        own_channel = channel is None
        if channel is None:
            channel = _Channel()
        try:
            if own_channel:
                channel.open(args.get("channel") or "")
            if started is not None:
                channel.send({"type": "started", "host": host, "report": started})
            while True:
                # A long poll comes back early when there is news (the first line of a quiet log is
                # shown at once), and the next one starts at once while there is credit: a line that
                # follows soon after (the first step after the start-up's lines) is not held back for
                # an interval; a chatty log uses its credit up and gets one poll per interval.
                now = time.monotonic()
                credit, credit_at = min(float(BURST_POLLS), credit + (now - credit_at) / poll_s), now
                if credit < 1.0:
                    time.sleep((1.0 - credit) * poll_s)
                    credit, credit_at = 1.0, time.monotonic()
                credit -= 1.0
                poll_started = time.time()
                wait = quiet_s if offset is not None else 0.0
                try:
                    report = self._call(
                        args["python"],
                        {**request, "op": "status", "offset": offset, "wait": wait},
                        wait + timeout_s,
                    )
                except (NoAnswer, NodeError, AnsibleConnectionFailure, AnsibleError) as err:
                    # Unanswered since the failed poll began (a hung poll is noticed only at its timeout).
                    first_miss = first_miss or poll_started
                    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
                    channel.send({"type": "miss", "host": host, "since": first_miss, "error": text})
                    if give_up_s and time.time() - first_miss > give_up_s:
                        return {"failed": True, "msg": f"{host}: no answer for {give_up_s:.0f} s ({text})"}
                    time.sleep(min(poll_s, 2.0))
                    continue
                first_miss = None
                offset = report.get("offset", offset)
                if unconfirmed_end(report) and not confirming:
                    # A worker's failed end is told once its node answers again. A node that goes
                    # away (a reclaimed instance) kills its processes first, and a poll waiting on it
                    # (a worker's waits up to quiet_s) can see them end: such a node is lost (the
                    # next poll fails), the first cause, not a trainer that failed. Its lines are
                    # shown meanwhile.
                    confirming = True
                    channel.send({"type": "report", "host": host, "report": _still_running(report)})
                    continue
                channel.send({"type": "report", "host": host, "report": report})
                if report.get("state") in FINAL_STATES:
                    code = (report.get("exit") or {}).get("exit_code")
                    return {"report": {k: v for k, v in report.items() if k != "lines"}, "exit_code": code}
        except _LauncherGone:
            return {"failed": True, "msg": "the launcher stopped listening; the trainer was left running"}
        finally:
            if own_channel:
                channel.close()


def _still_running(report: dict) -> dict:
    """A report of a node's end with the end left out (its lines, progress and time kept)."""
    held = ("exit", "errors", "rank_exits")
    return {**{k: v for k, v in report.items() if k not in held}, "state": "running"}


class NodeError(AnsibleError):
    """The node's helper did not run (its python missing, a crash): rc and what it printed."""

    def __init__(self, rc: int, text: str) -> None:
        super().__init__(f"the helper exited with {rc}: {text}" if text else f"the helper exited with {rc}")
        self.rc, self.text = rc, text


class _LauncherGone(Exception):
    pass


class _Channel:
    """JSON lines to the launcher's Unix socket (nothing when no path is given)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self._stream: Any = None

    def open(self, path: str) -> None:
        if path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
            except OSError as err:
                raise _LauncherGone() from err

    def receive(self, timeout_s: float) -> dict:
        """The launcher's answer to the last message (one JSON line)."""
        if self.sock is None:
            raise _LauncherGone()
        self.sock.settimeout(timeout_s)
        try:
            line = self.stream().readline()
        except TimeoutError:
            raise
        except OSError as err:
            raise _LauncherGone() from err
        finally:
            self.sock.settimeout(None)
        if not line:
            raise _LauncherGone()
        return json.loads(line)

    def stream(self) -> Any:
        if self._stream is None:
            self._stream = self.sock.makefile("rb")
        return self._stream

    def send(self, message: dict) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as err:
            raise _LauncherGone() from err

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self.sock is not None:
            self.sock.close()
