"""Pure logic of preflight: the round-robin schedule, offsets, the matrix, ufw rules, comparisons."""

from __future__ import annotations

import itertools

import pytest

from trainer.controller.preflight import bandwidth, clock, compare, network, ssh
from trainer.controller.preflight.report import FAIL, PASS, WARN


@pytest.mark.parametrize("count", range(1, 10))
def test_round_robin_meets_every_pair_once_in_few_rounds(count):
    nodes = [f"n{i}" for i in range(count)]
    rounds = bandwidth.round_robin(nodes)
    pairs = [frozenset(pair) for r in rounds for pair in r]
    assert sorted(pairs, key=sorted) == sorted(
        (frozenset(p) for p in itertools.combinations(nodes, 2)), key=sorted
    )
    assert len(pairs) == len(set(pairs))  # every pair exactly once
    expected_rounds = 0 if count < 2 else (count - 1 if count % 2 == 0 else count)
    assert len(rounds) == expected_rounds
    for one_round in rounds:
        in_round = [node for pair in one_round for node in pair]
        assert len(in_round) == len(set(in_round)), f"a node is twice in {one_round}"
        assert len(one_round) == count // 2  # odd N: exactly one node has a bye


def test_round_robin_is_far_fewer_rounds_than_sequential_tests():
    nodes = [f"n{i}" for i in range(16)]
    assert len(bandwidth.round_robin(nodes)) == 15 < len(list(itertools.combinations(nodes, 2))) == 120


def test_round_robin_refuses_duplicate_names():
    with pytest.raises(ValueError, match="duplicate"):
        bandwidth.round_robin(["a", "b", "a"])


def test_offset_uses_the_minimum_round_trip_sample():
    # Node clock 2.5 s ahead of the head; the slow sample (asymmetric delay) would mislead.
    samples = [(100.0, 97.9, 100.8), (200.0, 197.5, 200.0002), (300.0, 297.0, 300.5)]
    offset, rtt = clock.best_offset(samples)
    assert offset == pytest.approx(2.5, abs=1e-3)
    assert rtt == pytest.approx(0.0002)


def test_clock_failure_names_host_offset_and_fix():
    result = clock.evaluate("worker7", "head0", 2.5, 0.001, 1.0)
    assert result.status == FAIL
    assert "worker7" in result.detail and "+2.500 s" in result.detail and "head0" in result.detail
    assert "chronyc" in result.fix
    assert clock.evaluate("worker7", "head0", -0.2, 0.001, 1.0).status == PASS


def test_clock_counts_the_measurement_uncertainty():
    # 0.9 s measured with a 0.4 s round trip could be 1.1 s: not provably within 1 s.
    assert clock.evaluate("w", "h", 0.9, 0.4, 1.0).status == FAIL


def test_matrix_rows_are_senders():
    nodes = ["a", "b", "c"]
    cells = bandwidth.matrix(nodes, {("a", "b"): 9.0, ("b", "a"): 8.0})
    assert cells == [[None, 9.0, None], [8.0, None, None], [None, None, None]]
    text = bandwidth.format_matrix(nodes, cells)
    assert "9.00" in text and "8.00" in text


def test_iperf_json_both_directions_and_errors():
    result = {
        "end": {
            "sum_received": {"bits_per_second": 25e9},
            "sum_received_bidir_reverse": {"bits_per_second": 5e9},
        }
    }
    assert bandwidth.parse_iperf_json(result) == (25.0, 5.0, "")
    assert (
        bandwidth.parse_iperf_json({"error": "unable to connect to server"})[2]
        == "unable to connect to server"
    )


def test_slow_pair_warns_with_zero2_advice_and_failed_test_fails():
    slow = bandwidth.evaluate_pair("a", "b", 25.0, 4.0, "", 10.0)
    assert slow.status == WARN and "4.00" in slow.detail
    assert "ZeRO-2" in bandwidth.ZERO_ADVICE and "ZeRO-3" in bandwidth.ZERO_ADVICE
    assert bandwidth.evaluate_pair("a", "b", 25.0, 24.0, "", 10.0).status == PASS
    broken = bandwidth.evaluate_pair("a", "b", None, None, "unable to connect", 10.0)
    assert broken.status == FAIL and "b" in broken.fix


def test_bandwidth_ports_stay_in_the_comm_range_and_avoid_the_master_port():
    assert bandwidth.bandwidth_ports("29400:29999", 29999) == [29998]
    with pytest.raises(ValueError, match="cluster_comm_port_range"):
        bandwidth.parse_port_range("29400-29999")


def test_the_odd_node_out_is_named_not_the_majority():
    reference, odd = compare.odd_ones({"head": "x", "w1": "x", "w2": "y"}, "head")
    assert (reference, odd) == ("x", ["w2"])
    # Two nodes disagree: the head is the reference, the worker is named.
    assert compare.odd_ones({"head": "x", "w1": "y"}, "head") == ("x", ["w1"])


