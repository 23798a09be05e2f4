"""sha256 manifests: prove that a folder copied to another machine is byte-for-byte the source.

`dflash manifest create DIR -o MANIFEST` records every regular file under DIR (relative path, size,
sha256, mtime) and every symlink (its target); `dflash manifest verify DIR MANIFEST` re-hashes DIR and
names every missing, differing and (as a note, or an error with --strict) extra file. Used by the
data_sync role after rsync and by salvage. Light side: stdlib + fsutil only, no torch.

Format (JSON, `manifest_version` 1)::

    {"manifest_version": 1, "created": 1700000000.0, "source": "host:/path (informational)",
     "file_count": 2, "total_bytes": 123,
     "files": {"a/b.bin": {"size": 100, "sha256": "...", "mtime_ns": ...},
               "link": {"symlink": "a/b.bin"}}}

Paths use "/" and never contain "..". The manifest file itself is skipped when it lies inside DIR,
as are rsync's partial files (`.~tmp~/`, `.name.XXXXXX` temp names are ordinary files and are hashed:
a clean copy has none).
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import jsonin
from trainer.errors import DflashError
from trainer.store.fsutil import atomic_write_text, sha256_file

MANIFEST_VERSION = 1
# Partial-transfer folders (rsync --partial-dir of the data_sync role; `dflash s3 pull`): never data.
ALWAYS_EXCLUDED = (
    ".rsync-partial",
    ".rsync-partial/*",
    ".s3-partial",
    ".s3-partial/*",
    ".hf-partial",
    ".hf-partial/*",
)
# A set's own manifest inside it (a salvage set, an S3 prefix); a synced folder's manifest lives beside it.
MANIFEST_NAME = "MANIFEST.json"


def manifest_beside(folder: Path) -> Path:
    """Where a folder's own manifest lives: next to it, never inside it (`data/tok` ->
    `data/tok.manifest.json`)."""
    folder = Path(folder)
    return folder.parent / f"{folder.name}.manifest.json"


class ManifestError(DflashError, ValueError):
    """A manifest or folder that cannot be used; the message names the file."""


@dataclass
class VerifyResult:
    missing: list[str] = field(default_factory=list)
    differing: list[dict[str, Any]] = field(default_factory=list)  # path, why, expected, actual
    extra: list[str] = field(default_factory=list)
    checked: int = 0
    checked_bytes: int = 0
    strict: bool = False

    @property
    def ok(self) -> bool:
        return not self.missing and not self.differing and not (self.strict and self.extra)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "missing": self.missing,
            "differing": self.differing,
            "extra": self.extra,
            "strict": self.strict,
        }

    def render_text(self, folder: Path) -> str:
        lines = []
        for p in self.missing:
            lines.append(f"MISSING   {p}")
        for d in self.differing:
            lines.append(f"DIFFERS   {d['path']}: {d['why']}")
        for p in self.extra:
            lines.append(
                f"{'EXTRA    ' if self.strict else 'extra     '} {p}"
                + ("" if self.strict else " (not in the manifest)")
            )
        verdict = "OK" if self.ok else "FAILED"
        lines.append(
            f"manifest verify {folder}: {verdict}: {self.checked} entries checked "
            f"({self.checked_bytes} bytes), {len(self.missing)} missing, {len(self.differing)} differing, "
            f"{len(self.extra)} extra"
        )
        return "\n".join(lines)


def _excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(
        fnmatch.fnmatchcase(rel, pat) or fnmatch.fnmatchcase(rel.split("/")[0], pat) for pat in patterns
    )


def scan(
    folder: Path, exclude: tuple[str, ...] = (), skip: Path | None = None
) -> tuple[dict[str, Path], dict[str, str]]:
    """(regular files, symlinks) under `folder` by relative posix path. Symlinks are not followed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder")
    patterns = ALWAYS_EXCLUDED + tuple(exclude)
    skip_abs = Path(skip).absolute() if skip is not None else None
    files: dict[str, Path] = {}
    links: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        base = Path(dirpath)
        rel_dir = base.relative_to(folder).as_posix()
        kept = []
        for d in sorted(dirnames):
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if _excluded(rel, patterns):
                continue
            if (base / d).is_symlink():
                links[rel] = os.readlink(base / d)
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            path = base / name
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if _excluded(rel, patterns):
                continue
            if skip_abs is not None and path.absolute() == skip_abs:
                continue
            if path.is_symlink():
                links[rel] = os.readlink(path)
            elif path.is_file():
                files[rel] = path
    return files, links


def _workers(n: int | None) -> int:
    return max(1, n if n else min(4, os.cpu_count() or 1))


