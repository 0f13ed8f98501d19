"""Pure logic of preflight: the round-robin schedule, offsets, the matrix, ufw rules, comparisons."""

from __future__ import annotations

import itertools
import re

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


#: Commands and variables a fix can name; every failing check's fix names the host and one of them.
CONCRETE = re.compile(
    r"ansible-playbook|systemctl|chronyc|mount|ufw|ip link|ethtool|rm -rf|chown|cluster_\w+|training_\w+|"
    r"nfs_\w+|trainer_env|apt-get|nvidia-smi|trainer (plan|launch)|ss -ltnp|iperf3|stat -f|exportfs|nfs-ls|"
    r"checkpoint\.|--\w"
)


def assert_fix(result, host: str, *needles: str) -> None:
    """A failure the user can act on: its fix names the host and a concrete command or variable."""
    assert result.fix, f"{result.check} {result.subject}: no fix"
    assert host in result.fix, f"{result.check}: the fix does not name {host}: {result.fix}"
    assert CONCRETE.search(result.fix), f"{result.check}: no command or variable in: {result.fix}"
    for needle in needles:
        assert needle in result.fix, f"{result.check}: {needle!r} not in: {result.fix}"


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
    assert any("nvidia-smi lists 7 x NVIDIA H100" in r.detail for r in failed)
    for result in failed:
        assert_fix(result, "w2")
    assert any("cluster_accelerators: 7" in r.fix for r in failed)
    assert any("differs from the other nodes (8 x NVIDIA H100" in r.detail for r in failed)


def _written(uid=2000, **io):
    return {"uid": uid, "shared": {"io": {"error": "", "hung": False, "written": "x", **io}}}


def test_shared_dir_names_a_worker_whose_file_the_head_cannot_see_and_a_wrong_uid():
    from trainer.controller.preflight import storage

    facts = {"head": _written(), "w1": _written(), "w2": _written(uid=1001)}
    verify = {"results": {"head": {"visible": True, "uid": 2000, "content_ok": True},
                          "w1": {"visible": False, "error": "No such file or directory"}}}  # fmt: skip
    results = {r.subject: r for r in storage.shared_dir(_cluster(), facts, verify, _no_answer, _no_answer)}
    assert results["head"].status == PASS
    assert results["w1"].status == FAIL and "not visible on head" in results["w1"].detail
    assert_fix(results["w1"], "w1", "mount /shared")
    assert (
        results["w2"].status == FAIL
        and "uid 1001" in results["w2"].detail
        and "uid 2000" in results["w2"].fix
    )
    assert_fix(results["w2"], "w2", "cluster_training_uid")


def test_shared_dir_not_writable_on_the_head_fixes_the_export_not_a_mount():
    """The head's shared dir is the export itself: the fix is its owner and mode there."""
    from trainer.controller.preflight import storage

    facts = {
        "head": _written(error="Permission denied: /shared/.preflight-head-x"),
        "w1": _written(),
        "w2": _written(),
    }
    verify = {"results": {n: {"visible": True, "uid": 2000, "content_ok": True} for n in ("w1", "w2")}}
    results = {r.subject: r for r in storage.shared_dir(_cluster(), facts, verify, _no_answer, _no_answer)}
    head = results["head"]
    assert head.status == FAIL and "Permission denied" in head.detail
    assert_fix(head, "head", "chown trainer:trainer /shared")
    assert "mount" not in head.fix.split("(")[0]
    hung = storage.shared_dir(
        _cluster(),
        {**facts, "head": _written(), "w1": _written(hung=True, seconds=10)},
        verify,
        _no_answer,
        _no_answer,
    )
    w1 = next(r for r in hung if r.subject == "w1")
    assert w1.status == FAIL and "did not return within 10 s" in w1.detail
    assert_fix(w1, "w1", "umount -f -l /shared")


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


def test_torch_disagreeing_with_nvidia_smi_is_named_as_the_one_that_disagrees():
    from trainer.controller.preflight import nodes

    gpu = {"count": 8, "models": ["NVIDIA H100 80GB HBM3"] * 8, "source": "nvidia-smi", "driver": "580.95"}
    inventory = {"cluster_accelerators": 8, "cluster_accelerator_model": "NVIDIA H100 80GB HBM3"}
    cpu_torch = {"torch": "2.13.0+cpu", "torch_cuda": None, "torch_gpus": 0}
    facts = {name: {"accelerators": gpu, "versions": cpu_torch} for name in ("head", "w1", "w2")}
    results = nodes.accelerators(_cluster(head=inventory, w1=inventory, w2=inventory), facts, _no_answer)
    torch_failures = [r for r in results if r.status == FAIL and "torch sees" in r.detail]
    assert {r.subject for r in torch_failures} == {"head", "w1", "w2"}
    assert (
        "(nvidia-smi lists 8): torch disagrees with nvidia-smi and the inventory" in torch_failures[0].detail
    )
    assert_fix(torch_failures[0], torch_failures[0].subject, "training_torch_index_url_cuda")
    # nvidia-smi lists 4 of the 8 and torch sees the same 4: the node lacks GPUs, the inventory disagrees.
    four = {**gpu, "count": 4, "models": gpu["models"][:4]}
    facts = {
        "head": {"accelerators": gpu, "versions": {"torch_gpus": 8, "torch_cuda": "12.6"}},
        "w1": {"accelerators": gpu, "versions": {"torch_gpus": 8, "torch_cuda": "12.6"}},
        "w2": {"accelerators": four, "versions": {"torch_gpus": 4, "torch_cuda": "12.6"}},
    }
    results = nodes.accelerators(_cluster(head=inventory, w1=inventory, w2=inventory), facts, _no_answer)
    listed = next(r for r in results if r.status == FAIL and "nvidia-smi lists 4" in r.detail)
    assert "torch in the venv sees 4, as nvidia-smi does: the inventory disagrees" in listed.detail
    short = next(r for r in results if r.status == FAIL and "torch sees 4 of the 8" in r.detail)
    assert "nvidia-smi lists 4 too: the node lacks GPUs, not only torch" in short.detail


