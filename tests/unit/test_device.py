"""train.device on this machine (trainer/device.py): `auto` never trains a GPU node on its CPU in
silence, `cuda` without CUDA is refused. The machine's GPUs are probed from the driver's files; the
tests point the probe at folders of their own (a stand-in for a GPU machine whose torch sees none)."""

from __future__ import annotations

import pytest

from trainer import device
from trainer.device import DeviceRefused, choose_device, machine_nvidia_gpus


@pytest.fixture
def gpu_machine(tmp_path, monkeypatch):
    """A machine whose driver exposes two GPUs (device nodes only: a container's view)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    monkeypatch.setattr(device, "DEV", dev)
    monkeypatch.setattr(device, "PROC_GPUS", tmp_path / "no-proc")
    return dev


@pytest.fixture
def no_gpu_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "DEV", tmp_path)
    monkeypatch.setattr(device, "PROC_GPUS", tmp_path / "no-proc")


def test_the_machines_gpus_are_read_from_the_driver_then_the_device_nodes(gpu_machine, tmp_path, monkeypatch):
    assert machine_nvidia_gpus() == ["nvidia0", "nvidia1"], "nvidiactl and nvidia-uvm are not GPUs"
    proc = tmp_path / "proc"
    (proc / "0000:17:00.0").mkdir(parents=True)
    monkeypatch.setattr(device, "PROC_GPUS", proc)
    assert machine_nvidia_gpus() == ["0000:17:00.0"]


def test_auto_chooses_cuda_when_visible_and_the_cpu_only_on_a_machine_without_gpus():
    assert choose_device("auto", cuda=True, gpus=[]).describe() == "cuda (auto: CUDA visible)"
    assert choose_device("auto", cuda=False, gpus=[]).describe() == "cpu (auto: no CUDA)"
    assert choose_device("cpu", cuda=True, gpus=["nvidia0"]).describe() == "cpu (train.device cpu)"
    assert choose_device("cuda", cuda=True).type == "cuda"


def test_auto_on_gpus_torch_cannot_use_and_cuda_without_cuda_are_refused():
    with pytest.raises(DeviceRefused) as auto:
        choose_device("auto", cuda=False, gpus=["nvidia0", "nvidia1"])
    assert auto.value.code == "machine.gpus_unused" and auto.value.exit_code == 2
    assert "2 NVIDIA GPU(s) (nvidia0, nvidia1)" in auto.value.message
    assert "CPU build" in auto.value.message, "this machine's torch is 2.13.0+cpu: the cause named"
    assert "train.device cpu" in auto.value.fix and "dflash gpu decide" in auto.value.fix
    with pytest.raises(DeviceRefused) as cuda:
        choose_device("cuda", cuda=False, gpus=[])
    assert cuda.value.code == "machine.cuda_unavailable" and "torch sees no CUDA" in cuda.value.message


def test_preflight_refuses_auto_on_a_gpu_machine_whose_torch_sees_no_cuda(gpu_machine, make_config, capsys):
    import torch

    from trainer.cli import main

    if torch.cuda.is_available():
        pytest.skip("torch sees CUDA here: auto takes it")
    assert main(["preflight", "--config", str(make_config())]) == 2
    out = capsys.readouterr().out
    assert "ERROR [machine.gpus_unused]" in out and "2 NVIDIA GPU(s)" in out and "CPU build" in out


def test_auto_on_a_machine_without_gpus_trains_on_the_cpu_and_says_why(
    no_gpu_machine, make_config, monkeypatch
):
    import torch

    from trainer.config.run import load_config
    from trainer.preflight import run_preflight
    from trainer.training.distributed import setup_dist

    if torch.cuda.is_available():
        pytest.skip("torch sees CUDA here: auto takes it")
    cfg = load_config(make_config())
    report = run_preflight(cfg)
    assert report.ok and report.machine["device"] == "cpu (auto: no CUDA)"
    assert "device  cpu (auto: no CUDA)" in report.render_text()
    monkeypatch.delenv("RANK", raising=False)
    d = setup_dist(cfg)
    monkeypatch.delenv("RANK", raising=False)
    assert d.device.type == "cpu" and d.device_why == "auto: no CUDA"
