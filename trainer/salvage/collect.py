"""Collect a run's artifacts and the node's facts into a salvage set with a sha256 manifest.

Layout of a salvage set (`SET/`)::

    MANIFEST.json            trainer.manifest format (relative path -> size + sha256 + mtime_ns)
    run/                     the run folder: run.yaml, events.jsonl, train.log, every other file
    run/checkpoints/         the newest K complete checkpoints (+ the best by eval tau), `latest`
    config/                  the run config file as given (--config), if outside the run folder
    data/<name>/             the tokenized dataset (data.path of the run config) unless --no-data
    extra/<name>             scripts, patches, configs named with --include
    node/                    facts.json, nvidia-smi-q.txt, pip-freeze.txt, disk.txt, code/ (git HEAD +
                             diff of the trainer checkout), recon/, processes.json, stop.json
    NOTES.md, salvage-report.json   written by `dflash salvage notes`
    .salvage/                step reports (inventory, stop, collect, push, verify); not in the manifest

Large immutable files (checkpoint and dataset files) are hard-linked when the set is on the same
filesystem (a nearly full node disk cannot take a second copy); everything else is copied. A file
already in the set with the same size and mtime is left alone, and the manifest reuses its digest, so
a second collect reads only what changed. Files of the set that are no longer selected are removed.
Light side: no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import checkpoint as ckpt
from trainer.events import load_events
from trainer.fsutil import atomic_write_text
from trainer.manifest import MANIFEST_NAME, manifest_beside
from trainer.salvage import MANIFEST_EXCLUDE, STATE_DIR, SalvageError
from trainer.salvage.facts import code_state, node_facts

MANAGED = ("run", "config", "data", "extra", "node")
LINK_MIN_BYTES = 1 << 20


@dataclass
class Item:
    src: Path | None  # None: generated content (text)
    rel: str  # path inside the set
    size: int
    kind: str  # run | checkpoint | data | config | extra | node
    link_ok: bool = False
    text: str | None = None


@dataclass
class Selection:
    items: list[Item] = field(default_factory=list)
    not_moved: list[dict[str, Any]] = field(default_factory=list)  # path, bytes, why
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # name, step, problems, why
    dataset: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def add_path(self, path: Path, rel_dir: str, kind: str) -> None:
        """A file or a whole folder, under `rel_dir/<its name>` in the set."""
        if path.is_dir():
            self.add_tree(path, f"{rel_dir}/{path.name}", kind)
        else:
            self.items.append(Item(path, f"{rel_dir}/{path.name}", path.stat().st_size, kind))

    def add_tree(self, root: Path, rel_root: str, kind: str, link_ok: bool = False, skip=None) -> None:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            base = Path(dirpath)
            rel_dir = base.relative_to(root).as_posix()
            if skip is not None:
                dirnames[:] = [d for d in dirnames if not skip(base / d)]
            dirnames.sort()
            for name in sorted(filenames):
                p = base / name
                if skip is not None and skip(p):
                    continue
                if not p.is_file():
                    self.not_moved.append(
                        {
                            "path": str(p),
                            "bytes": 0,
                            "why": "not a regular file (socket, fifo or dangling link)",
                        }
                    )
                    continue
                rel = f"{rel_root}/{name}" if rel_dir == "." else f"{rel_root}/{rel_dir}/{name}"
                self.items.append(Item(p, rel, p.stat().st_size, kind, link_ok))


# ---------------------------------------------------------------- what to take


def best_by_tau(events: list[dict[str, Any]]) -> str | None:
    """The checkpoint name of the eval event with the highest tau, if any eval named one."""
    best = None
    for ev in events:
        if ev.get("event") != "eval":
            continue
        tau = ev.get("tau")
        name = ev.get("checkpoint") or (
            ckpt.checkpoint_name(ev["step"]) if isinstance(ev.get("step"), int) else None
        )
        if isinstance(tau, (int, float)) and name and (best is None or tau > best[0]):
            best = (float(tau), Path(str(name)).name)
    return best[1] if best else None


def _config_of(run_dir: Path, config: Path | None) -> dict[str, Any] | None:
    import yaml

    for p in ([config] if config else []) + [run_dir / "run.yaml"]:
        if p is not None and p.is_file():
            try:
                raw = yaml.safe_load(p.read_text())
                return raw if isinstance(raw, dict) else None
            except yaml.YAMLError:
                return None
    for ev in reversed(load_events(run_dir / "events.jsonl")):
        if ev.get("event") == "run_start" and isinstance(ev.get("config"), dict):
            return ev["config"]
    return None


def select(
    run_dir: Path,
    keep: int = 2,
    config: Path | None = None,
    includes: list[Path] | None = None,
    recon: list[Path] | None = None,
    with_data: bool = True,
    state_dir: Path | None = None,
) -> Selection:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SalvageError(f"run folder {run_dir} does not exist (pass the run's out_dir with --run-dir)")
    if keep < 1:
        raise SalvageError(f"--keep {keep}: keep at least the newest checkpoint")
    for p in (includes or []) + (recon or []) + ([config] if config else []):
        if not Path(p).exists():
            raise SalvageError(f"{p} does not exist (named with --include/--recon/--config)")
    sel = Selection()
    ck_root = ckpt.checkpoints_dir(run_dir)

    def in_checkpoints(p: Path) -> bool:
        return p == ck_root

    sel.add_tree(run_dir, "run", "run", skip=in_checkpoints)
    events = load_events(run_dir / "events.jsonl")
    all_ckpts = ckpt.list_checkpoints(run_dir)
    chosen = {p.name: "one of the newest " + str(keep) for p in all_ckpts[-keep:]}
    best = best_by_tau(events)
    if best and best not in chosen and (ck_root / best).is_dir():
        chosen[best] = "best by eval tau"
    for p in all_ckpts:
        problems = ckpt.verify_checkpoint(p)
        if p.name in chosen:
            sel.add_tree(p, f"run/checkpoints/{p.name}", "checkpoint", link_ok=True)
            sel.checkpoints.append(
                {"name": p.name, "step": ckpt.step_of(p.name), "why": chosen[p.name], "problems": problems}
            )
        else:
            sel.not_moved.append(
                {
                    "path": str(p),
                    "bytes": _size(p),
                    "why": f"older than the newest {keep} checkpoints (--keep)",
                }
            )
    if (ck_root / ckpt.LATEST).is_file():
        sel.items.append(
            Item(
                ck_root / ckpt.LATEST,
                f"run/checkpoints/{ckpt.LATEST}",
                (ck_root / ckpt.LATEST).stat().st_size,
                "run",
            )
        )
    if ck_root.is_dir():
        for p in sorted(ck_root.iterdir()):
            if p.name.startswith((".tmp-", ".old-")):
                sel.not_moved.append(
                    {
                        "path": str(p),
                        "bytes": _size(p),
                        "why": "an interrupted checkpoint save (temp folder), not a checkpoint",
                    }
                )
            elif p.is_dir() and ckpt.step_of(p.name) is None:
                sel.add_tree(p, f"run/checkpoints/{p.name}", "run")
    raw = _config_of(run_dir, config)
    if config and not Path(config).resolve().is_relative_to(run_dir.resolve()):
        sel.items.append(
            Item(Path(config), f"config/{Path(config).name}", Path(config).stat().st_size, "config")
        )
    data_path = None
    if raw and isinstance(raw.get("data"), dict) and raw["data"].get("path"):
        data_path = Path(raw["data"]["path"])
        if not data_path.is_absolute():
            base = Path(config).resolve().parent if config else run_dir.resolve()
            data_path = base / data_path
    if data_path is None:
        sel.notes.append("no run config found: the dataset could not be located")
    elif not data_path.is_dir():
        sel.not_moved.append(
            {
                "path": str(data_path),
                "bytes": 0,
                "why": "data.path of the run config does not exist on this node",
            }
        )
    elif not with_data:
        sel.not_moved.append(
            {"path": str(data_path), "bytes": _size(data_path), "why": "excluded with --no-data"}
        )
    else:
        rel = f"data/{data_path.name}"
        sel.add_tree(data_path, rel, "data", link_ok=True)
        sel.dataset = {"source": str(data_path), "path": rel, "bytes": _size(data_path)}
    if data_path is not None:
        # the data_sync role's manifest beside the data (`dflash manifest create DIR -o DIR.manifest.json`)
        sync_manifest = manifest_beside(data_path)
        if sync_manifest.is_file():
            sel.items.append(
                Item(sync_manifest, f"data/{sync_manifest.name}", sync_manifest.stat().st_size, "data")
            )
    for inc in includes or []:
        sel.add_path(Path(inc), "extra", "extra")
    for r in recon or []:
        sel.add_path(Path(r), "node/recon", "node")
    if state_dir is not None:
        # The first salvage run's records of what ran and how it stopped are kept: a later run finds
        # the trainer already stopped and must not overwrite them (its own reports stay in .salvage/).
        set_dir = state_dir.parent
        try:
            latest_state = json.loads((state_dir / "stop.json").read_text()).get("state")
        except (OSError, ValueError):
            latest_state = None
        for name, target in (("inventory.json", "node/processes.json"), ("stop.json", "node/stop.json")):
            first = set_dir / target
            keep_first = first.is_file() and latest_state in ("not_running", None)
            src = first if keep_first else state_dir / name
            if src.is_file():
                sel.items.append(Item(src, target, src.stat().st_size, "node"))
    dups = _duplicates(sel.items)
    if dups:
        raise SalvageError(
            f"two sources map to the same place in the salvage set: {dups} (rename an --include)"
        )
    return sel


def _duplicates(items: list[Item]) -> list[str]:
    seen, dups = set(), []
    for it in items:
        if it.rel in seen:
            dups.append(it.rel)
        seen.add(it.rel)
    return dups


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


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
    shutil.copy2(item.src, tmp)
    os.replace(tmp, dest)
    return "copied"


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
    """Build (or bring up to date) the salvage set and its manifest; returns the collect report."""
    from trainer.manifest import ManifestError, create_manifest, load_manifest, same_content

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
    for it in sel.items:
        how = _place(it, set_dir / it.rel, hardlink)
        counts[how] = counts.get(how, 0) + 1
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
    unchanged = (
        old is not None
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
