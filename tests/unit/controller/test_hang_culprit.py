"""A stall's culprit by what the kernel says (launcher/hang.py, node_ctl.process_states), on real
processes: a rank stopped with SIGSTOP (state T), a rank blocked on a FUSE mount that never answers
(state D, with the file it waits on; needs root for the mount), their peers sleeping. The stopped or
blocked rank is the cause with its own exit code, the others its consequence; a node at fault (state
D) is left out by --exclude-failed as a lost node is; a stall without such a rank stays a stall. And
by the ranks' Python stacks (a user's command; py-spy dumps recorded from real ranks): the rank that
is not in the collective its peers wait in is the cause."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.loopback import write_inventory
from helpers.node_helper import node_ctl
from helpers.played_attempts import PlayedAttempts
from rich.console import Console

from trainer import exitcodes
from trainer.controller.inventory import load_cluster
from trainer.controller.launcher.failure import Diagnosis, Outcome, diagnose, render
from trainer.controller.launcher.hang import find_hang, find_partition
from trainer.controller.launcher.launch import Launcher
from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.restarts import RestartPolicy

REPO = Path(__file__).resolve().parents[3]
#: py-spy dumps (`py-spy dump --json`) of real ranks of tests/data/hang_user/allreduce_loop.py.
STACKS = REPO / "tests" / "data" / "hang_user"
LAUNCH_ID = "hang-test-1"


def node_dir(tmp_path: Path, node_rank: int) -> Path:
    directory = tmp_path / f"node-{node_rank}"
    directory.mkdir(exist_ok=True)
    (directory / "launch-id").write_text(f"{LAUNCH_ID}\n")
    return directory


def rank_process(node_rank: int, rank: int, argv: list[str]) -> subprocess.Popen:
    """A process of this launch on node `node_rank` with torchrun's RANK, as run.sh and torchrun tag it."""
    env = dict(os.environ, CLUSTERTRAIN_LAUNCH_ID=LAUNCH_ID, NODE_RANK=str(node_rank), RANK=str(rank))
    return subprocess.Popen(argv, env=env)


def wait_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != state:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {state}"
        time.sleep(0.05)


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()  # SIGKILL ends a stopped process and a killable wait alike
        proc.wait(timeout=30)


SLEEPER = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(120)"]


def sleeping_rank(node_rank: int, rank: int) -> subprocess.Popen:
    """A rank asleep (state S), as a peer waiting in its collective is: started, and waited for until
    it has said so and sleeps (on a loaded machine a python still starting reads as state R)."""
    proc = subprocess.Popen(
        SLEEPER,
        env=dict(os.environ, CLUSTERTRAIN_LAUNCH_ID=LAUNCH_ID, NODE_RANK=str(node_rank), RANK=str(rank)),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "sleeping\n"
    wait_state(proc.pid, "S")
    return proc


def stalled_monitor(view: LiveView) -> JobMonitor:
    """A user's command on two nodes (one rank each) with --stall-timeout 5, silent past it."""
    monitor = JobMonitor(
        {"head": 0, "w1": 1},
        "head",
        view,
        stall_timeout_s=5,
        progress_from_steps=False,
        ranks={"head": range(0, 1), "w1": range(1, 2)},
    )
    for host in ("head", "w1"):
        monitor.on_message(
            {"host": host, "type": "report", "report": {"state": "running", "lines": ["ready"]}}
        )
    monitor.last_progress_at -= 60
    monitor.check_time()
    assert monitor.stall is not None
    return monitor


def stop_reports(monitor: JobMonitor, tmp_path: Path) -> None:
    """What each node's stop answers at a stall: its process states (node_ctl reading the real /proc)."""
    ctl = node_ctl()
    for host, node_rank in (("head", 0), ("w1", 1)):
        states = ctl.process_states(node_dir(tmp_path, node_rank))
        monitor.apply(monitor.hosts[host], {"state": "running", "proc_states": states})


def rendered(monitor: JobMonitor, view: LiveView, out: io.StringIO) -> tuple[Diagnosis, str]:
    diagnosis = diagnose(monitor, bundled=False)
    assert diagnosis is not None
    render(diagnosis, monitor, view, stall_timeout_s=5)
    return diagnosis, out.getvalue()


def test_a_stopped_rank_is_the_cause_and_its_peer_waits(tmp_path, processes):
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    os.kill(processes[1].pid, signal.SIGSTOP)
    wait_state(processes[1].pid, "T")
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = stalled_monitor(view)
        stop_reports(monitor, tmp_path)
        diagnosis, shown = rendered(monitor, view, out)
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank, cause.code) == ("hung", "w1", 1, exitcodes.HUNG)
    assert (
        "hung: stopped (SIGSTOP or another stop signal) — state T (rank 1 on w1 (node 1), exit code 71)"
        in shown
    )
    assert "then: rank 0 on head (node 0): waiting in its collective (sleeping — state S" in shown, shown
    assert diagnosis.restartable and diagnosis.at_fault == [], "a stop is the job's failure, not the node's"
    assert diagnosis.as_record()["cause"]["message"].startswith("stopped (SIGSTOP")


