"""S3 addresses, a boto3 client that sends Content-MD5 on every upload request, object heads and
listings, byte progress, and reading an object back with its sha256.

Credentials come from boto3's standard chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, then the
profile (AWS_PROFILE, else `default`) in the credentials file (AWS_SHARED_CREDENTIALS_FILE, else
~/.aws/credentials) and the config file (AWS_CONFIG_FILE, else ~/.aws/config), then container and
instance metadata; `make_client` names each when none gives keys. Nothing here prints or logs them;
errors name buckets and keys only. Light side: boto3 is imported lazily.
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

from trainer import jsonin
from trainer.s3 import S3Error

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
        raise S3Error(f"--s3 {url!r}: expected s3://BUCKET/PREFIX")
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise S3Error(f"--s3 {url!r}: no bucket name (expected s3://BUCKET/PREFIX)")
    if not (3 <= len(bucket) <= 63) or not all(c.islower() or c.isdigit() or c in ".-" for c in bucket):
        raise S3Error(f"--s3 {url!r}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise S3Error(f"--s3 {url!r}: the prefix has an empty, '.' or '..' part")
    return S3Location(bucket, prefix)


def add_content_md5(params: dict[str, Any], **_kwargs: Any) -> None:
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


def make_client(
    endpoint_url: str | None = None, max_pool: int = 16, retries: int = 3, timeout_s: float = 20.0
):
    """A boto3 S3 client from the standard credential chain, with Content-MD5 on every upload request.

    Raises S3Error (before any work) when no credentials are configured."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    try:
        session = boto3.Session()
        creds = session.get_credentials()
    except ProfileNotFound:
        raise S3Error(_no_credentials("its profile does not exist")) from None
    except BotoCoreError as exc:  # an unreadable credentials or config file, a failed credential_process
        raise S3Error(f"AWS credentials could not be read: {type(exc).__name__}: {exc}") from None
    if creds is None:
        raise S3Error(_no_credentials("no keys for it there"))
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
        client.meta.events.register(f"before-call.s3.{op}", add_content_md5, unique_id=f"dflash-md5-{op}")
    return client


def _no_credentials(why_profile: str) -> str:
    """What boto3's credential chain looked at, in its order, with the files it actually read (their
    paths after AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE), and how to give it keys."""
    import botocore.session

    env = os.environ
    bs = botocore.session.Session()
    creds_file = os.path.expanduser(bs.get_config_variable("credentials_file"))
    config_file = os.path.expanduser(bs.get_config_variable("config_file"))
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"

    def state(path: str) -> str:
        p = Path(path)
        if not p.exists():
            return "absent"
        return "empty" if not p.is_file() or p.stat().st_size == 0 else why_profile

    keys = [k for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if env.get(k)]
    env_state = f"only {keys[0]} is set" if keys else "not set"
    imds = env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    return (
        "no AWS credentials found. boto3 looked, in this order, at: AWS_ACCESS_KEY_ID + "
        f"AWS_SECRET_ACCESS_KEY in the environment ({env_state}); profile {profile!r} (AWS_PROFILE) in "
        f"the credentials file {creds_file} (AWS_SHARED_CREDENTIALS_FILE; {state(creds_file)}) and the "
        f"config file {config_file} (AWS_CONFIG_FILE; {state(config_file)}); then the container and "
        "instance metadata endpoints ("
        + ("off: AWS_EC2_METADATA_DISABLED=true" if imds else "none answered")
        + "). Set both variables, or put aws_access_key_id / aws_secret_access_key under "
        f"[{profile}] in that credentials file (the salvage and data_sync roles write the vault's "
        "vault_s3_* keys to a 0600 file and name it in AWS_SHARED_CREDENTIALS_FILE)"
    )


def check_bucket(client, loc: S3Location) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=loc.bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        raise S3Error(
            f"bucket {loc.bucket!r} is not usable (HeadBucket: {code}); create it or fix --s3"
        ) from None
    except BotoCoreError as exc:
        raise S3Error(
            f"S3 endpoint unreachable for bucket {loc.bucket!r}: {type(exc).__name__}: {exc}"
        ) from None


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


def abort_stale_uploads(client, loc: S3Location, keys: set[str] | frozenset[str]) -> list[str]:
    """Abort the multipart uploads an interrupted push left at `keys` (the set's own keys under the
    prefix); their keys. An upload at any other key -- another set's push into a child prefix
    (PREFIX/node-b/...) running right now, say -- is not this push's to abort and is left alone."""
    prefix = f"{loc.prefix}/" if loc.prefix else ""
    aborted = []
    paginator = client.get_paginator("list_multipart_uploads")
    for page in paginator.paginate(Bucket=loc.bucket, Prefix=prefix):
        for up in page.get("Uploads", []):
            if up["Key"] not in keys:
                continue
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
    return jsonin.loads(body)  # hostile nesting / lone surrogates: a ValueError like any bad JSON


def get_manifest(client, bucket: str, key: str) -> dict[str, Any] | None:
    """The manifest stored at `key` (None when there is none), checked like a local one before any of
    it is used: an object that is not JSON, not a manifest, or names a path outside its set is refused
    (S3Error, exit 2) -- whoever can write to the bucket must not be able to steer a reader's writes."""
    from trainer.store.manifest import ManifestError, check_manifest

    label = f"s3://{bucket}/{key}"
    try:
        raw = get_json(client, bucket, key)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise S3Error(f"manifest {label} is not valid JSON: {exc}") from None
    if raw is None:
        return None
    try:
        return check_manifest(raw, label)
    except ManifestError as exc:
        raise S3Error(str(exc)) from None


def bucket_versioning(client, bucket: str) -> str:
    """enabled | suspended | off | unknown (...): whether the bucket keeps an overwritten object's old
    bytes (GetBucketVersioning)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        status = client.get_bucket_versioning(Bucket=bucket).get("Status")
    except ClientError as exc:
        return f"unknown ({exc.response.get('Error', {}).get('Code', '?')})"
    except BotoCoreError as exc:
        return f"unknown ({type(exc).__name__})"
    return {"Enabled": "enabled", "Suspended": "suspended"}.get(status or "", "off")


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

            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=sys.stderr
            )

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
                print(
                    f"{self.label}: {self.done / MiB:.1f}/{self.total / MiB:.1f} MiB "
                    f"({100 * self.done / self.total:.0f}%)",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------- read back


def read_back(
    client, bucket: str, key: str, save_to: Path | None = None, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int, dict[str, str]]:
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
