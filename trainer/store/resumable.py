"""The resumable download, one frame for `dflash hub pull` (trainer/hub/pull.py) and `dflash s3 pull`
(trainer/s3/pull.py); each brings its own listing, fetch, proof and placing. What is still to fetch and
whether it fits (`plan_pull`, `PullPlan`); a partial file kept across a killed pull only for the same
remote object (`resume_offset`); each file fetched, proven, then placed or deleted (`fetch_verified`);
all of them in parallel, with the report's totals (`fetch_all`). Light side: stdlib only."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.store.fsutil import atomic_write_text


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

    def report(self, dest: Path, files: dict[str, dict[str, Any]], check: bool) -> dict[str, Any]:
        """What a pull's report says before anything moves: the listing against `dest`, the plan."""
        return {
            "dest": str(dest),
            "check": check,
            "files": len(files),
            "bytes": sum(e["size"] for e in files.values()),
            "present": len(files) - len(self.todo),
            "to_download": len(self.todo),
            "to_download_bytes": self.need,
            "plan": self.rows(files),
        }

    def shortfall(self, dest: Path) -> str | None:
        """Why the pull cannot start (the bytes to fetch exceed the free space), or None."""
        if self.need <= self.free:
            return None
        return (
            f"{dest}: {self.need / 2**30:.2f} GiB to download but only {self.free / 2**30:.2f} GiB free on "
            f"{self.free_at}; nothing was downloaded"
        )


def plan_pull(
    dest: Path,
    files: dict[str, dict[str, Any]],
    partial_dir: str,
    local_state: Callable[[Path, dict[str, Any]], tuple[str, str | None]],
    workers: int = 4,
) -> PullPlan:
    """Compare `dest` with the listing `files` (rel -> entry with `size`): the files already there are hashed
    in parallel (`local_state`), the partial files under `dest/partial_dir` counted, the bytes still needed
    summed and the free space read where `dest` is (or would be)."""
    with ThreadPoolExecutor(max(1, min(4, workers))) as pool:
        states = dict(zip(files, pool.map(lambda r: local_state(dest / r, files[r]), files)))
    todo = sorted(r for r, (s, _) in states.items() if s != "same")
    root = dest / partial_dir
    partial = {r: (root / r).stat().st_size for r in todo if (root / r).is_file()}
    need = sum(files[r]["size"] - min(partial.get(r, 0), files[r]["size"]) for r in todo)
    free_at = dest if dest.exists() else next(p for p in dest.parents if p.exists())
    return PullPlan(states, todo, partial, need, shutil.disk_usage(free_at).free, free_at)


def nothing_fetched() -> dict[str, Any]:
    """The totals of a pull that fetched nothing (`--check`: the plan only)."""
    return {"downloaded": 0, "downloaded_bytes": 0, "resumed_bytes": 0, "failed": []}


def fetch_verified(
    rel: str,
    part: Path,
    fetch: Callable[[], dict[str, Any]],
    refusal: Callable[[dict[str, Any]], str | None],
    place: Callable[[dict[str, Any]], None],
    again_when_fresh: bool = False,
) -> dict[str, Any]:
    """One file of a pull: `fetch()` writes it into `part` (resuming what `resume_offset` kept) and says
    what moved (`bytes`, `resumed_from`) and what the file holds; `refusal(got)` says why those are not
    the listed bytes (None: they are), and then `place(got)` puts `part` under its final name. Refused
    bytes are deleted, never placed; the file is fetched once more from the start when the refused try
    had resumed a partial (a bad partial), or after any refusal with `again_when_fresh` (a transfer that
    can go wrong in flight). The result ({path, bytes, resumed_from, ok, error}) carries a failure:
    one file must not hide the others' results."""
    res: dict[str, Any] = {"path": rel, "bytes": 0, "resumed_from": 0}
    try:
        for attempt in range(2):
            got = fetch()
            res["bytes"] += got["bytes"]
            if attempt == 0:
                res["resumed_from"] = got["resumed_from"]
            why = refusal(got)
            if why is None:
                place(got)
                resume_tag_file(part).unlink(missing_ok=True)
                res["ok"] = True
                return res
            part.unlink(missing_ok=True)  # refused: never left under its final name
            resume_tag_file(part).unlink(missing_ok=True)
            if got["resumed_from"] == 0 and not again_when_fresh:
                break  # a fresh download that is wrong: the source serves other bytes than it names
        tries = "" if attempt == 0 else ", after two downloads"
        res.update(ok=False, error=f"refused: {why} (deleted, not placed{tries})")
    except Exception as exc:  # noqa: BLE001 - one failed file must not hide the others' results
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    return res


def fetch_all(
    todo: Iterable[str], one: Callable[[str], dict[str, Any]], workers: int
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """`one(rel)` (a `fetch_verified`) for every file to fetch, `workers` at a time: the report's totals
    (downloaded, downloaded_bytes, resumed_bytes) and the files that failed ({path, error})."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = list(pool.map(one, todo))
    totals = {
        "downloaded": sum(r["ok"] for r in results),
        "downloaded_bytes": sum(r["bytes"] for r in results),
        "resumed_bytes": sum(r["resumed_from"] for r in results),
    }
    return totals, [{"path": r["path"], "error": r["error"]} for r in results if not r["ok"]]
