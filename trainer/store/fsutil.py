"""Small file-system helpers: atomic writes and streaming digests (light side)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 4 * 1024 * 1024


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a temp name in the same folder, fsync, then rename over `path` (mode: 0644 unless
    told otherwise: mkstemp's 0600 would make run files unreadable to a monitor running as another user)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode(), mode)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def resume_tag_file(part: Path) -> Path:
    """Where a partial download's tag is kept (`PART.etag`): removed with the partial file."""
    return part.with_name(part.name + ".etag")


def resume_offset(part: Path, tag: str, size: int) -> int:
    """How many bytes of a partial download `part` to keep: all of them when the tag saved beside it
    (`PART.etag`: the object's ETag, or the URL and ETag) is `tag` and it is no longer than the file's
    `size`; else none (the partial file is removed and `tag` saved, for the next try). The folder is made."""
    tag_file = resume_tag_file(part)
    part.parent.mkdir(parents=True, exist_ok=True)
    if part.is_file() and tag_file.is_file() and tag_file.read_text() == tag and part.stat().st_size <= size:
        return part.stat().st_size
    part.unlink(missing_ok=True)
    atomic_write_text(tag_file, tag)
    return 0


@dataclass
class PullPlan:
    """What a resumable download into `dest` still has to move: `states[rel]` is what `local_state`
    said of each file (("same", sha256) | (why, None)), `todo` the files not the same, `partial` the bytes a
    killed pull left of each, `need` the bytes still to fetch, `free` what the filesystem at `free_at` has."""

    states: dict[str, tuple[str, str | None]]
    todo: list[str]
    partial: dict[str, int]
    need: int
    free: int
    free_at: Path

    def rows(self, files: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The report's `plan`: each file to fetch, why, its size and the partial bytes kept."""
        return [
            {
                "path": r,
                "why": self.states[r][0],
                "size": files[r]["size"],
                "partial_bytes": self.partial.get(r, 0),
            }
            for r in self.todo
        ]


def plan_pull(
    dest: Path,
    files: dict[str, dict[str, Any]],
    partial_dir: str,
    local_state: Callable[[Path, dict[str, Any]], tuple[str, str | None]],
    workers: int = 4,
) -> PullPlan:
    """Compare `dest` with the listing `files` (rel -> entry with `size`): the files already there are hashed
    in parallel (`local_state`), the partial files under `dest/partial_dir` counted, the bytes still needed
    summed and the free space read where `dest` is (or would be). The Hub pull and the S3 pull share it."""
    with ThreadPoolExecutor(max(1, min(4, workers))) as pool:
        states = dict(zip(files, pool.map(lambda r: local_state(dest / r, files[r]), files)))
    todo = sorted(r for r, (s, _) in states.items() if s != "same")
    root = dest / partial_dir
    partial = {r: (root / r).stat().st_size for r in todo if (root / r).is_file()}
    need = sum(files[r]["size"] - min(partial.get(r, 0), files[r]["size"]) for r in todo)
    free_at = dest if dest.exists() else next(p for p in dest.parents if p.exists())
    return PullPlan(states, todo, partial, need, shutil.disk_usage(free_at).free, free_at)