def _topology_cluster(**per_host):
    base = {"training_procs_per_node": 2}
    return _cluster(**{h: {**base, **per_host.get(h, {})} for h in ("head", "w1", "w2")})


def test_topology_is_built_as_launch_builds_it_and_a_duplicate_rank_names_both_hosts():
    from trainer.controller.preflight import topology

    results, plan = topology.evaluate(_topology_cluster())
    assert plan is not None and results[0].status == PASS
    assert "3 node(s) × 2 process(es), world size 6" in results[0].detail
    assert (
        "w2 node 2 (ranks 4-5)" in results[0].detail
        and "effective batch 16 × 6 × 1 = 96" in results[0].detail
    )
    results, plan = topology.evaluate(
        _topology_cluster(w1={"cluster_node_rank": 1}, w2={"cluster_node_rank": 1})
    )
    assert plan is None and results[0].status == FAIL and results[0].subject == "w1, w2"
    assert "node rank 1 is given to more than one host: w1, w2" in results[0].detail
    assert_fix(results[0], "w1", "cluster_node_rank", "trainer plan -i inv")
    results, _ = topology.evaluate(_topology_cluster(w2={"training_procs_per_node": 1}))
    assert results[0].status == FAIL and "training_procs_per_node differs" in results[0].detail


def _links(*interfaces):
    return {"interfaces": {"interfaces": list(interfaces)}}


def _link(name, *addresses, mtu=1500, up=True, loopback=False):
    flags = (["LOOPBACK"] if loopback else ["BROADCAST"]) + (["UP", "LOWER_UP"] if up else [])
    return {
        "name": name,
        "flags": flags,
        "operstate": "UP" if up else "DOWN",
        "mtu": mtu,
        "addresses": list(addresses),
    }


def _addressed(**per_host):
    addresses = {"head": "10.0.0.1", "w1": "10.0.0.2", "w2": "10.0.0.3"}
    return _cluster(**{h: {"cluster_ip": a, **per_host.get(h, {})} for h, a in addresses.items()})


def test_interface_auto_resolves_as_launch_and_names_what_is_wrong_per_node():
    from trainer.controller.preflight import interfaces

    lo = _link("lo", "127.0.0.1/8", mtu=65536, loopback=True)
    facts = {
        "head": _links(lo, _link("eth0", "10.0.0.1/24")),
        "w1": _links(lo, _link("eth0", "10.0.0.2/24", up=False)),
        "w2": _links(lo, _link("eth0", "10.0.0.99/24")),  # cluster_ip 10.0.0.3 is on no interface
    }
    results = {r.subject: r for r in interfaces.evaluate(_addressed(), facts, _no_answer)}
    assert results["head"].status == PASS
    assert results["head"].detail.startswith("NCCL_SOCKET_IFNAME==eth0, GLOO_SOCKET_IFNAME=eth0: eth0 up")
    assert results["w1"].status == FAIL and "eth0 on w1 is down" in results["w1"].detail
    assert_fix(results["w1"], "w1", "ip link set eth0 up")
    assert (
        results["w2"].status == FAIL
        and "no interface of w2 holds its cluster_ip 10.0.0.3" in results["w2"].detail
    )
    assert_fix(results["w2"], "w2", "cluster_nccl_socket_ifname")


def test_interface_auto_puts_loopback_nodes_on_lo_as_launch_does():
    """Several "nodes" of one machine at 127.0.0.1, .2, .3 (each its own cluster_ip, as the inventory
    rules require): lo's 127.0.0.1/8 holds them all, in preflight's rule and in the launcher's own
    (node_ctl.interface_of, asked of this machine's interfaces)."""
    import importlib.util
    from pathlib import Path

    from trainer.controller.preflight import interfaces

    lo = _link("lo", "127.0.0.1/8", mtu=65536, loopback=True)
    facts = {h: _links(lo, _link("eth0", "10.0.0.9/24")) for h in ("head", "w1", "w2")}
    cluster = _cluster(
        head={"cluster_ip": "127.0.0.1"}, w1={"cluster_ip": "127.0.0.2"}, w2={"cluster_ip": "127.0.0.3"}
    )
    results = {r.subject: r for r in interfaces.evaluate(cluster, facts, _no_answer)}
    for host in ("head", "w1", "w2"):
        assert results[host].status == PASS, results[host].detail
        assert results[host].detail.startswith("NCCL_SOCKET_IFNAME==lo, GLOO_SOCKET_IFNAME=lo: lo up")
    # Only a loopback interface holds its whole prefix: eth0's /24 does not hold 10.0.0.7.
    facts["w2"] = _links(lo, _link("eth0", "10.0.0.9/24"))
    results = interfaces.evaluate(_cluster(w2={"cluster_ip": "10.0.0.7"}), facts, _no_answer)
    assert [r.status for r in results if r.subject == "w2"] == [FAIL]

    helper = Path(interfaces.__file__).parents[1] / "launcher/playbooks/files/node_ctl.py"
    spec = importlib.util.spec_from_file_location("node_ctl", helper)
    node_ctl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node_ctl)
    for resolve in (node_ctl.interface_of, node_ctl.interface_of_by_ioctl):
        assert resolve("127.0.0.2") == "lo" and resolve("127.0.0.1") == "lo"
        assert resolve("192.0.2.77") == ""  # TEST-NET: on no interface of this machine


