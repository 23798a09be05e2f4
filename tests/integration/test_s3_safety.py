"""What a manifest in S3 may not make `dflash s3 pull` do, and what a push may not overwrite or abort
(#48), on Ceph radosgw:

- a symlink entry whose target resolves outside the destination (absolute, `..`, through another
  link, through a link already in the folder) is refused with exit 2 naming it, nothing written;
- a pull never writes through a symlink already in the destination (a folder on the way: refused; the
  file's own name: the link is replaced, its target untouched), and a symlink entry meeting a real
  folder is one clear line;
- a `locations` entry outside the set's prefix is refused unless `--allow-location` names it;
- a push asks every key it writes (an object put there after it looked is still found), aborts only
  its own keys' stale multipart uploads (not a concurrent push into a child prefix), and without
  credentials says which files boto3 read.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

from tests.integration.test_s3sync import s3, tree
from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, client

DFLASH = [sys.executable, "-m", "trainer.cli"]


def put_set(s3c, prefix: str, files: dict[str, bytes], links=None, locations=None) -> None:
    """A set as a (possibly hostile) writer of the bucket leaves it: objects and a MANIFEST.json."""
    entries: dict[str, dict] = {}
    for rel, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        s3c.put_object(Bucket="salvage", Key=f"{prefix}/{rel}", Body=data, Metadata={"sha256": sha})
        entries[rel] = {"size": len(data), "sha256": sha}
    entries.update({rel: {"symlink": to} for rel, to in (links or {}).items()})
    manifest = {"manifest_version": 1, "files": entries, "locations": locations or {}}
    s3c.put_object(Bucket="salvage", Key=f"{prefix}/MANIFEST.json", Body=json.dumps(manifest).encode())


def one_clear_line(res: subprocess.CompletedProcess) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("links", "named", "why"),
    [
        ({"evil": "/etc"}, "evil", "is absolute"),
        ({"a/evil": "../../outside"}, "a/evil", "climbs out"),
        # lexically `d/../x` is `x`; the kernel follows d (-> `.`) first, then `..` leaves the folder
        ({"d": ".", "c": "d/../x"}, "c", "climbs out"),
        ({"d": "sub/../..", "c": "d/x"}, "c", "climbs out"),
        ({"a": "b", "b": "a"}, "a", "loop"),
    ],
)
def test_a_symlink_entry_pointing_outside_the_folder_is_refused(tmp_path, rgw, links, named, why):
    s3c = client(rgw.endpoint_url)
    prefix = f"links/{tmp_path.name}"
    put_set(s3c, prefix, {"ok.txt": b"fine\n"}, links)
    dest = tmp_path / "host" / "d"
    res = s3("pull", f"s3://salvage/{prefix}", dest, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    line = one_clear_line(res)
    assert f"symlink entry {named!r}" in line and why in line and "nothing was downloaded" in line
    assert not dest.exists()  # refused before the first byte


def test_links_that_stay_inside_are_planted(tmp_path, rgw):
    """The check is not a blanket refusal of `..`: a link that climbs and comes back down is fine."""
    s3c = client(rgw.endpoint_url)
    links = {"run/latest": "../shards/p.bin", "run/here": ".", "top": "run/here/latest"}
    put_set(s3c, "links/inside", {"shards/p.bin": b"weights"}, links)
    dest = tmp_path / "d"
    rep = json.loads(
        s3("pull", "s3://salvage/links/inside", dest, "--endpoint-url", rgw.endpoint_url, "--json").stdout
    )
    assert rep["ok"] and rep["links_placed"] == 3
    assert (dest / "top").read_bytes() == b"weights" and os.readlink(dest / "run/latest") == "../shards/p.bin"


def test_a_link_already_in_the_folder_is_never_written_through(tmp_path, rgw):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not yours\n")
    src = tree(tmp_path / "src")
    url = "s3://salvage/through/set"
    s3("push", src, url, "--endpoint-url", rgw.endpoint_url, "--no-progress")

    # a folder on the way is a link (an earlier pull's, a user's): refused, nothing lands outside
    dest = tmp_path / "d1"
    dest.mkdir()
    os.symlink(outside, dest / "shards")
    res = s3("pull", url, dest, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    line = one_clear_line(res)
    assert "'shards/part-0.bin'" in line and "is a symlink here" in line and "never writes through" in line
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]

    # a manifest link that would lead through a link the user keeps here to a place outside
    put_set(client(rgw.endpoint_url), "through/via", {"a.txt": b"a"}, {"x": "mine/keep.txt"})
    dest2 = tmp_path / "d2"
    dest2.mkdir()
    os.symlink(outside, dest2 / "mine")
    res = s3("pull", "s3://salvage/through/via", dest2, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    assert "symlink entry 'x'" in one_clear_line(res) and "outside" in res.stderr
    assert not (dest2 / "x").exists() and not (dest2 / "a.txt").exists()

    # the file's own name is a link: replaced by the file (rename never follows), its target untouched
    dest3 = tmp_path / "d3"
    dest3.mkdir()
    os.symlink(outside / "keep.txt", dest3 / "info.json")
    rep = json.loads(s3("pull", url, dest3, "--endpoint-url", rgw.endpoint_url, "--json").stdout)
    assert rep["ok"] and not (dest3 / "info.json").is_symlink()
    assert (dest3 / "info.json").read_text() == '{"rows": 3}\n'
    assert (outside / "keep.txt").read_text() == "not yours\n"


def test_place_never_follows_a_link_planted_after_the_check(tmp_path):
    """The write itself walks the folders with O_NOFOLLOW: a link that appears between the check and
    the rename fails that entry; nothing is written where it points."""
    from trainer.s3.pullsafe import place_file, place_link

    dest, outside = tmp_path / "d", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    os.symlink(outside, dest / "sub")
    part = tmp_path / "part"
    part.write_bytes(b"x")
    with pytest.raises(OSError, match="sub is a symlink or not a folder"):
        place_file(part, dest, "sub/f.bin", None)
    with pytest.raises(OSError, match="sub is a symlink"):
        place_link(dest, "sub/l", "../x")
    assert list(outside.iterdir()) == [] and part.exists()


def test_a_symlink_entry_meeting_a_real_folder_is_one_clear_line(tmp_path, rgw):
    src = tree(tmp_path / "src")  # its `latest` is a symlink
    url = "s3://salvage/meets/folder"
    s3("push", src, url, "--endpoint-url", rgw.endpoint_url, "--no-progress")
    dest = tmp_path / "d"
    (dest / "latest").mkdir(parents=True)
    (dest / "latest" / "notes.txt").write_text("mine\n")
    res = s3("pull", url, dest, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    line = one_clear_line(res)
    assert "symlink entry 'latest'" in line and "is a real folder here" in line
    assert (dest / "latest" / "notes.txt").read_text() == "mine\n"
    assert not (dest / "info.json").exists()  # refused before anything moved


def _referencing_set(tmp_path, rgw) -> tuple[str, str]:
    """A salvage set at B pushed with --reference to an earlier set at A: B's manifest keeps its big
    file at A (`locations`)."""
    from trainer.s3.push import push
    from trainer.store.manifest import MANIFEST_NAME, create_manifest

    big = os.urandom(2**20)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "w.bin").write_bytes(big)
    (b / "new.txt").write_text("only in b\n")
    s3c = client(rgw.endpoint_url)
    ua, ub = "s3://salvage/refs/earlier", "s3://salvage/refs/later"
    for d, u, refs in ((a, ua, []), (b, ub, [ua])):
        create_manifest(d, d / MANIFEST_NAME)
        rep = push(d, u, client=s3c, references=refs, progress=False)
        assert rep["ok"], rep
    assert rep["referenced"] == [{"path": "w.bin", "location": "s3://salvage/refs/earlier/w.bin"}]
    return ua, ub


def test_a_location_outside_the_prefix_is_refused_unless_allowed(tmp_path, rgw):
    ua, ub = _referencing_set(tmp_path, rgw)
    dest = tmp_path / "host" / "d"
    res = s3("pull", ub, dest, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    line = one_clear_line(res)
    assert "'w.bin' -> s3://salvage/refs/earlier/w.bin" in line and "--allow-location" in line
    assert not dest.exists()
    # a prefix that only shares the first letters is not the allowed one
    res = s3("pull", ub, dest, "--endpoint-url", rgw.endpoint_url, "--allow-location", ua[:-2], check_rc=2)
    assert "outside its own prefix" in one_clear_line(res) and not dest.exists()
    rep = json.loads(
        s3("pull", ub, dest, "--endpoint-url", rgw.endpoint_url, "--allow-location", ua, "--json").stdout
    )
    assert rep["ok"] and rep["downloaded"] == 2
    assert (dest / "w.bin").read_bytes() == (tmp_path / "a" / "w.bin").read_bytes()

    # another bucket, with the puller's credentials: refused the same way; one under the own prefix is fine
    s3c = client(rgw.endpoint_url)
    secret = b"payroll\n"
    if "private" not in {b["Name"] for b in s3c.list_buckets()["Buckets"]}:
        s3c.create_bucket(Bucket="private")
    s3c.put_object(Bucket="private", Key="hr/pay.csv", Body=secret)
    sha = hashlib.sha256(secret).hexdigest()
    manifest = {
        "manifest_version": 1,
        "files": {"pay.csv": {"size": len(secret), "sha256": sha}, "own.csv": {"size": 8, "sha256": sha}},
        "locations": {"pay.csv": "s3://private/hr/pay.csv", "own.csv": "s3://salvage/refs/steal/sub/x"},
    }
    s3c.put_object(Bucket="salvage", Key="refs/steal/sub/x", Body=secret)
    s3c.put_object(Bucket="salvage", Key="refs/steal/MANIFEST.json", Body=json.dumps(manifest).encode())
    dest2 = tmp_path / "d2"
    res = s3("pull", "s3://salvage/refs/steal", dest2, "--endpoint-url", rgw.endpoint_url, check_rc=2)
    line = one_clear_line(res)
    assert "'pay.csv' -> s3://private/hr/pay.csv" in line and "own.csv" not in line and not dest2.exists()


def test_push_asks_every_key_it_writes_not_only_the_listed_ones(tmp_path, rgw):
    """Another set's push lands at one of this set's keys after this push looked at the prefix (the
    first HEAD it sends): the push still finds it and refuses; the other set's object stays."""
    from trainer.s3 import S3Error
    from trainer.s3.push import push
    from trainer.store.manifest import MANIFEST_NAME, create_manifest

    ours = tmp_path / "ours"
    ours.mkdir()
    for i in range(6):
        (ours / f"f{i}.bin").write_bytes(os.urandom(1000 + i))
    create_manifest(ours, ours / MANIFEST_NAME)
    theirs = client(rgw.endpoint_url)
    s3c = client(rgw.endpoint_url)
    lock, landed = threading.Lock(), []

    def other_push_lands(**_kw):
        with lock:
            if not landed:
                theirs.put_object(
                    Bucket="salvage", Key="race/set/f3.bin", Body=b"theirs", Metadata={"dflash-set": "other"}
                )
                landed.append(True)

    s3c.meta.events.register("before-call.s3.HeadObject", other_push_lands)
    with pytest.raises(S3Error, match="holds objects of another set") as err:
        push(ours, "s3://salvage/race/set", client=s3c, progress=False)
    assert landed and "f3.bin: set other" in str(err.value)
    got = theirs.get_object(Bucket="salvage", Key="race/set/f3.bin")
    assert got["Body"].read() == b"theirs" and got["Metadata"]["dflash-set"] == "other"


