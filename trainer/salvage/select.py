"""What a salvage set takes from a run, and what it leaves (with why): the run folder (symlinks
recorded, never followed), the newest K checkpoints plus the best by eval tau, the run config, the
tokenized dataset, --include and --recon files, and the first salvage's records of what ran. Light side.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.salvage import SalvageError
from trainer.store import checkpoint as ckpt
from trainer.store.events import load_events
from trainer.store.manifest import manifest_beside

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
    links: list[dict[str, str]] = field(default_factory=list)  # path (in the set), target: not followed
    run_id: str | None = None

    def add_path(self, path: Path, rel_dir: str, kind: str) -> None:
        """A file or a whole folder, under `rel_dir/<its name>` in the set."""
        if path.is_dir():
            self.add_tree(path, f"{rel_dir}/{path.name}", kind)
        else:
            self.items.append(Item(path, f"{rel_dir}/{path.name}", path.stat().st_size, kind))

    def add_tree(self, root: Path, rel_root: str, kind: str, link_ok: bool = False, skip=None) -> None:
        """Every regular file under `root`. A symlink inside it (to a file or a folder, inside the run
        or out of it) is recorded in `links`, never followed: a link to /etc/shadow must not travel to
        S3, and a link loop must not copy the run again and again."""
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            base = Path(dirpath)
            rel_dir = base.relative_to(root).as_posix()
            if skip is not None:
                dirnames[:] = [d for d in dirnames if not skip(base / d)]
            for d in sorted(dirnames):
                if (base / d).is_symlink():
                    self.link(base / d, f"{rel_root}/{d}" if rel_dir == "." else f"{rel_root}/{rel_dir}/{d}")
            dirnames[:] = sorted(d for d in dirnames if not (base / d).is_symlink())
            for name in sorted(filenames):
                p = base / name
                if skip is not None and skip(p):
                    continue
                if p.is_symlink():
                    self.link(p, f"{rel_root}/{name}" if rel_dir == "." else f"{rel_root}/{rel_dir}/{name}")
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

    def link(self, p: Path, rel: str) -> None:
        self.links.append({"path": rel, "source": str(p), "target": os.readlink(p)})


# ---------------------------------------------------------------- what to take


def best_by_tau(events: list[dict[str, Any]], present: set[str] | None = None) -> str | None:
    """The checkpoint name of the eval event with the highest tau (a run that evaluates while it
    trains has one per checkpoint it evaluated: `eval.every_steps`); with `present`, the best among
    the checkpoints still there (rotation removes older ones)."""
    best = None
    for ev in events:
        if ev.get("event") != "eval":
            continue
        tau = ev.get("tau")
        name = ev.get("checkpoint") or (
            ckpt.checkpoint_name(ev["step"]) if isinstance(ev.get("step"), int) else None
        )
        name = Path(str(name)).name if name else None
        if present is not None and name not in present:
            continue
        if isinstance(tau, (int, float)) and name and (best is None or tau > best[0]):
            best = (float(tau), name)
    return best[1] if best else None


def _config_of(run_dir: Path, config: Path | None) -> dict[str, Any] | None:
    import yaml

    for p in ([config] if config else []) + [run_dir / "run.yaml"]:
        if p is not None and p.is_file():
            try:
                raw = yaml.safe_load(p.read_text())
                return raw if isinstance(raw, dict) else None
            except (yaml.YAMLError, UnicodeDecodeError):  # not YAML, not UTF-8: the config is unknown
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

    def in_checkpoints(p: Path) -> bool:  # and an evaluation's links to a checkpoint's files
        return p == ck_root or (p.name == "drafter" and p.parent.parent == run_dir / "evals")

    sel.add_tree(run_dir, "run", "run", skip=in_checkpoints)
    events = load_events(run_dir / "events.jsonl")
    sel.run_id = next(
        (str(e["run_id"]) for e in events if e.get("event") == "run_start" and e.get("run_id")), None
    )
    all_ckpts = ckpt.list_checkpoints(run_dir)
    chosen = {p.name: "one of the newest " + str(keep) for p in all_ckpts[-keep:]}
    best = best_by_tau(events, {p.name for p in all_ckpts})
    if best and best not in chosen:
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
    if (ck_root / ckpt.LATEST).is_symlink():
        sel.link(ck_root / ckpt.LATEST, f"run/checkpoints/{ckpt.LATEST}")
    elif (ck_root / ckpt.LATEST).is_file():
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
            elif p.is_symlink() and ckpt.step_of(p.name) is None:
                sel.link(p, f"run/checkpoints/{p.name}")  # recorded, never followed
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
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
