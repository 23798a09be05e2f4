"""`dflash salvage` for real: a real tiny training run (CPU), real processes, real S3 servers on
127.0.0.1 (Ceph radosgw for the end-to-end run and every integrity check the server must enforce;
moto for the fast cases), real speculators loads.

The only stand-ins: there is no GPU here, so `nvidia-smi` is absent (the inventory must say so; one
test puts a fake `nvidia-smi` on PATH to exercise the GPU-process merge), and the "sglang" server is a
sleeping Python module named sglang.launch_server (salvage must report it and leave it alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli_fork import run_dflash
from tests.conftest import wait_for, write_config
from tests.s3servers import (
    TEST_ACCESS_KEY,
    TEST_SECRET_KEY,
    client,
    s3_env,
)
from trainer.store.checkpoint import list_checkpoints, read_latest, verify_checkpoint
from trainer.store.events import load_events

pytestmark = pytest.mark.slow

FAST = {"max_tokens_per_batch": 256, "max_anchors": 32, "lr": 1.0e-3, "warmup_steps": 2}
DFLASH = [sys.executable, "-m", "trainer.cli"]
BASE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
OUTPUTS: list[str] = []  # every stdout/stderr of every salvage command: searched for credentials


def dflash(*args, env=None, timeout=600, check_rc: int | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [*DFLASH, "salvage", *map(str, args)],
        env=env or s3_env(BASE_ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    OUTPUTS.append(res.stdout + res.stderr)
    if check_rc is not None:
        assert res.returncode == check_rc, (
            f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        )
    return res


def events(out: Path, kind: str) -> list[dict]:
    return [e for e in load_events(out / "events.jsonl") if e["event"] == kind]


def keys(c, bucket: str, prefix: str) -> dict[str, int]:
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target, tiny_data) -> Path:
    """A completed real run: 4 steps, checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("finished")
    cfg = write_config(
        root / "run.yaml",
        tiny_target,
        tiny_data,
        root / "run",
        train={**FAST, "max_steps": 4, "checkpoint_every": 2},
    )
    res = run_dflash(["train", "--config", cfg], env=BASE_ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run"


def fake_sglang(tmp_path: Path) -> subprocess.Popen:
    """A long-running process that looks like an SGLang server (`python -m sglang.launch_server`)."""
    pkg = tmp_path / "fakepkgs" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    env = {**BASE_ENV, "PYTHONPATH": str(tmp_path / "fakepkgs")}
    return subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/none", "--port", "30000"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def endless_run(tmp_path: Path, tiny_target: Path, tiny_data: Path) -> tuple[Path, Path]:
    """(out_dir, config) of a run that trains until it is stopped, a checkpoint every 3 steps."""
    out = tmp_path / "run"
    train = {**FAST, "max_steps": 100000, "checkpoint_every": 3}
    return out, write_config(tmp_path / "run.yaml", tiny_target, tiny_data, out, train=train)


def test_salvage_end_to_end_on_radosgw(tmp_path, tiny_target, tiny_data, rgw):
    """Trainer + sglang running -> inventory -> --check changes nothing -> only the trainer stopped with
    a final checkpoint -> collect -> push with the endpoint killed mid-upload -> re-run completes ->
    verify reads everything back -> notes -> a second full run moves 0 bytes -> no credential anywhere."""
    out, cfg = endless_run(tmp_path, tiny_target, tiny_data)
    trainer = subprocess.Popen(
        [*DFLASH, "train", "--config", str(cfg)],
        env=BASE_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sglang = fake_sglang(tmp_path)
    set_dir = tmp_path / "salvage-set"
    url = "s3://salvage/e2e/node-a"
    s3c = client(rgw.endpoint_url)
    big = tmp_path / "extras" / "big-log.bin"
    big.parent.mkdir()
    with open(big, "wb") as fh:  # a large artifact so that the endpoint can die mid-upload
        fh.writelines(os.urandom(8 * 2**20) for _ in range(24))
    common = [
        "--run-dir",
        out,
        "--out",
        set_dir,
        "--s3",
        url,
        "--endpoint-url",
        rgw.endpoint_url,
        "--include",
        big,
    ]
    try:
        assert wait_for(lambda: len(events(out, "checkpoint")) >= 2, 240), "the trainer wrote no checkpoints"

        # 1. inventory: both reported, only the trainer to be stopped; no GPU listing here, and said so
        inv = json.loads(dflash("inventory", "--run-dir", out, "--json", check_rc=0).stdout)
        by_pid = {p["pid"]: p for p in inv["processes"]}
        assert by_pid[trainer.pid]["kind"] == "trainer" and by_pid[trainer.pid]["action"] == "stop"
        assert by_pid[sglang.pid]["kind"] == "server" and by_pid[sglang.pid]["what"] == "sglang"
        assert (
            by_pid[sglang.pid]["action"] == "report"
            and "sglang.launch_server" in by_pid[sglang.pid]["cmdline"]
        )
        assert inv["will_stop"] == [trainer.pid]
        assert inv["gpu_listing"] is False and "nvidia-smi not found" in inv["gpu_note"]

        # 2. --check lists what would be stopped and moved, and changes nothing
        res = dflash("all", *common, "--check", check_rc=0)
        assert f"would stop pid {trainer.pid}" in res.stdout and "big-log.bin" in res.stdout
        assert trainer.poll() is None and sglang.poll() is None
        assert not set_dir.exists() and keys(s3c, "salvage", "e2e/") == {}

        # 3. graceful stop: final checkpoint written and verified; sglang untouched
        res = dflash("stop", "--run-dir", out, "--out", set_dir, "--timeout", 180, "--json", check_rc=0)
        stop = json.loads(res.stdout)
        assert stop["state"] == "stopped" and stop["method"]["how"] == "signal", stop
        assert trainer.wait(timeout=60) == 0
        final = events(out, "checkpoint")[-1]
        assert final["reason"] == "signal" and stop["checkpoint"] == final["name"] == read_latest(out).name
        assert events(out, "run_end")[-1]["status"] == "stopped"
        assert verify_checkpoint(read_latest(out)) == [] and stop["checkpoint_problems"] == []
        assert sglang.poll() is None, "salvage stopped the sglang server it must leave alone"

        # 4. collect
        rep = json.loads(
            dflash(
                "collect", "--run-dir", out, "--out", set_dir, "--include", big, "--json", check_rc=0
            ).stdout
        )
        names = [c["name"] for c in rep["checkpoints"]]
        assert names == [p.name for p in list_checkpoints(out)[-2:]] and final["name"] in names
        assert (set_dir / "extra" / "big-log.bin").stat().st_size == big.stat().st_size
        manifest = json.loads((set_dir / "MANIFEST.json").read_text())
        assert f"run/checkpoints/{final['name']}/model.safetensors" in manifest["files"]
        assert "data/ds/state.json" in manifest["files"] and "node/facts.json" in manifest["files"]

        # 5. the S3 endpoint dies mid-upload (the play's progress lines read --progress-file)
        env = s3_env(BASE_ENV)
        pfile = tmp_path / "salvage-set.push-progress.json"
        push = subprocess.Popen(
            [
                *DFLASH,
                "salvage",
                "push",
                str(set_dir),
                "--s3",
                url,
                "--endpoint-url",
                rgw.endpoint_url,
                "--workers",
                "1",
                "--chunk-mib",
                "5",
                "--json",
                "--no-progress",
                "--progress-file",
                str(pfile),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def big_upload_started() -> bool:
            ups = s3c.list_multipart_uploads(Bucket="salvage", Prefix="e2e/").get("Uploads", [])
            return any(
                s3c.list_parts(Bucket="salvage", Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
                for u in ups
            )

        assert wait_for(big_upload_started, 120, 0.02), "the multipart upload never started"
        # freeze the uploader where it was seen mid-upload, so that the endpoint dies while the upload is
        # open however slow this machine is, then let it run on into the dead endpoint
        os.kill(push.pid, signal.SIGSTOP)
        try:
            assert s3c.list_multipart_uploads(Bucket="salvage", Prefix="e2e/").get("Uploads"), "already done"
            rgw.kill_gateway()
        finally:
            os.kill(push.pid, signal.SIGCONT)
        stdout, stderr = push.communicate(timeout=300)
        OUTPUTS.append(stdout + stderr)
        assert push.returncode == 1, stdout[-2000:] + stderr[-2000:]
        first = json.loads(stdout)
        assert not first["ok"] and any(f["path"] == "extra/big-log.bin" for f in first["failed"])
        # the progress file: bytes sent of the bytes to send, ended failed with the first error, one line
        state = json.loads(pfile.read_text())
        assert state["state"] == "failed" and state["total_bytes"] == first["to_upload_bytes"], state
        assert (
            0 < state["done_bytes"] < state["total_bytes"] and state["error"] == first["failed"][0]["error"]
        )
        assert state["line"].startswith(f"push to {url}: ") and "\n" not in state["line"], state["line"]
        rgw.start_gateway()
        assert "e2e/node-a/MANIFEST.json" not in keys(s3c, "salvage", "e2e/"), (
            "a manifest for an incomplete set"
        )

        # 6. the re-run completes, aborting the upload the dead endpoint left behind
        second = json.loads(
            dflash(
                "push",
                set_dir,
                "--s3",
                url,
                "--endpoint-url",
                rgw.endpoint_url,
                "--json",
                "--no-progress",
                "--progress-file",
                pfile,
                check_rc=0,
            ).stdout
        )
        assert "e2e/node-a/extra/big-log.bin" in second["aborted_stale_uploads"]
        state = json.loads(pfile.read_text())
        assert state["state"] == "done" and state["done_bytes"] == state["total_bytes"], state
        assert state["total_bytes"] == second["to_upload_bytes"] > 0 and ", done, " in state["line"]
        assert second["skipped"] >= 1, "objects finished before the kill were sent again"
        assert s3c.list_multipart_uploads(Bucket="salvage", Prefix="e2e/").get("Uploads", []) == []
        head = s3c.head_object(Bucket="salvage", Key="e2e/node-a/extra/big-log.bin")
        assert head["Metadata"]["sha256"] == manifest["files"]["extra/big-log.bin"]["sha256"]

        # 7. verify: every entry read back; checkpoints load and run a forward; the dataset passes the gate
        res = dflash("verify", "--s3", url, "--endpoint-url", rgw.endpoint_url, "--out", set_dir, check_rc=0)
        assert res.stdout.startswith(f"salvage verify {url}: OK")
        ver = json.loads((set_dir / ".salvage" / "verify.json").read_text())
        assert (
            ver["checked"] == ver["entries"] == len([e for e in manifest["files"].values() if "sha256" in e])
        )
        assert all(c["ok"] and "one CPU forward" in c["how"] for c in ver["load"]["checkpoints"].values())
        assert ver["load"]["datasets"]["data/ds"]["verdict"] == "PASSED"
        assert any(r["prefix"] == "run/checkpoints/" for r in ver["inventory"])

        # 8. notes; they say the node may go, but it can go only once the final push put them in S3
        res = dflash("notes", set_dir, check_rc=1)
        assert "S3 does not hold these notes yet" in res.stdout and "the node can go" not in res.stdout
        notes = (set_dir / "NOTES.md").read_text()
        assert "**Verdict: the node can go.**" in notes
        assert f"| {sglang.pid} | server |" in notes and "left running" in notes
        assert f"stopped at step {stop['end']['step']} with final checkpoint {final['name']}" in notes
        assert "data gate **PASSED**" in notes and url in notes
        assert (
            "## The run, from its event stream" in notes and f"progress step {stop['end']['step']}/" in notes
        )
        report = json.loads((set_dir / "salvage-report.json").read_text())
        assert report["node_can_go"] is True and report["stop"]["state"] == "stopped"
        dflash("push", set_dir, "--s3", url, "--endpoint-url", rgw.endpoint_url, "--no-progress", check_rc=0)
        assert "e2e/node-a/NOTES.md" in keys(s3c, "salvage", "e2e/")
        assert "the node can go" in dflash("notes", set_dir, check_rc=0).stdout
        assert (set_dir / "NOTES.md").read_text() == notes

        # 9. a second full run: nothing moves, everything is verified again, the notes are unchanged
        res = dflash("all", *common, check_rc=0)
        assert res.stdout.count("uploaded 0 object(s) + 0 record(s) (NOTES.md, report), 0 bytes") == 2, (
            res.stdout
        )
        assert f"salvage verify {url}: OK" in res.stdout and "not_running" in res.stdout
        assert (set_dir / "NOTES.md").read_text() == notes
        assert sglang.poll() is None

        # 10. no credential string in any output, log, manifest, note or uploaded object
        texts = {"outputs": "\n".join(OUTPUTS)}
        for p in [*set_dir.rglob("*"), *out.rglob("*")]:
            if p.is_file():
                texts[str(p)] = p.read_bytes().decode("latin-1")
        for key in keys(s3c, "salvage", "e2e/"):
            texts[f"s3:{key}"] = s3c.get_object(Bucket="salvage", Key=key)["Body"].read().decode("latin-1")
        leaked = [
            where for where, text in texts.items() if TEST_SECRET_KEY in text or TEST_ACCESS_KEY in text
        ]
        assert leaked == [], f"credentials found in {leaked}"
        assert len(texts) > 40
    finally:
        for p in (trainer, sglang):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_salvage_stop_stops_a_two_rank_torchrun_job_through_its_launcher(tmp_path, tiny_target, tiny_data):
    """`dflash salvage stop` on a 2-rank torchrun trainer signals the launcher (torchrun forwards SIGTERM
    to every rank), the ranks agree on the step to stop at, rank 0 writes the final checkpoint from
    ranks in sync, and the launcher exits by itself without killing a rank (SIGTERM under torchrun)."""
    out, cfg = endless_run(tmp_path, tiny_target, tiny_data)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "trainer.cli", "train", "--config", str(cfg)],
        env=BASE_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: len(events(out, "checkpoint")) >= 1, 240), (
            "the torchrun job wrote no checkpoint"
        )
        rep = json.loads(dflash("stop", "--run-dir", out, "--timeout", "120", "--json", check_rc=0).stdout)
        assert rep["method"]["how"] == "torchrun" and rep["signalled_pid"] == launcher.pid, rep
        assert rep["state"] == "stopped" and rep["ok"], rep
        # torchrun forwards SIGTERM, waits for its ranks, then re-raises the signal as its own exit 1
        # (a stopped service is not restarted whatever its exit code); it never had to SIGKILL a rank
        assert launcher.wait(timeout=120) == 1
        err = launcher.stderr.read()
        assert "Received 15 death signal" in err and "SIGKILL" not in err, err[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    final = events(out, "checkpoint")[-1]
    (end,) = events(out, "run_end")
    assert final["reason"] == "signal" and final["ranks_in_sync"] and final["step"] == end["step"]
    assert end["status"] == "stopped" and rep["checkpoint"] == final["name"]
    assert read_latest(out).name == final["name"] and verify_checkpoint(read_latest(out)) == []
    assert events(out, "run_start")[-1]["layout"]["world_size"] == 2


def _collect_and_push(run: Path, set_dir: Path, url: str, endpoint: str, *extra) -> dict:
    dflash("collect", "--run-dir", run, "--out", set_dir, *extra, check_rc=0)
    return json.loads(
        dflash(
            "push", set_dir, "--s3", url, "--endpoint-url", endpoint, "--json", "--no-progress", check_rc=0
        ).stdout
    )


def test_collect_keeps_the_best_checkpoint_by_eval_tau_and_leaves_data_out_on_request(tmp_path, finished_run):
    """--keep 1 takes the newest checkpoint plus the one the run's eval events rate best (an older one
    here); --no-data lists the dataset as not moved, with its size and why, and copies none of it."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    (ck2, ck4) = [p.name for p in list_checkpoints(run)]
    with open(run / "events.jsonl", "a") as fh:  # two evals, as `dflash eval` records them in the run
        for name, tau in ((ck2, 2.5), (ck4, 1.25)):
            fh.write(
                json.dumps({"event": "eval", "time": 1.0, "run_id": "r", "checkpoint": name, "tau": tau})
                + "\n"
            )
    rep = json.loads(
        dflash(
            "collect", "--run-dir", run, "--out", tmp_path / "set", "--keep", "1", "--no-data", "--json"
        ).stdout
    )
    why = {c["name"]: c["why"] for c in rep["checkpoints"]}
    assert why == {ck4: "one of the newest 1", ck2: "best by eval tau"}
    assert (tmp_path / "set" / "run" / "checkpoints" / ck2 / "model.safetensors").is_file()
    (data,) = [n for n in rep["not_moved"] if n["why"] == "excluded with --no-data"]
    assert data["bytes"] > 0 and Path(data["path"]).name == "ds"
    assert not (tmp_path / "set" / "data").exists() and "data" not in rep["by_kind"]
    # without an eval event, --keep 1 is the newest only
    plain = tmp_path / "plain"
    shutil.copytree(finished_run, plain, symlinks=True)
    rep = json.loads(
        dflash("collect", "--run-dir", plain, "--out", tmp_path / "set2", "--keep", "1", "--json").stdout
    )
    assert [c["name"] for c in rep["checkpoints"]] == [ck4] and rep["by_kind"]["data"]["files"] > 0


def test_verify_names_every_damaged_or_missing_object(tmp_path, finished_run, rgw):
    url = "s3://salvage/damaged"
    _collect_and_push(finished_run, tmp_path / "set", url, rgw.endpoint_url)
    s3c = client(rgw.endpoint_url)
    ck = read_latest(finished_run).name
    bad_key = f"damaged/run/checkpoints/{ck}/config.json"
    body = s3c.get_object(Bucket="salvage", Key=bad_key)["Body"].read()
    meta = s3c.head_object(Bucket="salvage", Key=bad_key)["Metadata"]
    # same size, same sha256 claim in the metadata: only reading the bytes back can tell
    s3c.put_object(
        Bucket="salvage",
        Key=bad_key,
        Body=body.replace(b'"block_size": 4', b'"block_size": 5'),
        Metadata=meta,
    )
    s3c.delete_object(Bucket="salvage", Key="damaged/run/train.log")
    res = dflash(
        "verify", "--s3", url, "--endpoint-url", rgw.endpoint_url, "--no-load-checkpoints", check_rc=1
    )
    head = res.stdout.split("\n\n")[0]
    assert head.startswith(f"salvage verify {url}: FAILED")
    assert f"DIFFERS  run/checkpoints/{ck}/config.json: sha256 read back" in head
    assert "MISSING  run/train.log" in head
    assert "1 missing, 1 differing" in head


def test_file_corrupted_after_the_manifest(tmp_path, finished_run):
    set_dir = tmp_path / "set"
    dflash("collect", "--run-dir", finished_run, "--out", set_dir, "--copy", check_rc=0)
    victim = set_dir / "run" / "events.jsonl"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x01
    victim.write_bytes(bytes(data))  # same size: only the digest tells
    res = dflash("verify", set_dir, "--no-load-checkpoints", check_rc=1)
    assert res.stdout.startswith(f"salvage verify {set_dir}: FAILED")
    assert "DIFFERS  run/events.jsonl: sha256" in res.stdout
    os.utime(set_dir / "run" / "train.log", ns=(10**18, 10**18))  # touched, same bytes: not a change
    res = dflash(
        "push", set_dir, "--s3", "s3://salvage/never", "--endpoint-url", "http://127.0.0.1:9", check_rc=2
    )
    assert (
        "1 file(s)" in res.stderr and "run/events.jsonl: modified after the manifest was made" in res.stderr
    )


def test_truncated_safetensors_fails_loadability_and_is_named(tmp_path, finished_run, moto):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    st = read_latest(run) / "model.safetensors"
    with open(st, "r+b") as fh:
        fh.truncate(st.stat().st_size // 2)  # an interrupted copy on the node, before salvage
    url = "s3://salvage/truncated"
    _collect_and_push(run, tmp_path / "set", url, moto.endpoint_url)
    res = dflash("verify", "--s3", url, "--endpoint-url", moto.endpoint_url, check_rc=1)
    head = res.stdout.split("\n\n")[0]
    rel = f"run/checkpoints/{st.parent.name}/model.safetensors"
    assert "0 missing, 0 differing" in head  # the bytes arrived as they were: the file itself is broken
    assert f"UNLOADABLE  {rel}: does not parse:" in head and "truncated safetensors file" in head
    assert f"UNLOADABLE  run/checkpoints/{st.parent.name}/: checkpoint fails" in head
    assert "1/2 checkpoints load + forward" in head


def test_empty_responses_dataset_verdict_in_the_notes(tmp_path, tiny_target, moto):
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(40):  # 35 of 40 samples: a prompt and a 6-token "response" (the seed's empty answers)
        n_resp = 6 if i < 35 else 40
        ids = rng.integers(3, 500, size=20 + n_resp).tolist()
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * 20 + [1] * n_resp)
    ds_path = tmp_path / "empty-responses"
    datasets.Dataset.from_dict(rows).save_to_disk(str(ds_path))
    # the manifest the data_sync role leaves beside synced data travels with the set
    subprocess.run(
        [*DFLASH, "manifest", "create", str(ds_path), "-o", f"{ds_path}.manifest.json"],
        check=True,
        capture_output=True,
        env=BASE_ENV,
    )
    cfg = write_config(tmp_path / "run.yaml", tiny_target, ds_path, tmp_path / "run", train=FAST)
    res = subprocess.run(
        [*DFLASH, "train", "--config", str(cfg)],
        env=BASE_ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 2 and "data.short_responses" in res.stdout  # preflight refused the run
    set_dir = tmp_path / "set"
    url = "s3://salvage/refused-run"
    res = dflash(
        "all",
        "--run-dir",
        tmp_path / "run",
        "--out",
        set_dir,
        "--config",
        cfg,
        "--s3",
        url,
        "--endpoint-url",
        moto.endpoint_url,
        check_rc=1,
    )
    assert "dataset fails the data gate: [data.short_responses]" in res.stdout
    notes = (set_dir / "NOTES.md").read_text()
    assert "**Verdict: DO NOT shut the node down yet.**" in notes
    assert "`data/empty-responses`: data gate **REFUSED**: 40 samples" in notes
    assert "[data.short_responses] 35 of 40 samples (87.5%)" in notes
    assert "the most common count is 6" in notes
    report = json.loads((set_dir / "salvage-report.json").read_text())
    assert report["node_can_go"] is False
    assert (
        "data/empty-responses.manifest.json" in json.loads((set_dir / "MANIFEST.json").read_text())["files"]
    )
    codes = [e["code"] for e in report["verify"]["load"]["datasets"]["data/empty-responses"]["errors"]]
    assert "data.short_responses" in codes
    # the verdict can be downgraded to a warning explicitly, and then the rest verifies
    res = dflash(
        "verify", "--s3", url, "--endpoint-url", moto.endpoint_url, "--data-gate", "warn", check_rc=0
    )
    assert "the data gate REFUSED it (kept as a warning, --data-gate warn)" in res.stdout


def test_content_md5_on_every_part_and_radosgw_rejects_a_bad_one(tmp_path, rgw, monkeypatch):
    from trainer.s3.client import make_client
    from trainer.s3.push import push
    from trainer.salvage.collect import collect

    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    (run / "weights.bin").write_bytes(os.urandom(12 * 2**20))  # 3 parts of 5 MiB
    set_dir = tmp_path / "set"
    collect(run, set_dir, check=False)
    for k, v in s3_env({}).items():  # in-process client: the standard variables
        monkeypatch.setenv(k, v)
    if True:
        c = make_client(rgw.endpoint_url)
        seen: list[tuple[str, str | None]] = []
        for op in ("UploadPart", "PutObject"):
            c.meta.events.register(
                f"before-send.s3.{op}",
                lambda request, op=op, **kw: seen.append((op, request.headers.get("Content-MD5"))),
            )
        rep = push(
            set_dir,
            "s3://salvage/md5",
            rgw.endpoint_url,
            chunk_bytes=5 * 2**20,
            threshold_bytes=5 * 2**20,
            progress=False,
            client=c,
        )
        assert rep["ok"]
        parts = [md5 for op, md5 in seen if op == "UploadPart"]
        assert len(parts) == 3 and all(parts), seen
        assert all(md5 for op, md5 in seen if op == "PutObject")

        bad = make_client(rgw.endpoint_url)

        def corrupt(params, **kw):  # runs after ours: a part "damaged in flight"
            params["headers"]["Content-MD5"] = "AAAAAAAAAAAAAAAAAAAAAA=="

        bad.meta.events.register("before-call.s3.UploadPart", corrupt)
        rep = push(
            set_dir,
            "s3://salvage/md5-bad",
            rgw.endpoint_url,
            chunk_bytes=5 * 2**20,
            threshold_bytes=5 * 2**20,
            progress=False,
            client=bad,
        )
    assert not rep["ok"] and "BadDigest" in rep["failed"][0]["error"]
    s3c = client(rgw.endpoint_url)
    assert "md5-bad/MANIFEST.json" not in keys(s3c, "salvage", "md5-bad/")
    assert s3c.list_multipart_uploads(Bucket="salvage", Prefix="md5-bad/").get("Uploads", []) == []


def test_reference_instead_of_sending_again(tmp_path, finished_run, moto):
    first = _collect_and_push(finished_run, tmp_path / "a", "s3://salvage/ref-a", moto.endpoint_url)
    assert first["ok"]
    dflash("collect", "--run-dir", finished_run, "--out", tmp_path / "b", check_rc=0)
    rep = json.loads(
        dflash(
            "push",
            tmp_path / "b",
            "--s3",
            "s3://salvage/ref-b",
            "--endpoint-url",
            moto.endpoint_url,
            "--reference",
            "s3://salvage/ref-a",
            "--json",
            "--no-progress",
            check_rc=0,
        ).stdout
    )
    referenced = {r["path"] for r in rep["referenced"]}
    assert {"data/ds/state.json", "data/ds/dataset_info.json"} <= referenced
    assert all(r["location"].startswith("s3://salvage/ref-a/") for r in rep["referenced"])
    assert rep["to_upload"] == rep["files"] - len(referenced)
    s3c = client(moto.endpoint_url)
    assert not any(k.startswith("ref-b/data/") for k in keys(s3c, "salvage", "ref-b/"))
    res = dflash(
        "verify",
        "--s3",
        "s3://salvage/ref-b",
        "--endpoint-url",
        moto.endpoint_url,
        "--no-load-checkpoints",
        "--allow-location",  # no --out SET: the push's report is not there to say what it referenced
        "s3://salvage/ref-a",
        check_rc=0,
    )
    assert "1/1 datasets pass the data gate" in res.stdout
    # with --out the set's own push report names the references: nothing to allow by hand
    ref_b = ["--s3", "s3://salvage/ref-b", "--endpoint-url", moto.endpoint_url]
    dflash("verify", *ref_b, "--out", tmp_path / "b", "--no-load-checkpoints", check_rc=0)


def test_bad_input_is_refused_before_any_work(tmp_path, finished_run):
    res = dflash("push", tmp_path, "--s3", "https://bucket/prefix", check_rc=2)
    assert "expected s3://BUCKET/PREFIX" in res.stderr
    res = dflash("collect", "--run-dir", tmp_path / "nope", "--out", tmp_path / "set", check_rc=2)
    assert "run folder" in res.stderr and "does not exist" in res.stderr and not (tmp_path / "set").exists()
    dflash("collect", "--run-dir", finished_run, "--out", tmp_path / "set", check_rc=0)
    no_creds = {k: v for k, v in BASE_ENV.items() if not k.startswith("AWS_")}
    no_creds.update(
        AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null", AWS_EC2_METADATA_DISABLED="true"
    )
    res = dflash(
        "push",
        tmp_path / "set",
        "--s3",
        "s3://salvage/x",
        "--endpoint-url",
        "http://127.0.0.1:9",
        env=no_creds,
        check_rc=2,
    )
    assert "no AWS credentials found" in res.stderr
    res = dflash("stop", "--run-dir", tmp_path, check_rc=2)
    assert "not a dflash run folder" in res.stderr


def test_stop_timeout_is_loud_and_a_dead_run_is_said(tmp_path):
    """A process that ignores SIGTERM stands in for a trainer stuck in a hung collective (its pid and
    start ticks in run_start, as the trainer writes them)."""
    from trainer.salvage.proc import identity
    from trainer.store.events import EventWriter

    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\nwhile True: time.sleep(1)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stuck.stdout.readline().strip() == "ready"
        run = tmp_path / "stuck"
        EventWriter(run, "r1").emit("run_start", schema_version=1, config={}, **identity(stuck.pid))
        res = dflash("stop", "--run-dir", run, "--timeout", 2, check_rc=3)
        assert "TIMEOUT" in res.stderr and "STILL RUNNING" in res.stderr and f"pid {stuck.pid}" in res.stderr
        assert stuck.poll() is None
    finally:
        stuck.kill()
        stuck.wait()
    dead = tmp_path / "dead"
    EventWriter(dead, "r2").emit("run_start", schema_version=1, config={}, pid=stuck.pid)
    res = dflash("stop", "--run-dir", dead, "--json", check_rc=1)
    assert json.loads(res.stdout)["state"] == "dead"


def test_stop_never_signals_an_unrelated_process_behind_a_stale_pid(tmp_path):
    """A trainer killed -9 leaves a run_start naming its pid; the pid is later taken by an unrelated
    long-lived process. Before: `salvage stop` saw a live pid older than the event and SIGTERMed it."""
    from trainer.salvage.proc import identity
    from trainer.store.events import EventWriter

    unrelated = subprocess.Popen(["sleep", "300"])  # stands in for the process that reused the pid
    try:
        assert wait_for(lambda: identity(unrelated.pid)["pid_start"] is not None, 10)
        ident = identity(unrelated.pid)
        stale = tmp_path / "stale"  # the dead trainer's start ticks: not the ones /proc shows now
        EventWriter(stale, "r1").emit("run_start", schema_version=1, config={},
                                      **{**ident, "pid_start": ident["pid_start"] - 50})  # fmt: skip
        legacy = tmp_path / "legacy"  # an older trainer's run_start: a pid, no start ticks
        EventWriter(legacy, "r2").emit("run_start", schema_version=1, config={}, pid=unrelated.pid)
        for run in (stale, legacy):
            res = dflash("stop", "--run-dir", run, "--timeout", 5, "--json", check_rc=1)
            rep = json.loads(res.stdout)
            assert rep["state"] == "not_ours" and not rep["ok"], rep
            assert f"pid {unrelated.pid} is NOT its trainer" in rep["message"]
            assert "Nothing was signalled" in rep["message"] and "signalled_pid" not in rep
            time.sleep(0.5)
            assert unrelated.poll() is None, f"salvage stop signalled an unrelated process ({run.name})"
        assert (
            "its pid was reused"
            in json.loads(dflash("stop", "--run-dir", stale, "--json", check_rc=1).stdout)["message"]
        )
    finally:
        unrelated.kill()
        unrelated.wait()


def test_one_unparseable_events_line_is_skipped_by_verify_and_named(tmp_path, finished_run):
    """A torn or garbled line in events.jsonl (every reader of the stream skips it). Before: verify
    failed for good ("does not parse: line N"), so no salvage of that run could ever pass."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    with open(run / "events.jsonl", "a") as fh:
        fh.write('{"event": "step", "step": 5, garbled\n')
    set_dir = tmp_path / "set"
    dflash("collect", "--run-dir", run, "--out", set_dir, "--no-data", check_rc=0)
    res = dflash("verify", set_dir, "--no-load-checkpoints", check_rc=0)
    n = len((run / "events.jsonl").read_text().splitlines())
    assert f"warning  run/events.jsonl: 1 line(s) that are not JSON skipped (line {n})" in res.stdout


def test_stop_ends_the_runs_own_vllm_server_left_behind_by_a_crashed_trainer(tmp_path):
    """A target.source vllm run records the server it started (run_start layout.source_server_pid). Its
    trainer killed -9 leaves that server running, holding the target's GPUs: salvage stop stops it (no
    --stop-unknown needed), while another vLLM server on the node is only reported."""
    from trainer.store.events import EventWriter

    script = tmp_path / "vllm_serve_standin.py"  # a python program whose name says vllm, as a server's does
    script.write_text("import time\nprint('ready', flush=True)\nwhile True: time.sleep(1)\n")

    def orphan(name: str) -> psutil.Process:
        """The stand-in started by a shell that exits at once: reparented as a crashed trainer's server is."""
        log = tmp_path / f"{name}.log"
        pid = subprocess.run(["sh", "-c", f"{sys.executable} {script} >{log} 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert wait_for(lambda: log.exists() and "ready" in log.read_text(), 30), f"{name} stand-in not up"
        return psutil.Process(int(pid))

    servers = [orphan("ours"), orphan("other")]
    ours, other = servers
    try:
        crashed = subprocess.Popen([sys.executable, "-c", "pass"])
        crashed.wait()
        run = tmp_path / "run"
        EventWriter(run, "r1").emit("run_start", schema_version=1, config={}, pid=crashed.pid,
                                    layout={"source": "vllm", "source_server_pid": ours.pid})  # fmt: skip
        check = json.loads(dflash("stop", "--run-dir", run, "--check", "--json", check_rc=1).stdout)
        assert check["others_planned"] == [{"pid": ours.pid, "what": "vllm"}] and "others" not in check
        assert ours.is_running(), "--check stops nothing"
        res = dflash("stop", "--run-dir", run, "--json", check_rc=1)
        rep = json.loads(res.stdout)
        assert rep["state"] == "dead"
        assert rep["others"] == [{"pid": ours.pid, "what": "vllm", "result": "exited after SIGTERM"}]
        assert not ours.is_running()
        assert other.is_running(), "a server that is not the run's is left running"
        inv = json.loads(dflash("inventory", "--run-dir", run, "--json", check_rc=0).stdout)
        row = next(p for p in inv["processes"] if p["pid"] == other.pid)
        assert (row["kind"], row["action"]) == ("server", "report")
    finally:
        for s in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                s.kill()


def test_inventory_sessions_unknown_work_and_gpu_processes(tmp_path, monkeypatch):
    """tmux is real; nvidia-smi is faked on PATH because this machine has no GPU (the inventory's GPU
    merge is what is tested: pid -> GPU memory, a GPU process that is neither known nor python)."""
    from trainer.salvage.inventory import take_inventory

    sock = f"dflash-salvage-{os.getpid()}"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "sleep 300"], check=True)
    worker = subprocess.Popen(["sleep", "300"])
    try:
        fake = tmp_path / "bin" / "nvidia-smi"
        fake.parent.mkdir()
        fake.write_text(
            f"#!/bin/sh\necho '{worker.pid}, sleep, 20480, GPU-aaaa'\necho '4194000, python3, 512, "
            "GPU-bbbb'\n"
        )
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
        inv = take_inventory([], stop_unknown=False)
        by_pid = {p["pid"]: p for p in inv["processes"]}
        assert inv["gpu_listing"] and "2 GPU compute process(es)" in inv["gpu_note"]
        assert by_pid[worker.pid]["kind"] == "unknown" and by_pid[worker.pid]["gpu_memory_mib"] == 20480
        assert by_pid[worker.pid]["action"] == "report"
        assert "not visible" in by_pid[4194000]["why"]
        assert any(p["kind"] == "session" and p["what"] == "tmux" for p in inv["processes"])
        inv = take_inventory([], stop_unknown=True)
        assert {p["pid"]: p for p in inv["processes"]}[worker.pid]["action"] == "stop"
        from trainer.salvage.stop import stop_others

        # only our worker: stop_unknown on a shared test machine would also hit other people's work
        done = stop_others(
            {"processes": [p for p in inv["processes"] if p["pid"] == worker.pid]}, timeout_s=10
        )
        assert any(d["pid"] == worker.pid and d["result"] == "exited after SIGTERM" for d in done)
        worker.wait(timeout=10)  # psutil reaped it already; it is gone either way
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], check=False)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