def create_manifest(
    folder: Path,
    out: Path | None = None,
    exclude: tuple[str, ...] = (),
    reuse: dict[str, Any] | None = None,
    workers: int | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """Hash every file under `folder`. With `reuse` (an older manifest of the same folder), files whose
    size and mtime_ns are unchanged keep their recorded digest instead of being re-read."""
    folder = Path(folder)
    files, links = scan(folder, exclude, skip=out)
    old = (reuse or {}).get("files", {})
    entries: dict[str, dict[str, Any]] = {}
    to_hash: list[str] = []
    stats: dict[str, os.stat_result] = {}
    for rel, path in files.items():
        st = path.stat()
        stats[rel] = st
        prev = old.get(rel)
        if (
            prev
            and prev.get("size") == st.st_size
            and prev.get("mtime_ns") == st.st_mtime_ns
            and prev.get("sha256")
        ):
            entries[rel] = {"size": st.st_size, "sha256": prev["sha256"], "mtime_ns": st.st_mtime_ns}
        else:
            to_hash.append(rel)
    with ThreadPoolExecutor(_workers(workers)) as pool:  # hashlib releases the GIL on large buffers
        for rel, digest in zip(to_hash, pool.map(lambda r: sha256_file(files[r]), to_hash)):
            st = stats[rel]
            entries[rel] = {"size": st.st_size, "sha256": digest, "mtime_ns": st.st_mtime_ns}
    for rel, target in links.items():
        entries[rel] = {"symlink": target}
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "created": round(time.time(), 3),
        "source": source or str(folder.resolve()),
        "file_count": len(files),
        "total_bytes": sum(e.get("size", 0) for e in entries.values()),
        "hashed": len(to_hash),
        "files": dict(sorted(entries.items())),
    }
    if out is not None:
        atomic_write_text(Path(out), json.dumps(manifest, indent=1) + "\n")
    return manifest


