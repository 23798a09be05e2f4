"""Prove a salvage set is intact and usable: in S3 (`--s3`) or in a local folder.

1. Inventory of the prefix: objects and bytes per sub-prefix, as a table (what the seed's team had,
   but it proves nothing by itself).
2. Integrity: every entry of the COLLECTED set's manifest (`--out SET`) is present in S3 and its bytes,
   read back and hashed, have that manifest's sha256 and size (the listing is never trusted); the
   object's sha256 metadata agrees too, and S3's own manifest describes the same set (same content
   digest). Without `--out`, S3 can only be compared with its own manifest, and the report says so.
   Paths from S3's manifest are checked (`trainer.store.manifest.check_manifest`) and read-back copies are
   written only inside the work folder.
3. Loadability of what was read back (`loadable.py`): JSON/JSONL/YAML files parse, every safetensors
   header parses and covers its file, every checkpoint verifies its SHA256SUMS, loads in speculators and
   runs one forward on CPU with a finite loss, every tokenized dataset loads and passes the data gate.

`ok` (exit 0) only when all of it holds; the report's summary lines come first and name every
missing, differing or unloadable key. Light side until the loadability checks, which import torch,
datasets and speculators lazily.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.salvage import MANIFEST_EXCLUDE, RECORDS, STATE_DIR, SalvageError
from trainer.salvage.loadable import check_loadable, needs_load
from trainer.store.manifest import MANIFEST_NAME

# ---------------------------------------------------------------- inventory table


def prefix_table(objects: list[dict[str, Any]], strip: str) -> list[dict[str, Any]]:
    """Counts and bytes per sub-prefix (two levels deep: run/checkpoints, data/NAME, node, ...)."""
    rows: dict[str, dict[str, Any]] = {}
    for obj in objects:
        rel = obj["Key"][len(strip) :].lstrip("/") if strip else obj["Key"]
        parts = rel.split("/")
        group = (
            "/".join(parts[:2]) + "/"
            if len(parts) > 2
            else (parts[0] + "/" if len(parts) > 1 else "(top level)")
        )
        row = rows.setdefault(group, {"prefix": group, "objects": 0, "bytes": 0})
        row["objects"] += 1
        row["bytes"] += obj["Size"]
    return sorted(rows.values(), key=lambda r: r["prefix"])


def render_table(rows: list[dict[str, Any]]) -> list[str]:
    total_n = sum(r["objects"] for r in rows)
    total_b = sum(r["bytes"] for r in rows)
    width = max([len(r["prefix"]) for r in rows] + [12])
    out = [f"{'prefix':{width}} {'objects':>8} {'bytes':>15} {'GiB':>9}"]
    for r in rows + [{"prefix": "total", "objects": total_n, "bytes": total_b}]:
        out.append(f"{r['prefix']:{width}} {r['objects']:>8} {r['bytes']:>15,} {r['bytes'] / 2**30:>9.3f}")
    return out


# ---------------------------------------------------------------- entry points


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    load = report.get("load") or {}
    bad_load = load.get("failures", [])
    report["ok"] = (
        report.get("manifest_found", False)
        and not report["missing"]
        and not report["differing"]
        and not bad_load
        and not report.get("set_mismatch")
    )
    head = [f"salvage verify {report['where']}: {'OK' if report['ok'] else 'FAILED'}"]
    if not report.get("manifest_found", False):
        head.append(f"  NO {MANIFEST_NAME} at {report['where']} (the push never completed?)")
    mismatch = report.get("set_mismatch") or []
    if mismatch:
        head.append(
            f"  S3's manifest does NOT describe the collected set ({len(mismatch)} difference(s)): "
            "push the set again"
        )
        head += [f"    MISMATCH  {m}" for m in mismatch[:20]] + (["    ..."] if len(mismatch) > 20 else [])
    elif report.get("compared_with"):
        head.append(f"  compared with: {report['compared_with']}")
    head.append(
        f"  integrity: {report['checked']} of {report['entries']} entries read back and hashed "
        f"({report['checked_bytes']:,} bytes): {len(report['missing'])} missing, "
        f"{len(report['differing'])} differing"
    )
    for rel in report["missing"]:
        head.append(f"    MISSING  {rel}")
    for d in report["differing"]:
        head.append(f"    DIFFERS  {d['path']}: {d['why']}")
    if load:
        ck = load.get("checkpoints", {})
        ds = load.get("datasets", {})
        head.append(
            f"  loadability: {load.get('parsed', 0)} JSON/YAML/safetensors files parsed, "
            f"{sum(v['ok'] for v in ck.values())}/{len(ck)} checkpoints load + forward, "
            f"{sum(bool(v.get('ok')) for v in ds.values())}/{len(ds)} datasets pass the data gate"
        )
        for f in bad_load:
            head.append(f"    UNLOADABLE  {f['path']}: {f['why']}")
        for w in load.get("warnings", []):
            head.append(f"    warning  {w}")
    elif report.get("load_skipped"):
        head.append(f"  loadability: NOT CHECKED ({report['load_skipped']})")
    if report.get("extra"):
        head.append(
            f"  {len(report['extra'])} object(s) not in the manifest (left alone): "
            + ", ".join(report["extra"][:10])
            + (" ..." if len(report["extra"]) > 10 else "")
        )
    report["summary"] = head
    return report


def _new_report(where: str, **extra: Any) -> dict[str, Any]:
    """A verify report before any check: what `_finish` and `render` expect, S3 or local alike."""
    return {
        "where": where,
        **extra,
        "missing": [],
        "differing": [],
        "checked": 0,
        "checked_bytes": 0,
        "entries": 0,
        "extra": [],
    }


def compare_sets(local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """Where S3's manifest does not describe the collected set: every entry missing, extra or different
    (size, sha256, symlink). Empty when both describe the same bytes."""
    lf, rf = local["files"], remote["files"]
    out = [f"{rel}: in the collected set, not in S3's manifest" for rel in sorted(set(lf) - set(rf))]
    out += [f"{rel}: in S3's manifest, not in the collected set" for rel in sorted(set(rf) - set(lf))]
    for rel in sorted(set(lf) & set(rf)):
        a = {k: v for k, v in lf[rel].items() if k in ("size", "sha256", "symlink")}
        b = {k: v for k, v in rf[rel].items() if k in ("size", "sha256", "symlink")}
        if a != b:
            out.append(f"{rel}: S3's manifest says {b}, the collected set {a}")
    return out


def verify_s3(
    url: str,
    endpoint_url: str | None = None,
    load: bool = True,
    target: Path | None = None,
    workdir: Path | None = None,
    workers: int = 8,
    data_gate: str = "fail",
    load_checkpoints: bool = True,
    client=None,
    local_manifest: dict[str, Any] | None = None,
    referenced: dict[str, str] | None = None,
    allow: list[str] | tuple = (),
) -> dict[str, Any]:
    """Read every object back. With `local_manifest` (the collected set's, which `--out SET` names),
    that manifest is the authority: each of its files must be in S3 with its size and sha256, and S3's
    manifest must describe the same set (same content digest); without it, S3 is only compared with
    its own manifest (the report says so). A read S3's manifest sends outside the set's prefix (a
    `locations` entry) is made only where `referenced` (rel -> s3:// URL: what this salvage's own push
    referenced, from its report) names exactly that address, or under a prefix in `allow` (the user's
    `--allow-location`); any other such entry is an error."""
    from trainer.s3 import client as s3
    from trainer.s3.pullsafe import within
    from trainer.store.manifest import ManifestError, content_digest, inside

    loc = s3.parse_s3_url(url)
    allowed = [s3.parse_s3_url(a) for a in allow]
    if data_gate not in ("fail", "warn"):
        raise SalvageError(f"--data-gate {data_gate!r}: fail or warn")
    client = client or s3.make_client(endpoint_url, max_pool=max(16, workers * 2))
    s3.check_bucket(client, loc)
    t0 = time.monotonic()
    objects = list(s3.list_objects(client, loc))
    bookkeeping = {loc.key(n) for n in (MANIFEST_NAME, *RECORDS)}
    report = _new_report(
        loc.url(),
        endpoint_url=endpoint_url,
        inventory=prefix_table([o for o in objects if o["Key"] not in bookkeeping], loc.prefix),
    )
    if local_manifest is not None:
        report["set_digest"] = content_digest(local_manifest)
    manifest = s3.get_manifest(client, loc.bucket, loc.key(MANIFEST_NAME))
    report["manifest_found"] = manifest is not None
    if manifest is None:
        report["seconds"] = round(time.monotonic() - t0, 3)
        return _finish(report)
    report["manifest_digest"] = content_digest(manifest)
    if local_manifest is not None:
        report["set_mismatch"] = compare_sets(local_manifest, manifest)
    else:
        report["compared_with"] = "S3's own manifest only (no --out SET: the collected set was not compared)"
    # the collected set's entries are what must be in S3; S3's manifest only says where (locations)
    authority = local_manifest if local_manifest is not None else manifest
    files = {r: e for r, e in authority["files"].items() if "sha256" in e}
    locations = manifest.get("locations", {})
    report["entries"] = len(files)
    tmp_root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dflash-verify-"))
    listed = {o["Key"]: o["Size"] for o in objects}
    report["extra"] = sorted(loc.rel(k) for k in listed if loc.rel(k) not in files and k not in bookkeeping)
    intact: list[str] = []

    def one(rel: str) -> tuple[str, str | None, str | None]:
        entry = files[rel]
        try:
            where = s3.parse_s3_url(locations[rel]) if rel in locations else None
            save = inside(tmp_root, rel) if load and needs_load(rel, authority) else None
        except (ManifestError, s3.S3Error) as exc:
            return rel, "error", f"refused: {exc}"
        if (
            where is not None
            and not within(where, loc)
            and not any(within(where, a) for a in allowed)
            and (referenced or {}).get(rel) != locations[rel]
        ):
            # whoever can write the bucket must not make verify read a copy elsewhere and certify it
            return (
                rel,
                "error",
                (
                    f"refused: S3's manifest sends this read to {locations[rel]}, outside {loc.url()}, "
                    "and this salvage's push did not reference it there (--allow-location PREFIX if you "
                    "trust it)"
                ),
            )
        bucket, key = (where.bucket, where.prefix) if where else (loc.bucket, loc.key(rel))
        try:
            digest, size, meta = s3.read_back(client, bucket, key, save)
        except Exception as exc:  # noqa: BLE001
            code = (
                getattr(exc, "response", {}).get("Error", {}).get("Code")
                if hasattr(exc, "response")
                else None
            )
            if code in ("NoSuchKey", "404", "NotFound"):
                return rel, "missing", None
            return rel, "error", f"could not be read: {type(exc).__name__}: {exc}"
        if size != entry["size"]:
            return rel, "differs", f"{size} bytes read back, manifest says {entry['size']}"
        if digest != entry["sha256"]:
            return (
                rel,
                "differs",
                f"sha256 read back {digest[:12]}..., manifest says {entry['sha256'][:12]}...",
            )
        if meta.get(s3.SHA_META) != entry["sha256"]:
            return (
                rel,
                "differs",
                f"object metadata sha256 {str(meta.get(s3.SHA_META))[:12]}... disagrees with the manifest",
            )
        return rel, None, None

    try:
        with ThreadPoolExecutor(workers) as pool:
            for rel, problem, why in pool.map(one, sorted(files)):
                if problem is None:
                    intact.append(rel)
                    report["checked"] += 1
                    report["checked_bytes"] += files[rel]["size"]
                elif problem == "missing":
                    report["missing"].append(rel)
                else:
                    report["checked"] += 1
                    report["differing"].append({"path": rel, "why": why})
        records = manifest.get("records", {})
        for name, rec in sorted(records.items()):
            try:
                digest, _size, _ = s3.read_back(client, loc.bucket, loc.key(name))
            except Exception as exc:  # noqa: BLE001
                report["missing"].append(f"{name} ({type(exc).__name__})")
                continue
            if not isinstance(rec, dict) or digest != rec.get("sha256"):
                want = str(rec.get("sha256") if isinstance(rec, dict) else rec)[:12]
                report["differing"].append(
                    {"path": name, "why": f"sha256 read back {digest[:12]}..., manifest says {want}..."}
                )
        report["records"] = sorted(records)
        report["integrity_seconds"] = round(time.monotonic() - t0, 3)
        if load:
            t1 = time.monotonic()
            report["load"] = check_loadable(
                tmp_root,
                authority,
                [r for r in intact if needs_load(r, authority)],
                target,
                data_gate,
                load_checkpoints,
            )
            report["load_seconds"] = round(time.monotonic() - t1, 3)
        else:
            report["load_skipped"] = "--no-load"
    finally:
        if workdir is None:
            shutil.rmtree(tmp_root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - t0, 3)
    return _finish(report)


def repairs(set_dir: Path, url: str) -> set[str]:
    """What the set's last verify of `url` found missing or different (paths of the set, records
    included): the next push sends these again even when their objects claim the right sha256. The
    MANIFEST.json name is in it when S3's manifest did not describe the collected set."""
    import json

    from trainer.s3.client import parse_s3_url
    from trainer.salvage.session import previous_reports

    want = parse_s3_url(url).url()
    rep = None
    # this salvage's verify, else the newest earlier salvage's (moved aside when this one began)
    for p in [Path(set_dir) / STATE_DIR / "verify.json", *previous_reports(Path(set_dir), "verify")]:
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(rep, dict) and rep.get("where") == want:
            break
        rep = None
    if rep is None or rep.get("ok"):
        return set()
    out = {str(m).split(" (")[0] for m in rep.get("missing", [])}
    out |= {d.get("path") for d in rep.get("differing", []) if isinstance(d, dict) and d.get("path")}
    if rep.get("set_mismatch"):
        out.add(MANIFEST_NAME)
    return out