def test_interface_named_in_the_inventory_must_exist_hold_the_address_and_suit_gloo():
    from trainer.controller.preflight import interfaces

    def facts_with(w1_links):
        return {
            "head": _links(_link("eth0", "10.0.0.1/24")),
            "w1": _links(*w1_links),
            "w2": _links(_link("eth0", "10.0.0.3/24")),
        }

    cluster = _addressed(
        head={"cluster_nccl_socket_ifname": "eth"},
        w1={"cluster_nccl_socket_ifname": "eth9"},
        w2={"cluster_nccl_socket_ifname": "=eth0"},
    )
    results = {
        r.subject: r
        for r in interfaces.evaluate(cluster, facts_with([_link("eth0", "10.0.0.2/24")]), _no_answer)
    }
    assert results["w1"].status == FAIL and "NCCL_SOCKET_IFNAME=eth9" in results["w1"].detail
    assert "matches no interface of w1" in results["w1"].detail
    assert_fix(results["w1"], "w1", "cluster_nccl_socket_ifname: =eth0")
    # A prefix works for NCCL but gloo takes one exact name: launch would export GLOO_SOCKET_IFNAME=eth.
    assert results["head"].status == FAIL and "GLOO_SOCKET_IFNAME=eth " in results["head"].detail
    assert_fix(results["head"], "head", "cluster_nccl_socket_ifname: =eth0")
    assert results["w2"].status == PASS
    # The named interface exists but carries another network than the cluster address.
    cluster = _addressed(w1={"cluster_nccl_socket_ifname": "=ib0"})
    links = [_link("eth0", "10.0.0.2/24"), _link("ib0", "192.168.5.2/24")]
    results = {r.subject: r for r in interfaces.evaluate(cluster, facts_with(links), _no_answer)}
    assert (
        results["w1"].status == FAIL
        and "none of which holds its cluster_ip 10.0.0.2 (eth0 does)" in results["w1"].detail
    )


def test_interface_mtu_that_differs_from_the_other_nodes_is_named():
    from trainer.controller.preflight import interfaces

    facts = {
        "head": _links(_link("eth0", "10.0.0.1/24")),
        "w1": _links(_link("eth0", "10.0.0.2/24", mtu=9000)),
        "w2": _links(_link("eth0", "10.0.0.3/24")),
    }
    failed = [r for r in interfaces.evaluate(_addressed(), facts, _no_answer) if r.status == FAIL]
    assert [r.subject for r in failed] == ["w1"]
    assert "MTU 9000 on w1's eth0, the other nodes use 1500" in failed[0].detail
    assert_fix(failed[0], "w1", "ip link set dev eth0 mtu 1500")


