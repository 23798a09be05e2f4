"""The GPU check's new parts that need no GPU and no smoke run (bench/gpu/unit.py, toolchain.py, the
two-GPU stages of stages.py): where the stages run and with which sandbox, rendered from the role's own
template; a stage in a unit (through a stand-in systemd-run: this machine runs no systemd, the GPU node's
is the real one); the ptxas Triton picks; the two-GPU stages' skips. The smoke run itself
(tests/integration/test_gpu_check.py) records the toolchain and the decision as they are here."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.integration.test_gpu_check import REPO, check_module


def test_where_the_stages_run_is_decided_and_said(monkeypatch, tmp_path):
    """A transient unit only where systemd is the init system, systemd-run is there and the check is
    root; otherwise outside a unit with every reason named; `--unit on` without them refuses."""
    check_module()
    import unit

    assert unit.decide("off", True) == (False, "outside a unit: --unit off")
    monkeypatch.setattr(unit.shutil, "which", lambda name: None)
    monkeypatch.setattr(unit.os, "geteuid", lambda: 1000)
    run_dir = {"/run/systemd/system": tmp_path / "no-such"}
    monkeypatch.setattr(unit, "Path", lambda p: run_dir.get(p, Path(p)))
    use, why = unit.decide("auto", True)
    assert not use and why.startswith("outside a unit: systemd is not running here")
    assert "no systemd-run" in why and "not root" in why and "supervisord" in why
    with pytest.raises(SystemExit, match="--unit on, but systemd is not running here"):
        unit.decide("on", False)
    (tmp_path / "run").mkdir()
    run_dir["/run/systemd/system"] = tmp_path / "run"
    monkeypatch.setattr(unit.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(unit.os, "geteuid", lambda: 0)
    assert unit.decide("auto", True) == (True, "in transient units with dflash-train.service's sandbox")


def template_keys() -> tuple[set[str], set[str]]:
    """The property names of the template's [Service] section, read from its text: those outside any
    `{% if %}` (every unit has them) and all of them (the check renders them: none is copied by hand)."""
    check_module()
    import unit

    always, possible, depth, section = set(), set(), 0, None
    for line in unit.TEMPLATE.read_text().splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s
        depth += s.startswith("{% if") - s.startswith("{% endif")
        if section == "[Service]" and re.match(r"^[A-Z]\w+=", s):
            possible.add(s.split("=", 1)[0])
            if depth == 0:
                always.add(s.split("=", 1)[0])
    return always, possible


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_units_sandbox_is_the_products_rendered_from_the_roles_template(monkeypatch, tmp_path, gpus):
    """Every property of the product's [Service] but those that say what runs and how it is supervised,
    rendered from the role's own template, defaults and derived vars, with the decisions the role asks of
    `dflash` (the sandbox, the toolchain's environment) asked of the same code for this host's recon
    facts, and the check's folder as the run folder; the unit's environment: the template's and the
    check's own."""
    check_module()
    import unit

    fact = tmp_path / "dflash.fact"
    devices = {"nodes": ["/dev/nvidia0", "/dev/nvidiactl"], "names": ["nvidia"]} if gpus else {}
    fact.write_text(json.dumps({"gpus": {"count": gpus}, "devices": devices, "systemd": True}))
    monkeypatch.setattr(unit, "FACT_FILE", fact)
    work = tmp_path / "work"
    u = unit.Unit(work, cuda=bool(gpus))
    assert u.unknown == [], "the template uses variables bench/gpu/unit.py gives no value"
    props = dict(u.properties)  # the last of a repeated key
    keys = {k for k, _ in u.properties}
    always, possible = template_keys()
    assert always - unit.PROCESS_KEYS <= keys <= possible - unit.PROCESS_KEYS
    assert not keys & {"ExecStart", "User", "Restart", "Environment", "WorkingDirectory"}
    assert props["ReadWritePaths"] == str(work) and props["ProtectSystem"] == "strict"
    assert props["PrivateDevices"] == ("no" if gpus else "yes")
    allowed = [v for k, v in u.properties if k == "DeviceAllow"]
    assert bool(allowed) == bool(gpus) and (not gpus or any("/dev/nvidia0" in v for v in allowed))
    assert props["IPAddressDeny"] == "any" and "localhost" in props["IPAddressAllow"]
    assert u.env["HOME"] == str(work) and u.env["HF_HUB_OFFLINE"] == "1"
    # ProtectHome follows the role's rule over the check's paths: read-only when one is under /root or /home
    assert props["ProtectHome"] == ("read-only" if any(
        str(p).startswith(("/root", "/home")) for p in (REPO, sys.prefix, sys.base_prefix)
    ) else "yes")  # fmt: skip
    cmd = u.wrap(["python", "-c", "pass"], {"PYTHONPATH": "/x", "SECRET": "no", "GPU_CHECK_STAGE": "s"}, "s")
    assert cmd[:4] == ["systemd-run", cmd[1], "--wait", "--pipe"] and cmd[-3:] == ["python", "-c", "pass"]
    assert "--setenv=PYTHONPATH=/x" in cmd and not any("SECRET" in a for a in cmd)
    assert f"--property=ReadWritePaths={work}" in cmd and "--setenv=HOME=" + str(work) in cmd


FAKE_SYSTEMD_RUN = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
opts = []
while args and args[0].startswith("--"):
    opts.append(args.pop(0))
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(opts) + "\\n")
env = {o.split("=", 1)[1].split("=", 1)[0]: o.split("=", 2)[2] for o in opts if o.startswith("--setenv=")}
env["PATH"] = "/usr/bin:/bin"
os.execvpe(args[0], args, env)
"""


def test_a_stage_in_a_unit_gets_only_the_units_environment_and_its_exit_code(monkeypatch, tmp_path):
    """run_logged through a stand-in systemd-run (this machine runs no systemd: the real one is the GPU
    node's): the command runs with the sandbox's properties on its line, only the template's and the
    check's variables, its output in the stage's log and its exit code as the stage's; past its limit
    the unit is stopped with `systemctl stop`."""
    check_module()
    import common
    import unit

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemd-run").write_text(FAKE_SYSTEMD_RUN)
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "systemctl.log"}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("NOT_THE_SERVICES", "1")
    monkeypatch.setattr(common.Service, "unit", unit.Unit(tmp_path / "work", cuda=False))
    show = [sys.executable, "-c", "import os, sys; print(sorted(os.environ)); sys.exit(3)"]
    with pytest.raises(common.StageFailed, match="exited 3") as err:
        common.run_logged("env", show, tmp_path / "env.log", 60)
    printed = str(err.value)
    assert "'HOME'" in printed and "'PYTORCH_CUDA_ALLOC_CONF'" in printed and "'GPU_CHECK_STAGE'" in printed
    assert "NOT_THE_SERVICES" not in printed
    opts = json.loads((tmp_path / "calls.jsonl").read_text().splitlines()[0])
    assert "--property=ProtectSystem=strict" in opts and "--property=NoNewPrivileges=yes" in opts
    with pytest.raises(common.StageFailed, match="timed out"):
        common.run_logged("sleeper", ["sleep", "30"], tmp_path / "sleeper.log", 1)
    assert "stop dflash-gpu-check-sleeper-" in (tmp_path / "systemctl.log").read_text()


def test_two_gpu_stages_skip_with_their_reason_and_launch_as_the_unit_does(monkeypatch, tmp_path):
    check_module()
    import stages
    import torch
    from common import MODES, Ctx, Skip

    ctx = Ctx(MODES["quick"], False, tmp_path, "s", {}, tmp_path, tmp_path, 0.0, None, tmp_path / "logs")
    for fn in (stages.dp2, stages.copy2):
        with pytest.raises(Skip, match="needs 2 CUDA devices: this is a CPU run"):
            fn(ctx, None, 10)
    ctx.cuda = True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(Skip, match=r"2 data-parallel ranks needs 2 GPUs, 1 visible"):
        stages.dp2(ctx, None, 10)
    with pytest.raises(Skip, match=r"target.gpus_per_copy 2 needs 2 GPUs, 1 visible"):
        stages.copy2(ctx, None, 10)
    cmd = stages.torchrun_cmd(2, "train", "--config", "c.yaml")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[-5:] == ["-m", "trainer.cli", "train", "--config", "c.yaml"] and "--shutdown-timeout=20" in cmd


def test_the_ptxas_in_use_is_tritons_own_choice_and_honours_its_variable(monkeypatch, tmp_path):
    """toolchain.ptxas asks Triton's get_ptxas (triton/backends/nvidia/compiler.py): the bundled ptxas
    below sm_90, ptxas-blackwell from sm_90 on, TRITON_PTXAS_BLACKWELL_PATH first when it runs."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    check_module()
    import toolchain

    a100, h100 = toolchain.ptxas(80)["in_use"], toolchain.ptxas(90)["in_use"]
    assert Path(a100["path"]).name == "ptxas" and Path(h100["path"]).name == "ptxas-blackwell"
    assert "release" in h100["version"] and h100["release"] in h100["version"]
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", str(fake))
    rec = toolchain.ptxas(90)
    assert rec["in_use"]["path"] == str(fake) and rec["in_use"]["release"] == "12.8"
    assert rec["env"]["TRITON_PTXAS_BLACKWELL_PATH"] == str(fake)
