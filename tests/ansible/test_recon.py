"""recon.yml on real SSH hosts (network namespaces, odd ports, host key checking on). GPUs cannot run
here: one host gets a stand-in `nvidia-smi` that prints the recorded output of the seeds' 8xA100-40GB
node (tests/fixtures/nvidia-smi/); the other host has no nvidia-smi at all (zero GPUs)."""

import json
import stat

FIX = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def recorded_smi(path, machine):
    """A script that answers like nvidia-smi on `machine` (its recorded outputs)."""
    path.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --query-gpu=*) exec cat {FIX / (machine + ".query.csv")} ;; '
        f"*) exec cat {FIX / (machine + '.nvidia-smi.txt')} ;; esac\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_recon_reports_gpus_and_zero_gpus_and_is_idempotent(bed, runner, reports, tmp_path):
    smi = recorded_smi(tmp_path / "nvidia-smi-a100", "a100-8x40gb")
    inv = bed.inventory(
        tmp_path / "inv.yml",
        extra_hostvars={
            "node-a": {
                "gpu_facts_nvidia_smi": str(smi),
                "expected_gpu_count": 8,
                "expected_gpu_model": "NVIDIA A100-SXM4-40GB",
            },
            "node-b": {"gpu_facts_nvidia_smi": str(tmp_path / "absent-nvidia-smi"), "expected_gpu_count": 0},
        },
    )
    ev = {"gpu_facts_report_dir": str(reports)}
    first = runner.run("recon.yml", inv, extravars=ev)
    assert first.ok(), first.stdout[-3000:]
    a = json.loads((reports / "node-a" / "recon.json").read_text())
    b = json.loads((reports / "node-b" / "recon.json").read_text())
    assert (a["gpus"]["count"], a["gpus"]["model"], a["gpus"]["driver"], a["gpus"]["driver_cuda"]) == (
        8,
        "NVIDIA A100-SXM4-40GB",
        "550.127.05",
        "12.4",
    )
    assert a["hostname"] == "node-a" and b["hostname"] == "node-b"  # really two hosts (own UTS namespaces)
    assert b["gpus"]["count"] == 0 and b["gpus"]["model"] is None
    assert a["python"] == "3.11" and a["systemd"] is False and a["disk_total_gib"] > 0
    # the facts file on each host holds the same facts
    fact = json.loads((bed.hosts["node-a"].root / "facts.d" / "dflash.fact").read_text())
    assert fact["gpus"]["count"] == 8
    second = runner.run("recon.yml", inv, extravars=ev)
    assert second.ok()
    assert second.changed("node-a") == 0 and second.changed("node-b") == 0, second.changed_tasks()


def test_recon_stops_on_unexpected_hardware(bed, runner, reports, tmp_path):
    smi = recorded_smi(tmp_path / "nvidia-smi-h200", "h200-1x141gb")
    inv = bed.inventory(
        tmp_path / "inv.yml",
        extra_hostvars={
            "node-a": {
                "gpu_facts_nvidia_smi": str(smi),
                "expected_gpu_count": 8,
                "expected_gpu_model": "NVIDIA A100-SXM4-40GB",
            }
        },
    )
    res = runner.run("recon.yml", inv, limit="node-a", extravars={"gpu_facts_report_dir": str(reports)})
    assert not res.ok()
    failed = res.task_results("Stop when the GPUs are not what the group expects", "node-a")
    assert failed and "expected 8 GPUs, found 1" in failed[0]["msg"] and "NVIDIA H200" in failed[0]["msg"]
