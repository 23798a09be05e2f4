"""`dflash s3 push` / `dflash s3 pull` against a real S3 server (moto's HTTP server on 127.0.0.1; the
killed-pull resume also on Ceph radosgw, as the data_sync role's S3 -> host test): a round trip proven
by sha256, a second pull that moves nothing, a damaged local copy repaired, a pull killed mid-way that
resumes from its partial file, an object replaced in between, and bad input refused before anything is
written."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import real_tmpfs, wait_for
from tests.s3servers import client, s3_env

DFLASH = [sys.executable, "-m", "trainer.cli"]


def s3(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [*DFLASH, "s3", *map(str, args)],
        env=s3_env({**os.environ, "HF_HUB_OFFLINE": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check_rc is not None:
        assert res.returncode == check_rc, (
            f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res


def tree(root: Path) -> Path:
    (root / "shards").mkdir(parents=True)
    for i in range(3):
        (root / "shards" / f"part-{i}.bin").write_bytes(os.urandom(2**20 + i))
    (root / "info.json").write_text('{"rows": 3}\n')
    (root / "empty.txt").write_bytes(b"")
    os.symlink("shards/part-0.bin", root / "latest")
    return root


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and ".s3-partial" not in p.parts
    }


def test_round_trip_is_proven_idempotent_and_repairs(tmp_path, moto):
    src = tree(tmp_path / "tok")
    url = "s3://salvage/data/tok"
    up = json.loads(s3("push", src, url, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert up["ok"] and up["uploaded"] == 5 and Path(up["manifest"]) == tmp_path / "tok.manifest.json"
    assert not (src / "MANIFEST.json").exists()  # the source folder itself is not touched
    again = json.loads(s3("push", src, url, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert again["uploaded"] == 0 and again["skipped"] == 5

    dest = tmp_path / "host" / "data" / "tok"  # parents do not exist yet
    first = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert first["ok"] and first["downloaded"] == 5 and first["present"] == 0 and first["links_placed"] == 1
    assert digests(dest) == digests(src)
    assert os.readlink(dest / "latest") == "shards/part-0.bin"
    assert (dest / "shards" / "part-2.bin").stat().st_mtime_ns == (
        src / "shards" / "part-2.bin"
    ).stat().st_mtime_ns
    assert not (dest / ".s3-partial").exists()
    verify = subprocess.run(
        [*DFLASH, "manifest", "verify", str(dest), str(tmp_path / "host" / "data" / "tok.manifest.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    second = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert (
        second["ok"]
        and second["downloaded"] == 0
        and second["downloaded_bytes"] == 0
        and second["present"] == 5
    )

    # same size, other bytes (a quick size/mtime check would miss it), one file gone, one extra file
    victim = dest / "shards" / "part-1.bin"
    data = bytearray(victim.read_bytes())
    data[100:164] = b"\0" * 64
    victim.write_bytes(bytes(data))
    (dest / "info.json").unlink()
    (dest / "mine.txt").write_text("a note the user keeps here\n")
    check = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json", "--check").stdout)
    assert {p["path"]: p["why"] for p in check["plan"]} == {
        "info.json": "missing",
        "shards/part-1.bin": "differs",
    }
    assert not (dest / "info.json").exists()  # --check moved nothing
    third = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert third["ok"] and third["downloaded"] == 2 and third["extra"] == ["mine.txt"]
    assert (dest / "mine.txt").read_text() == "a note the user keeps here\n"
    assert {k: v for k, v in digests(dest).items() if k != "mine.txt"} == digests(src)


@pytest.mark.parametrize("server", ["moto", "rgw"])
def test_pull_killed_midway_resumes_from_its_partial_file(tmp_path, server, request):
    """On moto and on Ceph radosgw (which really serves the ranged GET the resume asks for)."""
    moto = request.getfixturevalue(server)  # the server under test
    src = tmp_path / "target"
    src.mkdir()
    size = 24 * 2**20
    (src / "model.safetensors").write_bytes(os.urandom(size))
    url = "s3://salvage/data/target"
    s3("push", src, url, "--endpoint-url", moto.endpoint_url, "--no-progress")
    dest = tmp_path / "host" / "target"
    part = dest / ".s3-partial" / "model.safetensors"
    proc = subprocess.Popen(
        [
            *DFLASH,
            "s3",
            "pull",
            url,
            str(dest),
            "--endpoint-url",
            moto.endpoint_url,
            "--bwlimit-kbps",  # 2 MiB/s: the 20 MiB still to come after the kill point take 10 s
            "2048",
            "--no-progress",
        ],
        env=s3_env({**os.environ}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_for(lambda: part.is_file() and part.stat().st_size >= 4 * 2**20, timeout=120), proc.stderr
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    landed = part.stat().st_size
    assert 0 < landed < size and not (dest / "model.safetensors").exists()  # nothing half-written in place
    res = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert res["ok"] and res["resumed_bytes"] == landed
    assert res["downloaded_bytes"] == size - landed  # only the missing bytes travelled
    assert digests(dest) == digests(src)


def test_object_replaced_after_a_kill_is_fetched_again_from_the_start(tmp_path, moto):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 * 2**20))
    url = "s3://salvage/data/ckpt"
    s3("push", src, url, "--endpoint-url", moto.endpoint_url, "--no-progress")
    dest = tmp_path / "host" / "ckpt"
    part = dest / ".s3-partial" / "w.bin"
    part.parent.mkdir(parents=True)
    etag = client(moto.endpoint_url).head_object(Bucket="salvage", Key="data/ckpt/w.bin")["ETag"]
    part.write_bytes((src / "w.bin").read_bytes()[: 2**20])  # what a killed pull leaves
    (part.parent / "w.bin.etag").write_text(etag)
    (src / "w.bin").write_bytes(os.urandom(3 * 2**20))  # a new checkpoint under the same name
    s3("push", src, url, "--endpoint-url", moto.endpoint_url, "--no-progress")
    res = json.loads(s3("pull", url, dest, "--endpoint-url", moto.endpoint_url, "--json").stdout)
    assert res["ok"] and res["resumed_bytes"] == 0 and res["downloaded_bytes"] == 3 * 2**20
    assert digests(dest) == digests(src)


def test_bad_input_is_refused_before_anything_is_written(tmp_path, moto):
    s3c = client(moto.endpoint_url)
    s3c.put_object(Bucket="salvage", Key="loose/a.bin", Body=b"x" * 10)
    dest = tmp_path / "host" / "d"
    res = s3("pull", "s3://salvage/loose", dest, "--endpoint-url", moto.endpoint_url, check_rc=2)
    assert "s3://salvage/loose/MANIFEST.json does not exist" in res.stderr and "dflash s3 push" in res.stderr
    res = s3("pull", "s3://Bad_Bucket/x", dest, "--endpoint-url", moto.endpoint_url, check_rc=2)
    assert "not a valid bucket name" in res.stderr

    src = tree(tmp_path / "set")
    s3("push", src, "s3://salvage/gap", "--endpoint-url", moto.endpoint_url, "--no-progress")
    s3c.delete_object(Bucket="salvage", Key="gap/shards/part-1.bin")
    res = s3("pull", "s3://salvage/gap", dest, "--endpoint-url", moto.endpoint_url, check_rc=2)
    assert "shards/part-1.bin: absent" in res.stderr and "nothing was downloaded" in res.stderr
    assert not dest.exists()


def test_a_destination_without_room_is_refused_before_downloading(tmp_path, moto):
    src = tmp_path / "big"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(6 * 2**20))
    s3("push", src, "s3://salvage/big", "--endpoint-url", moto.endpoint_url, "--no-progress")
    with real_tmpfs(tmp_path / "small", "4m") as small:  # a real 4 MiB filesystem for a 6 MiB set
        res = s3("pull", "s3://salvage/big", small / "d", "--endpoint-url", moto.endpoint_url, check_rc=2)
        assert "to download but only" in res.stderr and "nothing was downloaded" in res.stderr
        assert list(small.iterdir()) == []