def test_nccl_interface_spec_matching():
    from trainer.controller.preflight.interfaces import nccl_selects

    names = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert nccl_selects("eth", names) == ["eth0", "eth1"]
    assert nccl_selects("=eth0", names) == ["eth0"]
    assert nccl_selects("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_selects("=eth", names) == []


TRACKING_WORKER = {
    "Reference ID": "0A000001 (10.0.0.1)",
    "Stratum": "11",
    "Leap status": "Normal",
    "System time": "0.000012 seconds fast of NTP time",
}


def _clock_facts(**chrony):
    default = {"running": True, "tracking": TRACKING_WORKER}
    head = {
        "running": True,
        "tracking": {"Reference ID": "7F7F0101 ()", "Stratum": "10", "Leap status": "Normal"},
    }
    return {
        "head": {"chrony": chrony.get("head", head)},
        "w1": {"chrony": chrony.get("w1", default)},
        "w2": {"chrony": chrony.get("w2", default)},
    }


def _clients(*offsets):
    return {
        name: {"clock": {"samples": [[100.0, 100.0005 - off, 100.001]]}}
        for name, off in zip(("w1", "w2"), offsets, strict=True)
    }


def test_clock_checks_chronyd_runs_and_is_synchronised_besides_the_measured_offset():
    from trainer.controller.preflight import network

    cluster = _addressed()
    healthy = {
        r.subject: r
        for r in network.clock_results(
            cluster, _clients(0.0, 0.0), _clock_facts(), 1.0, _no_answer, _no_answer
        )
    }
    assert all(r.status == PASS for r in healthy.values()), healthy
    assert "chronyd synchronised to 0A000001 (10.0.0.1)" in healthy["w1"].detail
    assert "+0.000 s against head" in healthy["w1"].detail
    # chronyd stopped on w1: the offset is still fine today, but nothing keeps it so.
    stopped = {"running": False, "rc": 1, "error": "506 Cannot talk to daemon"}
    results = {
        r.subject: r
        for r in network.clock_results(
            cluster, _clients(0.0, 0.0), _clock_facts(w1=stopped), 1.0, _no_answer, _no_answer
        )
    }
    assert results["w1"].status == FAIL and "chronyd is not running on w1" in results["w1"].detail
    assert_fix(results["w1"], "w1", "systemctl enable --now chrony")
    # Running but following nothing.
    unsynced = {
        "running": True,
        "tracking": {"Reference ID": "00000000 ()", "Leap status": "Not synchronised"},
    }
    results = {
        r.subject: r
        for r in network.clock_results(
            cluster, _clients(0.0, 0.0), _clock_facts(w2=unsynced), 1.0, _no_answer, _no_answer
        )
    }
    assert results["w2"].status == FAIL and "not synchronised" in results["w2"].detail
    assert_fix(results["w2"], "w2", "chronyc -n sources", "123/udp")
    # A clock past the bound and a stopped chronyd on the same node: both named.
    results = {
        r.subject: r
        for r in network.clock_results(
            cluster, _clients(2.5, 0.0), _clock_facts(w1=stopped), 1.0, _no_answer, _no_answer
        )
    }
    assert "not running" in results["w1"].detail and "+2.500 s off head's" in results["w1"].detail
    assert "chronyc makestep" in results["w1"].fix
    # Not installed at all.
    missing = {"running": False, "rc": 127, "error": "chronyc is not installed"}
    head = {
        r.subject: r
        for r in network.clock_results(
            cluster, _clients(0.0, 0.0), _clock_facts(head=missing), 1.0, _no_answer, _no_answer
        )
    }["head"]
    assert head.status == FAIL and "chrony is not installed on head" in head.detail
    assert_fix(head, "head", "--tags timesync")


def _nfs_facts(server=None, **clients):
    server = server or {
        "role": "server",
        "service": {"name": "nfs-server", "state": "active"},
        "rpc": {"answered": True, "accepted": True},
    }
    mounted = {
        "nfs": {"role": "client", "rpc": {"answered": True, "accepted": True}},
        "shared": {
            "mount": {"point": "/shared", "fstype": "nfs4", "source": "10.0.0.1:/shared"},
            "io": {"hung": False, "error": "", "seconds": 0.02},
        },
    }
    return {"head": {"nfs": server}, "w1": clients.get("w1", mounted), "w2": clients.get("w2", mounted)}


def test_nfs_server_down_is_named_on_the_head_and_from_every_worker():
    from trainer.controller.preflight import nfs

    cluster = _addressed()
    healthy = nfs.evaluate(cluster, _nfs_facts(), _no_answer)
    assert [r.status for r in healthy] == [PASS, PASS, PASS], healthy
    refused = {"role": "client", "rpc": {"answered": False, "error": "Connection refused"}}
    down = {
        "role": "server",
        "service": {"name": "nfs-server", "state": "inactive"},
        "rpc": {"answered": False, "error": "Connection refused"},
    }
    results = {
        r.subject: r
        for r in nfs.evaluate(cluster, _nfs_facts(down, w1={"nfs": refused}, w2={"nfs": refused}), _no_answer)
    }
    assert results["head"].status == FAIL and "nfs-server is inactive on head" in results["head"].detail
    assert_fix(results["head"], "head", "systemctl restart nfs-server")
    assert results["w1"].status == FAIL
    assert (
        "the NFS server on head (10.0.0.1:2049) does not answer w1: Connection refused"
        in results["w1"].detail
    )
    assert_fix(results["w1"], "head", "10.0.0.2")


def test_nfs_hung_mount_is_a_failure_naming_the_server_and_the_remount():
    from trainer.controller.preflight import nfs

    hung = {
        "nfs": {"role": "client", "rpc": {"answered": True}},
        "shared": {
            "mount": {"point": "/shared", "fstype": "nfs4", "source": "10.0.0.1:/shared"},
            "io": {"hung": True, "error": "no answer within 10 s", "seconds": 10},
        },
    }
    results = {r.subject: r for r in nfs.evaluate(_addressed(), _nfs_facts(w2=hung), _no_answer)}
    assert results["w2"].status == FAIL and "the NFS mount /shared on w2 hangs" in results["w2"].detail
    assert "server head, 10.0.0.1" in results["w2"].detail
    assert_fix(results["w2"], "w2", "umount -f -l /shared && mount /shared")
    local = {
        "nfs": {"role": "client", "rpc": {"answered": True}},
        "shared": {"mount": {"point": "/", "fstype": "ext4", "source": "/dev/sda1"}, "io": {}},
    }
    results = {r.subject: r for r in nfs.evaluate(_addressed(), _nfs_facts(w1=local), _no_answer)}
    assert (
        results["w1"].status == FAIL
        and "/shared is not an NFS mount on w1 (it is on ext4 at /)" in results["w1"].detail
    )
    assert_fix(results["w1"], "w1", "mount /shared")


def test_nfs_in_containers_checks_the_fstab_entry_and_the_libnfs_round_trip():
    from trainer.controller.preflight import nfs

    cluster = _addressed(w1={"nfs_client_mount_state": "present"}, w2={"nfs_client_mount_state": "present"})
    ok = {
        "nfs": {"role": "client", "rpc": {"answered": True}, "libnfs": {"ok": True}},
        "shared": {"mount": {"point": "/", "fstype": "overlay"}, "fstab": {"source": "10.0.0.1:/shared"}},
    }
    no_entry = {**ok, "shared": {"mount": {"point": "/", "fstype": "overlay"}, "fstab": None}}
    results = {r.subject: r for r in nfs.evaluate(cluster, _nfs_facts(w1=ok, w2=no_entry), _no_answer)}
    assert results["w1"].status == PASS and "libnfs" in results["w1"].detail
    assert results["w2"].status == FAIL and "no fstab entry for /shared on w2" in results["w2"].detail
    assert_fix(results["w2"], "w2", "--tags nfs_client")
    gids = _addressed(w1={"cluster_training_gid": 2000})
    assert nfs.libnfs_url(gids, gids.workers[0]) == "nfs://10.0.0.1/shared?version=4&uid=2000&gid=2000"


def test_stale_build_lock_fails_with_the_file_and_the_fix_and_ops_not_built_ahead_warn():
    from trainer.controller.preflight import extensions

    lock = {
        "path": "/var/cache/x/deepspeed_shm_comm/lock",
        "op_dir": "/var/cache/x/deepspeed_shm_comm",
        "op": "deepspeed_shm_comm",
        "age_s": 3600.0,
        "stale": True,
    }
    built = {
        "configured_dir": "/var/cache/x",
        "built": {"deepspeed_shm_comm": True},
        "stale": [],
        "locks": [],
    }
    facts = {
        "head": {"extensions": built},
        "w1": {"extensions": {**built, "stale": [lock], "locks": [lock]}},
        "w2": {
            "extensions": {
                "configured_dir": "",
                "default_dir": "/home/t/.cache/torch_extensions",
                "built": {},
                "stale": [],
                "locks": [],
            }
        },
    }
    results = {r.subject: r for r in extensions.evaluate(_cluster(), facts, _no_answer)}
    assert results["head"].status == PASS and "built ahead in /var/cache/x" in results["head"].detail
    assert (
        results["w1"].status == FAIL
        and "stale build lock /var/cache/x/deepspeed_shm_comm/lock" in results["w1"].detail
    )
    assert_fix(results["w1"], "w1", "rm -rf /var/cache/x/deepspeed_shm_comm", "as trainer")
    assert results["w2"].status == WARN and "not built ahead on w2" in results["w2"].detail
    assert "--tags trainer_env" in results["w2"].fix


def _space_plan(**config):
    from trainer.controller.launcher.plan import make_plan

    return make_plan(_topology_cluster(), overrides=[f"{k}={v}" for k, v in config.items()])


def test_checkpoint_estimate_and_the_room_it_needs():
    from trainer.controller.preflight import space

    plan = _space_plan(**{"model.n_layer": 2, "model.n_embd": 64, "data.block_size": 64})
    size, how = space.checkpoint_estimate(plan, None)
    params = 12 * 2 * 64**2 + 64 * (2 * 256 + 64)
    assert size == params * 12 and f"{params:,} parameters" in how
    assert space.checkpoints_kept(plan) == 3  # save_total_limit 2, plus the one being written
    facts = {
        name: {
            "shm": {"free_bytes": 10 * 2**30, "error": ""},
            "shared": {"io": {"free_bytes": 2 * size, "hung": False, "error": ""}},
        }
        for name in ("head", "w1", "w2")
    }
    results = {r.subject: r for r in space.evaluate(_topology_cluster(), plan, facts, _no_answer)}
    assert results["head"].status == WARN and "3 checkpoint(s)" in results["head"].detail
    assert "checkpoint.save_total_limit" in results["head"].fix and "head" in results["head"].fix
    facts["head"]["shared"]["io"]["free_bytes"] = size // 2
    results = {r.subject: r for r in space.evaluate(_topology_cluster(), plan, facts, _no_answer)}
    assert results["head"].status == FAIL and "less than one checkpoint" in results["head"].detail
    assert_fix(results["head"], "head", "cluster_shared_dir")


def test_shm_too_small_on_a_multi_gpu_node_fails_naming_the_remount():
    from trainer.controller.preflight import space

    gpus = {"cluster_accelerators": 8, "cluster_accelerator_model": "H100"}
    cluster = _cluster(head=gpus, w1=gpus, w2=gpus)
    facts = {
        name: {"shm": {"free_bytes": 64 * 2**20, "error": ""}, "shared": {"io": {}}}
        for name in ("head", "w1", "w2")
    }
    results = [r for r in space.evaluate(cluster, None, facts, _no_answer) if r.status == FAIL]
    assert len(results) == 3 and "/dev/shm on w1 has 64.0 MiB free, 1.00 GiB needed" in results[1].detail
    assert_fix(results[1], "w1", "mount -o remount,size=1G /dev/shm")


def _iperf(forward, reverse):
    return {
        "end": {
            "sum_received": {"bits_per_second": forward * 1e9},
            "sum_received_bidir_reverse": {"bits_per_second": reverse * 1e9},
        }
    }


def _bandwidth(values):
    """values: {(client, server): (forward, reverse)} for the 3 pairs of a 3-node round robin."""
    nodes = ["head", "w1", "w2"]
    rounds = [{"index": i, "pairs": [{"client": c, "server": s}]} for i, (c, s) in enumerate(values, 1)]
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in values.items()]
    return bandwidth.evaluate(nodes, rounds, bandwidth.measure(rounds, clients, {}, _no_answer), 1.0)


