"""Safe reach (docs/salvage.md, docs/provision.md): salvage.yml stops jobs, so it refuses to start without
`-l` or on the controller unless asked for, before any task reaches a host; and `-l GROUP` reaches only
the user's own hosts (the repository's inventory holds no example host in a real group)."""

import subprocess
from pathlib import Path

import yaml

from tests.ansible.conftest import REPO, ansible_cli

GPU_GROUPS = ("a100", "pro6000", "b200", "h100", "h100_1", "h200", "h200_1", "cpu")
GUARD = "Refuse to salvage every host or the controller unless asked for"


def play(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return ansible_cli("ansible-playbook", "playbooks/salvage.yml", *args, timeout=timeout)


def tasks_run(out: str) -> list[str]:
    return [line.split("[", 1)[1].rsplit("]", 1)[0] for line in out.splitlines() if line.startswith("TASK [")]


def nodes(tmp_path: Path) -> Path:
    """Two ssh hosts of a user's own file, on a closed port: a task that reaches one finds it unreachable
    at once (connection refused), which is how the test sees the play went past the guard."""
    node = {
        "ansible_host": "127.0.0.1",
        "ansible_port": 1,
        "ansible_user": "root",
        "ansible_python_interpreter": "/usr/bin/python3",
    }
    path = tmp_path / "nodes.private.yml"
    inv = {"all": {"children": {"a100": {"hosts": {"node-a": node, "node-b": node}}}}}
    path.write_text(yaml.safe_dump(inv))
    return path


def test_salvage_refuses_without_a_limit_and_says_how(tmp_path):
    inv = nodes(tmp_path)
    for extra in ([], ["-e", "salvage_all_hosts=false"]):
        r = play("-i", "inventory", "-i", str(inv), "--check", *extra)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-2000:]
        assert "name the hosts with -l HOST" in out and "-e salvage_all_hosts=true" in out, out[-2000:]
        assert tasks_run(out) == [GUARD], out[-2000:]  # nothing else started, on no host
        assert "UNREACHABLE" not in out  # no host was reached


def test_salvage_refuses_the_controller_unless_asked_for(tmp_path):
    inv = nodes(tmp_path)
    for args in (["-l", "local"], ["-l", "a100,local"], ["-e", "salvage_all_hosts=true"]):
        r = play("-i", "inventory", "-i", str(inv), "--check", *args)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-2000:]
        assert "would run on the controller (localhost:" in out and "-e salvage_controller=true" in out, args
        assert tasks_run(out) == [GUARD] and "UNREACHABLE" not in out, (args, out[-2000:])
    # asked for: the play goes on to the salvage role (listed, not run on this machine)
    r = play("-l", "local", "-e", "salvage_controller=true", "--list-hosts")
    assert r.returncode == 0 and "localhost" in r.stdout, r.stdout + r.stderr


def test_salvage_with_a_limit_goes_past_the_guard_to_the_hosts(tmp_path):
    """-l names the hosts: the guard passes and the salvage role's tasks reach them (here: unreachable);
    so does every host of the inventory when asked for with salvage_all_hosts (the controller left out)."""
    inv = nodes(tmp_path)
    for args in (["-l", "node-a"], ["-l", "a100"], ["-e", "salvage_all_hosts=true", "-l", "!local"]):
        r = play("-i", "inventory", "-i", str(inv), "--check", *args)
        out = r.stdout + r.stderr
        assert tasks_run(out)[0] == GUARD and len(tasks_run(out)) > 1, (args, out[-2000:])
        assert "would run on the controller" not in out and "name the hosts with" not in out, args
        assert "fatal: [node-a]: UNREACHABLE" in out and r.returncode != 0, (args, out[-2000:])
        assert ("node-b" in out) == (args[1] != "node-a"), args


def test_a_group_of_the_repository_inventory_holds_no_example_host():
    """The README's `-l a100` reaches the user's hosts only: every GPU group of inventory/ is empty until
    the user's own *.private.yml puts a node in it; `local` holds this machine alone."""
    for group in GPU_GROUPS:
        r = ansible_cli("ansible-inventory", "-i", str(REPO / "inventory"), "--graph", group)
        assert r.returncode == 0, r.stderr[-2000:]
        hosts = [line.strip(" |-") for line in r.stdout.splitlines() if not line.strip(" |-").startswith("@")]
        assert hosts == ([] if group != "cpu" else ["localhost"]), (group, r.stdout)