def test_the_states_read_before_the_stop_name_the_culprit_in_the_stop_record(tmp_path, processes, capsys):
    """The launcher reads every node's states (node_ctl's `states` op, states.yml) before its stop: the
    culprit is named from them, and the history record the stop then writes says `hung` with the host
    and rank, not `stall`. The read signals nothing: the stopped rank stays stopped for the stop."""
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    os.kill(processes[1].pid, signal.SIGSTOP)
    wait_state(processes[1].pid, "T")
    ctl = node_ctl()
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = stalled_monitor(view)
        for host, node_rank in (("head", 0), ("w1", 1)):
            assert ctl.serve({"op": "states", "node_dir": str(node_dir(tmp_path, node_rank))}) == 0
            answer = json.loads(capsys.readouterr().out)
            assert set(answer) == {"proc_states"}, answer
            monitor.hosts[host].proc_states = answer["proc_states"]
        diagnosis = diagnose(monitor, bundled=False)
    assert Path(f"/proc/{processes[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    record = Launcher._stop_record(SimpleNamespace(launch_id="L1", attempt_number=1), diagnosis)
    assert (record["why"], record["hosts"], record["exit_code"]) == ("hung", ["w1"], exitcodes.HUNG)
    assert (record["cause"]["host"], record["cause"]["rank"]) == ("w1", 1), record
    assert record["cause"]["message"].startswith("stopped (SIGSTOP or another stop signal) — state T")


def test_a_stop_ends_a_node_with_a_stopped_rank_and_says_it_stopped_it(tmp_path, processes):
    """node_ctl's stop continues this node's stopped rank so it takes the TERM sent to run.sh's group
    (no KILL after the grace), and answers that it stopped the run: `trainer stop` prints "stopped"
    from that answer, not "not running"."""
    directory = node_dir(tmp_path, 0)
    ctl = node_ctl()
    # Each rank takes a second to exit after the TERM, as a trainer does: the stop finds them still there.
    slow_exit = (
        "import signal, sys, time; "
        "signal.signal(15, lambda *_: (time.sleep(1), sys.exit(0))); time.sleep(120)"
    )
    sleeper = f"{sys.executable} -c '{slow_exit}'"
    group = subprocess.Popen(  # run.sh's place: the group leader, two ranks under it
        ["bash", "-c", f"{sleeper} & {sleeper} & wait"],
        env=dict(os.environ, CLUSTERTRAIN_LAUNCH_ID=LAUNCH_ID, NODE_RANK="0"),
        start_new_session=True,
    )
    processes.append(group)
    (directory / "pid").write_text(f"{group.pid}\n")
    deadline = time.monotonic() + 20
    while len(ranks := [pid for pid in ctl.tagged_pids(directory) if pid != group.pid]) < 2:
        assert time.monotonic() < deadline, "the two ranks never started"
        time.sleep(0.05)
    os.kill(ranks[0], signal.SIGSTOP)  # the lower pid: the stop looks at the running one after it
    wait_state(ranks[0], "T")
    started = time.monotonic()
    answer = ctl.stop(directory, grace_s=60)
    assert answer["stopped"] is True, answer
    assert ctl.tagged_pids(directory) == [], "every process of the launch ended"
    assert time.monotonic() - started < 30, "the stopped rank took the TERM: no wait for the grace's KILL"


def test_a_rank_blocked_on_a_hung_mount_names_the_file_and_its_node_is_at_fault(tmp_path, processes):
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("a FUSE mount made without fusermount needs root and /dev/fuse")
    from helpers.hung_mount import hung_mount

    mount = tmp_path / "share"
    mount.mkdir()
    with hung_mount(str(mount)):
        processes += [
            sleeping_rank(0, 0),
            rank_process(1, 1, [sys.executable, "-c", f"open({str(mount / 'data.bin')!r}).read()"]),
        ]
        try:
            wait_state(processes[1].pid, "D")
            out = io.StringIO()
            with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
                monitor = stalled_monitor(view)
                stop_reports(monitor, tmp_path)
                diagnosis, shown = rendered(monitor, view, out)
        finally:
            processes[1].kill()
            processes[1].wait(timeout=30)
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank, cause.code) == ("hung", "w1", 1, exitcodes.HUNG)
    # The kernel function it sleeps in is the kernel's own (fuse_get_req on 6.x), the call and file are not.
    assert cause.message.startswith("in uninterruptible sleep — state D in fuse_"), cause.message
    assert cause.message.endswith(f", blocked in openat on {mount}/data.bin"), cause.message
    assert diagnosis.at_fault == ["w1"], "blocked in the kernel: the node is at fault"
    assert "hung: in uninterruptible sleep — state D" in shown, shown


