"""Upload a folder that has a manifest to S3 (a salvage set, or any folder: `dflash s3 push`).

`push`: every file of the set's manifest goes to `s3://BUCKET/PREFIX/<relative path>` through boto3's
transfer manager (multipart above `multipart_threshold`, parts in parallel), with

- `Content-MD5` on every PutObject and UploadPart request (an event hook computes it from the exact
  bytes sent), so the server rejects a part damaged in flight (`BadDigest`);
- the file's sha256 in the object's metadata (`x-amz-meta-sha256`) and in the manifest. Servers such
  as Ceph radosgw ignore the flexible checksums (ChecksumSHA256 comes back empty), so integrity is
  proven client-side: `verify` reads every object back and hashes it;
- resume by object: an object already present with the same sha256 in its metadata and the same size
  is skipped (a second push moves 0 bytes); multipart uploads left under the prefix by an interrupted
  push are aborted first, so nothing half-written stays in the bucket;
- the manifest uploaded last (`PREFIX/MANIFEST.json`): its presence means every entry was sent.

Credentials come from boto3's standard chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
~/.aws/...). Nothing here prints or logs them; errors name buckets and keys only. Light side: boto3 is
imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from trainer.fsutil import sha256_file
from trainer.manifest import MANIFEST_NAME, manifest_beside
from trainer.s3 import S3Error
from trainer.s3.client import (
    DEFAULT_CHUNK,
    DEFAULT_THRESHOLD,
    SHA_META,
    Progress,
    S3Location,
    abort_stale_uploads,
    check_bucket,
    get_json,
    head,
    list_objects,
    make_client,
    parse_s3_url,
)

# ---------------------------------------------------------------- push


def _plan(
    client, loc: S3Location, manifest: dict[str, Any], references: dict[str, str]
) -> list[dict[str, Any]]:
    """Per file: upload, skip (same sha256 at the key) or reference (same sha256 elsewhere)."""
    from concurrent.futures import ThreadPoolExecutor

    rels = [r for r, e in manifest["files"].items() if "sha256" in e]
    # one listing instead of a HEAD per file: only keys already there need their metadata read
    present = {o["Key"]: o["Size"] for o in list_objects(client, loc)}

    def decide(rel: str) -> dict[str, Any]:
        entry = manifest["files"][rel]
        key = loc.key(rel)
        h = head(client, loc.bucket, key) if present.get(key) == entry["size"] else None
        if h is None and key in present:
            h = {"Metadata": {}, "ContentLength": present[key]}  # there, but with another size
        if (
            h is not None
            and h.get("Metadata", {}).get(SHA_META) == entry["sha256"]
            and h["ContentLength"] == entry["size"]
        ):
            return {
                "path": rel,
                "key": key,
                "size": entry["size"],
                "action": "skip",
                "why": "same sha256 already at the key",
            }
        ref = references.get(entry["sha256"])
        if ref is not None:
            return {
                "path": rel,
                "key": key,
                "size": entry["size"],
                "action": "reference",
                "location": ref,
                "why": "an object with the same sha256 already lives in S3",
            }
        why = "absent" if h is None else "differs (sha256 metadata or size)"
        return {"path": rel, "key": key, "size": entry["size"], "action": "upload", "why": why}

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(decide, rels))


def load_references(client, urls: list[str]) -> dict[str, str]:
    """sha256 -> s3:// URL of objects listed by the manifests of other prefixes (earlier salvage
    sets, a dataset uploaded before), each confirmed by its object's sha256 metadata."""
    found: dict[str, str] = {}
    for url in urls:
        loc = parse_s3_url(url)
        manifest = get_json(client, loc.bucket, loc.key(MANIFEST_NAME))
        if manifest is None:
            raise S3Error(
                f"--reference {url}: no {MANIFEST_NAME} there (only salvage sets can be referenced)"
            )
        locations = manifest.get("locations", {})
        for rel, entry in manifest.get("files", {}).items():
            if "sha256" not in entry or entry["sha256"] in found:
                continue
            where = locations.get(rel) or loc.url(rel)
            ref = parse_s3_url(where)
            h = head(client, ref.bucket, ref.prefix)
            if h is not None and h.get("Metadata", {}).get(SHA_META) == entry["sha256"]:
                found[entry["sha256"]] = where
    return found


