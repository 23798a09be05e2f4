"""S3 transfers, every file proven by its sha256: `client` (addresses, the boto3 client, heads,
read-back), `push` (a folder with a manifest: a salvage set or `dflash s3 push`), `pull` (`dflash s3
pull`, resumable). Light side: boto3 is imported lazily, never torch."""

from __future__ import annotations

from trainer.errors import DflashError


class S3Error(DflashError, ValueError):
    """A bad S3 address, missing credentials, an unusable bucket or a prefix that does not match its
    manifest: found before any byte moves; the message says what to fix."""
