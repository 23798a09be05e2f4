"""playbooks/train.yml end to end through ansible-runner on a real SSH host without systemd: recon ->
provision (GPU roles skip with their reason) -> a tiny run prepared on the host -> trainer under
supervisord -> monitor answering HTTP 200 on the host's 127.0.0.1:8080 -> first step; a second run
changes nothing."""

import json

from tests.ansible.test_trainer_service import wait_for


def test_train_playbook_runs_the_whole_job(bed, provisioned, provision_vars, runner, reports, tmp_path):
    host = bed.hosts["node-b"]
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        **provision_vars,
        "gpu_facts_report_dir": str(reports),
        "train_prepare_demo": True,
        "train_demo_tiny": True,
        "train_demo_steps": 3000,
        "trainer_service_user": "root",
        "trainer_service_create_user": False,
        "trainer_service_run_name": "e2e",
    }
    ctl = f"{host.root}/venv/bin/supervisorctl -c {host.root}/supervisor/supervisord.conf"
    try:
        first = runner.run("train.yml", inv, limit="node-b", extravars=ev)
        assert first.ok(), "\n".join(map(str, first.failures()))
        skipped = [
            r["msg"]
            for t in ("Say what happens to the driver", "Say what happens to the toolkit")
            for r in first.task_results(t, "node-b")
        ]
        assert len(skipped) == 2 and all("skip: no NVIDIA GPU" in m for m in skipped), skipped
        said = first.task_results("Say where to watch it", "node-b")[0]["msg"]
        assert said[1] == "page: http://127.0.0.1:8080/" and f"-p {host.port} root@{host.addr}" in said[2]
        # the monitor answers inside the host's own network namespace
        status, body = host.local_get("http://127.0.0.1:8080/api/status")
        assert status == 200 and json.loads(body)["step"] >= 1
        wait_for(
            lambda: "RUNNING" in host.ssh(bed, f"{ctl} status", check=False).stdout,
            what="both programs running",
        )
        progs = host.ssh(bed, f"{ctl} status", check=False).stdout
        assert "dflash-train" in progs and "dflash-monitor" in progs
        second = runner.run("train.yml", inv, limit="node-b", extravars=ev)
        assert second.ok() and second.changed("node-b") == 0, second.changed_tasks()
    finally:
        host.ssh(bed, f"{ctl} shutdown", check=False)