UFW_STATUS = """Status: active
Logging: on (low)
Default: deny (incoming), allow (outgoing), deny (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
29500/tcp                  DENY IN     Anywhere
22/tcp                     ALLOW IN    Anywhere
29400:29999/tcp            ALLOW IN    10.89.0.0/24
29500/tcp                  ALLOW IN    10.89.0.0/24
OpenSSH                    ALLOW IN    Anywhere
22/tcp (v6)                ALLOW IN    Anywhere (v6)
"""


# Recorded from ufw 0.36.2 in a Debian 12 container: a deny inserted above the cluster rule.
UFW_RECORDED = """Status: active
Logging: on (low)
Default: deny (incoming), allow (outgoing), deny (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
29500/tcp                  DENY IN     Anywhere
22/tcp                     ALLOW IN    Anywhere
29400:29999/tcp            ALLOW IN    10.89.77.11                # clustertrain
29500/tcp (v6)             DENY IN     Anywhere (v6)
22/tcp (v6)                ALLOW IN    Anywhere (v6)
"""


def test_ufw_recorded_output_names_the_deny_rule_above_the_cluster_rule():
    active, default, rules = network.parse_ufw_status(UFW_RECORDED)
    assert active and [r.source for r in rules] == ["Anywhere", "Anywhere", "10.89.77.11"]
    assert network.ufw_verdict(rules, default, 29500, "10.89.77.11") == (False, "29500/tcp DENY IN Anywhere")
    assert network.ufw_verdict(rules, default, 29600, "10.89.77.11")[0]
    assert network.ufw_verdict(rules, default, 29600, "10.89.77.12") == (False, "default deny (incoming)")


def test_ufw_first_matching_rule_decides():
    active, default, rules = network.parse_ufw_status(UFW_STATUS)
    assert active and default == "deny" and len(rules) == 4
    allowed, rule = network.ufw_verdict(rules, default, 29500, "10.89.0.3")
    assert not allowed and "DENY" in rule
    assert network.ufw_verdict(rules, default, 29401, "10.89.0.3")[0]
    assert not network.ufw_verdict(rules, default, 29401, "192.0.2.9")[0]  # not the cluster subnet
    assert not network.ufw_verdict(rules, default, 8080, "10.89.0.3")[0]  # default deny


def test_ssh_diagnosis_names_the_cause_and_never_suggests_disabling_host_keys():
    detail, fix = ssh.diagnose(
        "w1", "w2", "10.0.0.3", "train", "train@10.0.0.3: Permission denied (publickey)."
    )
    assert "refuses" in detail and "authorized_keys on w2" in fix
    detail, fix = ssh.diagnose("w1", "w2", "10.0.0.3", "train", "Host key verification failed.")
    assert "not pinned" in detail and "known_hosts" in fix and "never use StrictHostKeyChecking=no" in fix


def _cluster(**per_host):
    from pathlib import Path

    from trainer.controller.inventory import Cluster, Host

    def host(name):
        return Host(name, {"cluster_accelerators": 0, "cluster_accelerator_model": "cpu",
                           "cluster_training_user": "trainer", "cluster_training_uid": 2000,
                           "cluster_shared_dir": "/shared", "training_venv": "/opt/venv",
                           **per_host.get(name, {})})  # fmt: skip

    return Cluster(Path("inv"), host("head"), (host("w1"), host("w2")))


def _no_answer(host):
    return f"no answer from {host}"


def test_versions_name_the_worker_and_the_package_that_differ():
    from trainer.controller.preflight import nodes

    same = {
        "python": "3.11.2",
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "accelerate": "1.15.0",
        "trainer": "0.1.0",
    }
    facts = {
        "head": {"versions": same},
        "w1": {"versions": same},
        "w2": {"versions": {**same, "torch": "2.12.0"}},
    }
    results = nodes.versions(_cluster(), facts, _no_answer)
    failed = [r for r in results if r.status == FAIL]
    assert [r.subject for r in failed] == ["w2"]
    assert "torch 2.12.0 (others 2.13.0)" in failed[0].detail and "deepspeed" not in failed[0].detail


def test_accelerators_must_match_the_inventory_and_each_other():
    from trainer.controller.preflight import nodes

    gpu = {"count": 8, "models": ["NVIDIA H100 80GB HBM3"] * 8, "source": "nvidia-smi"}
    inventory = {"cluster_accelerators": 8, "cluster_accelerator_model": "NVIDIA H100 80GB HBM3"}
    cluster = _cluster(head=inventory, w1=inventory, w2=inventory)
    facts = {"head": {"accelerators": gpu}, "w1": {"accelerators": gpu},
             "w2": {"accelerators": {**gpu, "count": 7, "models": gpu["models"][:7]}}}  # fmt: skip
    failed = [r for r in nodes.accelerators(cluster, facts, _no_answer) if r.status == FAIL]
    assert {r.subject for r in failed} == {"w2"}
    assert any("node reports 7 x NVIDIA H100" in r.detail for r in failed)
    assert any("differs from the other nodes (8 x NVIDIA H100" in r.detail for r in failed)


