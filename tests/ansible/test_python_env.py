"""python_env on real SSH hosts: uv from its PyPI wheel, a venv with the CPU recipe, the trainer package,
all installed from the controller's wheel cache (--no-index: the hosts download nothing). The install
runs in the background and the play prints its progress (bytes, rate; tasks/install.yml)."""

import json
from pathlib import Path

from tests.ansible.conftest import ROLE_PLAYBOOK as ROLE


def test_python_env_installs_the_trainer_from_the_wheel_cache(
    bed, provisioned, provision_vars, runner, wheel_cache, repo_snapshot, tmp_path
):
    assert provisioned.ok()
    for host in bed.hosts.values():
        venv = host.root / "venv"
        # the venv is real and works over SSH: the CLI answers and torch is the CPU build from the cache
        r = host.ssh(
            bed,
            f"{venv}/bin/dflash plan --help && {venv}/bin/python -c 'import torch, trainer; "
            "print(torch.__version__)'",
        )
        assert "--target-config" in r.stdout and "2.13.0+cpu" in r.stdout
        assert (host.root / "wheels" / next(p.name for p in wheel_cache.glob("torch-*.whl"))).is_file()
        # compiled once at install (the services cannot write bytecode into root's venv): a module nothing
        # imported yet has its .pyc, a package's test folder has none
        site = f"{venv}/lib/python3*/site-packages"
        r = host.ssh(
            bed,
            f"ls {site}/transformers/models/bert/__pycache__ | grep -c '^modeling_bert[.]'; "
            f"ls {site}/numpy/_core/tests/__pycache__ 2>/dev/null | wc -l",
        )
        assert r.stdout.split() == ["1", "0"], r.stdout
    # the install said how far it was: one watch per install step, each line from the progress file the
    # source's watcher wrote around uv (bytes uv's cache and the venv grew by, rate; no total, no ETA)
    watched = [
        e["event_data"]["res"]
        for e in provisioned.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("task", "").startswith("Watch the install, a line")
        and e["event_data"].get("host") == "node-a"
    ]
    assert len(watched) == 2, [e.get("event_data", {}).get("task") for e in provisioned.events][-80:]
    torch_step = [json.loads(r["stdout"]) for r in watched[0]["results"]]
    end = torch_step[-1]
    assert end["state"] == "done" and end["done_bytes"] > 500 * 2**20 and end["total_bytes"] is None, end
    assert end["line"].startswith("uv install (runtime.txt; uv cache + venv): ") and ", done, " in end["line"]
    assert "ETA" not in end["line"] and f"node-a: {end['line']}" in provisioned.stdout
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {"test_role": "python_env", **provision_vars}
    host, venv = bed.hosts["node-a"], bed.hosts["node-a"].root / "venv"
    # a second real run changes nothing: the journey proves it for all of train.yml (test_runbook_page.py)
    # --check tells the truth: after a source change, exactly the sync (and the install, which a command
    # cannot dry-run: reported as skipped), no other task (a --check with nothing changed was a role run
    # more that proved less: this one fails on any task that --check reports changed without a cause)
    plan = Path("trainer") / "layout" / "plan.py"
    with open(repo_snapshot / plan, "a") as fh:
        fh.write("\nTEST_MARKER = 1\n")
    try:
        check = runner.run(ROLE, inv, limit="node-a", extravars=ev, check=True)
        assert check.ok() and "TEST_MARKER" not in (host.root / "src" / plan).read_text()
        assert check.changed_tasks("node-a") == [
            "Push the trainer's source (pyproject.toml, trainer/, requirements/)"
        ]
        assert check.task_results("Install the trainer package from the synced source", "node-a")[0].get(
            "skipped"
        )
        third = runner.run(ROLE, inv, limit="node-a", extravars=ev)
        assert third.ok() and third.changed_tasks("node-a") == [
            "Push the trainer's source (pyproject.toml, trainer/, requirements/)",
            "Install the trainer package from the synced source",
            "Compile the venv's bytecode (its services cannot write it)",
        ]
        r = host.ssh(bed, f"{venv}/bin/python -c 'import trainer.layout.plan as p; print(p.TEST_MARKER)'")
        assert r.stdout.strip() == "1"  # the installed package is the new source
    finally:
        text = (repo_snapshot / plan).read_text().replace("\nTEST_MARKER = 1\n", "")
        (repo_snapshot / plan).write_text(text)