def test_bandwidth_outlier_names_both_hosts_and_the_direction():
    healthy = {("head", "w1"): (4.1, 3.8), ("head", "w2"): (3.2, 4.4), ("w1", "w2"): (2.9, 4.0)}
    results, _ = _bandwidth(healthy)
    assert [r.status for r in results] == [PASS, PASS, PASS]
    shaped = {**healthy, ("w1", "w2"): (0.05, 4.0)}  # w1 -> w2 shaped to 50 Mbit/s
    results, report = _bandwidth(shaped)
    warned = [r for r in results if r.status == WARN]
    assert [r.subject for r in warned] == ["w1 <-> w2"]
    assert (
        "w1 -> w2 0.050 Gbit/s is 80x below the median of the other links (4.00 Gbit/s)" in warned[0].detail
    )
    assert "from w1 to w2" in warned[0].fix and "tc qdisc show" in warned[0].fix
    assert report["outlier_fraction"] == bandwidth.OUTLIER_FRACTION
    # Below the absolute threshold everywhere: every pair warns, none is an outlier.
    rounds = [{"index": 1, "pairs": [{"client": "a", "server": "b"}]}]
    found = bandwidth.measure(
        rounds, [{"client": "a", "peer_name": "b", **_iperf(0.5, 0.01)}], {}, _no_answer
    )
    results, _ = bandwidth.evaluate(["a", "b"], rounds, found, 1.0)
    assert (
        results[0].status == WARN and "below 1 Gbit/s" in results[0].detail
    )  # 2 nodes: no median to compare
    assert bandwidth.retest_rounds(found, rounds) == []  # and nothing to measure again


