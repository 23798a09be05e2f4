"""`dflash hub pull` against a local stand-in for the Hugging Face Hub (tests/hubserver.py).

The internet is the one thing that cannot run here, so the Hub's endpoint is a small HTTP server on
127.0.0.1 (`--endpoint` / HF_ENDPOINT) answering the requests huggingface_hub makes: the model-info
API with files metadata, and /resolve/ with X-Repo-Commit, ETag, X-Linked-Etag/-Size and Range. The
client side (huggingface_hub, the verb, the manifest) is the real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hubserver import COMMIT, HubStandIn

DFLASH = [sys.executable, "-m", "trainer.cli"]
REPO = "tiny-org/qwen3-tiny"
SHARD = "model-00002-of-00002.safetensors"  # 16 MiB of random bytes: the file a kill lands in
MiB = 2**20


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    out["HF_HOME"] = os.environ.get("PYTEST_HF_HOME", "/nonexistent-hf-home")  # no stored token
    return out


def hub(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [*DFLASH, "hub", "pull", *map(str, args)], env=env(), capture_output=True, text=True, timeout=300
    )
    if check_rc is not None:
        assert res.returncode == check_rc, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory) -> Path:
    """A real tiny transformers model (config, safetensors) and its tokenizer files, plus one 16 MiB
    shard."""
    from trainer.demo.synth import servable_tiny_target

    out = servable_tiny_target(tmp_path_factory.mktemp("hub") / "qwen3-tiny")
    (out / SHARD).write_bytes(os.urandom(16 * MiB))
    return out


@pytest.fixture
def standin(repo_dir):
    with HubStandIn() as srv:
        srv.add_folder(REPO, repo_dir)
        yield srv


def verify(dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASH, "manifest", "verify", str(dest), str(dest.parent / f"{dest.name}.manifest.json")],
        env=env(),
        capture_output=True,
        text=True,
    )


def test_pull_is_proven_idempotent_and_written_into_the_manifest(tmp_path, standin, repo_dir):
    dest = tmp_path / "node" / "target"
    res = json.loads(hub(f"hf://{REPO}@main", dest, "--endpoint", standin.endpoint, "--json").stdout)
    assert res["ok"] and res["commit"] == COMMIT and res["downloaded"] == res["files"]
    names = {p.relative_to(repo_dir).as_posix() for p in repo_dir.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", SHARD} <= names
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} == names
    assert verify(dest).returncode == 0
    manifest = json.loads((tmp_path / "node" / "target.manifest.json").read_text())
    assert manifest["source"] == f"hf://{REPO}@{COMMIT}" and manifest["file_count"] == len(names)
    # every download was pinned to the commit the info call named, not to the branch
    assert all(f"/resolve/{COMMIT}/" in p for m, p, _ in standin.requests if "/resolve/" in p)
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(dest).model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(dest).convert_tokens_to_ids("w7") == 7
    served = dict(standin.served)
    again = json.loads(hub(REPO, dest, "--revision", "main", "--endpoint", standin.endpoint, "--json").stdout)
    assert again["ok"] and again["present"] == again["files"] and again["downloaded_bytes"] == 0
    assert standin.served == served  # a second pull moves nothing


def test_pull_killed_mid_file_resumes_from_its_partial(tmp_path, standin):
    dest = tmp_path / "target"
    part = dest / ".hf-partial" / SHARD
    standin.stall_after[SHARD] = 12 * MiB  # the stand-in stops sending there; huggingface_hub has
    # written its first 10 MiB chunk by then
    proc = subprocess.Popen(
        [*DFLASH, "hub", "pull", f"hf://{REPO}", str(dest), "--endpoint", standin.endpoint, "--workers", "1"],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (part.is_file() and part.stat().st_size >= 10 * MiB) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        standin.release.set()
    landed = part.stat().st_size
    assert 0 < landed < 16 * MiB and not (dest / SHARD).exists()  # nothing half-written in place
    first = standin.served[SHARD]
    standin.stall_after.clear()
    res = json.loads(hub(f"hf://{REPO}", dest, "--endpoint", standin.endpoint, "--json").stdout)
    second = standin.served[SHARD] - first
    print(f"bytes served for {SHARD}: first pull {first} (killed), resumed pull {second}, file {16 * MiB}")
    assert res["ok"] and res["resumed_bytes"] == landed
    assert second == 16 * MiB - landed < 16 * MiB  # the partial bytes were reused, not fetched again
    assert verify(dest).returncode == 0
    assert not (dest / ".hf-partial").exists()


def test_a_file_unlike_the_hubs_sha256_is_refused_and_never_placed(tmp_path, standin, repo_dir):
    bad = bytearray((repo_dir / "model.safetensors").read_bytes())
    bad[-1] ^= 0xFF  # same size, other bytes: only the sha256 can tell
    standin.corrupt["model.safetensors"] = bytes(bad)
    standin.corrupt["config.json"] = (repo_dir / "config.json").read_bytes().replace(b"qwen3", b"qwen4")
    dest = tmp_path / "target"
    res = hub(f"hf://{REPO}@{COMMIT}", dest, "--endpoint", standin.endpoint, check_rc=1)
    assert "FAILED model.safetensors: refused: sha256" in res.stderr and "LFS sha256" in res.stderr
    assert "FAILED config.json: refused: git blob id" in res.stderr
    assert not (dest / "model.safetensors").exists() and not (dest / "config.json").exists()
    assert not (dest / ".hf-partial" / "model.safetensors").exists()  # deleted, not kept
    assert (dest / SHARD).is_file()  # the good files are placed
    assert not (tmp_path / "target.manifest.json").exists()  # no manifest for an unproven copy


@pytest.mark.parametrize(
    "args, message",
    [
        (["hf://not a repo@main"], "is not a Hub repo"),
        (["hf://a/b/c"], "is not a Hub repo"),
        (["hf://org/x@main", "--revision", "v2"], "names revision 'main' but --revision says 'v2'"),
        ([f"hf://{REPO}", "--token-file", "/nonexistent/token"], "token file /nonexistent/token"),
        ([f"hf://{REPO}@no-such-branch"], "RevisionNotFound"),
        (["hf://tiny-org/absent"], "RepositoryNotFound"),
    ],
)
def test_bad_input_is_refused_with_exit_2(tmp_path, standin, args, message):
    res = hub(args[0], tmp_path / "t", *args[1:], "--endpoint", standin.endpoint, check_rc=2)
    assert message in res.stderr
    assert not (tmp_path / "t").exists()


def test_the_token_comes_from_its_file_and_offline_mode_is_refused(tmp_path, standin):
    standin.token = "hf_secret_token"
    token = tmp_path / "token"
    token.write_text("hf_secret_token\n")
    token.chmod(0o600)
    dest = tmp_path / "target"
    res = hub(
        f"hf://{REPO}", dest, "--token-file", token, "--endpoint", standin.endpoint, "--check", "--json"
    )
    assert json.loads(res.stdout)["to_download"] > 0 and not dest.exists()  # --check moves nothing
    assert hub(f"hf://{REPO}", dest, "--endpoint", standin.endpoint, check_rc=2)  # no token: refused
    standin.requests.clear()
    hub(f"hf://{REPO}", dest, "--token-file", token, "--endpoint", standin.endpoint)
    auth = [{k.lower(): v for k, v in h.items()}.get("authorization") for _, _, h in standin.requests]
    assert auth and set(auth) == {"Bearer hf_secret_token"}
    assert verify(dest).returncode == 0
    offline = subprocess.run(
        [*DFLASH, "hub", "pull", REPO, str(dest), "--endpoint", standin.endpoint],
        env={**env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    assert offline.returncode == 2 and "HF_HUB_OFFLINE is set" in offline.stderr


def test_plan_reads_the_targets_config_from_the_same_hub_source(tmp_path, standin, repo_dir):
    """No copy of the target on the controller: `dflash plan --target-config hf://REPO@REVISION`."""
    args = ["plan", "--gpu", "H200", "--gpu-count", "1", "--json"]
    e = {**env(), "HF_ENDPOINT": standin.endpoint, "HF_HOME": str(tmp_path / "hf")}
    hub_plan = subprocess.run(
        [*DFLASH, *args, "--target-config", f"hf://{REPO}@main"], env=e, capture_output=True, text=True
    )
    assert hub_plan.returncode == 0, hub_plan.stderr
    local = subprocess.run(
        [*DFLASH, *args, "--target-config", str(repo_dir / "config.json")],
        env=e,
        capture_output=True,
        text=True,
    )
    a, b = json.loads(hub_plan.stdout), json.loads(local.stdout)
    paths = {k for k, v in b["target"].items() if str(repo_dir) in str(v)}  # where it was read from
    assert {k: v for k, v in a["target"].items() if k not in paths} == {
        k: v for k, v in b["target"].items() if k not in paths
    }
    assert {k: v for k, v in a.items() if k != "target"} == {k: v for k, v in b.items() if k != "target"}
    missing = subprocess.run(
        [*DFLASH, *args, "--target-config", "hf://tiny-org/absent@main"],
        env=e,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "config.json of hf://tiny-org/absent@main" in missing.stderr
