"""Salvage never says "the node can go" while something is missing (issue #33), against real S3 servers
on 127.0.0.1 (moto for the fast cases, Ceph radosgw for the repair of a corrupted object):

- a file that reaches the run after the push is never certified: verify compares S3 with the collected
  set's manifest, and the notes want collect, push and verify to name the same manifest digest;
- a push refuses to overwrite the objects of another set at the same prefix, and says whether the
  bucket keeps versions;
- a manifest planted in S3 cannot make verify write outside its work folder;
- a second salvage repairs an object the first verify found corrupted;
- collect records symlinks and never follows them (a loop, a link to a file outside the run);
- a full disk during collect is a clear refusal, with nothing half-written left behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import real_tmpfs
from tests.integration.test_salvage import (  # noqa: F401 - finished_run is a fixture
    BASE_ENV,
    DFLASH,
    dflash,
    finished_run,
    keys,
)
from tests.s3servers import client, s3_env
from trainer.store.checkpoint import read_latest

pytestmark = pytest.mark.slow


def _run_copy(finished: Path, where: Path) -> Path:
    shutil.copytree(finished, where, symlinks=True)
    return where


def _s3(endpoint: str) -> list[str]:
    return ["--endpoint-url", endpoint]


def _push(set_dir: Path, url: str, endpoint: str, rc: int = 0) -> subprocess.CompletedProcess:
    return dflash("push", set_dir, "--s3", url, *_s3(endpoint), "--json", "--no-progress", check_rc=rc)


def _verify(set_dir: Path, url: str, endpoint: str, rc: int) -> str:
    args = ["verify", "--s3", url, *_s3(endpoint), "--out", set_dir, "--no-load"]
    return dflash(*args, check_rc=rc).stdout


def _final_notes(set_dir: Path, url: str, endpoint: str) -> None:
    """notes (they say the node may go, but S3 does not hold them yet), the final notes push, notes:
    only now "the node can go"."""
    res = dflash("notes", set_dir, "--json", check_rc=1)
    rep = json.loads(res.stdout)
    assert rep["notes_verdict"] and not rep["node_can_go"], rep
    assert "S3 does not hold these notes yet" in rep["reasons"][-1]
    _push(set_dir, url, endpoint)
    assert "the node can go" in dflash("notes", set_dir, check_rc=0).stdout


def test_a_file_added_after_the_push_is_never_certified(tmp_path, finished_run, moto):  # noqa: F811
    """The review's repro: collect, push, verify, then a file added to the run and collected again
    (one more file), notes, verify. Before: "integrity N of N OK", "the node can go"."""
    run = _run_copy(finished_run, tmp_path / "run")
    set_dir, url = tmp_path / "set", "s3://salvage/late-file"
    dflash("stop", "--run-dir", run, "--out", set_dir, check_rc=0)  # a finished run: not_running
    first = json.loads(dflash("collect", "--run-dir", run, "--out", set_dir, "--json", check_rc=0).stdout)
    pushed = json.loads(_push(set_dir, url, moto.endpoint_url).stdout)
    _verify(set_dir, url, moto.endpoint_url, rc=0)
    _final_notes(set_dir, url, moto.endpoint_url)

    (run / "late.txt").write_text("written after the push\n")
    again = json.loads(dflash("collect", "--run-dir", run, "--out", set_dir, "--json", check_rc=0).stdout)
    assert again["file_count"] == first["file_count"] + 1
    res = dflash("notes", set_dir, check_rc=1)  # the verify report on record is of the old set
    assert "DO NOT shut the node down" in res.stdout and "describe different sets" in res.stdout
    assert pushed["manifest_digest"] == first["manifest_digest"] != again["manifest_digest"]
    out = _verify(set_dir, url, moto.endpoint_url, rc=1)
    head = out.split("\n\n")[0]
    assert "MISMATCH  run/late.txt: in the collected set, not in S3's manifest" in head
    assert "MISSING  run/late.txt" in head and "1 missing" in head
    res = dflash("notes", set_dir, check_rc=1)
    assert "verify FAILED" in res.stdout
    assert "DO NOT shut" in (set_dir / "NOTES.md").read_text()

    _push(set_dir, url, moto.endpoint_url)  # the late file goes up; then everything holds again
    _verify(set_dir, url, moto.endpoint_url, rc=0)
    _final_notes(set_dir, url, moto.endpoint_url)
    assert client(moto.endpoint_url).get_object(Bucket="salvage", Key="late-file/run/late.txt")[
        "Body"
    ].read() == (b"written after the push\n")


def test_a_push_never_overwrites_another_set_and_says_if_the_bucket_keeps_versions(
    tmp_path,
    finished_run,  # noqa: F811
    moto,
):
    """Set B pushed to set A's prefix (a reused host alias). Before: B's train.log replaced A's and A's
    verify and notes said "the node can go"."""
    s3c = client(moto.endpoint_url)
    bucket = f"clash-{uuid.uuid4().hex[:8]}"
    s3c.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/nodes/node-a"
    run_a, run_b = _run_copy(finished_run, tmp_path / "a"), _run_copy(finished_run, tmp_path / "b")
    with open(run_b / "train.log", "a") as fh:
        fh.write("node B's own log line\n")
    set_a, set_b = tmp_path / "set-a", tmp_path / "set-b"
    dflash("collect", "--run-dir", run_a, "--out", set_a, check_rc=0)
    rep = json.loads(_push(set_a, url, moto.endpoint_url).stdout)
    a_log = s3c.get_object(Bucket=bucket, Key="nodes/node-a/run/train.log")["Body"].read()
    before = keys(s3c, bucket, "nodes/node-a/")

    dflash("collect", "--run-dir", run_b, "--out", set_b, check_rc=0)
    res = _push(set_b, url, moto.endpoint_url, rc=2)
    assert "holds objects of another set" in res.stderr and "Nothing was sent" in res.stderr
    assert "Traceback" not in res.stderr
    assert s3c.get_object(Bucket=bucket, Key="nodes/node-a/run/train.log")["Body"].read() == a_log
    assert keys(s3c, bucket, "nodes/node-a/") == before
    _verify(set_a, url, moto.endpoint_url, rc=0)  # A is intact
    assert rep["ok"] and rep["bucket_versioning"] == "off" and rep["set_id"]
    # --check refuses the same way (it would overwrite); B goes to a prefix of its own
    dflash("push", set_b, "--s3", url, *_s3(moto.endpoint_url), "--check", check_rc=2)
    _push(set_b, url + "-b", moto.endpoint_url)
    # A's own second push is no clash and moves nothing
    again = json.loads(_push(set_a, url, moto.endpoint_url).stdout)
    assert again["uploaded"] == 0 and again["skipped"] == again["files"]

    s3c.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    res = dflash("push", set_a, "--s3", url, *_s3(moto.endpoint_url), "--no-progress", check_rc=0)
    assert "bucket versioning: enabled" in res.stdout


def test_a_manifest_planted_in_s3_writes_nothing_outside(tmp_path, moto):
    """Entries `/abs/...` and `../../...` in S3's manifest (one compromised node can plant it: every node
    has the same keys). Before: verify wrote the read-back copies there."""
    s3c = client(moto.endpoint_url)
    tag = uuid.uuid4().hex[:8]
    absolute = tmp_path / "abs" / f"planted-{tag}.json"
    work = tmp_path / "w" / "a" / "b"
    escaped = tmp_path / "w" / f"planted-{tag}.json"
    body = b'{"planted": true}\n'
    sha = hashlib.sha256(body).hexdigest()
    entries = {str(absolute): {"size": len(body), "sha256": sha}}
    entries[f"../../planted-{tag}.json"] = {"size": len(body), "sha256": sha}
    for rel in entries:
        s3c.put_object(Bucket="salvage", Key=f"planted/{rel}", Body=body, Metadata={"sha256": sha})
    manifest = {"manifest_version": 1, "files": entries}
    s3c.put_object(Bucket="salvage", Key="planted/MANIFEST.json", Body=json.dumps(manifest).encode())
    args = ["verify", "--s3", "s3://salvage/planted", *_s3(moto.endpoint_url), "--workdir", work]
    res = dflash(*args, check_rc=2)
    assert "unsafe path" in res.stderr and "Traceback" not in res.stderr
    assert not absolute.exists() and not escaped.exists()
    # a pull refuses it the same way, before writing anything
    res = subprocess.run(
        [*DFLASH, "s3", "pull", "s3://salvage/planted", tmp_path / "pulled", *_s3(moto.endpoint_url)],
        env=s3_env(BASE_ENV),
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2 and "unsafe path" in res.stderr, res.stderr[-2000:]
    assert not absolute.exists() and not (tmp_path / "pulled").exists()
    # a symlink entry with a file under it would write through the link: refused too
    manifest = {
        "manifest_version": 1,
        "files": {"d": {"symlink": str(tmp_path / "abs")}, "d/x.json": {"size": len(body), "sha256": sha}},
    }
    s3c.put_object(Bucket="salvage", Key="planted2/MANIFEST.json", Body=json.dumps(manifest).encode())
    args = ["verify", "--s3", "s3://salvage/planted2", *_s3(moto.endpoint_url), "--workdir", work]
    res = dflash(*args, check_rc=2)
    assert "lies under the symlink entry 'd'" in res.stderr


def test_a_second_salvage_repairs_a_corrupted_object(tmp_path, finished_run, rgw):  # noqa: F811
    """An object corrupted in S3 with its sha256 metadata intact. Before: every later push skipped it
    (the metadata claims the right digest), so verify kept failing however often salvage ran."""
    url = "s3://salvage/repair"
    set_dir = tmp_path / "set"
    dflash("collect", "--run-dir", finished_run, "--out", set_dir, check_rc=0)
    _push(set_dir, url, rgw.endpoint_url)
    s3c = client(rgw.endpoint_url)
    rel = f"run/checkpoints/{read_latest(finished_run).name}/config.json"
    body = s3c.get_object(Bucket="salvage", Key=f"repair/{rel}")["Body"].read()
    meta = s3c.head_object(Bucket="salvage", Key=f"repair/{rel}")["Metadata"]
    s3c.put_object(Bucket="salvage", Key=f"repair/{rel}", Body=body.replace(b"4", b"5", 1), Metadata=meta)
    head = _verify(set_dir, url, rgw.endpoint_url, rc=1).split("\n\n")[0]
    assert f"DIFFERS  {rel}: sha256 read back" in head

    rep = json.loads(_push(set_dir, url, rgw.endpoint_url).stdout)
    _verify(set_dir, url, rgw.endpoint_url, rc=0)
    assert s3c.get_object(Bucket="salvage", Key=f"repair/{rel}")["Body"].read() == body
    assert rep["resent"] == [rel] and rep["uploaded"] == 1, rep
    # once verify has passed, a push is back to skipping everything
    rep = json.loads(_push(set_dir, url, rgw.endpoint_url).stdout)
    assert rep["resent"] == [] and rep["uploaded"] == 0


def test_collect_records_symlinks_and_never_follows_them(tmp_path, finished_run):  # noqa: F811
    """A link loop and links to a file and a folder outside the run. Before: the loop copied the run
    again and again (~40 times), and the outside file travelled into the set (and on to S3)."""
    run = _run_copy(finished_run, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for S3\n")
    (run / "loop").symlink_to(".")
    (run / "sub").mkdir()
    (run / "sub" / "up").symlink_to("..")
    (run / "secret").symlink_to(outside / "secret.txt")
    (run / "elsewhere").symlink_to(outside)
    (run / "checkpoints" / "more").symlink_to(outside)  # beside the checkpoints: recorded too
    set_dir = tmp_path / "set"
    args = ["collect", "--run-dir", run, "--out", set_dir, "--no-data", "--json"]
    rep = json.loads(dflash(*args, timeout=120, check_rc=0).stdout)
    links = {link["path"]: link["target"] for link in rep["links"]}
    assert links == {
        "run/checkpoints/more": str(outside),
        "run/elsewhere": str(outside),
        "run/loop": ".",
        "run/secret": str(outside / "secret.txt"),
        "run/sub/up": "..",
    }
    copied = [p for p in set_dir.rglob("*") if p.is_file()]
    assert not any(b"not for S3" in p.read_bytes() for p in copied)
    assert not (set_dir / "run" / "loop").exists() and not (set_dir / "run" / "secret").exists()
    runs = [p for p in copied if p.name == "events.jsonl"]
    assert runs == [set_dir / "run" / "events.jsonl"], runs  # the run once, not once per loop turn
    manifest = json.loads((set_dir / "MANIFEST.json").read_text())
    assert not any(rel.startswith(("run/loop", "run/secret", "run/elsewhere")) for rel in manifest["files"])
    dflash("notes", set_dir, check_rc=1)  # not pushed: the node cannot go, but the links are named
    notes = (set_dir / "NOTES.md").read_text()
    assert f"symlink `run/secret` -> `{outside / 'secret.txt'}`: recorded, not followed" in notes


def test_a_full_disk_during_collect_is_a_clear_refusal(tmp_path, finished_run):  # noqa: F811
    """A 512 KiB tmpfs as the set's disk (real ENOSPC). Before: a traceback (exit 1, which a supervisor
    restarts) and a `.salvage-tmp` file left in the set."""
    with real_tmpfs(tmp_path / "small", "512k") as mnt:
        res = dflash("collect", "--run-dir", finished_run, "--out", mnt / "set", "--copy", check_rc=2)
        assert "disk is full" in res.stderr and "No space left on device" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr + res.stdout
        assert not [p for p in mnt.rglob("*") if p.name.endswith((".salvage-tmp", ".tmp"))]
        assert not (mnt / "set" / "MANIFEST.json").exists()


def test_salvage_all_to_a_refused_address_after_a_good_salvage_cannot_go(tmp_path, finished_run, rgw):  # noqa: F811
    """The review's repro on radosgw: a good salvage to one prefix, then `salvage all --s3
    s3://nosuchbucket/x`. Before: the push was refused, `all` ran notes anyway, and the earlier
    salvage's push and verify reports (another prefix) made it print "the node can go" and write
    `node_can_go: true`. Also: a last push that is refused (the endpoint down) takes "can go" back."""
    set_dir, url = tmp_path / "set", "s3://salvage/good/node-a"
    common = ["--run-dir", finished_run, "--out", set_dir, "--endpoint-url", rgw.endpoint_url]
    good = dflash("all", *common, "--s3", url, check_rc=0)
    assert "the node can go" in good.stdout
    assert json.loads((set_dir / "salvage-report.json").read_text())["node_can_go"] is True
    rgw.kill_gateway()
    try:
        res = _push(set_dir, url, rgw.endpoint_url, rc=2)  # the endpoint unreachable: refused
        assert "Traceback" not in res.stderr
    finally:
        rgw.start_gateway()
    rep = json.loads(dflash("notes", set_dir, "--json", check_rc=1).stdout)
    assert not rep["node_can_go"] and rep["notes_verdict"] is False, rep
    assert any(r.startswith(f"push to {url} was refused: S3 endpoint unreachable") for r in rep["reasons"]), (
        rep
    )

    res = dflash("all", *common, "--s3", "s3://nosuchbucket/x", check_rc=2)
    assert "the node can go" not in res.stdout and "Traceback" not in res.stderr
    assert "DO NOT shut the node down yet" in res.stdout, res.stdout[-3000:]
    report = json.loads((set_dir / "salvage-report.json").read_text())
    assert report["node_can_go"] is False
    assert any(r.startswith("push to s3://nosuchbucket/x was refused:") for r in report["reasons"]), report
    assert "**Verdict: DO NOT shut the node down yet.**" in (set_dir / "NOTES.md").read_text()
    # nothing ran after the refused push: no verify report in this salvage; the earlier one is kept aside
    state = set_dir / ".salvage"
    assert not (state / "verify.json").exists()
    (kept,) = [p for p in (state / "previous").iterdir() if (p / "verify.json").is_file()]
    old_verify = json.loads((kept / "verify.json").read_text())
    assert old_verify["ok"] and old_verify["where"] == url
    assert json.loads(dflash("notes", set_dir, "--json", check_rc=1).stdout)["node_can_go"] is False


def test_verify_reads_outside_the_sets_prefix_only_where_this_salvages_push_referenced(
    tmp_path,
    finished_run,  # noqa: F811
    moto,
):
    """Whoever can write the bucket deletes an object of the set and points S3's manifest (`locations`)
    at a copy under another prefix. Before: verify read the copy there and certified the set ("the node
    can go" with the object gone from its own prefix). Now only the addresses this salvage's own push
    referenced (its report, `--reference`) are read outside the prefix; any other is an error."""
    url, set_dir = "s3://salvage/hijack", tmp_path / "set"
    dflash("stop", "--run-dir", finished_run, "--out", set_dir, check_rc=0)
    dflash("collect", "--run-dir", finished_run, "--out", set_dir, check_rc=0)
    _push(set_dir, url, moto.endpoint_url)
    _verify(set_dir, url, moto.endpoint_url, rc=0)
    s3c = client(moto.endpoint_url)
    rel = f"run/checkpoints/{read_latest(finished_run).name}/config.json"
    s3c.copy_object(
        Bucket="salvage", Key=f"elsewhere/{rel}", CopySource={"Bucket": "salvage", "Key": f"hijack/{rel}"}
    )
    s3c.delete_object(Bucket="salvage", Key=f"hijack/{rel}")
    manifest = json.loads(s3c.get_object(Bucket="salvage", Key="hijack/MANIFEST.json")["Body"].read())
    manifest["locations"] = {rel: f"s3://salvage/elsewhere/{rel}"}
    s3c.put_object(Bucket="salvage", Key="hijack/MANIFEST.json", Body=json.dumps(manifest).encode())
    head = _verify(set_dir, url, moto.endpoint_url, rc=1).split("\n\n")[0]
    assert rel in head and "outside s3://salvage/hijack" in head, head
    assert "the node can go" not in dflash("notes", set_dir, check_rc=1).stdout