def _round_robin_of(nodes):
    return [
        {"index": i, "pairs": [{"client": c, "server": s, "port": 29999} for c, s in pairs]}
        for i, pairs in enumerate(bandwidth.round_robin(nodes), start=1)
    ]


def test_an_outlier_pair_is_measured_again_and_a_slow_first_test_alone_does_not_warn():
    """One iperf3 test slow by chance (a busy host) clears on the second measurement; a bad link is
    slow both times and still warns, saying it was measured twice."""
    nodes = ["n1", "n2", "n3", "n4"]
    rounds = _round_robin_of(nodes)
    first = {(p["client"], p["server"]): (9.0, 9.5) for r in rounds for p in r["pairs"]}
    first[("n1", "n3")] = (0.4, 9.1)  # n1 -> n3 slow once
    first[("n4", "n2")] = (0.2, 9.2)  # n4 -> n2 slow
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in first.items()]
    found = bandwidth.measure(rounds, clients, {}, _no_answer)
    again = bandwidth.retest_rounds(found, rounds)
    # n1-n3 and n4-n2 share no node: one round, the original direction and port kept.
    assert again == [
        {
            "index": 1,
            "pairs": [
                {"client": "n1", "server": "n3", "port": 29999},
                {"client": "n4", "server": "n2", "port": 29999},
            ],
        }
    ]
    second = [
        {"client": "n1", "peer_name": "n3", **_iperf(8.8, 9.3)},  # fine now
        {"client": "n4", "peer_name": "n2", **_iperf(0.3, 9.0)},  # still slow: a bad link
    ]
    results, report = bandwidth.evaluate(
        nodes, rounds, found.better_of(bandwidth.measure(again, second, {}, _no_answer)), 1.0, again
    )
    by_subject = {r.subject: r for r in results}
    assert by_subject["n1 <-> n3"].status == PASS and "measured twice" in by_subject["n1 <-> n3"].detail
    assert by_subject["n1 <-> n3"].data["forward_gbit"] == 8.8  # the faster of 0.4 and 8.8
    slow = by_subject["n4 <-> n2"]
    assert slow.status == WARN and "n4 -> n2 0.300 Gbit/s" in slow.detail and "measured twice" in slow.detail
    assert [r.status for r in results].count(WARN) == 1
    assert report["retested"] == [["n1", "n3"], ["n4", "n2"]]
    assert report["matrix"][2][0] == 9.3 and report["matrix"][3][1] == 0.3  # n3 -> n1, n4 -> n2


def test_a_pair_measured_once_is_not_an_outlier_beside_the_retested_pairs_faster_second_tests():
    """The bed's case under load: w2's egress shaped during the first rounds, so its two pairs are
    measured again (fast then); head -> w1's one short test came out 3.1 Gbit/s, no outlier among the
    first rounds' (w2's were slower), but 6x below the retested pairs' 19 to 20. It must not warn."""
    nodes = ["head", "w1", "w2"]
    rounds = _round_robin_of(nodes)
    # w2 -> either 0.05 Gbit/s (shaped), either -> w2 2.0 (its ACKs shaped too); head <-> w1 20.8 and
    # 3.1 (w1 -> head): 3.1 is no outlier beside the first rounds' median of 2.0.
    speed = {("w2", "head"): 0.05, ("w2", "w1"): 0.05, ("head", "w2"): 2.0, ("w1", "w2"): 2.0}
    speed.update({("head", "w1"): 20.8, ("w1", "head"): 3.1})
    pairs = [(p["client"], p["server"]) for r in rounds for p in r["pairs"]]
    values = {(c, s): (speed[(c, s)], speed[(s, c)]) for c, s in pairs}
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in values.items()]
    found = bandwidth.measure(rounds, clients, {}, _no_answer)
    again = bandwidth.retest_rounds(found, rounds, 0.2)
    retested = {frozenset((p["client"], p["server"])) for r in again for p in r["pairs"]}
    assert retested == {frozenset({"head", "w2"}), frozenset({"w1", "w2"})}
    second = [
        {"client": p["client"], "peer_name": p["server"], **_iperf(19.2, 19.9)}
        for r in again
        for p in r["pairs"]
    ]
    final = found.better_of(bandwidth.measure(again, second, {}, _no_answer))
    results, _ = bandwidth.evaluate(nodes, rounds, final, 0.2, again, found)
    assert [r.status for r in results] == [PASS] * 3, [r.detail for r in results]
    # Without the first rounds to compare with, the once-measured 3.1 is called an outlier.
    results, _ = bandwidth.evaluate(nodes, rounds, final, 0.2, again)
    assert [r.status for r in results].count(WARN) == 1


