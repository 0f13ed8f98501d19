"""Fixtures for every tier: the trainer run (its helpers live in helpers/trainer_harness.py). The tiers' own
conftest.py files add their markers (local/: slow, testbed/: testbed); other areas keep their own fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

# A test run started as a background job of a non-interactive shell (`.ci/run &`) inherits SIGINT
# ignored, and an ignored signal stays ignored in every child: `trainer push` and the in-process copy
# then ignored the interrupt the push tests send as Ctrl-C, and finished their copies instead. With a
# handler here, the children get SIGINT's default disposition again at exec (a handler is reset, an
# ignored signal is not), as under a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One OpenMP thread for every process a test starts on this machine (torch reads it at import; torchrun
# sets it only for several processes per node). The tests run many trainers at once on few cores (CI's
# three workers, simulated nodes of one process each): where each took a thread per core, the idle
# threads spun while others waited for the CPU. Three one-process ranks training 40 steps of the tiny
# GPT on this 2-core machine took 33-37 s and 62-68 CPU-s that way, 10 s and 16 CPU-s with one thread.
# Processes that reach a node through sshd (simulated nodes) get it from their inventory's training_env.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ansible (imported in this process by the controller tests) replaces sys.intern with a patch object;
# torch._dynamo, imported later by transformers in the fine-tuning tests, registers a polyfill for
# sys.intern and refuses that object (TypeError: substitute_in_graph expects a function). Production
# never has both in one process (tests/unit/test_package_split.py keeps the sides apart); this test
# process has both, so dynamo is imported first, while sys.intern is still the builtin.
with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401
from helpers.trainer_harness import Run, finish, start_run

from trainer.torch_extensions import remove_stale


def pytest_sessionstart(session):
    """Clear the build locks of DeepSpeed's ops that no process holds, in this account's torch
    extension dirs, before any test: a test run interrupted while an op compiled (Ctrl-C, a CI
    timeout) leaves one, and every later DeepSpeed start on this machine then waits on it forever
    (a CI run lost 37 minutes in one chunk to a lock left that way; the launcher's start check
    refused the simulated nodes for it). A lock a process holds (another test run building now) is
    left alone. The product's own fix (`trainer.torch_extensions remove-stale`), said aloud."""
    for lock in remove_stale():
        print(f"conftest: removed the stale torch extension build lock {lock['path']} (no process held it)")


def _ci_cpu():
    """scripts/ci_cpu.py where CI runs this test process in a cgroup of its own (ci_queue.py, .ci/run),
    else None."""
    if not os.environ.get("CLUSTERTRAIN_CI_CPU_GROUP"):
        return None
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "ci_cpu.py"
    spec = importlib.util.spec_from_file_location("ci_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CI_CPU = _ci_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """In CI, each test's CPU seconds (every process it started, the bed's containers too for a bed
    test) into CI's report of where the CPU goes (scripts/ci_cpu.py): on this CPU-bound machine the
    tests that cost the most CPU are what make CI long, and wall times hide which those are."""
    if CI_CPU is None:
        yield
        return
    bed = item.get_closest_marker("testbed") is not None

    def containers() -> float:
        return (CI_CPU.containers_seconds("ct-") or 0.0) if bed else 0.0

    def own() -> float:
        return CI_CPU.usage_seconds(os.environ[CI_CPU.CPU_GROUP_ENV]) or 0.0

    started, own_before, containers_before = time.monotonic(), own(), containers()
    yield
    # A container killed and started again (the node-loss tests) counts from zero: its part is then lost.
    in_containers = max(0.0, containers() - containers_before)
    entry = {
        "test": item.nodeid,
        "cpu_s": round(own() - own_before + in_containers, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    with open(os.environ[CI_CPU.CPU_LOG_ENV], "a") as log:
        log.write(json.dumps(entry) + "\n")


@pytest.fixture
def run_trainer(tmp_path):
    """run_trainer(*overrides, launcher="torchrun"|"accelerate"|"none", nproc=2, env=None, name="out")
    runs one training job to completion in tmp_path and returns a Run."""

    def run(*overrides: str, launcher: str = "torchrun", nproc: int = 2, env=None, name: str = "out") -> Run:
        output_dir = tmp_path / name
        return finish(
            start_run(output_dir, list(overrides), launcher=launcher, nproc=nproc, env=env), output_dir
        )

    return run