def verify_local(
    set_dir: Path,
    load: bool = True,
    target: Path | None = None,
    data_gate: str = "fail",
    load_checkpoints: bool = True,
) -> dict[str, Any]:
    """The same proof for a salvage set on disk (e.g. fetched to the controller)."""
    from trainer.store.manifest import ManifestError, content_digest, load_manifest, verify_manifest

    set_dir = Path(set_dir)
    if not set_dir.is_dir():
        raise SalvageError(f"{set_dir} is not a folder")
    t0 = time.monotonic()
    report = _new_report(str(set_dir))
    objects = [
        {"Key": p.relative_to(set_dir).as_posix(), "Size": p.stat().st_size}
        for p in sorted(set_dir.rglob("*"))
        if p.is_file()
        and STATE_DIR not in p.relative_to(set_dir).parts
        and p.relative_to(set_dir).as_posix() not in (MANIFEST_NAME, *RECORDS)
    ]
    report["inventory"] = prefix_table(objects, "")
    try:
        manifest = load_manifest(set_dir / MANIFEST_NAME)
    except ManifestError:
        report["manifest_found"] = False
        return _finish(report)
    report["manifest_found"] = True
    report["manifest_digest"] = report["set_digest"] = content_digest(manifest)
    res = verify_manifest(set_dir, manifest, exclude=MANIFEST_EXCLUDE, manifest_path=set_dir / MANIFEST_NAME)
    report["entries"] = sum("sha256" in e for e in manifest["files"].values())
    report.update(
        missing=res.missing,
        differing=[{"path": d["path"], "why": d["why"]} for d in res.differing],
        checked=res.checked,
        checked_bytes=res.checked_bytes,
        extra=res.extra,
    )
    bad = set(res.missing) | {d["path"] for d in res.differing}
    if load:
        rels = [r for r, e in manifest["files"].items() if "sha256" in e and r not in bad]
        report["load"] = check_loadable(set_dir, manifest, rels, target, data_gate, load_checkpoints)
    else:
        report["load_skipped"] = "--no-load"
    report["seconds"] = round(time.monotonic() - t0, 3)
    return _finish(report)