def test_pairs_measured_again_share_no_node_within_a_round():
    # 6 nodes, n1's links to n2 and n3 slow: the two pairs share n1, so two rounds of one pair.
    nodes6 = [f"n{i}" for i in range(1, 7)]
    rounds6 = _round_robin_of(nodes6)
    values6 = {(p["client"], p["server"]): (9.0, 9.0) for r in rounds6 for p in r["pairs"]}
    for pair in [("n1", "n2"), ("n1", "n3")]:
        key = pair if pair in values6 else pair[::-1]
        values6[key] = (0.1, 0.1)
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in values6.items()]
    again = bandwidth.retest_rounds(bandwidth.measure(rounds6, clients, {}, _no_answer), rounds6)
    assert [len(r["pairs"]) for r in again] == [1, 1]
    assert {frozenset((p["client"], p["server"])) for r in again for p in r["pairs"]} == {
        frozenset({"n1", "n2"}),
        frozenset({"n1", "n3"}),
    }


def _phases(prebuilt=True, **bounds):
    from trainer.controller.preflight.deepspeed_job import BOUNDS_S, Phases

    return Phases({"head": 0, "w1": 1}, "head", prebuilt, 0.0, {**BOUNDS_S, **bounds})


LAUNCH_LINE = "[clustertrain] 2026-11-22T23:00:00+00:00 launch run-abc on ct-head in /shared: torchrun ..."


