"""Atomic writes: all or nothing, readable by default."""

import stat

import pytest

from trainer.store.fsutil import atomic_write_bytes, atomic_write_text


def test_atomic_write_replaces_whole_and_is_0644(tmp_path):
    p = tmp_path / "sub" / "f.json"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert [x.name for x in p.parent.iterdir()] == ["f.json"], "no temp file left behind"
    atomic_write_text(tmp_path / "secret", "k", mode=0o600)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "f"
    atomic_write_bytes(p, b"old")

    with pytest.raises(TypeError):
        atomic_write_bytes(p, object())  # fails mid-write
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["f"]