def test_a_stall_without_a_stopped_or_blocked_rank_stays_a_stall_and_shows_each_state(tmp_path, processes):
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = stalled_monitor(view)
        stop_reports(monitor, tmp_path)
        diagnosis, shown = rendered(monitor, view, out)
    assert diagnosis.cause.kind == "stall" and diagnosis.code == exitcodes.FAILURE
    assert "process state: rank 1 on w1 (node 1): sleeping — state S, in hrtimer_nanosleep" in shown, shown


def bundled_stalled_monitor(view: LiveView, steps: dict[str, tuple[int | None, int | None]]) -> JobMonitor:
    """The bundled trainer on two nodes (one rank each), each rank's progress record saying (started,
    done), with --stall-timeout 5, silent past it."""
    monitor = JobMonitor(
        {"head": 0, "w1": 1}, "head", view, stall_timeout_s=5, ranks={"head": range(0, 1), "w1": range(1, 2)}
    )
    for rank, host in enumerate(("head", "w1")):
        started, done = steps[host]
        record = {"rank": rank, "started": started, "done": done, "phase": "train", "time": 1.0}
        monitor.on_message(
            {"host": host, "type": "report", "report": {"state": "running", "progress": [record]}}
        )
    monitor.last_progress_at -= 60
    monitor.check_time()
    assert monitor.stall is not None
    return monitor


def bundled_diagnosis(
    tmp_path: Path, steps: dict[str, tuple[int | None, int | None]]
) -> tuple[Diagnosis, str]:
    """The bundled trainer's stall (bundled_stalled_monitor with `steps`) with both ranks asleep: its
    diagnosis once the stop's process states came, and what the report shows."""
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = bundled_stalled_monitor(view, steps)
        stop_reports(monitor, tmp_path)
        diagnosis = diagnose(monitor, bundled=True)
        assert diagnosis is not None
        render(diagnosis, monitor, view, stall_timeout_s=5)
    return diagnosis, out.getvalue()