def render(report: dict[str, Any]) -> str:
    lines = list(report["summary"])
    lines.append("")
    lines.append("inventory of " + report["where"] + ":")
    lines += ["  " + x for x in render_table(report.get("inventory", []))]
    lines += load_lines(report.get("load") or {}, markdown=False)
    return "\n".join(lines)


def load_lines(load: dict[str, Any], markdown: bool) -> list[str]:
    """One line per checkpoint and dataset the load checks saw, and each data-gate error under its
    dataset: as terminal text, or as a markdown list (NOTES.md, with each error's fix)."""
    q = "`" if markdown else ""
    lines = []
    for c, r in load.get("checkpoints", {}).items():
        head = f"- {q}{c}{q}" if markdown else f"  checkpoint {c}"
        lines.append(f"{head}: {'OK' if r['ok'] else 'FAILED'}: {r.get('how') or r.get('why')}")
    for d, r in load.get("datasets", {}).items():
        verdict = r.get("verdict", "not run")
        head = f"- `{d}`: data gate **{verdict}**" if markdown else f"  dataset {d}: data gate {verdict}"
        lines.append(f"{head}: {r.get('figures') or r.get('why')}")
        for e in r.get("errors", []):
            lines.append(f"    {'- ' if markdown else ''}[{e['code']}] {e['message']}")
            if markdown:
                lines.append(f"      fix: {e['fix']}")
    return lines
