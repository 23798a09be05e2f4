"""The run's vars as docs/node-to-drafter.md passes them, on the controller itself (no test host, ~1 min):

- `-e @run.yml` carries data_sync_items and trainer_service_run_config: extra vars beat set_fact, so
  train.yml's hand-off (the dataset item from dflash_dataset and data.path) used to be silently ignored.
  Now the dataset is pulled from S3 beside the user's own item, and the play says the data.path the role
  will read (trainer_service_config, rendered from the role's own vars);
- a relative controller folder in an item (`src: ./prompts`) is the repository root's (dflash_repo), where
  the page's commands run, never playbooks/ (rsync's `change_dir ... failed`);
- the demo paths (train_prepare_demo, regenerate_prepare_demo) set_fact a user's name: the user's own
  run config, target or prompts beside them is refused before provisioning, however it is passed.

`ansible-playbook playbooks/train.yml --tags data` on localhost (ansible_connection local) does only the
data step: the hand-off, the prerequisites and data_sync; S3 is moto's server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO, VENV_BIN
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, MotoServer, client, s3_env

pytestmark = pytest.mark.slow


def play(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_train_yml_takes_the_hand_off_and_a_relative_folder_with_dash_e_at(tmp_path):
    root = tmp_path / "checkout"  # the repository root as the play sees it (dflash_repo)
    node = tmp_path / "node"  # the "node": this machine, its own root
    (root / "prompts").mkdir(parents=True)
    (root / "requirements").symlink_to(REPO / "requirements")  # python_env's argument spec reads its pins
    (root / "prompts" / "prompts.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    (node / "venv" / "bin").mkdir(parents=True)
    (node / "venv" / "bin" / "dflash").symlink_to(VENV_BIN / "dflash")
    dataset = tmp_path / "made"
    dataset.mkdir()
    (dataset / "dflash_data.json").write_text('{"samples": 1}\n')
    moto = MotoServer().start()
    try:
        client(moto.endpoint_url).create_bucket(Bucket="regen")
        pushed = subprocess.run(
            [
                VENV_BIN / "dflash",
                "s3",
                "push",
                dataset,
                "s3://regen/q/dataset",
                "--endpoint-url",
                moto.endpoint_url,
            ],
            env=s3_env(),
            capture_output=True,
            text=True,
        )
        assert pushed.returncode == 0, pushed.stderr
        inv = tmp_path / "inv.yml"
        local = {
            "ansible_connection": "local",
            "ansible_python_interpreter": str(VENV_BIN / "python"),
            "dflash_root": str(node),
            "dflash_repo": str(root),
            "dflash_group_vars": "loaded",
            "dflash_s3_endpoint_url": moto.endpoint_url,
            "vault_s3_access_key_id": TEST_ACCESS_KEY,
            "vault_s3_secret_access_key": TEST_SECRET_KEY,
        }
        inv.write_text(yaml.safe_dump({"all": {"hosts": {"ctl": local}}}))
        # the page's run.yml (step 6), with a relative controller folder of the page's step 5
        run = tmp_path / "run.yml"
        run.write_text(
            yaml.safe_dump(
                {
                    "trainer_service_run_config": {
                        "target": {"path": f"{node}/target"},
                        "drafter": {"num_layers": 1},
                    },
                    "data_sync_items": [{"name": "prompts", "src": "./prompts", "dest": f"{node}/prompts"}],
                    "dflash_dataset": "s3://regen/q",
                }
            )
        )
        r = play(["playbooks/train.yml", "-i", str(inv), "--tags", "data", "-e", f"@{run}"], cwd=REPO)
    finally:
        moto.stop()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    said = r.stdout[r.stdout.index("TASK [Say what the run takes]") :]
    assert "data_sync items: prompts, dataset" in said, said[:600]
    assert f"data.path: {node}/dataset" in said, said[:600]
    # the user's item from the repository root (not playbooks/prompts), the dataset from S3
    assert (node / "prompts" / "prompts.jsonl").read_bytes() == (
        root / "prompts" / "prompts.jsonl"
    ).read_bytes()
    assert json.loads((node / "dataset" / "dflash_data.json").read_text()) == {"samples": 1}
    assert (root / "reports" / "ctl" / "manifests" / "prompts.json").exists()


def test_the_role_reads_the_hand_off_over_the_run_config():
    """trainer_service reads trainer_service_config: the user's run config with the play's data.path on top
    (a name no user passes, so -e @FILE cannot hide it); without a hand-off, the user's data.path."""
    from tests.unit.test_role_contracts import render_role_var

    mine = {"target": {"path": "/t"}, "data": {"path": "/mine"}, "drafter": {"num_layers": 1}}
    values = {"dflash_root": "/opt/dflash", "trainer_service_run_config": mine}
    assert render_role_var("trainer_service", "trainer_service_config", values) == mine
    handed = render_role_var(
        "trainer_service",
        "trainer_service_config",
        {**values, "trainer_service_data_path": "/opt/dflash/dataset"},
    )
    assert handed == {**mine, "data": {"path": "/opt/dflash/dataset"}}
    plan = render_role_var(
        "trainer_service",
        "trainer_service_plan_config",
        {**values, "trainer_service_data_path": "/opt/dflash/dataset"},
    )
    assert plan["data"] == {"path": "/opt/dflash/dataset"} and plan["out_dir"] == "/opt/dflash/runs/main/out"