def test_the_bundled_trainers_rank_behind_its_peers_is_the_cause_with_its_state(tmp_path, processes):
    """Rank 1 still in step 5 (it sleeps outside the collective) while rank 0 is in step 6 and waits in
    its collective: both sleep, so no state tells; the progress records name rank 1, with its state."""
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    diagnosis, shown = bundled_diagnosis(tmp_path, {"head": (6, 5), "w1": (5, 5)})
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank, diagnosis.code) == ("hung", "w1", 1, exitcodes.HUNG), shown
    assert cause.message.startswith(
        "behind its peers: in step 5 while they are in step 6 — sleeping — state S"
    )
    assert not cause.node_at_fault  # the job, not the node: a restart, not a node left out
    assert "then: rank 0 on head (node 0): waiting in its collective (sleeping — state S" in shown, shown


def test_a_rank_in_no_step_yet_at_the_stall_is_the_one_behind(tmp_path, processes):
    """Its record written before its first step (`started`: null) while its peer is in step 6: named
    behind, where the launcher crashed on the null (DeepSpeed's slow start on two loopback nodes)."""
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    diagnosis, shown = bundled_diagnosis(tmp_path, {"head": (6, 5), "w1": (None, None)})
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank) == ("hung", "w1", 1), shown
    assert cause.message.startswith("behind its peers: in no step yet while they are in step 6"), cause


def test_a_bundled_stall_with_every_rank_in_one_step_stays_a_stall(tmp_path, processes):
    processes += [sleeping_rank(0, 0), sleeping_rank(1, 1)]
    diagnosis, shown = bundled_diagnosis(tmp_path, {"head": (6, 5), "w1": (6, 5)})
    assert diagnosis.cause.kind == "stall", shown


def test_a_rank_gone_while_its_peers_wait_is_the_cause_only_where_ranks_are_numbered_as_planned():
    waiting = {"pid": 10, "ppid": 1, "state": "S", "rank": 0, "wchan": "futex_wait_queue"}
    hang = find_hang(
        {"head": [waiting], "w1": []}, {"head": 0, "w1": 1}, {"head": range(0, 1), "w1": range(1, 2)}
    )
    assert hang is not None and (hang.culprit.host, hang.culprit.rank, hang.culprit.state) == (
        "w1",
        1,
        "gone",
    )
    assert hang.culprit.what == "exited while its peers wait (its process is gone)"
    # Two ranks per node planned, one per node run: the numbering is the command's own, nothing is gone.
    other = {**waiting, "pid": 11, "rank": 1}
    assert (
        find_hang(
            {"head": [waiting], "w1": [other]}, {"head": 0, "w1": 1}, {"head": range(2), "w1": range(2, 4)}
        )
        is None
    )
    # A node's report is untrusted: a record that is not one is skipped, not a crash.
    assert find_hang({"head": ["x", {"state": 3}], "w1": None}, {"head": 0, "w1": 1}, {}) is None


class HungOnce(PlayedAttempts):
    """Attempts: the first hangs in state D on node1, the next (on what is left) succeeds."""

    def __init__(self, plan, cluster) -> None:
        super().__init__(plan)
        self.cluster = cluster

    def attempt(self, view, record, **kwargs):
        if self.plans:
            return Outcome(exitcodes.OK, "done")
        out = io.StringIO()
        with LiveView(Console(file=out, force_terminal=False)) as inner:
            monitor = JobMonitor(
                {"node0": 0, "node1": 1}, "node0", inner, stall_timeout_s=5, progress_from_steps=False
            )
            monitor.last_progress_at -= 60
            monitor.check_time()
            blocked = {
                "pid": 5,
                "ppid": 1,
                "state": "D",
                "rank": 1,
                "wchan": "fuse_get_req",
                "syscall": "openat",
            }
            monitor.apply(monitor.hosts["node1"], {"state": "running", "proc_states": [blocked]})
            monitor.apply(monitor.hosts["node0"], {"state": "running", "proc_states": []})
            diagnosis = diagnose(monitor, bundled=False)
        return Outcome(diagnosis.code, "failed", ["node1"], diagnosis.summary, True, diagnosis=diagnosis)


