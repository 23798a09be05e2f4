"""Salvage a node before it is shut down: inventory of running work, graceful stop of the
trainer, a checksummed salvage set, upload to S3, read-back verification and NOTES.md.

Light side: nothing here imports torch, transformers or speculators at import time; only the
loadability checks of `verify` import them, lazily. Docs: docs/salvage.md.
"""

from trainer.errors import DflashError

STATE_DIR = ".salvage"  # step reports of this salvage set; never part of the manifest
NOTES_NAME = "NOTES.md"
REPORT_NAME = "salvage-report.json"
# NOTES.md and the report describe the set: they are uploaded beside it as "records" (sha256 in their
# metadata and in the uploaded manifest), not listed as its files, so regenerating them identically
# changes nothing and a second salvage run moves nothing.
RECORDS = (NOTES_NAME, REPORT_NAME)
MANIFEST_EXCLUDE = (STATE_DIR, NOTES_NAME, REPORT_NAME)


class SalvageError(DflashError, RuntimeError):
    """Bad input or a precondition that fails before any work; the message says what to change."""