def stale_files(set_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Files that changed (size or mtime) or vanished since the manifest was made: pushing them would
    send bytes the manifest does not describe."""
    bad = []
    for rel, entry in manifest["files"].items():
        if "sha256" not in entry:
            continue
        p = set_dir / rel
        try:
            st = p.stat()
        except FileNotFoundError:
            bad.append(f"{rel}: missing")
            continue
        if st.st_size != entry["size"]:
            bad.append(f"{rel}: size {st.st_size}, manifest says {entry['size']}")
        elif entry.get("mtime_ns") is not None and st.st_mtime_ns != entry["mtime_ns"]:
            # touched (a copy that did not keep mtimes, say): only different bytes are a change
            if sha256_file(p) != entry["sha256"]:
                bad.append(f"{rel}: modified after the manifest was made")
    return bad


def push(
    set_dir: Path,
    url: str,
    endpoint_url: str | None = None,
    check: bool = False,
    references: list[str] | None = None,
    workers: int = 8,
    chunk_bytes: int = DEFAULT_CHUNK,
    threshold_bytes: int = DEFAULT_THRESHOLD,
    progress: bool = True,
    client=None,
    manifest_path: Path | None = None,
    remake_hint: str = "re-run `dflash salvage collect`",
    records: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Upload a salvage set (folder with MANIFEST.json) to `url`, or any folder whose manifest is
    `manifest_path` (`dflash s3 push`). `records` name small files of the folder that describe it (a
    salvage set's NOTES.md and report): uploaded after the files, listed in the uploaded manifest's
    `records`, never among its files. Returns the push report; raises S3Error on bad input before any
    transfer."""
    from trainer.manifest import ManifestError, load_manifest

    set_dir = Path(set_dir)
    loc = parse_s3_url(url)
    mpath = Path(manifest_path) if manifest_path is not None else set_dir / MANIFEST_NAME
    try:
        manifest = load_manifest(mpath)
    except ManifestError as exc:
        raise S3Error(f"{exc} ({remake_hint} first)") from None
    stale = stale_files(set_dir, manifest)
    if stale:
        raise S3Error(
            f"{len(stale)} file(s) of {set_dir} differ from {mpath.name}: "
            + "; ".join(stale[:20])
            + f" -- {remake_hint} (or restore the files) before pushing"
        )
    client = client or make_client(endpoint_url, max_pool=max(16, workers * 2))
    check_bucket(client, loc)
    refs = load_references(client, references or [])
    t0 = time.monotonic()
    plan = _plan(client, loc, manifest, refs)
    todo = [p for p in plan if p["action"] == "upload"]
    report: dict[str, Any] = {
        "s3": loc.url(),
        "endpoint_url": endpoint_url,
        "check": check,
        "files": len(plan),
        "bytes": sum(p["size"] for p in plan),
        "to_upload": len(todo),
        "to_upload_bytes": sum(p["size"] for p in todo),
        "skipped": sum(p["action"] == "skip" for p in plan),
        "referenced": [
            {"path": p["path"], "location": p["location"]} for p in plan if p["action"] == "reference"
        ],
        "plan": plan,
    }
    if check:
        report.update(uploaded=0, uploaded_bytes=0, failed=[], ok=True)
        return report
    report["aborted_stale_uploads"] = abort_stale_uploads(client, loc)
    failed = _upload_all(
        client, loc, set_dir, manifest, todo, workers, chunk_bytes, threshold_bytes, progress
    )
    report["failed"] = failed
    report["uploaded"] = len(todo) - len(failed)
    report["uploaded_bytes"] = sum(p["size"] for p in todo if p["path"] not in {f["path"] for f in failed})
    if not failed:
        try:
            records = _push_records(client, loc, set_dir, records)
            report["records"] = records
            report["uploaded_bytes"] += sum(r["size"] for r in records.values() if r["uploaded"])
            pushed = dict(manifest)
            pushed["records"] = {n: {"size": r["size"], "sha256": r["sha256"]} for n, r in records.items()}
            pushed["locations"] = {p["path"]: p["location"] for p in plan if p["action"] == "reference"}
            pushed["pushed_to"] = loc.url()
            body = (json.dumps(pushed, indent=1) + "\n").encode()
            digest = hashlib.sha256(body).hexdigest()
            h = head(client, loc.bucket, loc.key(MANIFEST_NAME))
            if h is None or h.get("Metadata", {}).get(SHA_META) != digest:
                client.put_object(
                    Bucket=loc.bucket,
                    Key=loc.key(MANIFEST_NAME),
                    Body=body,
                    Metadata={SHA_META: digest},
                    ContentType="application/json",
                )
                report["manifest_uploaded_bytes"] = len(body)
            else:
                report["manifest_uploaded_bytes"] = 0
            report["manifest_key"] = loc.key(MANIFEST_NAME)
        except Exception as exc:  # noqa: BLE001 - the endpoint died between the last object and the manifest
            failed.append(
                {
                    "path": MANIFEST_NAME,
                    "key": loc.key(MANIFEST_NAME),
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
    report["seconds"] = round(time.monotonic() - t0, 3)
    report["ok"] = not failed
    return report


def _push_records(
    client, loc: S3Location, set_dir: Path, names: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """NOTES.md and the JSON report: small, uploaded whole with Content-MD5 and sha256 metadata,
    skipped when the object already has the same sha256."""
    out = {}
    for name in names:
        p = set_dir / name
        if not p.is_file():
            continue
        body = p.read_bytes()
        digest = hashlib.sha256(body).hexdigest()
        h = head(client, loc.bucket, loc.key(name))
        same = h is not None and h.get("Metadata", {}).get(SHA_META) == digest
        if not same:
            ctype = "text/markdown" if name.endswith(".md") else "application/json"
            client.put_object(
                Bucket=loc.bucket,
                Key=loc.key(name),
                Body=body,
                Metadata={SHA_META: digest},
                ContentType=ctype,
            )
        out[name] = {"size": len(body), "sha256": digest, "uploaded": not same}
    return out


def _upload_all(
    client, loc, set_dir, manifest, todo, workers, chunk_bytes, threshold_bytes, progress
) -> list[dict[str, str]]:
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager
    from s3transfer.subscribers import BaseSubscriber

    bar = Progress(sum(p["size"] for p in todo), f"upload to {loc.url()}", progress)

    class _Bytes(BaseSubscriber):
        def on_progress(self, future, bytes_transferred, **kwargs):
            bar(bytes_transferred)

    config = TransferConfig(
        multipart_threshold=threshold_bytes,
        multipart_chunksize=chunk_bytes,
        max_concurrency=workers,
        use_threads=True,
    )
    failed = []
    with TransferManager(client, config) as tm:
        futures = []
        for p in todo:
            extra = {"Metadata": {SHA_META: manifest["files"][p["path"]]["sha256"]}}
            fut = tm.upload(
                str(set_dir / p["path"]), loc.bucket, p["key"], extra_args=extra, subscribers=[_Bytes()]
            )
            futures.append((p, fut))
        for p, fut in futures:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - one failed object must not hide the others' results
                failed.append({"path": p["path"], "key": p["key"], "error": f"{type(exc).__name__}: {exc}"})
    bar.close()
    return failed


def push_folder(
    folder: Path,
    url: str,
    endpoint_url: str | None = None,
    check: bool = False,
    exclude: tuple[str, ...] = (),
    workers: int = 8,
    progress: bool = True,
    client=None,
) -> dict[str, Any]:
    """`dflash s3 push DIR URL`: DIR's manifest written beside it (`DIR.manifest.json`, digests of
    unchanged files reused), then `push` (a dataset is uploaded once from wherever it was tokenized)."""
    from trainer.manifest import ManifestError, create_manifest, load_manifest

    folder = Path(folder)
    if not folder.is_dir():
        raise S3Error(f"{folder} is not a folder")
    parse_s3_url(url)  # a bad URL fails before any hashing
    mpath = manifest_beside(folder)
    try:
        old = load_manifest(mpath) if mpath.is_file() else None
    except ManifestError:
        old = None  # a broken old manifest is simply rebuilt
    create_manifest(folder, mpath, exclude=tuple(exclude), reuse=old, source=str(folder.resolve()))
    report = push(
        folder,
        url,
        endpoint_url=endpoint_url,
        check=check,
        workers=workers,
        progress=progress,
        client=client,
        manifest_path=mpath,
        remake_hint="re-run `dflash s3 push`",
    )
    report["manifest"] = str(mpath)
    return report