def test_exclude_failed_leaves_a_node_at_fault_out_as_a_lost_one(tmp_path):
    cluster = load_cluster(write_inventory(tmp_path)[0])

    def replan(excluded, extra):
        kept = dataclasses.replace(
            cluster, workers=tuple(h for h in cluster.workers if h.name not in excluded)
        )
        return make_plan(kept, run_name="hung", command=("true",))

    launcher = HungOnce(replan(set(), []), cluster)
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=False, width=300))
    code = RestartPolicy(launcher, view, max_restarts=1, exclude_failed=True, replan=replan).run()
    assert code == exitcodes.OK and launcher.plans == [["node0"]], out.getvalue()
    assert "node1 left out: 2 -> 1 nodes" in out.getvalue(), out.getvalue()


def test_a_node_whose_port_its_peers_get_no_answer_from_is_cut_off(tmp_path):
    """A partial partition on real sockets: three "nodes" on 127.0.0.1-3, the master port closed on
    two (a refusal: the path is open, they answer) and dropped on the third (a listener whose accept
    queue is full: Linux drops the SYNs, as a firewall's DROP rule does). Each node's connects
    (node_ctl.reach_peers, the states op's) name the third as the one no peer reaches; every rank
    sleeping in its collective (no state tells it), the cause is that node, at fault, exit 71."""
    ctl = node_ctl()
    cut = socket.socket()
    cut.bind(("127.0.0.3", 0))
    cut.listen(0)
    port = cut.getsockname()[1]
    held = []
    try:
        for _ in range(4):  # fill the accept queue: later SYNs go unanswered
            client = socket.socket()
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.connect(("127.0.0.3", port))
            held.append(client)
        time.sleep(0.3)
        nodes = {"head": "127.0.0.1", "w1": "127.0.0.2", "w2": "127.0.0.3"}
        reach = {}
        for host in ("head", "w1"):
            peers = [[other, address] for other, address in nodes.items() if other != host]
            started = time.monotonic()
            reach[host] = {"port": port, "peers": ctl.reach_peers(peers, port)}
            assert time.monotonic() - started < ctl.REACH_TIMEOUT_S + 3, "the peers are tried at once"
    finally:
        for sock in [*held, cut]:
            sock.close()
    assert reach["head"]["peers"] == {"w1": "answers", "w2": "no answer"}, reach
    assert reach["w1"]["peers"] == {"head": "answers", "w2": "no answer"}, reach
    # w2 cut off answers nobody (its firewall drops the answers too).
    reach["w2"] = {"port": port, "peers": {"head": "no answer", "w1": "no answer"}}
    partition = find_partition(reach)
    assert partition is not None and (partition.host, partition.unanswered) == ("w2", ["head", "w1"])
    # Two nodes: either side may be the one at fault, nothing is named.
    assert find_partition({"head": reach["head"], "w2": reach["w2"]}) is None

    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=300)) as view:
        monitor = JobMonitor(
            {"head": 0, "w1": 1, "w2": 2},
            "head",
            view,
            stall_timeout_s=5,
            progress_from_steps=False,
            ranks={"head": range(0, 1), "w1": range(1, 2), "w2": range(2, 3)},
        )
        for node_rank, host in enumerate(("head", "w1", "w2")):
            monitor.on_message(
                {"host": host, "type": "report", "report": {"state": "running", "lines": ["x"]}}
            )
            waiting = {"pid": 10 + node_rank, "ppid": 1, "state": "S", "rank": node_rank, "wchan": "futex"}
            monitor.hosts[host].proc_states = [waiting]
            monitor.hosts[host].reach = reach[host]
        monitor.last_progress_at -= 60
        monitor.check_time()
        diagnosis, shown = rendered(monitor, view, out)
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.code) == ("hung", "w2", exitcodes.HUNG), shown
    assert (
        f"hung: w2 does not answer its peers on port {port} while SSH works (head, w1 got no answer" in shown
    )
    assert diagnosis.at_fault == ["w2"], "its node is at fault: --exclude-failed leaves it out"
    assert f"then: head (node 0): waiting in its collective: no answer from w2 on port {port}" in shown, shown