def test_deepspeed_phases_follow_the_nodes_logs():
    phases = _phases()
    assert phases.update(1.0) is None and phases.phase == "start"
    phases.add_lines("head", [LAUNCH_LINE], 2.0)
    assert phases.current() == "start"  # w1 has not started yet
    phases.add_lines("w1", [LAUNCH_LINE], 3.0)
    assert phases.update(3.0) == "rendezvous"
    phases.add_lines("head", ["GPU health monitor off: this rank trains on the CPU"], 10.0)
    assert phases.update(10.0) == "compile (prebuilt)"
    phases.add_lines("head", ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"], 11.0)
    assert phases.update(11.0) is None  # w1 has not loaded its op yet
    phases.add_lines("w1", ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"], 12.0)
    assert phases.update(12.0) == "setup"
    phases.add_lines("head", ["training 109,312 parameters with deepspeed on 2 process(es)"], 14.0)
    assert phases.update(14.0) == "step 1"
    phases.add_lines("head", ["step 1/4 loss 4.5 lr 3e-3 tok/s 5,000 step_time 300ms"], 20.0)
    assert phases.update(20.0) == "step 2"
    phases.add_lines("head", ["step 2/4 loss 4.2", "step 3/4 loss 4.1", "step 4/4 loss 3.9"], 23.0)
    assert phases.update(23.0) == "checkpoint"
    phases.add_lines("head", ["checkpoint /shared/runs/x/checkpoints/step-4"], 24.0)
    assert phases.update(24.0) == "finishing"


def test_a_phase_past_its_bound_is_a_stall_naming_the_phase_and_the_node():
    phases = _phases(prebuilt=True)
    phases.add_lines("head", [LAUNCH_LINE, "GPU health monitor off: cpu"], 5.0)
    phases.add_lines("w1", [LAUNCH_LINE], 5.0)
    phases.add_lines("head", ["DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"], 6.0)
    assert phases.stall(6.0) is None and phases.phase == "compile (prebuilt)"
    assert phases.stall(6.0 + 180) is None
    stall = phases.stall(6.0 + 181)
    assert stall is not None and stall.phase == "compile (prebuilt)" and stall.hosts == ["w1"]
    assert "w1: last output 182 s ago: [clustertrain]" in stall.detail
    # Not built ahead: a real compile gets its own, longer bound.
    slow = _phases(prebuilt=False)
    slow.add_lines("head", [LAUNCH_LINE, "GPU health monitor off: cpu"], 5.0)
    slow.add_lines("w1", [LAUNCH_LINE], 5.0)
    assert slow.stall(5.0) is None and slow.phase == "compile" and slow.stall(5.0 + 600) is None
    assert slow.stall(5.0 + 901).phase == "compile"


def test_step_bound_grows_with_the_slowest_step():
    phases = _phases(step=120)
    phases.add_lines("head", [LAUNCH_LINE, "GPU health monitor off", "training 1 parameters"], 0.0)
    phases.add_lines("w1", [LAUNCH_LINE, "DeepSpeed x built successfully"], 0.0)
    phases.add_lines("head", ["DeepSpeed x built successfully", "step 1/100 loss 1"], 10.0)
    phases.add_lines("head", ["step 2/100 loss 1"], 40.0)  # a 30 s step
    phases.update(40.0)
    assert phases.phase == "step 3" and phases.bound() == 600  # 20 × 30 s, above the 120 s floor
    assert phases.stall(40.0 + 599) is None
    stall = phases.stall(40.0 + 601)
    assert stall.phase == "step 3" and stall.hosts == ["head", "w1"]  # a collective: every node waits


def test_shm_for_a_one_node_deepspeed_job_on_the_cpu():
    from pathlib import Path

    from trainer.controller.inventory import Cluster, Host
    from trainer.controller.launcher.plan import make_plan
    from trainer.controller.preflight import space

    host = Host("solo", {"cluster_accelerators": 0, "training_procs_per_node": 4,
                         "cluster_training_user": "t", "cluster_shared_dir": "/shared",
                         "training_venv": "/opt/venv"})  # fmt: skip
    cluster = Cluster(Path("inv"), host, ())
    plan = make_plan(cluster, engine="deepspeed")
    need, why = space.shm_needed(cluster, host, plan)
    assert need == 4 * 66 * 2**20 and "DeepSpeed's shared-memory allreduce for 4 process(es)" in why
    facts = {"solo": {"shm": {"free_bytes": 64 * 2**20, "error": ""}, "shared": {"io": {}}}}
    result = space.evaluate(cluster, plan, facts, _no_answer)[0]
    assert result.status == FAIL and "0.26 GiB needed" in result.detail
    assert_fix(result, "solo", "mount -o remount,size=1G /dev/shm")
    assert space.shm_needed(cluster, host, make_plan(cluster, engine="ddp"))[0] == 0


def test_every_check_is_one_registry_entry_documented_under_its_skip_name():
    from pathlib import Path

    from trainer.controller.preflight.checks import CHECKS, REGISTRY

    docs = (Path(__file__).resolve().parents[3] / "docs" / "preflight.md").read_text()
    assert re.findall(r"^### `(\w+)`$", docs, flags=re.MULTILINE) == list(CHECKS), "in run order"
    assert (CHECKS[0], CHECKS[-1]) == ("topology", "deepspeed")  # the controller first, the real job last
    assert [c.name for c in REGISTRY if c.judge is None] == ["topology", "deepspeed"]  # their own phases


def test_the_playbook_runs_only_the_probes_the_chosen_checks_read():
    from trainer.controller.preflight import probe
    from trainer.controller.preflight.checks import REGISTRY, probes_for

    assert probe.NODE_FACTS not in probes_for(["ssh", "ufw", "master_port", "bandwidth"])
    assert probe.NODE_FACTS in probes_for(["ufw", "clock"]) and probe.NODE_FACTS in probes_for(["space"])
    # The clock's clients measure against the head's listener: it runs without master_port too.
    assert {probe.LISTENER, probe.CLIENT} <= set(probes_for(["clock"]))
    assert probes_for(["bandwidth"]) == [probe.IPERF_TEST]
    # Every task a check reads is one the playbook switches on by that name, and no task is
    # switched on by anything else.
    playbook = probe.PLAYBOOK.read_text()
    read = {task for check in REGISTRY for task in check.reads}
    switched = set(re.findall(r"'(Preflight \| [^']+)' in preflight_probes", playbook))
    assert switched == read, switched ^ read
    assert "preflight_checks" not in playbook


def test_the_deepspeed_job_waits_only_on_failures_it_would_hang_or_fail_on():
    from trainer.controller.preflight.checks import deepspeed_blockers
    from trainer.controller.preflight.report import Report, Result

    report = Report("inv")
    report.add([Result("bandwidth", "a <-> b", FAIL, "slow"), Result("clock", "b", FAIL, "off")])
    report.add([Result("ufw", "a", WARN, "a rule"), Result("nfs", "b", PASS, "mounted")])
    assert deepspeed_blockers(report) == ""
    report.add([Result("nfs", "c", FAIL, "not mounted"), Result("master_port", "a", FAIL, "held")])
    assert deepspeed_blockers(report) == "master_port (a), nfs (c)"


def test_a_pair_below_the_threshold_is_measured_again_unless_most_pairs_are():
    """1 s tests on a busy host: one pair below the threshold while the others are above it is
    measured again (noise clears, a slow pair stays slow); when most pairs are below it, the network
    is slow, and a second test would only say so again."""
    nodes = ["n1", "n2", "n3", "n4"]
    rounds = _round_robin_of(nodes)
    values = {(p["client"], p["server"]): (9.0, 9.5) for r in rounds for p in r["pairs"]}
    values[("n1", "n3")] = (3.0, 9.1)  # below 5 Gbit/s, not an outlier (over a quarter of 9)
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in values.items()]
    found = bandwidth.measure(rounds, clients, {}, _no_answer)
    assert bandwidth.retest_rounds(found, rounds) == []  # no outlier
    again = bandwidth.retest_rounds(found, rounds, 5.0)
    assert [(p["client"], p["server"]) for r in again for p in r["pairs"]] == [("n1", "n3")]
    # Every pair below the threshold: nothing to measure again.
    slow = {pair: (3.0, 3.2) for pair in values}
    clients = [{"client": c, "peer_name": s, **_iperf(*v)} for (c, s), v in slow.items()]
    assert bandwidth.retest_rounds(bandwidth.measure(rounds, clients, {}, _no_answer), rounds, 5.0) == []
