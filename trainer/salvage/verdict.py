"""The verdict of a salvage: may the node be shut down?

Only when, in the salvage now open (`session.py`), the trainer stopped cleanly (or was not running),
collect, push and verify each recorded a report of THIS salvage, none was refused or failed, all three
name the manifest digest of the set as it is now, push and verify name the same S3 address, and, for
the final word, the last push (the final notes push) put exactly the NOTES.md and salvage-report.json
that say so into S3 at that address. The notes cannot name their own upload, so `notes_verdict` is what
NOTES.md says and `notes_in_s3` is whether the push after it carried them; `dflash salvage notes` says
"the node can go" only when both hold. Light side.
"""

from __future__ import annotations

import hashlib
from typing import Any

from trainer.salvage import NOTES_NAME, REPORT_NAME

BOUND = ("collect", "push", "verify")  # the steps whose reports must be of the open salvage


def _s3(url: Any) -> str | None:
    if not isinstance(url, str) or not url:
        return None
    return url.rstrip("/")


def notes_verdict(
    steps: dict[str, Any], current: str | None = None, salvage_id: str | None = None
) -> tuple[bool, list[str]]:
    """(the notes may say "the node can go", every reason not to). `current` is the content digest of
    the set's MANIFEST.json now; `salvage_id` the open salvage's id."""
    reasons = []
    if salvage_id is None:
        reasons.append(
            "no salvage was started in this set (`dflash salvage stop --out SET` or `dflash salvage all` "
            "starts one): no step report can be shown to be of this salvage"
        )
    stop = steps.get("stop")
    if stop is None:
        reasons.append("the trainer was not stopped through salvage (no stop report)")
    elif not stop.get("ok"):
        reasons.append(f"stop: {stop.get('message')}")
    for step, missing in (
        ("collect", "nothing was collected (no collect report)"),
        ("push", "the set was not pushed to S3 (no push report)"),
        ("verify", "the upload was not verified (no verify report)"),
    ):
        rep = steps.get(step)
        if rep is None:
            reasons.append(missing)
        elif rep.get("refused"):
            where = rep.get("s3") or rep.get("where")
            did = "failed" if rep.get("error") else "was refused"
            reasons.append(
                f"{step}{f' to {where}' if step == 'push' and where else ''} {did}: {rep['refused']}"
            )
        elif salvage_id is not None and rep.get("salvage_id") != salvage_id:
            reasons.append(
                f"the {step} report is of an earlier salvage ({str(rep.get('salvage_id'))[:12]}, not "
                f"{salvage_id[:12]}): run {step} again"
            )
        elif step == "push" and not rep.get("ok"):
            reasons.append(f"push: {len(rep.get('failed', []))} object(s) failed to upload; re-run the push")
        elif step == "verify" and not rep.get("ok"):
            reasons.append("verify FAILED: " + "; ".join(s.strip() for s in rep.get("summary", [])[1:6]))
    if all(k in steps and not steps[k].get("refused") for k in BOUND):  # else already a reason above
        reasons += same_set(steps, current) + same_address(steps)
    return not reasons, reasons


def same_set(steps: dict[str, Any], current: str | None) -> list[str]:
    """Reasons why the collect, push and verify reports may describe different sets."""
    named = {
        "the set's MANIFEST.json": current,
        "collect": (steps.get("collect") or {}).get("manifest_digest"),
        "push": (steps.get("push") or {}).get("manifest_digest"),
        "verify (S3's manifest)": (steps.get("verify") or {}).get("manifest_digest"),
        "verify (the collected set it compared with)": (steps.get("verify") or {}).get("set_digest"),
    }
    unnamed = [k for k, v in named.items() if not v]
    if unnamed:
        return [
            f"{', '.join(unnamed)} named no manifest digest, so nothing proves that the set collected is "
            "the set in S3: re-run push and verify (`dflash salvage verify --s3 URL --out SET`)"
        ]
    if len(set(named.values())) > 1:
        return [
            "collect, push and verify describe different sets ("
            + ", ".join(f"{k} {v[:12]}" for k, v in named.items())
            + "): the set changed after it was pushed or verified; push and verify it again"
        ]
    return []


def same_address(steps: dict[str, Any]) -> list[str]:
    """Push and verify must name one S3 address: what was verified is where the set was pushed."""
    pushed, verified = _s3((steps.get("push") or {}).get("s3")), _s3((steps.get("verify") or {}).get("where"))
    if not pushed or not verified:
        return ["push or verify named no S3 address: push and verify the set (`--s3 URL`) again"]
    if pushed != verified:
        return [
            f"push and verify name different S3 addresses (push {pushed}, verify {verified}): verify the "
            "address the set was pushed to"
        ]
    return []


def notes_in_s3(steps: dict[str, Any], written: dict[str, bytes], salvage_id: str | None) -> list[str]:
    """Why the last push did not (yet) put exactly these NOTES.md and report bytes into S3 at the
    verified address in this salvage; empty when it did."""
    push = steps.get("push") or {}
    records = push.get("records") if isinstance(push.get("records"), dict) else {}
    if push.get("salvage_id") != salvage_id or not push.get("ok") or push.get("refused"):
        return ["the final notes push did not complete in this salvage: push the set again, then run notes"]
    stale = [
        name
        for name in (NOTES_NAME, REPORT_NAME)
        if (records.get(name) or {}).get("sha256") != hashlib.sha256(written[name]).hexdigest()
    ]
    if stale:
        return [
            f"S3 does not hold these notes yet ({', '.join(stale)}): push the set once more (the final "
            f"notes push to {push.get('s3')}), then run `dflash salvage notes` again"
        ]
    return []