def recorded_stacks(name: str) -> tuple[list[dict], list[dict]]:
    """A rank's main-thread frames and other threads as node_ctl's states answer carries them:
    node_ctl.thread_stacks over a py-spy dump recorded from a real rank (tests/data/hang_user/
    stack-NAME.json, the repository's path written as {REPO}, so the source lines are read from this
    checkout)."""
    recorded = json.loads((STACKS / f"stack-{name}.json").read_text())
    dump = json.dumps(recorded["dump"]).replace("{REPO}", str(REPO))
    return node_ctl().thread_stacks(dump, recorded["pid"])


def rank_record(rank: int, stack: str | None = None, state: str = "S", **extra) -> dict:
    record = {
        "pid": 100 + rank,
        "ppid": 1,
        "state": state,
        "rank": rank,
        "wchan": "futex_wait_queue",
        **extra,
    }
    if not stack:
        return record
    frames, threads = recorded_stacks(stack)
    return {**record, "stack": frames, **({"threads": threads} if threads else {})}


def stacked_stall(head: list[dict], w1: list[dict]) -> tuple[Diagnosis, str]:
    """A user's command stalled on two nodes whose states answer carried these records."""
    out = io.StringIO()
    with LiveView(Console(file=out, force_terminal=False, width=400)) as view:
        monitor = stalled_monitor(view)
        monitor.hosts["head"].proc_states, monitor.hosts["w1"].proc_states = head, w1
        return rendered(monitor, view, out)


SLEEP_FRAME = "hang (allreduce_loop.py:20: time.sleep(3600))"


def test_a_rank_outside_the_collective_its_peers_wait_in_is_named_by_its_stack():
    diagnosis, shown = stacked_stall([rank_record(0, "waiting")], [rank_record(1, "sleeping")])
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank, cause.code) == ("hung", "w1", 1, exitcodes.HUNG), shown
    assert cause.message.startswith(
        f"not in the collective its peers wait in (all_reduce): at {SLEEP_FRAME} ← main (allreduce_loop.py:"
    ), cause.message
    assert cause.message.endswith("— sleeping — state S, in futex_wait_queue"), cause.message
    waits = "waiting in all_reduce, called at main (allreduce_loop.py:31: dist.all_reduce(total))"
    assert f"then: rank 0 on head (node 0): {waits} (sleeping — state S" in shown, shown
    assert f"stack of rank 1 on w1 (node 1) (py-spy, innermost first):\n  {SLEEP_FRAME}" in shown, shown
    assert diagnosis.restartable and diagnosis.at_fault == [], "the job's fault, not the node's"


def test_the_stacks_name_nobody_where_every_rank_or_none_is_in_a_collective():
    """Every rank in its collective (a collective that never completes: a peer lost, a partition) or
    none in one (nothing to be outside of): no culprit by the stacks, the stall stays a stall, and
    each rank's line says where its Python was, or why its stack could not be read."""
    diagnosis, shown = stacked_stall([rank_record(0, "waiting")], [rank_record(1, "waiting")])
    assert diagnosis.cause.kind == "stall" and diagnosis.code == exitcodes.FAILURE, shown
    assert (
        "process state: rank 1 on w1 (node 1): sleeping — state S, in futex_wait_queue; at all_reduce ("
        in shown
    )
    diagnosis, _ = stacked_stall([rank_record(0, "sleeping")], [rank_record(1, "sleeping")])
    assert diagnosis.cause.kind == "stall"
    blocked = node_ctl().stack_blocker("/venv/bin/py-spy", 2)
    diagnosis, shown = stacked_stall([rank_record(0, "waiting")], [rank_record(1, stack_error=blocked)])
    assert diagnosis.cause.kind == "stall", "one rank's stack, in a collective, tells nothing alone"
    assert (
        "rank 1 on w1 (node 1): sleeping — state S, in futex_wait_queue; no stack: kernel.yama.ptrace_scope "
        "is 2 on this node (only root may attach a debugger)" in shown
    ), shown


