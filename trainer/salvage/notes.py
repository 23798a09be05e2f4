"""NOTES.md and salvage-report.json: what the node was, what ran, where everything went, what was
proven and how, and what was left behind, generated from the step reports in `SET/.salvage/`.

The first lines give the verdict: "the node can go" only when the trainer stopped cleanly (or was not
running), the push completed and verify passed; otherwise every reason not to shut it down is listed.
Light side.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainer.fsutil import atomic_write_text
from trainer.manifest import MANIFEST_NAME, ManifestError, content_digest, load_manifest
from trainer.salvage import NOTES_NAME, REPORT_NAME, STATE_DIR, SalvageError
from trainer.salvage.verify import load_lines

STEPS = ("inventory", "stop", "collect", "push", "verify")


def load_steps(set_dir: Path) -> dict[str, Any]:
    """The step reports; for inventory and stop, the first run's records kept in node/ (a later run
    finds the trainer already stopped: what ran and how it stopped is what the notes must say)."""
    out = {}
    first = {"inventory": "node/processes.json", "stop": "node/stop.json"}
    for step in STEPS:
        p = Path(set_dir) / STATE_DIR / f"{step}.json"
        kept = Path(set_dir) / first.get(step, "-")
        if kept.is_file():
            out[step] = json.loads(kept.read_text())
        elif p.is_file():
            out[step] = json.loads(p.read_text())
    return out


def save_step(set_dir: Path, step: str, report: dict[str, Any]) -> Path:
    """Record a step's report. A report that says the same as the recorded one up to per-run figures
    (timings, what this run happened to send) leaves the file alone, so an unchanged node keeps
    unchanged files (a fetch of the set then moves nothing)."""
    p = Path(set_dir) / STATE_DIR / f"{step}.json"
    new = json.loads(json.dumps(report, default=str))
    if p.is_file():
        try:
            if _stable({step: json.loads(p.read_text())}) == _stable({step: new}):
                return p
        except ValueError:
            pass
    atomic_write_text(p, json.dumps(new, indent=1) + "\n")
    return p


def verdict(steps: dict[str, Any], current: str | None = None) -> tuple[bool, list[str]]:
    """(node can go, every reason not to). `current` is the content digest of the set's MANIFEST.json
    now: collect, push and verify must each name it (the set collected is the set in S3, proven)."""
    reasons = []
    stop = steps.get("stop")
    if stop is None:
        reasons.append("the trainer was not stopped through salvage (no stop report)")
    elif not stop.get("ok"):
        reasons.append(f"stop: {stop.get('message')}")
    if "collect" not in steps:
        reasons.append("nothing was collected (no collect report)")
    push = steps.get("push")
    if push is None:
        reasons.append("the set was not pushed to S3 (no push report)")
    elif not push.get("ok"):
        reasons.append(f"push: {len(push.get('failed', []))} object(s) failed to upload; re-run the push")
    ver = steps.get("verify")
    if ver is None:
        reasons.append("the upload was not verified (no verify report)")
    elif not ver.get("ok"):
        reasons.append("verify FAILED: " + "; ".join(s.strip() for s in ver.get("summary", [])[1:6]))
    reasons += _same_set(steps, current)
    return not reasons, reasons


def _same_set(steps: dict[str, Any], current: str | None) -> list[str]:
    """Reasons why the collect, push and verify reports may describe different sets."""
    named = {
        "the set's MANIFEST.json": current,
        "collect": (steps.get("collect") or {}).get("manifest_digest"),
        "push": (steps.get("push") or {}).get("manifest_digest"),
        "verify (S3's manifest)": (steps.get("verify") or {}).get("manifest_digest"),
        "verify (the collected set it compared with)": (steps.get("verify") or {}).get("set_digest"),
    }
    if not all(k in steps for k in ("collect", "push", "verify")):
        return []  # already a reason above
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


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.3f} GB"


def _ts(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "?"


def render_notes(set_dir: Path, steps: dict[str, Any], current: str | None = None) -> str:
    ok, reasons = verdict(steps, current)
    collect = steps.get("collect", {})
    facts = collect.get("facts", {})
    host = facts.get("hostname", "this node")
    L: list[str] = [
        f"# Salvage notes: {host}",
        "",
        f"Generated by `dflash salvage notes` from the salvage of {facts.get('taken', '?')}.",
        "",
    ]
    if ok:
        L += [
            (
                "**Verdict: the node can go.** The trainer stopped cleanly, every artifact below was "
                "uploaded "
                "and read back with equal sha256, and every checkpoint and dataset loads. Collect, push "
                f"and verify name the same set (manifest digest `{(current or '?')[:16]}`)."
            ),
            "",
        ]
    else:
        L += ["**Verdict: DO NOT shut the node down yet.**", ""] + [f"- {r}" for r in reasons] + [""]

    L += ["## Node", "", "| fact | value |", "| --- | --- |"]
    for key in (
        "hostname",
        "os",
        "kernel",
        "machine",
        "cpus",
        "memory_gb",
        "gpus",
        "driver_version",
        "cuda_version",
        "python",
        "python_executable",
    ):
        if key in facts:
            L.append(f"| {key} | {facts[key]} |")
    for name, ver in sorted(facts.get("packages", {}).items()):
        L.append(f"| {name} | {ver} |")
    if facts.get("gpu_note"):
        L.append(f"| GPU facts | {facts['gpu_note']} |")
    L += [
        "",
        (
            "Full facts in the set: `node/facts.json`, `node/nvidia-smi-q.txt` (when nvidia-smi exists), "
            "`node/pip-freeze.txt`, `node/disk.txt`, `node/code/` (git HEAD and diff of the trainer)."
        ),
        "",
    ]

    L += ["## What ran, and its state when stopped", ""]
    inv = steps.get("inventory")
    if inv:
        L += [
            f"GPU processes: {inv.get('gpu_note')}",
            "",
            "| pid | kind | user | started | GPU MiB | action | command |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in inv["processes"]:
            cmd = p["cmdline"] if len(p["cmdline"]) <= 90 else p["cmdline"][:87] + "..."
            mem = "-" if p["gpu_memory_mib"] is None else f"{p['gpu_memory_mib']:.0f}"
            L.append(
                f"| {p['pid']} | {p['kind']} | {p['user']} | {_ts(p['started'])} | {mem} | {p['action']} | "
                f"`{cmd.replace('|', '/')}` |"
            )
        L.append("")
    else:
        L += ["No process inventory was taken.", ""]
    stop = steps.get("stop")
    if stop:
        L += [f"Trainer: **{stop.get('state')}**: {stop.get('message')}"]
        if stop.get("method"):
            L.append(f"(asked to stop via {stop['method'].get('how')}, waited {stop.get('waited_s', 0)} s)")
        ck = stop.get("checkpoint")
        if ck:
            probs = stop.get("checkpoint_problems") or []
            L.append(
                f"Checkpoint `latest`: {ck}: "
                + ("verifies (SHA256SUMS)" if not probs else "DOES NOT VERIFY: " + "; ".join(probs))
            )
        if stop.get("others"):
            for o in stop["others"]:
                L.append(
                    f"- also stopped (salvage_stop_unknown): pid {o['pid']} {o.get('what', '')}: "
                    f"{o['result']}"
                )
        L.append("")

    run_copy = Path(set_dir) / "run"
    if (run_copy / "events.jsonl").is_file():
        from trainer.monitor.summary import render_summary

        try:
            text = render_summary(run_copy)
        except (FileNotFoundError, ValueError) as exc:
            text = f"the run's event stream cannot be read: {exc}"
        L += ["## The run, from its event stream", "", "```text", text, "```", ""]

    L += ["## Where every artifact lives", ""]
    push = steps.get("push")
    base = push.get("s3") if push else None
    L.append(
        f"Local salvage set: `{collect.get('set_dir', set_dir)}` ({collect.get('file_count', '?')} files, "
        f"{_gb(collect.get('total_bytes'))}); manifest `MANIFEST.json` (path, size, sha256 of every file)."
    )
    if base:
        n_ref = len(push.get("referenced", []))
        L.append(
            f"S3: `{base}/` (manifest `{base}/MANIFEST.json`, these notes `{base}/NOTES.md`): every file of "
            f"the set"
            + (f", {n_ref} of them referenced where they already lived" if n_ref else "")
            + ("." if push.get("ok") else "; the push did NOT complete.")
        )
        if push.get("bucket_versioning"):
            L.append(
                f"Bucket versioning: {push['bucket_versioning']}"
                + (
                    " (an overwritten object's old bytes are kept)."
                    if push["bucket_versioning"] == "enabled"
                    else " (an object overwritten later is gone: keep this prefix to this set)."
                )
            )
    L += ["", "| what | files | bytes | where |", "| --- | --- | --- | --- |"]
    for kind, c in sorted(collect.get("by_kind", {}).items()):
        L.append(f"| {kind} | {c['files']} | {c['bytes']:,} | {_where(kind, base)} |")
    for ref in (push or {}).get("referenced", []):
        L.append(f"| `{ref['path']}` (referenced) | 1 | | {ref['location']} |")
    L.append("")
    for c in collect.get("checkpoints", []):
        probs = c.get("problems") or []
        L.append(
            f"- checkpoint `{c['name']}` (step {c['step']}, {c['why']}): "
            + ("verifies" if not probs else "DOES NOT VERIFY: " + "; ".join(probs))
            + (f"; at `{base}/run/checkpoints/{c['name']}/`" if base else "")
        )
    if collect.get("dataset"):
        ds = collect["dataset"]
        L.append(
            f"- dataset `{ds['source']}` -> `{ds['path']}/` ({_gb(ds['bytes'])})"
            + (f"; at `{base}/{ds['path']}/`" if base else "")
        )
    L.append("")

    L += ["## What was verified, and how", ""]
    ver = steps.get("verify")
    if ver:
        L += ["```"] + ver.get("summary", []) + ["```", ""]
        L.append(
            "Every manifest entry was read back from S3 and hashed (sha256), never trusted from the listing; "
            "JSON/YAML/safetensors headers parsed; each checkpoint verified its SHA256SUMS, loaded in "
            "speculators and ran one forward on CPU; each dataset was loaded and run through the data gate."
        )
        L.append("")
        L += load_lines(ver.get("load") or {}, markdown=True)
        L += ["", "Inventory of the prefix:", "", "| prefix | objects | bytes |", "| --- | --- | --- |"]
        for row in ver.get("inventory", []):
            L.append(f"| {row['prefix']} | {row['objects']} | {row['bytes']:,} |")
        L.append("")
    else:
        L += ["Not verified yet: run `dflash salvage verify --s3 ...`.", ""]

    L += ["## Found but not moved, and why", ""]
    left = collect.get("not_moved", [])
    for item in left:
        L.append(f"- `{item['path']}` ({_gb(item['bytes'])}): {item['why']}")
    for p in (inv or {}).get("processes", []):
        if (
            p["action"] == "report"
            and p["kind"] in ("trainer", "server", "unknown", "session")
            and not p["why"].startswith("a worker of the trainer")
        ):
            L.append(f"- process {p['pid']} ({p['what']}, {p['kind']}): left running: {p['why']}")
    for link in collect.get("links", []):
        L.append(
            f"- symlink `{link['path']}` -> `{link['target']}`: recorded, not followed (its target was not "
            "collected; salvage never follows a link out of the run)"
        )
    for n in collect.get("notes", []):
        L.append(f"- {n}")
    if not left and not inv:
        L.append("- nothing recorded")
    L += ["- the target model's weights: not salvaged (the run config names where they came from)", ""]
    return "\n".join(L) + "\n"


# Per-run figures (timings, how many objects this particular run sent): kept in SET/.salvage/, left out
# of the report so that a second run over an unchanged node regenerates it byte for byte.
VOLATILE = {
    "seconds",
    "integrity_seconds",
    "load_seconds",
    "placed",
    "removed",
    "hashed",
    "uploaded",
    "uploaded_bytes",
    "to_upload",
    "to_upload_bytes",
    "skipped",
    "resent",
    "aborted_stale_uploads",
    "plan",
    "manifest_uploaded_bytes",
    "records",
    "would_place",
    "check",
    "files",
    "bytes",
}


def _stable(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, dict):
        return {
            k: _stable(v, depth + 1)
            for k, v in obj.items()
            if not (depth == 1 and k in VOLATILE) and k != "seconds"
        }
    if isinstance(obj, list):
        return [_stable(v, depth + 1) for v in obj]
    return obj


def _where(kind: str, base: str | None) -> str:
    prefix = {
        "run": "run/",
        "checkpoint": "run/checkpoints/",
        "data": "data/",
        "config": "config/",
        "extra": "extra/",
        "node": "node/",
    }.get(kind, "")
    return f"`{base}/{prefix}`" if base else "local set only"


def write_notes(set_dir: Path) -> dict[str, Any]:
    set_dir = Path(set_dir)
    if not (set_dir / STATE_DIR).is_dir():
        raise SalvageError(
            f"{set_dir}/{STATE_DIR}/ does not exist: run `dflash salvage collect --out {set_dir}` first"
        )
    steps = load_steps(set_dir)
    current = None
    try:
        current = content_digest(load_manifest(set_dir / MANIFEST_NAME))
    except ManifestError:
        pass  # no (usable) manifest: the verdict names it
    ok, reasons = verdict(steps, current)
    text = render_notes(set_dir, steps, current)
    report = {"report_version": 1, "node_can_go": ok, "reasons": reasons, **_stable(steps)}
    old = [(set_dir / n).read_text() if (set_dir / n).is_file() else None for n in (NOTES_NAME, REPORT_NAME)]
    new = [text, json.dumps(report, indent=1, default=str, sort_keys=True) + "\n"]
    for name, before, after in zip((NOTES_NAME, REPORT_NAME), old, new, strict=True):
        if before != after:  # an unchanged file keeps its mtime: a later fetch of the set moves nothing
            atomic_write_text(set_dir / name, after)
    return {
        "notes": str(set_dir / NOTES_NAME),
        "report": str(set_dir / REPORT_NAME),
        "node_can_go": ok,
        "reasons": reasons,
        "changed": old != new,
    }
