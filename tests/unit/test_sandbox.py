"""`dflash service sandbox` (trainer/layout/sandbox.py): what the trainer's unit opens on its node, one
decision per test from recon facts as gpu_facts records them. The systemd side (the rendered unit under
real systemd: ENXIO not EPERM, two gloo ranks) is tests/ansible/test_systemd_host.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer.layout.sandbox import SandboxError, decide, online_tracker

H100_550 = {  # driver >= 550.40: /proc/devices says `nvidia`, not `nvidia-frontend`
    "gpus": {"count": 8, "driver": "550.54.15"},
    "devices": {
        "nodes": [*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap1"],
        "names": ["nvidia", "nvidia-caps", "nvidia-nvswitch", "nvidia-uvm"],
    },
}
A100_535 = {"gpus": {"count": 1}, "devices": {"nodes": ["/dev/nvidia0"], "names": ["nvidia-frontend"]}}
IB = {"nodes": ["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"], "names": ["infiniband_verbs"]}
CPU = {"gpus": {"count": 0}, "devices": {"nodes": [], "names": []}}
ENS5 = [
    {"device": "lo", "ipv4": {"address": "127.0.0.1", "netmask": "255.0.0.0"}},
    {
        "device": "ens5",
        "ipv4": {"address": "10.9.0.12", "netmask": "255.255.255.0"},
        "ipv6": [{"address": "fe80::1", "prefix": "64"}, {"address": "fd00:9::12", "prefix": "64"}],
    },
    {"device": "eth0", "ipv4": {"address": "203.0.113.7", "netmask": "255.255.255.0"}},
]


@pytest.mark.parametrize(
    "recon", [H100_550, A100_535], ids=["driver-550-nvidia", "driver-535-nvidia-frontend"]
)
def test_every_driver_naming_is_allowed_by_glob_and_each_node_by_path(recon):
    out = decide(recon, {})
    assert not out["private_devices"]
    allow = out["device_allow"]
    assert allow[0] == "char-nvidia* rw"  # fnmatch against /proc/devices: nvidia, nvidia-frontend, -uvm, ...
    assert "char-nvidia-frontend rw" not in allow
    for node in recon["devices"]["nodes"] + ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]:
        assert f"{node} rw" in allow  # by path: systemd stats it, whatever /proc/devices names it
    assert out["limit_memlock"] == ""


def test_a_gpu_seen_only_by_nvidia_smi_still_gets_its_devices():
    out = decide({"gpus": {"count": 2}}, {})  # recon from before the devices probe
    assert "char-nvidia* rw" in out["device_allow"] and "/dev/nvidiactl rw" in out["device_allow"]


def test_a_cpu_host_keeps_private_devices():
    out = decide(CPU, {})
    assert out["private_devices"] and out["device_allow"] == [] and out["limit_memlock"] == ""


def test_infiniband_gets_its_nodes_rdma_cm_and_unlimited_locked_memory():
    out = decide({**H100_550, "devices": {k: H100_550["devices"][k] + IB[k] for k in IB}}, {})
    allow = out["device_allow"]
    assert {"char-infiniband* rw", "/dev/infiniband/uverbs0 rw", "/dev/infiniband/rdma_cm rw"} <= set(allow)
    assert out["limit_memlock"] == "infinity"
    only_names = decide({"devices": {"nodes": [], "names": ["infiniband_mad"]}}, {})
    assert (
        only_names["limit_memlock"] == "infinity"
        and "/dev/infiniband/rdma_cm rw" in only_names["device_allow"]
    )


def test_one_node_keeps_every_rank_on_loopback_behind_a_loopback_filter():
    out = decide(H100_550, {}, interfaces=ENS5)
    assert out["local_addr"] == "127.0.0.1"  # torchrun's store and MASTER_ADDR, not the host's FQDN
    assert out["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    assert out["ip_deny"] == "any" and out["ip_allow"] == ["localhost"]  # the node's addresses not needed


def test_one_node_with_a_named_interface_allows_its_networks():
    out = decide(CPU, {}, interfaces=ENS5, socket_ifname="ens5")
    assert out["env"]["GLOO_SOCKET_IFNAME"] == "ens5"
    assert out["ip_allow"] == ["localhost", "10.9.0.0/24", "fd00:9::/64"]


def test_several_nodes_use_the_interface_that_holds_this_nodes_cluster_address():
    out = decide(H100_550, {}, node_rank=1, node_addresses=["10.9.0.11", "10.9.0.12"], interfaces=ENS5)
    assert out["env"] == {
        "GLOO_SOCKET_IFNAME": "ens5",
        "NCCL_SOCKET_IFNAME": "ens5",
        "VLLM_HOST_IP": "10.9.0.12",
    }
    assert out["local_addr"] == "10.9.0.12"
    # every node's cluster address and the cluster interface's networks (link-local left out), not eth0's
    assert out["ip_allow"] == ["localhost", "10.9.0.11", "10.9.0.12", "10.9.0.0/24", "fd00:9::/64"]
    named = decide(
        H100_550,
        {},
        node_rank=1,
        node_addresses=["10.9.0.11", "10.9.0.12"],
        interfaces=ENS5,
        socket_ifname="eth0",
    )
    assert named["env"]["NCCL_SOCKET_IFNAME"] == "eth0" and "203.0.113.0/24" in named["ip_allow"]


def test_several_nodes_refuse_a_cluster_address_on_no_interface():
    with pytest.raises(SandboxError, match="on none of its interfaces"):
        decide(CPU, {}, node_rank=0, node_addresses=["198.51.100.1", "10.9.0.12"], interfaces=ENS5)
    with pytest.raises(SandboxError, match="not an IP address"):
        decide(CPU, {}, node_rank=0, node_addresses=["gpu-a.example", "gpu-b.example"], interfaces=ENS5)


@pytest.mark.parametrize(
    "config, env, online",
    [
        ({"report_to": ["wandb"], "trackers": {"wandb_mode": "online"}}, {}, "W&B online"),
        ({"report_to": ["wandb"], "trackers": {"wandb_mode": "offline"}}, {}, ""),
        (
            {"report_to": ["mlflow"]},
            {"MLFLOW_TRACKING_URI": "https://u:p@mlflow.example.com/x"},
            "mlflow.example.com",
        ),
        ({"report_to": ["mlflow"]}, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}, ""),
        ({"report_to": ["mlflow"]}, {"MLFLOW_TRACKING_URI": "file:///runs/mlruns"}, ""),
        ({"report_to": ["mlflow"]}, {}, ""),
        ({"report_to": ["trackio"]}, {"TRACKIO_SPACE_ID": "me/runs"}, "me/runs"),
        ({"report_to": ["tensorboard"]}, {"MLFLOW_TRACKING_URI": "https://mlflow.example.com"}, ""),
    ],
)
def test_an_online_tracker_lifts_the_ip_filter_with_its_reason(config, env, online):
    assert (online in online_tracker(config, env)) and bool(online_tracker(config, env)) == bool(online)
    out = decide(CPU, config, env=env)
    if online:
        assert out["ip_deny"] == "" and out["ip_allow"] == []
        assert any("IP filter lifted" in r and online in r for r in out["reasons"])
    else:
        assert out["ip_deny"] == "any" and out["ip_allow"] == ["localhost"]
    assert out["env"]["GLOO_SOCKET_IFNAME"] == "lo"  # the ranks stay on loopback either way


def test_no_ip_filter_when_the_inventory_says_so():
    out = decide(CPU, {}, ip_filter=False)
    assert out["ip_deny"] == "" and out["ip_allow"] == []


def run(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "service", "sandbox", *args],
        input=stdin,
        capture_output=True,
        text=True,
    )


def test_the_verb_reads_recon_and_the_run_config_and_refuses_bad_input_in_one_line(tmp_path):
    recon = tmp_path / "recon.json"
    recon.write_text(json.dumps(H100_550))
    ok = run(
        "--facts", str(recon), "--config", "-", stdin="report_to: [wandb]\ntrackers: {wandb_mode: online}\n"
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["online_tracker"] == "W&B online"
    for bad, why in (
        (["--facts", str(tmp_path / "none.json")], "does not exist"),
        (["--facts-json", "{"], "neither JSON nor YAML"),
        (["--facts-json", "[1]"], "not a mapping"),
        (["--facts-json", "{}", "--node-address", "10.0.0.1", "--node-address", "10.0.0.2"], "none of its"),
    ):
        r = run(*bad)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
