"""`dflash manifest create/verify` (trainer/store/manifest.py): real files, real hashing, the CLI's exit
codes."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from trainer.store.manifest import ManifestError, create_manifest, load_manifest, verify_manifest


def _tree(root):
    (root / "data" / "shard").mkdir(parents=True)
    (root / "data" / "shard" / "a.bin").write_bytes(os.urandom(300_000))
    (root / "data" / "b.txt").write_text("hello\n")
    (root / "config.json").write_text('{"x": 1}')
    (root / "latest").symlink_to("config.json")
    return root


def dflash(*args):
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *map(str, args)], capture_output=True, text=True, check=False
    )


def test_create_records_size_and_sha256_of_every_file(tmp_path):
    src = _tree(tmp_path / "src")
    m = create_manifest(src, tmp_path / "m.json")
    assert sorted(m["files"]) == ["config.json", "data/b.txt", "data/shard/a.bin", "latest"]
    a = m["files"]["data/shard/a.bin"]
    assert a["size"] == 300_000
    assert a["sha256"] == hashlib.sha256((src / "data/shard/a.bin").read_bytes()).hexdigest()
    assert m["files"]["latest"] == {"symlink": "config.json"}
    assert m["file_count"] == 3 and m["total_bytes"] == 300_000 + 6 + 8
    assert load_manifest(tmp_path / "m.json")["files"] == m["files"]


def test_verify_names_every_missing_and_differing_file(tmp_path):
    src = _tree(tmp_path / "src")
    man = create_manifest(src)
    (src / "data" / "b.txt").unlink()
    (src / "config.json").write_text('{"x": 2}')  # same size, other bytes
    with open(src / "data" / "shard" / "a.bin", "ab") as fh:
        fh.write(b"x")
    (src / "new.bin").write_bytes(b"n")
    res = verify_manifest(src, man)
    assert not res.ok
    assert res.missing == ["data/b.txt"]
    assert [d["path"] for d in res.differing] == ["config.json", "data/shard/a.bin"]
    assert "sha256" in res.differing[0]["why"] and "size 300001" in res.differing[1]["why"]
    assert res.extra == ["new.bin"]


def test_extra_files_fail_only_with_strict(tmp_path):
    src = _tree(tmp_path / "src")
    man = create_manifest(src)
    (src / "more.txt").write_text("m")
    assert verify_manifest(src, man).ok
    assert not verify_manifest(src, man, strict=True).ok


def test_cli_exit_codes_and_messages(tmp_path):
    src = _tree(tmp_path / "src")
    out = tmp_path / "m.json"
    r = dflash("manifest", "create", src, "-o", out, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] is True
    r = dflash("manifest", "verify", src, out)
    assert r.returncode == 0 and "OK" in r.stdout
    (src / "data" / "b.txt").unlink()
    (src / "config.json").write_text('{"y": 0}')
    r = dflash("manifest", "verify", src, out, "--json")
    assert r.returncode == 1
    res = json.loads(r.stdout)
    assert res["missing"] == ["data/b.txt"] and res["differing"][0]["path"] == "config.json"
    r = dflash("manifest", "verify", src, out)
    assert "MISSING   data/b.txt" in r.stdout and "DIFFERS   config.json" in r.stdout
    # bad input: a clear error, exit 2
    r = dflash("manifest", "verify", tmp_path / "nope", out)
    assert r.returncode == 2 and "is not a folder" in r.stderr
    (tmp_path / "bad.json").write_text("{")
    r = dflash("manifest", "verify", src, tmp_path / "bad.json")
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_create_is_unchanged_when_nothing_changed_and_reuse_skips_hashing(tmp_path):
    src = _tree(tmp_path / "src")
    out = tmp_path / "m.json"
    assert json.loads(dflash("manifest", "create", src, "-o", out, "--json").stdout)["changed"]
    before = out.stat().st_mtime_ns
    r = json.loads(dflash("manifest", "create", src, "-o", out, "--json", "--reuse").stdout)
    assert r == {**r, "changed": False, "hashed": 0}
    assert out.stat().st_mtime_ns == before
    (src / "data" / "b.txt").write_text("changed\n")
    r = json.loads(dflash("manifest", "create", src, "-o", out, "--json", "--reuse").stdout)
    assert r["changed"] and r["hashed"] == 1


def test_manifest_inside_the_folder_is_not_listed(tmp_path):
    src = _tree(tmp_path / "src")
    m = create_manifest(src, src / "MANIFEST.json")
    assert "MANIFEST.json" not in m["files"]
    assert verify_manifest(
        src, load_manifest(src / "MANIFEST.json"), manifest_path=src / "MANIFEST.json", strict=True
    ).ok


def test_unsafe_paths_are_refused(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(
        json.dumps({"manifest_version": 1, "files": {"../etc/passwd": {"size": 1, "sha256": "0"}}})
    )
    with pytest.raises(ManifestError, match="unsafe path"):
        load_manifest(bad)
