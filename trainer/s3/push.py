"""Upload a folder that has a manifest to S3 (a salvage set, or any folder: `dflash s3 push`).

`push`: every file of the set's manifest goes to `s3://BUCKET/PREFIX/<relative path>` through boto3's
transfer manager (multipart above `multipart_threshold`, parts in parallel), with

- `Content-MD5` on every PutObject and UploadPart request (an event hook computes it from the exact
  bytes sent), so the server rejects a part damaged in flight (`BadDigest`);
- the file's sha256 in the object's metadata (`x-amz-meta-sha256`) and in the manifest. Servers such
  as Ceph radosgw ignore the flexible checksums (ChecksumSHA256 comes back empty), so integrity is
  proven client-side: `verify` reads every object back and hashes it;
- resume by object: an object already present with the same sha256 in its metadata and the same size
  is skipped (a second push moves 0 bytes) -- unless the set's last verify of this prefix found it
  missing or different (`force`: a second salvage repairs what the first verify named; no object is
  read back here, so a re-push of a large set stays cheap); multipart uploads that an interrupted push
  left at this set's own keys are aborted first, so nothing half-written stays in the bucket (uploads
  at other keys, such as another set's push into a child prefix, are not touched);
- the set's id (`set.id` of a salvage set's manifest) in every object's metadata (`x-amz-meta-dflash-set`):
  a push asks every key it may write (a HEAD each, not only the listed ones) and refuses, before
  sending anything, to overwrite an object (or the manifest) of another set at the same prefix
  (exit 2; nothing is written beside it: the prefix must name the node and the run);
- whether the bucket keeps versions (GetBucketVersioning) in the report;
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

from trainer.s3 import S3Error
from trainer.s3.client import (
    DEFAULT_CHUNK,
    DEFAULT_THRESHOLD,
    SHA_META,
    Progress,
    S3Location,
    abort_stale_uploads,
    bucket_versioning,
    check_bucket,
    get_manifest,
    head,
    make_client,
    parse_s3_url,
)
from trainer.store.fsutil import sha256_file
from trainer.store.manifest import MANIFEST_NAME, content_digest, manifest_beside

# ---------------------------------------------------------------- push

SET_META = "dflash-set"


def set_id_of(manifest: dict[str, Any]) -> str | None:
    ident = manifest.get("set")
    return str(ident["id"]) if isinstance(ident, dict) and ident.get("id") else None


def foreign_owner(h: dict[str, Any] | None, ours: str | None) -> str | None:
    """The other set's id (or "none") when the object `h` was not written by set `ours`."""
    if h is None:
        return None
    theirs = h.get("Metadata", {}).get(SET_META)
    if ours is None:
        return theirs  # a plain folder push only refuses to overwrite a salvage set's objects
    return None if theirs == ours else (theirs or "none")


def _plan(
    client,
    loc: S3Location,
    manifest: dict[str, Any],
    references: dict[str, str],
    force: set[str] | None = None,
) -> list[dict[str, Any]]:
    """Per file: upload, skip (same sha256 at the key) or reference (same sha256 elsewhere). An object
    already at the key carries its set's id (`owner`); a path in `force` is uploaded again. Every key
    the push may write is asked (a HEAD each), not only those a listing showed: an object that
    another push put there after the listing (or that the listing did not show) is still found."""
    from concurrent.futures import ThreadPoolExecutor

    rels = [r for r, e in manifest["files"].items() if "sha256" in e]
    ours = set_id_of(manifest)

    def decide(rel: str) -> dict[str, Any]:
        entry = manifest["files"][rel]
        key = loc.key(rel)
        h = head(client, loc.bucket, key)  # its metadata: sha256 and set
        where = {"path": rel, "key": key, "size": entry["size"]}
        owner = foreign_owner(h, ours)
        if owner is not None:
            return {**where, "action": "refuse", "owner": owner}
        if rel in (force or ()):
            why = "the last verify found this object missing or different: sent again"
            return {**where, "action": "upload", "why": why}
        if (
            h is not None
            and h.get("Metadata", {}).get(SHA_META) == entry["sha256"]
            and h["ContentLength"] == entry["size"]
        ):
            return {**where, "action": "skip", "why": "same sha256 already at the key"}
        ref = references.get(entry["sha256"])
        if ref is not None:
            why = "an object with the same sha256 already lives in S3"
            return {**where, "action": "reference", "location": ref, "why": why}
        why = "absent" if h is None else "differs (sha256 metadata or size)"
        return {**where, "action": "upload", "why": why}

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(decide, rels))