# The demo paths set_fact a user's name (train.yml: trainer_service_run_config; regenerate.yml:
# regenerate_job_target and regenerate_job_prompts): an extra var would silently beat the demo's, and the
# demo's a host or group var. Each form the user may pass is refused in the first play, before provisioning
# (`--tags always`: only the input checks run, nothing is provisioned here).
DEMO_CLASHES = {
    "train": ("train_prepare_demo", {"trainer_service_run_config": {"target": {"path": "/t"}}}),
    "regenerate": (
        "regenerate_prepare_demo",
        {"regenerate_job_target": "/t", "regenerate_job_prompts": "/p"},
    ),
}


def inputs_play(
    tmp_path: Path, playbook: str, form: str, demo: bool, mine: dict
) -> subprocess.CompletedProcess:
    """`ansible-playbook playbooks/PLAYBOOK.yml --tags always` on localhost with the demo switched on (as the
    cpu and local groups do) or off, and the user's vars passed as `form`: -e @FILE, host vars, group vars."""
    switch = DEMO_CLASHES[playbook][0]
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": str(VENV_BIN / "python"),
        "dflash_repo": str(REPO),  # the roles' argument specs (run with --tags always) read these two
        "dflash_root": str(tmp_path / "node"),
    }
    group: dict = {switch: demo}
    extra: list[str] = []
    if form == "extra":
        (tmp_path / "mine.yml").write_text(yaml.safe_dump(mine))
        extra = ["-e", f"@{tmp_path / 'mine.yml'}"]
    elif form == "host":
        host.update(mine)
    else:
        group.update(mine)
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"cpu": {"hosts": {"ctl": host}, "vars": group}}}}))
    return play([f"playbooks/{playbook}.yml", "-i", str(inv), "--tags", "always", *extra], cwd=REPO)


@pytest.mark.parametrize("form", ["extra", "host", "group"])
@pytest.mark.parametrize("playbook", ["train", "regenerate"])
def test_the_demo_refuses_your_own_vars_before_provisioning(tmp_path, playbook, form):
    switch, mine = DEMO_CLASHES[playbook]
    r = inputs_play(tmp_path, playbook, form, demo=True, mine=mine)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"ctl: {switch} is true" in out and "would be silently ignored" in out, out[-3000:]
    for name in mine:
        assert name in out.split(f"{switch} is true", 1)[1], out[-3000:]
    assert f"add -e {switch}=false" in out, out[-3000:]
    assert "PLAY [Provision]" not in out, out[-3000:]


@pytest.mark.parametrize("playbook", ["train", "regenerate"])
def test_the_demo_alone_and_your_own_vars_alone_pass_the_inputs(tmp_path, playbook):
    switch, mine = DEMO_CLASHES[playbook]
    demo = inputs_play(tmp_path, playbook, "group", demo=True, mine={})
    yours = inputs_play(tmp_path, playbook, "extra", demo=False, mine=mine)
    for r in (demo, yours):  # on to provisioning (of which --tags always runs only the argument checks)
        assert r.returncode == 0 and "PLAY [Provision]" in r.stdout, r.stdout[-3000:]
        assert "silently ignored" not in r.stdout