def test_push_aborts_only_its_own_stale_uploads(tmp_path, rgw):
    s3c = client(rgw.endpoint_url)
    src = tmp_path / "parent"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(4096))
    # a push of this set killed mid-way left an upload at its own key ...
    stale = s3c.create_multipart_upload(Bucket="salvage", Key="abort/parent/a.bin")["UploadId"]
    # ... while another node's push into a child prefix is running right now
    child = s3c.create_multipart_upload(Bucket="salvage", Key="abort/parent/node-b/big.bin")["UploadId"]
    part = os.urandom(5 * 2**20)
    etag = s3c.upload_part(
        Bucket="salvage", Key="abort/parent/node-b/big.bin", UploadId=child, PartNumber=1, Body=part
    )["ETag"]
    rep = json.loads(
        s3("push", src, "s3://salvage/abort/parent", "--endpoint-url", rgw.endpoint_url, "--json").stdout
    )
    assert rep["ok"] and rep["aborted_stale_uploads"] == ["abort/parent/a.bin"]
    left = {
        u["UploadId"]
        for u in s3c.list_multipart_uploads(Bucket="salvage", Prefix="abort/").get("Uploads", [])
    }
    assert stale not in left and child in left
    s3c.complete_multipart_upload(  # the other push finishes its file
        Bucket="salvage",
        Key="abort/parent/node-b/big.bin",
        UploadId=child,
        MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]},
    )
    assert s3c.head_object(Bucket="salvage", Key="abort/parent/node-b/big.bin")["ContentLength"] == len(part)


