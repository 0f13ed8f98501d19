"""start.yml's per-node arguments, made by the launcher (wire.start_calls) rather than by a template
per value in the tasks (issue 27: each template is compiled again in every host's worker): what the
head gets that the workers do not, and what every node gets the same."""

from __future__ import annotations

from trainer.controller.launcher.wire import start_calls


def _extravars(lock_in_probe: bool) -> dict:
    nodes = {
        host: {
            "node_rank": rank,
            "address": f"10.0.0.{rank + 1}",
            "ifname_auto": rank == 1,
            "node_dir": f"/shared/runs/r/launch/node-{rank}",
            "check": {"workdir": "/w", "program": "true", "venv_bin": "/v/bin"},
            "run_sh": f"#!/bin/bash\necho {rank}\n",
            "secret_env": {"TOKEN": f"secret-{rank}"},
            "wait_for": ["/shared/runs/r/launch/config.yaml"],
        }
        for rank, host in enumerate(("head", "w1"))
    }
    return {
        "launch_head": "head",
        "launch_nodes": nodes,
        "launch_lock_request": {"action": "acquire", "token": "t"},
        "launch_lock_in_probe": lock_in_probe,
        "launch_command_timeout_s": 30,
        "launch_venv_needs": ["python"],
        "launch_master_port": 29500,
        "launch_run_name": "r",
        "launch_training_user": "trainer",
        "launch_has_secrets": True,
        "launch_id": "abc",
        "launch_dir": "/shared/runs/r/launch",
        "launch_files": {"config.yaml": "x: 1\n"},
        "launch_info": {"engine": "ddp"},
        "launch_record": {"attempt": 1},
        "launch_reuse": False,
        "launch_poll_s": 2.0,
        "launch_quiet_s": 10.0,
        "launch_status_timeout_s": 20.0,
        "launch_give_up_s": 330.0,
        "launch_activity": False,
    }


def test_the_head_alone_gets_the_master_port_the_lock_the_files_and_the_record():
    extravars = _extravars(lock_in_probe=True)
    start_calls(extravars)
    head, worker = extravars["launch_nodes"]["head"], extravars["launch_nodes"]["w1"]
    assert head["probe"]["request"]["port"] == 29500 and worker["probe"]["request"]["port"] == 0
    assert head["probe"]["request"]["lock"] == {"action": "acquire", "token": "t"}
    assert worker["probe"]["request"]["lock"] == {}
    assert head["start"]["request"]["files"] == {"config.yaml": "x: 1\n"}
    assert worker["start"]["request"]["files"] == {}
    assert head["start"]["request"]["record"] == {"attempt": 1} and worker["start"]["request"]["record"] == {}
    # Only rank 0's lines are shown as they come.
    assert head["start"]["follow"]["request"]["quiet"] is False
    assert worker["start"]["follow"]["request"]["quiet"] is True


def test_each_node_gets_its_own_script_secrets_and_dir_with_the_launch_s_settings():
    extravars = _extravars(lock_in_probe=False)
    start_calls(extravars)
    for rank, host in enumerate(("head", "w1")):
        node = extravars["launch_nodes"][host]
        probe, start = node["probe"], node["start"]
        assert probe["timeout_s"] == 30 and start["timeout_s"] == 90
        assert probe["request"]["lock"] == {}, "the lock is taken by its own task, not the probe"
        assert probe["request"]["address"] == f"10.0.0.{rank + 1}"
        assert probe["request"]["iface_auto"] is (rank == 1)
        assert probe["request"]["check"] == node["check"] and probe["request"]["training_user"] == "trainer"
        assert start["secret"] is True, "the start's request holds secrets: never a command-line argument"
        assert start["request"]["run_sh"] == f"#!/bin/bash\necho {rank}\n"
        assert start["request"]["secret_env"] == {"TOKEN": f"secret-{rank}"}
        assert start["request"]["node_dir"] == start["follow"]["request"]["node_dir"] == node["node_dir"]
        assert start["follow"] == {
            "poll_s": 2.0,
            "quiet_s": 10.0,
            "timeout_s": 20.0,
            "give_up_s": 330.0,
            "request": {"node_dir": node["node_dir"], "offset": 0, "quiet": rank != 0, "activity": False},
        }
        assert f"secret-{rank}" not in str(probe), "the probe is never given the secrets"


def test_the_secrets_scripts_and_files_travel_once_inside_the_start():
    extravars = _extravars(lock_in_probe=False)
    start_calls(extravars)
    rest = {key: value for key, value in extravars.items() if key != "launch_nodes"}
    rest["nodes"] = [
        {k: v for k, v in node.items() if k != "start"} for node in extravars["launch_nodes"].values()
    ]
    for value in ("secret-0", "secret-1", "echo 0", "echo 1", "x: 1", "engine", "attempt"):
        assert value not in str(rest), f"{value!r} left outside the start's request"