def test_a_rank_in_another_collective_than_most_of_its_peers_is_named_by_its_stack():
    """Every rank in a collective, one in all_gather where the others all_reduce (py-spy dumps of a
    real diverged_loop.py): that one is the culprit, with both collectives and their lines; with one
    rank in each (no majority) either may be the one astray, and the stall stays a stall."""
    reduce = "all_reduce, called at main (diverged_loop.py:24: dist.all_reduce(total))"
    gather = "all_gather, called at main (diverged_loop.py:22: dist.all_gather("
    head = [rank_record(0, "diverged-reducing"), rank_record(1, "gathering")]
    diagnosis, shown = stacked_stall(head, [rank_record(2, "diverged-reducing")])
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank, cause.code) == ("hung", "head", 1, exitcodes.HUNG), shown
    assert cause.message.startswith(f"in another collective than its peers: {gather}"), cause.message
    assert f"while they wait in {reduce} — sleeping — state S" in cause.message, cause.message
    assert f"then: rank 2 on w1 (node 1): waiting in {reduce} (sleeping" in shown, shown
    assert diagnosis.restartable and diagnosis.at_fault == [], "the job's fault, not the node's"
    diagnosis, shown = stacked_stall([rank_record(0, "diverged-reducing")], [rank_record(1, "gathering")])
    assert diagnosis.cause.kind == "stall", shown


def test_a_rank_whose_main_thread_waits_on_its_stuck_thread_names_that_thread():
    """A rank's main thread in threading's join while its loader thread sleeps (a py-spy dump of a
    real thread_loop.py rank): the rank is outside the collective, and what it waits on is named, its
    thread and that thread's frame, in the cause and under its stack; a rank without other threads
    says nothing of threads."""
    diagnosis, shown = stacked_stall([rank_record(0, "waiting")], [rank_record(1, "joining")])
    cause = diagnosis.cause
    assert (cause.kind, cause.host, cause.rank) == ("hung", "w1", 1), shown
    loader = "load_batch (thread_loop.py:15: time.sleep(3600))"
    assert cause.message.startswith(
        "not in the collective its peers wait in (all_reduce): at Thread._wait_for_tstate_lock (threading.py:"
    ), cause.message
    assert f"; its main thread waits on its thread loader, at {loader} — sleeping" in cause.message, (
        cause.message
    )
    assert (
        f"its thread loader (py-spy, innermost first):\n  {loader}\n  Thread.run (threading.py:" in shown
    ), shown
    diagnosis, _ = stacked_stall([rank_record(0, "waiting")], [rank_record(1, "sleeping")])
    assert "its thread" not in diagnosis.cause.message


def test_a_stopped_rank_comes_before_a_rank_outside_the_collective():
    """The kernel's states first: a stopped rank is the cause even where another rank's stack is
    outside the collective; that one is named among the consequences with where it was."""
    diagnosis, shown = stacked_stall(
        [rank_record(0, "waiting"), rank_record(1, "sleeping")], [rank_record(2, state="T")]
    )
    assert (diagnosis.cause.host, diagnosis.cause.rank) == ("w1", 2), shown
    assert diagnosis.cause.message.startswith("stopped (SIGSTOP or another stop signal) — state T"), shown
    assert f"then: rank 1 on head (node 0): not in a collective either: at {SLEEP_FRAME}" in shown, shown


def test_why_a_node_cannot_read_its_ranks_stacks():
    ctl = node_ctl()
    assert "py-spy is not installed in the training venv" in ctl.stack_blocker(None, None)
    assert ctl.stack_blocker("/venv/bin/py-spy", 3).startswith(
        "kernel.yama.ptrace_scope is 3 on this node (no process may attach a debugger): the ranks' stacks "
        "cannot be read"
    )
    # No Yama, or Yama's classic (0) and descendants-only (1) scopes: py-spy may try (under 1 the ranks
    # allow it: trainer/stack_access.py).
    assert [ctl.stack_blocker("/venv/bin/py-spy", scope) for scope in (None, 0, 1)] == ["", "", ""]