def test_without_credentials_the_message_names_what_boto3_read(tmp_path, rgw):
    creds = tmp_path / "aws" / "credentials"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        HF_HUB_OFFLINE="1",
        AWS_SHARED_CREDENTIALS_FILE=str(creds),
        AWS_CONFIG_FILE=str(tmp_path / "aws" / "config"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    put_set(client(rgw.endpoint_url), "creds/set", {"a.txt": b"a\n"})
    cmd = [*DFLASH, "s3", "pull", "s3://salvage/creds/set", str(tmp_path / "d"), "--endpoint-url"]
    cmd.append(rgw.endpoint_url)

    def run(**extra):
        return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=120)

    res = run()
    assert res.returncode == 2
    line = one_clear_line(res)
    assert f"the credentials file {creds} (AWS_SHARED_CREDENTIALS_FILE; absent)" in line
    assert "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY in the environment (not set)" in line
    assert "off: AWS_EC2_METADATA_DISABLED=true" in line and "under [default]" in line
    # a profile that does not exist: the same clear line (exit 2), not boto3's ProfileNotFound (exit 1)
    creds.parent.mkdir()
    creds.write_text("[default]\n")
    res = run(AWS_PROFILE="nosuch")
    assert res.returncode == 2 and "profile 'nosuch'" in one_clear_line(res)
    assert "its profile does not exist" in res.stderr
    # the file the message names is the one boto3 reads: keys there and the same pull works
    creds.write_text(
        f"[default]\naws_access_key_id = {TEST_ACCESS_KEY}\naws_secret_access_key = {TEST_SECRET_KEY}\n"
    )
    res = run(AWS_DEFAULT_REGION="us-east-1")
    assert res.returncode == 0, res.stderr
    assert TEST_SECRET_KEY not in res.stdout + res.stderr and (tmp_path / "d" / "a.txt").read_text() == "a\n"