def same_content(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two manifests describe the same bytes (ignores creation time, mtimes and the source label)."""

    def strip(m: dict[str, Any]) -> dict[str, Any]:
        return {
            k: {kk: vv for kk, vv in v.items() if kk != "mtime_ns"} for k, v in m.get("files", {}).items()
        }

    return strip(a) == strip(b)


def load_manifest(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest {path} does not exist")
    try:
        data = jsonin.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"manifest {path} is not valid JSON: {exc}") from None
    return check_manifest(data, str(path))


def check_manifest(data: Any, label: str) -> dict[str, Any]:
    """`data` (a parsed manifest from a file or an S3 object named `label`) if it is a usable manifest:
    the right version, and every entry a safe relative path with size + sha256 (or a symlink). A
    manifest read from S3 is input, never trusted: no entry may be absolute, contain `..`, `.` or an
    empty part, hold a NUL or a backslash, or lie under another entry that is a symlink (a write
    through it would leave the set)."""
    if not isinstance(data, dict) or data.get("manifest_version") != MANIFEST_VERSION:
        got = data.get("manifest_version") if isinstance(data, dict) else type(data).__name__
        raise ManifestError(f"manifest {label}: expected manifest_version {MANIFEST_VERSION}, got {got!r}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"manifest {label}: 'files' must be a mapping of relative path -> entry")
    for rel, entry in files.items():
        check_rel(rel, f"manifest {label}")
        if not isinstance(entry, dict) or not (
            isinstance(entry.get("symlink"), str)
            or (
                type(entry.get("size")) is int
                and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str)
                and len(entry["sha256"]) == 64
            )
        ):
            raise ManifestError(
                f"manifest {label}: entry {rel!r} needs size (an integer >= 0) and sha256 (64 hex "
                "digits), or symlink"
            )
    links = {rel for rel, e in files.items() if "symlink" in e}
    for rel in files:
        parts = rel.split("/")
        under = next(
            ("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in links), None
        )
        if under is not None:
            raise ManifestError(f"manifest {label}: entry {rel!r} lies under the symlink entry {under!r}")
    for key in ("records", "locations"):
        if not isinstance(data.get(key, {}), dict):
            raise ManifestError(f"manifest {label}: {key!r} must be a mapping")
    for name in data.get("records", {}):
        check_rel(name, f"manifest {label} (records)")
    return data


def check_rel(rel: Any, label: str) -> str:
    """A path from a manifest, if it is safe to join under a folder: relative, "/"-separated, no empty,
    `.` or `..` part, no NUL or backslash."""
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{label}: an entry's path must be a non-empty string, got {rel!r}")
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in rel or "\x00" in rel:
        raise ManifestError(
            f"{label}: unsafe path {rel!r} (absolute, an empty, '.' or '..' part, a backslash or NUL): "
            "a manifest's paths must stay inside its folder"
        )
    return rel


def inside(root: Path, rel: str, label: str = "manifest") -> Path:
    """`root / rel` after `check_rel`, and proven to resolve inside `root` (no symlink on the way out)."""
    check_rel(rel, label)
    root = Path(root)
    path = root / rel
    if not path.resolve().is_relative_to(root.resolve()):
        raise ManifestError(f"{label}: {rel!r} resolves outside {root} (a symlink on its way?)")
    return path


def content_digest(manifest: dict[str, Any]) -> str:
    """sha256 of what a manifest describes (every path with its size and sha256, or its symlink), not of
    when or where it was made: two manifests of the same bytes have the same digest. Collect, push and
    verify each name it, and the notes say "the node can go" only when all three name the same one."""
    import hashlib

    entries = {
        rel: {k: v for k, v in e.items() if k in ("size", "sha256", "symlink")}
        for rel, e in manifest.get("files", {}).items()
    }
    body = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest()


def verify_manifest(
    folder: Path,
    manifest: dict[str, Any],
    exclude: tuple[str, ...] = (),
    strict: bool = False,
    workers: int | None = None,
    manifest_path: Path | None = None,
) -> VerifyResult:
    """Compare `folder` with `manifest`: sizes first (cheap), then sha256 of every same-size file."""
    folder = Path(folder)
    files, links = scan(folder, exclude, skip=manifest_path)
    res = VerifyResult(strict=strict)
    expected = manifest["files"]
    to_hash: list[str] = []
    for rel, entry in expected.items():
        if "symlink" in entry:
            if rel not in links:
                res.missing.append(rel) if rel not in files else res.differing.append(
                    {"path": rel, "why": "a regular file where a symlink was expected"}
                )
            elif links[rel] != entry["symlink"]:
                res.differing.append(
                    {"path": rel, "why": f"symlink to {links[rel]!r}, expected {entry['symlink']!r}"}
                )
            res.checked += 1
            continue
        path = files.get(rel)
        if path is None:
            if rel in links:
                res.differing.append({"path": rel, "why": "a symlink where a regular file was expected"})
            else:
                res.missing.append(rel)
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            res.differing.append(
                {
                    "path": rel,
                    "why": f"size {size} bytes, expected {entry['size']}",
                    "expected_size": entry["size"],
                    "size": size,
                }
            )
            res.checked += 1
            continue
        to_hash.append(rel)
    with ThreadPoolExecutor(_workers(workers)) as pool:
        for rel, digest in zip(to_hash, pool.map(lambda r: sha256_file(files[r]), to_hash)):
            res.checked += 1
            res.checked_bytes += expected[rel]["size"]
            if digest != expected[rel]["sha256"]:
                res.differing.append(
                    {
                        "path": rel,
                        "why": f"sha256 {digest[:12]}..., expected {expected[rel]['sha256'][:12]}...",
                        "expected_sha256": expected[rel]["sha256"],
                        "sha256": digest,
                    }
                )
    res.extra = sorted(set(files) - set(expected)) + sorted(set(links) - set(expected))
    res.missing.sort()
    res.differing.sort(key=lambda d: d["path"])
    return res


# ---------------------------------------------------------------- CLI


def cmd_create(args) -> int:
    out = Path(args.output)
    reuse = None
    if args.reuse and out.is_file():
        try:
            reuse = load_manifest(out)
        except ManifestError:
            reuse = None  # a broken old manifest is simply rebuilt
    previous = reuse
    if previous is None and out.is_file():
        try:
            previous = load_manifest(out)
        except ManifestError:
            previous = None
    manifest = create_manifest(Path(args.dir), None, tuple(args.exclude), reuse, args.workers, args.source)
    changed = (
        previous is None
        or not same_content(previous, manifest)
        or any(
            previous["files"].get(k, {}).get("mtime_ns") != v.get("mtime_ns")
            for k, v in manifest["files"].items()
        )
    )
    if changed:
        atomic_write_text(out, json.dumps(manifest, indent=1) + "\n")
    summary = {
        "manifest": str(out),
        "changed": changed,
        "file_count": manifest["file_count"],
        "total_bytes": manifest["total_bytes"],
        "hashed": manifest["hashed"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"manifest {out}: {manifest['file_count']} files, {manifest['total_bytes']} bytes "
            f"({manifest['hashed']} hashed{', unchanged' if not changed else ''})"
        )
    return 0


def cmd_verify(args) -> int:
    manifest = load_manifest(Path(args.manifest))
    folder = Path(args.dir)
    if not folder.is_dir():
        raise ManifestError(f"{folder} is not a folder (nothing was copied there yet?)")
    res = verify_manifest(
        folder, manifest, tuple(args.exclude), args.strict, args.workers, Path(args.manifest)
    )
    if args.json:
        print(json.dumps({"dir": str(folder), "manifest": str(args.manifest), **res.to_dict()}))
    else:
        print(res.render_text(folder))
    return 0 if res.ok else 1