def test_shared_dir_names_a_worker_whose_file_the_head_cannot_see_and_a_wrong_uid():
    from trainer.controller.preflight import storage

    writes = {
        "head": {"uid": 2000, "error": ""},
        "w1": {"uid": 2000, "error": ""},
        "w2": {"uid": 1001, "error": ""},
    }
    verify = {"results": {"head": {"visible": True, "uid": 2000, "content_ok": True},
                          "w1": {"visible": False, "error": "No such file or directory"}}}  # fmt: skip
    results = {r.subject: r for r in storage.shared_dir(_cluster(), writes, verify, _no_answer)}
    assert results["head"].status == PASS
    assert results["w1"].status == FAIL and "not visible on head" in results["w1"].detail
    assert "mount" in results["w1"].fix
    assert (
        results["w2"].status == FAIL
        and "uid 1001" in results["w2"].detail
        and "uid 2000" in results["w2"].fix
    )


def test_a_node_that_did_not_answer_fails_every_check_with_the_reason():
    from trainer.controller.preflight import storage

    results = storage.data(_cluster(), {"head": {"data": {"path": "p", "sha256": "a" * 64}}}, _no_answer)
    failed = {r.subject: r.detail for r in results if r.status == FAIL}
    assert set(failed) == {"w1", "w2"} and "no answer from w1" in failed["w1"]


def test_a_gpu_node_whose_torch_sees_no_gpu_fails_naming_the_build_and_the_driver():
    """nvidia-smi lists all 8 GPUs, but the venv has the CPU build of torch: the trainer would train on
    the CPU. Preflight names the host, the torch build and the driver."""
    from trainer.controller.preflight import nodes

    gpu = {"count": 8, "models": ["NVIDIA H100 80GB HBM3"] * 8, "source": "nvidia-smi", "driver": "580.95"}
    inventory = {"cluster_accelerators": 8, "cluster_accelerator_model": "NVIDIA H100 80GB HBM3"}
    cuda = {"torch": "2.13.0+cu126", "torch_cuda": "12.6", "torch_gpus": 8}
    facts = {
        "head": {"accelerators": gpu, "versions": cuda},
        "w1": {"accelerators": gpu, "versions": cuda},
        "w2": {"accelerators": gpu, "versions": {"torch": "2.13.0+cpu", "torch_cuda": None, "torch_gpus": 0}},
    }
    results = nodes.accelerators(_cluster(head=inventory, w1=inventory, w2=inventory), facts, _no_answer)
    failed = [r for r in results if r.status == FAIL]
    assert [r.subject for r in failed] == ["w2"]
    assert "torch sees 0 of the 8 GPU(s)" in failed[0].detail
    assert "torch 2.13.0+cpu (CPU build)" in failed[0].detail and "driver 580.95" in failed[0].detail
    assert "training_torch_index_url_cuda" in failed[0].fix
    passed = {r.subject: r.detail for r in results if r.status == PASS and "torch sees" in r.detail}
    assert passed["head"] == "torch sees 8 GPU(s): torch 2.13.0+cu126 (CUDA 12.6 build), driver 580.95"


def test_interconnect_names_the_nodes_without_infiniband_and_what_nccl_will_use():
    from trainer.controller.preflight.interconnect import interconnect

    mixed = {"head": {"infiniband": ["mlx5_0"]}, "w1": {"infiniband": ["mlx5_0"]}, "w2": {"infiniband": []}}
    auto = {r.subject: r for r in interconnect(_cluster(), mixed, _no_answer)}
    assert auto["head"].status == PASS and "mlx5_0" in auto["head"].detail
    assert auto["cluster"].status == WARN and "auto: 1 on every node, since w2" in auto["cluster"].detail
    forced = {
        r.subject: r for r in interconnect(_cluster(head={"cluster_nccl_ib_disable": 0}), mixed, _no_answer)
    }
    assert forced["cluster"].status == FAIL and "is 0 but w2 list no devices" in forced["cluster"].detail
    everywhere = {name: {"infiniband": ["mlx5_0"]} for name in ("head", "w1", "w2")}
    auto = {r.subject: r for r in interconnect(_cluster(), everywhere, _no_answer)}
    assert auto["cluster"].status == PASS and "auto: 0" in auto["cluster"].detail
    off = {
        r.subject: r
        for r in interconnect(_cluster(head={"cluster_nccl_ib_disable": 1}), everywhere, _no_answer)
    }
    assert off["cluster"].status == WARN and "cluster_nccl_ib_disable: auto" in off["cluster"].fix