def load_references(client, urls: list[str]) -> dict[str, str]:
    """sha256 -> s3:// URL of objects listed by the manifests of other prefixes (earlier salvage
    sets, a dataset uploaded before), each confirmed by its object's sha256 metadata."""
    found: dict[str, str] = {}
    for url in urls:
        loc = parse_s3_url(url)
        manifest = get_manifest(client, loc.bucket, loc.key(MANIFEST_NAME))
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


def push(set_dir: Path, url: str, *args, progress_file: Path | None = None, **kw) -> dict[str, Any]:
    """`_push` (below), with `progress_file`: bytes sent of the bytes to send, rate and ETA
    (trainer/store/progress_file.py), ended `failed` with the first error (or the refusal)."""
    from trainer.store.progress_file import counting

    with counting(progress_file, f"push to {url}") as pf:
        report = _push(set_dir, url, *args, sent=pf, **kw)
        pf.finish(report["ok"], None if report["ok"] else report["failed"][0]["error"])
    return report


def _push(
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
    force: set[str] | None = None,
    sent=None,
) -> dict[str, Any]:
    """Upload a salvage set (folder with MANIFEST.json) to `url`, or any folder whose manifest is
    `manifest_path` (`dflash s3 push`). `records` name small files of the folder that describe it (a
    salvage set's NOTES.md and report): uploaded after the files, listed in the uploaded manifest's
    `records`, never among its files. Returns the push report; raises S3Error on bad input before any
    transfer."""
    from trainer.store.manifest import ManifestError, load_manifest

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
    plan = _plan(client, loc, manifest, refs, force)
    ours = set_id_of(manifest)
    _refuse_other_sets(client, loc, plan, records, ours)
    todo = [p for p in plan if p["action"] == "upload"]
    if sent is not None:
        sent.total = sum(p["size"] for p in todo)
    report: dict[str, Any] = {
        "s3": loc.url(),
        "endpoint_url": endpoint_url,
        "check": check,
        "manifest_digest": content_digest(manifest),
        "set_id": ours,
        "bucket_versioning": bucket_versioning(client, loc.bucket),
        "resent": sorted(p["path"] for p in todo if p["path"] in (force or ())),
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
    own_keys = {p["key"] for p in plan} | {loc.key(n) for n in (MANIFEST_NAME, *records)}
    report["aborted_stale_uploads"] = abort_stale_uploads(client, loc, own_keys)
    failed = _upload_all(
        client, loc, set_dir, manifest, todo, workers, chunk_bytes, threshold_bytes, progress, ours, sent
    )
    report["failed"] = failed
    report["uploaded"] = len(todo) - len(failed)
    report["uploaded_bytes"] = sum(p["size"] for p in todo if p["path"] not in {f["path"] for f in failed})
    if not failed:
        try:
            records = _push_records(client, loc, set_dir, records, ours, force or set())
            report["records"] = records
            report["uploaded_bytes"] += sum(r["size"] for r in records.values() if r["uploaded"])
            pushed = dict(manifest)
            pushed["records"] = {n: {"size": r["size"], "sha256": r["sha256"]} for n, r in records.items()}
            pushed["locations"] = {p["path"]: p["location"] for p in plan if p["action"] == "reference"}
            pushed["pushed_to"] = loc.url()
            body = (json.dumps(pushed, indent=1) + "\n").encode()
            _, sent_whole = _put_whole(client, loc, MANIFEST_NAME, body, ours, force or set())
            report["manifest_uploaded_bytes"] = len(body) if sent_whole else 0
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


def _meta(sha: str, set_id: str | None) -> dict[str, str]:
    return {SHA_META: sha, **({SET_META: set_id} if set_id else {})}


def _refuse_other_sets(
    client, loc: S3Location, plan: list[dict[str, Any]], records: tuple[str, ...], ours: str | None
) -> None:
    """S3Error (exit 2, nothing sent) when the prefix holds objects of another set that this push
    would overwrite: its manifest, its records, or any file of the plan."""
    clash = [(p["path"], p["owner"]) for p in plan if p["action"] == "refuse"]
    for name in (MANIFEST_NAME, *records):
        owner = foreign_owner(head(client, loc.bucket, loc.key(name)), ours)
        if owner is not None:
            clash.append((name, owner))
    if not clash:
        return
    other = ""
    try:
        theirs = get_manifest(client, loc.bucket, loc.key(MANIFEST_NAME)) or {}
        ident = theirs.get("set") if isinstance(theirs.get("set"), dict) else {}
        other = f" (that set: host {ident.get('host', '?')}, run {ident.get('run_dir', '?')}, " + (
            f"source {theirs.get('source', '?')})"
        )
    except S3Error:
        other = " (its MANIFEST.json cannot be read)"
    shown = "; ".join(f"{path}: set {owner[:12]}" for path, owner in clash[:5])
    raise S3Error(
        f"{loc.url()} holds objects of another set{other}: {len(clash)} object(s) this push would "
        f"overwrite ({shown}{' ...' if len(clash) > 5 else ''}); this set is {ours or 'a plain folder'}. "
        "Nothing was sent. Push to a prefix of its own (the salvage role's default names the node and "
        "the run: PREFIX/<host>/<run>; set salvage_s3_url), or remove the other set there first"
    )


def _put_whole(
    client, loc: S3Location, name: str, body: bytes, set_id: str | None, force: set[str]
) -> tuple[str, bool]:
    """`body` as the object `name` under the prefix, uploaded whole (Content-MD5, sha256 and set
    metadata) unless an object with the same sha256 is there already and `name` is not in `force`.
    Returns (its sha256, whether it was sent)."""
    digest = hashlib.sha256(body).hexdigest()
    h = head(client, loc.bucket, loc.key(name))
    if h is not None and h.get("Metadata", {}).get(SHA_META) == digest and name not in force:
        return digest, False
    client.put_object(
        Bucket=loc.bucket,
        Key=loc.key(name),
        Body=body,
        Metadata=_meta(digest, set_id),
        ContentType="text/markdown" if name.endswith(".md") else "application/json",
    )
    return digest, True


def _push_records(
    client,
    loc: S3Location,
    set_dir: Path,
    names: tuple[str, ...],
    set_id: str | None = None,
    force: set[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """NOTES.md and the JSON report: small, each uploaded whole (`_put_whole`), skipped when the object
    already has the same sha256."""
    out = {}
    for name in names:
        p = set_dir / name
        if not p.is_file():
            continue
        body = p.read_bytes()
        digest, sent_whole = _put_whole(client, loc, name, body, set_id, force or set())
        out[name] = {"size": len(body), "sha256": digest, "uploaded": sent_whole}
    return out


def _upload_all(
    client,
    loc,
    set_dir,
    manifest,
    todo,
    workers,
    chunk_bytes,
    threshold_bytes,
    progress,
    set_id=None,
    sent=None,
) -> list[dict[str, str]]:
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager
    from s3transfer.subscribers import BaseSubscriber

    bar = Progress(sum(p["size"] for p in todo), f"upload to {loc.url()}", progress)

    class _Bytes(BaseSubscriber):
        def on_progress(self, future, bytes_transferred, **kwargs):
            bar(bytes_transferred)
            if sent is not None:
                sent.count(bytes_transferred)

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
            extra = {"Metadata": _meta(manifest["files"][p["path"]]["sha256"], set_id)}
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
    progress_file: Path | None = None,
) -> dict[str, Any]:
    """`dflash s3 push DIR URL`: DIR's manifest written beside it (`DIR.manifest.json`, digests of
    unchanged files reused), then `push` (a dataset is uploaded once from wherever it was tokenized)."""
    from trainer.store.manifest import ManifestError, create_manifest, load_manifest

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
        progress_file=progress_file,
    )
    report["manifest"] = str(mpath)
    return report
