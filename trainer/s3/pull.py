"""A folder from S3, every file proven by sha256 (`dflash s3 pull`).

`pull s3://BUCKET/PREFIX DIR` (the data_sync role's S3 -> host direction) reads `PREFIX/MANIFEST.json`
(a push or a salvage set) and, before anything is written, refuses a prefix with no manifest, an object
that is missing or has another size than the manifest says, a destination disk without room, and what
`trainer.s3.pullsafe` refuses (a link out of DIR, a write through a link, a read outside the prefix
that `--allow-location` did not name). Then, per file:

- already in DIR with the manifest's size and sha256: kept (a second pull moves 0 bytes);
- otherwise downloaded into `DIR/.s3-partial/<path>`. A pull killed mid-way leaves that partial file
  and the object's ETag beside it; the next pull asks only for the missing bytes (an HTTP Range, with
  If-Match on the ETag, so an object replaced in between is fetched again from the start);
- the complete file is hashed; only a sha256 equal to the manifest's moves it into place (rename,
  the manifest's mtime kept); a mismatch is fetched once more from scratch, then reported.

It finishes by writing the manifest beside DIR (`DIR.manifest.json`, so `dflash manifest verify DIR
DIR.manifest.json` re-proves it any time) and reports every file present, fetched, resumed, failed,
and the local files the manifest does not name (left alone). Credentials: boto3's standard chain, as
salvage. Light side: boto3 is imported lazily, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from trainer.s3 import S3Error
from trainer.s3 import client as s3lib
from trainer.s3.pullsafe import check_entries, check_locations, open_partial, place_file, place_link
from trainer.store.fsutil import atomic_write_text, sha256_file
from trainer.store.manifest import MANIFEST_NAME, manifest_beside
from trainer.store.resumable import fetch_all, fetch_verified, nothing_fetched, plan_pull, resume_offset

PARTIAL_DIR = ".s3-partial"
MiB = 2**20


# ---------------------------------------------------------------- pull


class _Throttle:
    """A shared byte budget (KiB/s) for every download thread; 0 = unlimited."""

    def __init__(self, kbps: int):
        self.rate = kbps * 1024
        self.t0 = time.monotonic()
        self.sent = 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            self.sent += n
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def _object_sizes(
    client, loc, rels: list[str], locations: dict[str, str]
) -> dict[str, tuple[str, str, int | None]]:
    """rel -> (bucket, key, size in S3 or None when absent): one listing for the prefix, a HEAD for
    files a salvage set references elsewhere (`locations`, already checked by `check_locations`)."""
    listed = {o["Key"]: o["Size"] for o in s3lib.list_objects(client, loc)}
    out = {}
    for rel in rels:
        if rel in locations:
            ref = s3lib.parse_s3_url(locations[rel])
            h = s3lib.head(client, ref.bucket, ref.prefix)
            out[rel] = (ref.bucket, ref.prefix, None if h is None else h["ContentLength"])
        else:
            key = loc.key(rel)
            out[rel] = (loc.bucket, key, listed.get(key))
    return out


def _why_object(size: int | None, expected: int) -> str:
    return "absent" if size is None else f"{size} bytes, the manifest says {expected}"


def _refusal(entry: dict[str, Any], got: dict[str, Any]) -> str | None:
    """Why a downloaded object is not the bytes its manifest names (None: it is)."""
    if got["sha256"] == entry["sha256"]:
        return None
    return (
        f"sha256 {got['sha256'][:12]}..., the manifest says {entry['sha256'][:12]}... (the object does not "
        "hold the bytes its manifest names)"
    )


def _local_state(path: Path, entry: dict[str, Any]) -> tuple[str, str | None]:
    """('same', sha256) | ('missing', None) | ('differs', None) for a destination file against its
    manifest entry."""
    if path.is_symlink() or not path.is_file():
        return ("missing" if not path.exists() and not path.is_symlink() else "differs"), None
    if path.stat().st_size != entry["size"]:
        return "differs", None
    sha = sha256_file(path)
    return ("same", sha) if sha == entry["sha256"] else ("differs", None)


def _fetch(
    client, bucket: str, key: str, entry: dict[str, Any], part: Path, throttle: _Throttle, bar: s3lib.Progress
) -> dict[str, Any]:
    """Download one object into `part` (resuming a partial of the same ETag); returns what moved and
    the sha256 of the whole file."""
    etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
    offset = resume_offset(part, etag, entry["size"])
    digest = hashlib.sha256()
    if offset:
        with open(part, "rb") as fh:  # the bytes a killed pull left: hashed, not fetched again
            for chunk in iter(lambda: fh.read(MiB), b""):
                digest.update(chunk)
    moved = 0
    with open_partial(part) as fh:  # never through a symlink at the partial's name
        if offset < entry["size"]:
            kw = {"Range": f"bytes={offset}-"} if offset else {}
            body = client.get_object(Bucket=bucket, Key=key, IfMatch=etag, **kw)["Body"]
            for chunk in body.iter_chunks(MiB):
                fh.write(chunk)
                digest.update(chunk)  # hashed as it lands: no second read of the file
                moved += len(chunk)
                bar(len(chunk))
                throttle(len(chunk))
        fh.flush()
        os.fsync(fh.fileno())  # on disk before the rename makes it the real file
    return {"resumed_from": offset, "bytes": moved, "sha256": digest.hexdigest()}


def pull(
    url: str,
    dest: Path,
    endpoint_url: str | None = None,
    check: bool = False,
    workers: int = 4,
    bwlimit_kbps: int = 0,
    progress: bool = True,
    client=None,
    allow_locations: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Copy s3://BUCKET/PREFIX (which has a MANIFEST.json) into `dest`, resumable, every file proven.
    Returns the report (`ok` false when a file could not be proven); raises S3Error on bad input
    before anything is written: see `trainer.s3.pullsafe` for what a manifest may not do. Files the
    manifest keeps elsewhere (`locations`) are read only from under its own prefix or a prefix in
    `allow_locations` (`--allow-location`)."""
    from trainer.store.manifest import ManifestError, check_manifest, scan

    loc = s3lib.parse_s3_url(url)
    allow_locations = [s3lib.parse_s3_url(a).url() for a in allow_locations]  # a bad one: exit 2 now
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise S3Error(f"destination {dest} exists and is not a folder")
    client = client or s3lib.make_client(endpoint_url, max_pool=max(16, workers * 2))
    s3lib.check_bucket(client, loc)
    try:
        raw = s3lib.get_json(client, loc.bucket, loc.key(MANIFEST_NAME))
    except ValueError as exc:  # not JSON, not UTF-8
        raise S3Error(f"manifest {loc.url(MANIFEST_NAME)} is not valid JSON: {exc}") from None
    if raw is None:
        raise S3Error(
            f"{loc.url(MANIFEST_NAME)} does not exist, so nothing there can be proven: upload the folder "
            "with "
            f"`dflash s3 push DIR {loc.url()}` (it writes the manifest), or pull a salvage set's prefix"
        )
    try:
        manifest = check_manifest(raw, loc.url(MANIFEST_NAME))
    except ManifestError as exc:
        raise S3Error(str(exc)) from None
    files = {r: e for r, e in manifest["files"].items() if "sha256" in e}
    links = {r: e["symlink"] for r, e in manifest["files"].items() if "symlink" in e}
    locations = check_locations(loc, manifest.get("locations", {}), files, allow_locations)
    check_entries(dest, files, links, PARTIAL_DIR)
    objects = _object_sizes(client, loc, sorted(files), locations)
    broken = [
        f"{rel}: {_why_object(size, files[rel]['size'])} (s3://{b}/{k})"
        for rel, (b, k, size) in objects.items()
        if size != files[rel]["size"]
    ]
    if broken:
        raise S3Error(
            f"{len(broken)} object(s) under {loc.url()} do not match its manifest, so the copy "
            "there is incomplete; nothing was downloaded: " + "; ".join(broken[:20])
        )

    t0 = time.monotonic()
    plan = plan_pull(dest, files, PARTIAL_DIR, _local_state, workers)
    partial_root = dest / PARTIAL_DIR
    report: dict[str, Any] = {"s3": loc.url(), **plan.report(dest, files, check), "links": len(links)}
    if plan.shortfall(dest):
        raise S3Error(plan.shortfall(dest))
    if check:
        report.update(nothing_fetched(), links_placed=0, ok=True, seconds=round(time.monotonic() - t0, 3))
        return report

    dest.mkdir(parents=True, exist_ok=True)
    throttle = _Throttle(bwlimit_kbps)
    bar = s3lib.Progress(plan.need, f"download from {loc.url()}", progress)

    def one(rel: str) -> dict[str, Any]:
        bucket, key, _ = objects[rel]
        entry, part = files[rel], partial_root / rel
        return fetch_verified(
            rel,
            part,
            partial(_fetch, client, bucket, key, entry, part, throttle, bar),
            partial(_refusal, entry),
            lambda got: place_file(part, dest, rel, entry.get("mtime_ns")),
            again_when_fresh=True,  # a bad transfer: once more from the start
        )

    totals, failed = fetch_all(plan.todo, one, workers)
    bar.close()
    placed_links = 0
    for rel, to in links.items():
        try:
            placed_links += place_link(dest, rel, to)
        except OSError as exc:  # a link or folder planted there since the check: that entry fails
            failed.append({"path": rel, "error": f"{type(exc).__name__}: {exc}"})
    if not failed:
        # every file is in place: what is left are empty folders (or partials of files no longer named)
        shutil.rmtree(partial_root, ignore_errors=True)
        atomic_write_text(manifest_beside(dest), _manifest_text(manifest))
    local, local_links = scan(dest)
    report.update(
        totals,
        failed=failed,
        links_placed=placed_links,
        extra=sorted(set(local) - set(files)) + sorted(set(local_links) - set(links)),
        manifest=str(manifest_beside(dest)) if not failed else None,
        ok=not failed,
        seconds=round(time.monotonic() - t0, 3),
    )
    return report


def _manifest_text(manifest: dict[str, Any]) -> str:
    keep = {k: v for k, v in manifest.items() if k not in ("records", "locations", "pushed_to")}
    return json.dumps(keep, indent=1) + "\n"
