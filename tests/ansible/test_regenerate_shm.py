"""regenerate.yml's /dev/shm gate, on this machine (no test host): a container runtime's default /dev/shm
(64 MiB) cannot hold vLLM's engine queues, so regenerate_job refuses to start its engines there, with the
trainer's preflight check and fix (trainer/preflight/shm.py, machine.shm_too_small), asked through the job's
own command (`dflash regenerate ... --check-only`). A 64 MiB /dev/shm is a real tmpfs mounted over
/dev/shm in a mount namespace of the command's own (`unshare -m`; the suite runs as root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO, VENV_BIN, local_env
from trainer.preflight.shm import SHM_FIX

pytestmark = pytest.mark.slow


def with_shm(size: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` with a /dev/shm of `size` (a fresh tmpfs in a mount namespace of its own: this machine's
    /dev/shm is untouched)."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *argv],
        cwd=REPO,
        env=local_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def regenerate(target: Path, tmp_path: Path, *args: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n')
    base = ["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    return [str(VENV_BIN / "dflash"), "regenerate", *base, *args, "--check-only"]


@pytest.mark.parametrize(
    "args, refused",
    [
        (
            ["--server", "http://127.0.0.1:8100", "--server", "http://127.0.0.1:8101"],
            True,
        ),  # regenerate_job's
        (["--server", "http://localhost:8100"], True),
        (["--backend", "vllm", "--device", "cpu"], True),  # the engine in this process
        (["--server", "http://10.0.0.7:8100"], False),  # engines on another host: their /dev/shm
        (["--backend", "transformers"], False),  # no vLLM: no queues
    ],
)
def test_dflash_regenerate_refuses_vllm_engines_here_on_a_64_mib_dev_shm(
    vllm_sized_target, tmp_path, args, refused
):
    small = with_shm("64m", regenerate(vllm_sized_target, tmp_path, *args))
    if not refused:
        assert small.returncode == 0 and "nothing started" in small.stdout, small.stdout + small.stderr
        return
    assert small.returncode == 2, small.stdout + small.stderr
    line = small.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, small.stderr
    assert line.startswith("dflash regenerate: [machine.shm_too_small] /dev/shm has 64 MiB free;"), line
    assert "needs 240 MiB there (vLLM's engine queues 240 MiB)" in line and f"(fix: {SHM_FIX})" in line, line
    assert not (tmp_path / "out").exists()
    roomy = with_shm("1g", regenerate(vllm_sized_target, tmp_path, *args))
    assert roomy.returncode == 0 and "can start here" in roomy.stdout, roomy.stdout + roomy.stderr


def role_play(tmp_path: Path, target: Path) -> list[str]:
    """regenerate_job (tasks/main.yml) on localhost up to its engines: GPU facts of a CPU host (0 GPUs: one
    engine) in a facts folder of its own, the job under supervisord in tmp_path, nothing waited for."""
    facts = tmp_path / "facts"
    facts.mkdir()
    (facts / "dflash.fact").write_text(json.dumps({"gpus": {"count": 0}}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n')
    role_vars = {
        "dflash_root": str(tmp_path / "node"),
        "gpu_facts_fact_dir": str(facts),
        "regenerate_job_target": str(target),
        "regenerate_job_prompts": str(prompts),
        "regenerate_job_venv": str(VENV_BIN.parent),
        "regenerate_job_user": "root",
        "regenerate_job_create_user": False,
        "regenerate_job_manager": "supervisord",
        "regenerate_job_wait": "none",
    }
    book = tmp_path / "play.yml"
    book.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "all",
                    "gather_facts": False,
                    "roles": [{"role": "regenerate_job", "vars": role_vars}],
                }
            ]
        )
    )
    local = ["-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]
    return [str(VENV_BIN / "ansible-playbook"), *local, str(book)]


def test_regenerate_job_refuses_before_its_engines_start(vllm_sized_target, tmp_path):
    r = with_shm("64m", role_play(tmp_path, vllm_sized_target))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    failed = out[out.index("TASK [regenerate_job : Stop when the job cannot start here]") :]
    assert "localhost: dflash regenerate: [machine.shm_too_small] /dev/shm has 64 MiB free" in failed, failed
    assert f"(fix: {SHM_FIX})" in " ".join(failed.split()), failed  # the play output folds long lines
    # nothing was started: the job's folder and supervisord's come after the check
    assert not (tmp_path / "node").exists(), sorted(p.name for p in (tmp_path / "node").rglob("*"))


def test_the_role_check_passes_on_a_roomy_dev_shm(vllm_sized_target, tmp_path):
    """The same arguments pass on a 1 GiB /dev/shm (tasks_from check.yml only: nothing is started)."""
    argv = role_play(tmp_path, vllm_sized_target)
    book = Path(argv[-1])
    play = yaml.safe_load(book.read_text())
    role_vars = play[0]["roles"][0]["vars"]
    play[0]["roles"] = []
    play[0]["tasks"] = [
        {
            "ansible.builtin.include_role": {"name": "regenerate_job", "tasks_from": "check.yml"},
            "vars": role_vars,
        }
    ]
    book.write_text(yaml.safe_dump(play))
    r = with_shm("1g", [*argv[:-1], "-e", "regenerate_job_gpus=0", str(book)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Stop when the job cannot start here" in out and "skipping: [localhost]" in out, out[-3000:]
