"""Collect a run's artifacts and the node's facts into a salvage set with a sha256 manifest.

Layout of a salvage set (`SET/`)::

    MANIFEST.json            trainer.store.manifest format (relative path -> size + sha256 + mtime_ns)
    run/                     the run folder: run.yaml, events.jsonl, train.log, every other file
    run/checkpoints/         the newest K complete checkpoints (+ the best by eval tau), `latest`
    config/                  the run config file as given (--config), if outside the run folder
    data/<name>/             the tokenized dataset (data.path of the run config) unless --no-data
    extra/<name>             scripts, patches, configs named with --include
    node/                    facts.json, nvidia-smi-q.txt, pip-freeze.txt, disk.txt, code/ (git HEAD +
                             diff of the trainer checkout), recon/, processes.json, stop.json
    NOTES.md, salvage-report.json   written by `dflash salvage notes`
    .salvage/                step reports (inventory, stop, collect, push, verify); not in the manifest

What is taken (and what is left, with why) is decided in `select.py`; symlinks in the run are recorded
in the collect report and the notes, never followed. Large immutable files (checkpoint and dataset
files) are hard-linked when the set is on the same filesystem (a nearly full node disk cannot take a
second copy); everything else is copied. A file
already in the set with the same size and mtime is left alone, and the manifest reuses its digest, so
a second collect reads only what changed. Files of the set that are no longer selected are removed.
Light side: no torch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.salvage import MANIFEST_EXCLUDE, STATE_DIR, SalvageError
from trainer.salvage.facts import code_state, node_facts
from trainer.salvage.select import LINK_MIN_BYTES, Item, Selection, select
from trainer.store.fsutil import atomic_write_text
from trainer.store.manifest import MANIFEST_NAME

__all__ = ["collect", "select", "Item", "Selection"]

MANAGED = ("run", "config", "data", "extra", "node")


# ---------------------------------------------------------------- do it


def _place(item: Item, dest: Path, hardlink: bool) -> str:
    """Put one item at dest; returns linked | copied | kept | written."""
    if item.text is not None:
        if dest.is_file() and dest.read_text() == item.text:
            return "kept"
        atomic_write_text(dest, item.text)
        return "written"
    st = item.src.stat()
    if dest.is_file():
        dst = dest.stat()
        if dst.st_size == st.st_size and dst.st_mtime_ns == st.st_mtime_ns:
            return "kept"
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if hardlink and item.link_ok and st.st_size >= LINK_MIN_BYTES:
        try:
            os.link(item.src, dest)
            return "linked"
        except OSError:
            pass  # another filesystem: copy
    tmp = dest.with_name(f".{dest.name}.salvage-tmp")
    try:
        shutil.copy2(item.src, tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written stays in the set
        raise
    return "copied"


def _set_identity(old: dict[str, Any] | None, host: str, run_dir: Path, run_id: str | None) -> dict[str, Any]:
    """Which set this is: a random id kept while the same node salvages the same run into the same set
    folder, new otherwise. Every object a push writes carries it, and a push refuses to overwrite
    objects of another set (a reused host alias, another run at the same prefix)."""
    ident = {"host": host, "run_dir": str(Path(run_dir).resolve()), "run_id": run_id}
    prev = (old or {}).get("set")
    if isinstance(prev, dict) and prev.get("id") and all(prev.get(k) == v for k, v in ident.items()):
        return {"id": prev["id"], **ident}
    return {"id": uuid.uuid4().hex, **ident}


def _no_space(exc: OSError, set_dir: Path, what: str) -> SalvageError:
    try:
        free = f"{shutil.disk_usage(set_dir).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return SalvageError(
        f"the salvage set's disk is full ({exc.strerror}; {free}) while writing {what} under {set_dir}: "
        "free space there, or collect to a bigger disk (--out elsewhere; the role: salvage_set_dir). "
        "Nothing half-written was left; the set's MANIFEST.json was not updated"
    )


def collect(
    run_dir: Path,
    set_dir: Path,
    keep: int = 2,
    config: Path | None = None,
    includes: list[Path] | None = None,
    recon: list[Path] | None = None,
    with_data: bool = True,
    hardlink: bool = True,
    check: bool = False,
    refresh_facts: bool = False,
) -> dict[str, Any]:
    """Build (or bring up to date) the salvage set and its manifest; returns the collect report. A full
    disk is a SalvageError (exit 2) naming what could not be written; no temp file is left."""
    set_dir = Path(set_dir)
    if set_dir.resolve().is_relative_to(Path(run_dir).resolve()):
        raise SalvageError(f"the salvage set {set_dir} must not lie inside the run folder {run_dir}")
    state = set_dir / STATE_DIR
    sel = select(run_dir, keep, config, includes, recon, with_data, state_dir=state)
    t0 = time.monotonic()
    old_facts = set_dir / "node" / "facts.json"
    if old_facts.is_file() and not refresh_facts:
        # facts of this node were taken by the first collect: keep them (a second run moves nothing)
        facts = json.loads(old_facts.read_text())
        for p in sorted((set_dir / "node").rglob("*")):
            rel = p.relative_to(set_dir).as_posix()
            if (
                p.is_file()
                and rel not in ("node/processes.json", "node/stop.json", "node/facts.json")
                and not rel.startswith("node/recon/")
            ):
                sel.items.append(Item(p, rel, p.stat().st_size, "node"))
        facts_text = old_facts.read_text()
    else:
        facts, fact_files = node_facts()
        for name, text in fact_files.items():
            sel.items.append(Item(None, f"node/{name}", len(text.encode()), "node", text=text))
        for name, text in code_state().items():
            sel.items.append(Item(None, f"node/code/{name}", len(text.encode()), "node", text=text))
        facts_text = json.dumps(facts, indent=1, sort_keys=True) + "\n"
    report: dict[str, Any] = {
        "run_dir": str(Path(run_dir).resolve()),
        "set_dir": str(set_dir.resolve()),
        "check": check,
        "keep": keep,
        "files": len(sel.items) + 1,
        "bytes": sum(i.size for i in sel.items) + len(facts_text),
        "checkpoints": sel.checkpoints,
        "dataset": sel.dataset,
        "not_moved": sel.not_moved,
        "links": sel.links,
        "notes": sel.notes,
        "facts": facts,
        "by_kind": _by_kind(sel.items),
    }
    if check:
        report["would_place"] = [{"path": i.rel, "bytes": i.size, "kind": i.kind} for i in sel.items]
        return report
    set_dir.mkdir(parents=True, exist_ok=True)
    sel.items.append(Item(None, "node/facts.json", len(facts_text), "node", text=facts_text))
    counts: dict[str, int] = {}
    what = str(set_dir)
    try:
        for it in sel.items:
            what = it.rel
            how = _place(it, set_dir / it.rel, hardlink)
            counts[how] = counts.get(how, 0) + 1
        what = MANIFEST_NAME
        return _finish_set(set_dir, sel, report, counts, facts, run_dir, t0)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise _no_space(exc, set_dir, what) from None
        raise


def _finish_set(
    set_dir: Path,
    sel: Selection,
    report: dict[str, Any],
    counts: dict[str, int],
    facts: dict[str, Any],
    run_dir: Path,
    t0: float,
) -> dict[str, Any]:
    """Remove what is no longer selected, then (re)write the manifest; completes the collect report."""
    from trainer.store.manifest import (
        ManifestError,
        content_digest,
        create_manifest,
        load_manifest,
        same_content,
    )

    wanted = {it.rel for it in sel.items}
    removed = []
    for top in MANAGED:
        root = set_dir / top
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.relative_to(set_dir).as_posix() not in wanted:
                p.unlink()
                removed.append(p.relative_to(set_dir).as_posix())
    old = None
    try:
        old = load_manifest(set_dir / MANIFEST_NAME)
    except ManifestError:
        old = None
    manifest = create_manifest(
        set_dir,
        None,
        exclude=(*MANIFEST_EXCLUDE, MANIFEST_NAME),
        reuse=old,
        source=f"{facts['hostname']}:{set_dir.resolve()}",
    )
    manifest["set"] = _set_identity(old, facts["hostname"], run_dir, sel.run_id)
    unchanged = (
        old is not None
        and old.get("set") == manifest["set"]
        and same_content(old, manifest)
        and all(
            old["files"].get(k, {}).get("mtime_ns") == v.get("mtime_ns") for k, v in manifest["files"].items()
        )
    )
    if not unchanged:  # an unchanged set keeps its manifest file untouched (a fetch then moves nothing)
        atomic_write_text(set_dir / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    report.update(
        placed=counts,
        removed=removed,
        hashed=manifest["hashed"],
        manifest=MANIFEST_NAME,
        file_count=manifest["file_count"],
        total_bytes=manifest["total_bytes"],
        manifest_digest=content_digest(manifest),
        set_id=manifest["set"]["id"],
        seconds=round(time.monotonic() - t0, 3),
    )
    return report


def _by_kind(items: list[Item]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for it in items:
        k = out.setdefault(it.kind, {"files": 0, "bytes": 0})
        k["files"] += 1
        k["bytes"] += it.size
    return out
