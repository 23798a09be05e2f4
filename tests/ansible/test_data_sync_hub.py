"""data_sync's hf source on a real SSH host: the host downloads hf://REPO@REVISION itself with
`dflash hub pull`, the token from the vault travels as a 0600 file (in no command line or environment),
--check moves nothing, a second run changes nothing, a file whose bytes differ from the Hub's sha256
stops the play and is never placed.

The internet is the one thing that cannot run here: the Hub is tests/hubserver.py's stand-in, listening
on the controller's side of the host's link (as radosgw does for the S3 test), so the host reaches it
from inside its namespace at http://<gateway(host)>:<port>."""

import json
import os
from pathlib import Path

import pytest

from tests.ansible.conftest import ROLE_PLAYBOOK as ROLE
from tests.ansible.conftest import gateway
from tests.ansible.test_data_sync import SecretWatch, digests
from tests.hubserver import COMMIT, HubStandIn

REPO = "tiny-org/target"
TOKEN = "hf_vaulttoken_9f8e7d6c5b4a"


@pytest.fixture
def standin(bed, tmp_path):
    host = bed.hosts["node-a"]
    if host.container:
        pytest.fail("node-a is a container here: the stand-in listens on namespace hosts' links")
    src = tmp_path / "repo"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}\n')
    (src / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}\n')
    (src / "model.safetensors").write_bytes(os.urandom(3 * 2**20))
    with HubStandIn(host=gateway(host)) as srv:
        srv.add_folder(REPO, src)
        srv.token = TOKEN
        yield srv, src


def test_hub_to_host_through_the_role(bed, provisioned, runner, standin, tmp_path):
    srv, src = standin
    host = bed.hosts["node-a"]
    dest = host.root / "models" / "target"
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        "test_role": "data_sync",
        "dflash_hf_endpoint": srv.endpoint,
        "vault_hf_token": TOKEN,
        "data_sync_items": [
            {"name": "target", "src": f"hf://{REPO}@main", "dest": str(dest), "direction": "hf"}
        ],
    }
    dry = runner.run(ROLE, inv, limit="node-a", extravars=ev, check=True)
    assert dry.ok() and dry.changed("node-a") == 1 and not dest.exists(), dry
    with SecretWatch(host.pid, TOKEN, verb=" hub pull ", mark=str(dest)) as watch:
        first = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert first.ok(), first
    assert watch.pulls_seen > 0 and not watch.leaks, (watch.pulls_seen, watch.leaks[:5])
    token_file = first.task_results("Make the Hub token file (0600, on the host): target", "node-a")[0][
        "path"
    ]
    assert not Path(token_file).exists()  # removed after the pull
    assert TOKEN not in first.stdout and TOKEN not in json.dumps(first.events)
    assert digests(dest) == digests(src)
    manifest = json.loads((host.root / "models" / "target.manifest.json").read_text())
    assert manifest["source"] == f"hf://{REPO}@{COMMIT}" and set(manifest["files"]) == set(digests(src))
    second = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert second.ok() and second.changed("node-a") == 0, second.changed_tasks()

    (dest / "model.safetensors").unlink()
    bad = bytearray((src / "model.safetensors").read_bytes())
    bad[0] ^= 0xFF
    srv.corrupt["model.safetensors"] = bytes(bad)
    third = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert not third.ok()
    failure = json.dumps(third.failures())
    assert "FAILED model.safetensors: refused: sha256" in failure, failure[-2000:]
    assert not (dest / "model.safetensors").exists()
    assert not (dest / ".hf-partial" / "model.safetensors").exists()

    malformed = runner.run(
        ROLE,
        inv,
        limit="node-a",
        extravars={
            **ev,
            "data_sync_items": [{"name": "t", "src": "hf://a b", "dest": str(dest), "direction": "hf"}],
        },
    )
    checked = json.dumps(malformed.task_results("Check the items before copying anything", "node-a"))
    assert not malformed.ok() and "hf://ORG/NAME@REVISION (got hf://a b)" in checked, checked[-2000:]
