"""Move a salvage set to S3 and read it back.

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

import base64
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.fsutil import sha256_file
from trainer.salvage import MANIFEST_NAME, RECORDS, SalvageError

MiB = 2**20
DEFAULT_CHUNK = 16 * MiB
DEFAULT_THRESHOLD = 16 * MiB
SHA_META = "sha256"


# ---------------------------------------------------------------- addresses and clients


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading/trailing slash; may be ""

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def url(self, rel: str = "") -> str:
        key = self.key(rel) if rel else self.prefix
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def rel(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key


def parse_s3_url(url: str) -> S3Location:
    """`s3://BUCKET/PREFIX` -> S3Location; a clear error for anything else."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise SalvageError(f"--s3 {url!r}: expected s3://BUCKET/PREFIX")
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise SalvageError(f"--s3 {url!r}: no bucket name (expected s3://BUCKET/PREFIX)")
    if not (3 <= len(bucket) <= 63) or not all(c.islower() or c.isdigit() or c in ".-" for c in bucket):
        raise SalvageError(f"--s3 {url!r}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise SalvageError(f"--s3 {url!r}: the prefix has an empty, '.' or '..' part")
    return S3Location(bucket, prefix)


def _content_md5(params: dict[str, Any], **_kwargs: Any) -> None:
    """before-call hook: set Content-MD5 from the body about to be sent (bytes or a seekable file)."""
    headers = params.setdefault("headers", {})
    if any(k.lower() == "content-md5" for k in headers):
        return
    body = params.get("body")
    md5 = hashlib.md5(usedforsecurity=False)
    if body is None:
        pass
    elif isinstance(body, (bytes, bytearray)):
        md5.update(body)
    else:
        start = body.tell()
        for chunk in iter(lambda: body.read(MiB), b""):
            md5.update(chunk)
        body.seek(start)
    headers["Content-MD5"] = base64.b64encode(md5.digest()).decode("ascii")


def make_client(endpoint_url: str | None = None, max_pool: int = 16, retries: int = 3, timeout_s: float = 20.0):
    """A boto3 S3 client from the standard credential chain, with Content-MD5 on every upload request.

    Raises SalvageError (before any work) when no credentials are configured."""
    import boto3
    from botocore.config import Config

    session = boto3.Session()
    if session.get_credentials() is None:
        raise SalvageError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
            "(the salvage role passes them from the vault as environment variables)"
        )
    region = session.region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = Config(
        # Flexible checksums (CRC32 trailers) are not understood by every S3 server (radosgw): send
        # Content-MD5 instead, which every server checks.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": retries, "mode": "standard"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s * 3,
        max_pool_connections=max_pool,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
    for op in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-call.s3.{op}", _content_md5, unique_id=f"dflash-md5-{op}")
    return client


def check_bucket(client, loc: S3Location) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=loc.bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        raise SalvageError(f"bucket {loc.bucket!r} is not usable (HeadBucket: {code}); create it or fix --s3") from None
    except BotoCoreError as exc:
        raise SalvageError(f"S3 endpoint unreachable for bucket {loc.bucket!r}: {type(exc).__name__}: {exc}") from None


def head(client, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def list_objects(client, loc: S3Location) -> Iterator[dict[str, Any]]:
    paginator = client.get_paginator("list_objects_v2")
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    for page in paginator.paginate(Bucket=loc.bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def abort_stale_uploads(client, loc: S3Location) -> list[str]:
    """Abort multipart uploads left under the prefix by an interrupted push; their keys."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    aborted = []
    paginator = client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=loc.bucket, Prefix=prefix):
        for up in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=loc.bucket, Key=up["Key"], UploadId=up["UploadId"])
            aborted.append(up["Key"])
    return aborted


def get_json(client, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return json.loads(body)


# ---------------------------------------------------------------- progress


class Progress:
    """Byte progress on stderr: a tqdm bar on a terminal, a line every few seconds otherwise."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=sys.stderr)

    def __call__(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if now - self._last >= 5 or self.done >= self.total:
                self._last = now
                print(f"{self.label}: {self.done / MiB:.1f}/{self.total / MiB:.1f} MiB "
                      f"({100 * self.done / self.total:.0f}%)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------- push


def _plan(client, loc: S3Location, manifest: dict[str, Any], references: dict[str, str]) -> list[dict[str, Any]]:
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
        if h is not None and h.get("Metadata", {}).get(SHA_META) == entry["sha256"] and h["ContentLength"] == entry["size"]:
            return {"path": rel, "key": key, "size": entry["size"], "action": "skip", "why": "same sha256 already at the key"}
        ref = references.get(entry["sha256"])
        if ref is not None:
            return {"path": rel, "key": key, "size": entry["size"], "action": "reference", "location": ref,
                    "why": "an object with the same sha256 already lives in S3"}
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
            raise SalvageError(f"--reference {url}: no {MANIFEST_NAME} there (only salvage sets can be referenced)")
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
) -> dict[str, Any]:
    """Upload a salvage set (folder with MANIFEST.json) to `url`, or any folder whose manifest is
    `manifest_path` (`dflash s3 push`). Returns the push report; raises SalvageError on bad input
    before any transfer."""
    from trainer.manifest import ManifestError, load_manifest

    set_dir = Path(set_dir)
    loc = parse_s3_url(url)
    mpath = Path(manifest_path) if manifest_path is not None else set_dir / MANIFEST_NAME
    try:
        manifest = load_manifest(mpath)
    except ManifestError as exc:
        raise SalvageError(f"{exc} ({remake_hint} first)") from None
    stale = stale_files(set_dir, manifest)
    if stale:
        raise SalvageError(
            f"{len(stale)} file(s) of {set_dir} differ from {mpath.name}: " + "; ".join(stale[:20])
            + f" -- {remake_hint} (or restore the files) before pushing"
        )
    client = client or make_client(endpoint_url, max_pool=max(16, workers * 2))
    check_bucket(client, loc)
    refs = load_references(client, references or [])
    t0 = time.monotonic()
    plan = _plan(client, loc, manifest, refs)
    todo = [p for p in plan if p["action"] == "upload"]
    report: dict[str, Any] = {
        "s3": loc.url(), "endpoint_url": endpoint_url, "check": check,
        "files": len(plan), "bytes": sum(p["size"] for p in plan),
        "to_upload": len(todo), "to_upload_bytes": sum(p["size"] for p in todo),
        "skipped": sum(p["action"] == "skip" for p in plan),
        "referenced": [{"path": p["path"], "location": p["location"]} for p in plan if p["action"] == "reference"],
        "plan": plan,
    }
    if check:
        report.update(uploaded=0, uploaded_bytes=0, failed=[], ok=True)
        return report
    report["aborted_stale_uploads"] = abort_stale_uploads(client, loc)
    failed = _upload_all(client, loc, set_dir, manifest, todo, workers, chunk_bytes, threshold_bytes, progress)
    report["failed"] = failed
    report["uploaded"] = len(todo) - len(failed)
    report["uploaded_bytes"] = sum(p["size"] for p in todo if p["path"] not in {f["path"] for f in failed})
    if not failed:
        try:
            records = _push_records(client, loc, set_dir)
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
                client.put_object(Bucket=loc.bucket, Key=loc.key(MANIFEST_NAME), Body=body,
                                  Metadata={SHA_META: digest}, ContentType="application/json")
                report["manifest_uploaded_bytes"] = len(body)
            else:
                report["manifest_uploaded_bytes"] = 0
            report["manifest_key"] = loc.key(MANIFEST_NAME)
        except Exception as exc:  # noqa: BLE001 - the endpoint died between the last object and the manifest
            failed.append({"path": MANIFEST_NAME, "key": loc.key(MANIFEST_NAME), "error": f"{type(exc).__name__}: {exc}"})
    report["seconds"] = round(time.monotonic() - t0, 3)
    report["ok"] = not failed
    return report


def _push_records(client, loc: S3Location, set_dir: Path) -> dict[str, dict[str, Any]]:
    """NOTES.md and the JSON report: small, uploaded whole with Content-MD5 and sha256 metadata,
    skipped when the object already has the same sha256."""
    out = {}
    for name in RECORDS:
        p = set_dir / name
        if not p.is_file():
            continue
        body = p.read_bytes()
        digest = hashlib.sha256(body).hexdigest()
        h = head(client, loc.bucket, loc.key(name))
        same = h is not None and h.get("Metadata", {}).get(SHA_META) == digest
        if not same:
            ctype = "text/markdown" if name.endswith(".md") else "application/json"
            client.put_object(Bucket=loc.bucket, Key=loc.key(name), Body=body, Metadata={SHA_META: digest}, ContentType=ctype)
        out[name] = {"size": len(body), "sha256": digest, "uploaded": not same}
    return out


def _upload_all(client, loc, set_dir, manifest, todo, workers, chunk_bytes, threshold_bytes, progress) -> list[dict[str, str]]:
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager
    from s3transfer.subscribers import BaseSubscriber

    bar = Progress(sum(p["size"] for p in todo), f"upload to {loc.url()}", progress)

    class _Bytes(BaseSubscriber):
        def on_progress(self, future, bytes_transferred, **kwargs):
            bar(bytes_transferred)

    config = TransferConfig(multipart_threshold=threshold_bytes, multipart_chunksize=chunk_bytes,
                            max_concurrency=workers, use_threads=True)
    failed = []
    with TransferManager(client, config) as tm:
        futures = []
        for p in todo:
            extra = {"Metadata": {SHA_META: manifest["files"][p["path"]]["sha256"]}}
            fut = tm.upload(str(set_dir / p["path"]), loc.bucket, p["key"], extra_args=extra, subscribers=[_Bytes()])
            futures.append((p, fut))
        for p, fut in futures:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - one failed object must not hide the others' results
                failed.append({"path": p["path"], "key": p["key"], "error": f"{type(exc).__name__}: {exc}"})
    bar.close()
    return failed


# ---------------------------------------------------------------- read back


def read_back(client, bucket: str, key: str, save_to: Path | None = None, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int, dict[str, str]]:
    """(sha256, size, metadata) of an object, streamed; with `save_to`, also written there (temp +
    rename)."""
    obj = client.get_object(Bucket=bucket, Key=key)
    h = hashlib.sha256()
    size = 0
    fh = None
    tmp = None
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{save_to.name}.", dir=save_to.parent)
        fh = os.fdopen(fd, "wb")
    try:
        for chunk in obj["Body"].iter_chunks(MiB):
            h.update(chunk)
            size += len(chunk)
            if fh is not None:
                fh.write(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
        if fh is not None:
            fh.close()
            os.replace(tmp, save_to)
    except BaseException:
        if fh is not None:
            fh.close()
            Path(tmp).unlink(missing_ok=True)
        raise
    return h.hexdigest(), size, obj.get("Metadata", {})
