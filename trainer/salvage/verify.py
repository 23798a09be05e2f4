"""Prove a salvage set is intact and usable: in S3 (`--s3`) or in a local folder.

1. Inventory of the prefix: objects and bytes per sub-prefix, as a table (what the seed's team had,
   but it proves nothing by itself).
2. Integrity: every manifest entry is present and its bytes, read back and hashed, have the manifest's
   sha256 and size (the listing is never trusted); the object's sha256 metadata agrees too.
3. Loadability of what was read back: JSON/JSONL/YAML files parse, every safetensors header parses and
   covers its file, every checkpoint verifies its SHA256SUMS, loads in speculators and runs one forward
   on CPU with a finite loss, every tokenized dataset loads and passes the data gate.

`ok` (exit 0) only when all of it holds; the report's summary lines come first and name every
missing, differing or unloadable key. Light side until the loadability checks, which import torch,
datasets and speculators lazily.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.manifest import MANIFEST_NAME
from trainer.salvage import MANIFEST_EXCLUDE, RECORDS, STATE_DIR, SalvageError

LOAD_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".safetensors")


# ---------------------------------------------------------------- inventory table


def prefix_table(objects: list[dict[str, Any]], strip: str) -> list[dict[str, Any]]:
    """Counts and bytes per sub-prefix (two levels deep: run/checkpoints, data/NAME, node, ...)."""
    rows: dict[str, dict[str, Any]] = {}
    for obj in objects:
        rel = obj["Key"][len(strip) :].lstrip("/") if strip else obj["Key"]
        parts = rel.split("/")
        group = "/".join(parts[:2]) + "/" if len(parts) > 2 else (parts[0] + "/" if len(parts) > 1 else "(top level)")
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


# ---------------------------------------------------------------- loadability


def _needs_load(rel: str, manifest: dict[str, Any]) -> bool:
    return rel.endswith(LOAD_SUFFIXES) or _in_special_dir(rel, manifest)


def _special_dirs(files: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(checkpoint folders, dataset folders) among the manifest's paths."""
    dirs: dict[str, set[str]] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        dirs.setdefault(parent, set()).add(name)
    ckpts = sorted(d for d, names in dirs.items() if {"config.json", "model.safetensors", "SHA256SUMS"} <= names)
    datasets = sorted(d for d, names in dirs.items() if {"state.json", "dataset_info.json"} <= names)
    return ckpts, datasets


def _in_special_dir(rel: str, manifest: dict[str, Any]) -> bool:
    ckpts, datasets = manifest.setdefault("_special", _special_dirs(manifest["files"]))
    parent = rel.rpartition("/")[0]
    return parent in ckpts or parent in datasets


def check_text_files(root: Path, rels: list[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Parse JSON / JSONL / YAML / safetensors headers. (failures, warnings)."""
    import yaml

    from trainer.target import SafetensorsError, read_safetensors_header

    failures, warnings = [], []
    for rel in rels:
        p = root / rel
        try:
            if rel.endswith(".json"):
                json.loads(p.read_text())
            elif rel.endswith(".jsonl"):
                data = p.read_bytes()
                lines = data.split(b"\n")
                if lines and lines[-1] != b"":
                    warnings.append(f"{rel}: the last line is incomplete (a writer was killed mid-line); ignored")
                for i, line in enumerate(lines[:-1], 1):
                    if line.strip():
                        try:
                            json.loads(line)
                        except ValueError as exc:
                            raise ValueError(f"line {i}: {exc}") from None
            elif rel.endswith((".yaml", ".yml")):
                yaml.safe_load(p.read_text())
            elif rel.endswith(".safetensors"):
                read_safetensors_header(p)
        except (SafetensorsError, ValueError, UnicodeDecodeError, yaml.YAMLError) as exc:
            msg = str(exc).replace(str(root) + "/", "")
            failures.append({"path": rel, "why": f"does not parse: {msg}"})
    return failures, warnings


def check_checkpoint(folder: Path, target: Path | None = None) -> dict[str, Any]:
    """verify SHA256SUMS, load in speculators, run one forward on CPU; the result says how."""
    from trainer.checkpoint import verify_checkpoint

    out: dict[str, Any] = {"ok": False}
    problems = verify_checkpoint(folder)
    if problems:
        out["why"] = "; ".join(problems)
        return out
    t0 = time.monotonic()
    try:
        out.update(_load_and_forward(folder, target))
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding, named with the folder
        out["why"] = f"does not load in speculators: {type(exc).__name__}: {str(exc)[:400]}"
        return out
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _load_and_forward(folder: Path, target: Path | None) -> dict[str, Any]:
    import logging
    import warnings

    import torch

    from trainer.target import read_safetensors_header

    read_safetensors_header(folder / "model.safetensors")  # a clear message for a truncated file
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashSpeculatorConfig

    from trainer.drafter import load_sdpa_drafter

    logging.getLogger("speculators").setLevel(logging.WARNING)
    try:
        from loguru import logger

        logger.disable("speculators")  # its INFO lines about file lookups are noise here
    except ImportError:
        pass
    config = DFlashSpeculatorConfig.from_pretrained(str(folder))
    recorded = config.speculators_config.verifier.name_or_path
    verifier = target if target is not None else (Path(recorded) if recorded else None)
    have_verifier = verifier is not None and (verifier / "config.json").is_file()
    config.speculators_config.verifier.name_or_path = str(verifier) if have_verifier else None
    with warnings.catch_warnings():  # sdpa attention: CPU has no flex attention
        warnings.simplefilter("ignore")
        model, info = load_sdpa_drafter(folder, config, output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ValueError(f"weights do not match the architecture: {bad}")
    if have_verifier:
        model.load_verifier_weights()
    placeholders = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if torch.isnan(p).any():  # verifier-owned weights speculators could not load
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                placeholders.append(name)
    model = model.float().eval()
    hidden = config.transformer_layer_config.hidden_size
    vocab = config.transformer_layer_config.vocab_size
    n_aux = len(model.target_layer_ids)
    T = 2 * config.block_size
    ids = torch.randint(0, vocab, (1, T), generator=g)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)  # anchors are sampled: a fixed seed makes the figure repeatable
        _, loss, _ = model(
            torch.randn(1, T, n_aux * hidden, generator=g), ids, torch.ones(1, T, dtype=torch.long),
            torch.randn(1, T, hidden, generator=g), torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T).unsqueeze(0), loss_config=resolve_loss_config("ce", "eager"), max_anchors=2,
        )
    if not torch.isfinite(loss):
        raise ValueError(f"one CPU forward gave a non-finite loss ({float(loss)})")
    how = (f"verifier weights from {verifier}" if have_verifier else
           f"target {recorded} not on this machine: verifier-owned weights ({', '.join(placeholders) or 'none'}) "
           "were placeholders (pass --target DIR to use the real ones)")
    return {"ok": True, "forward_loss": round(float(loss), 4), "params": sum(p.numel() for p in model.parameters()),
            "verifier": str(verifier) if have_verifier else None, "how": f"loaded in speculators, one CPU forward; {how}"}


def _gate_config(root: Path, dataset: str, manifest: dict[str, Any]):
    """A run config for the data gate: the set's run.yaml with data.path pointed at the copy."""
    import yaml

    from trainer.config import ConfigError, config_from_dict

    raw = None
    configs = ["run/run.yaml"] + sorted(r for r in manifest["files"] if r.startswith("config/") and r.endswith((".yaml", ".yml")))
    for rel in configs:
        if raw is not None:
            break
        if rel in manifest["files"] and (root / rel).is_file():
            try:
                raw = yaml.safe_load((root / rel).read_text())
            except yaml.YAMLError:
                raw = None
    if not isinstance(raw, dict):
        raw = {"target": {"path": "."}, "drafter": {"aux_layer_ids": [1], "mask_token_id": 0}, "out_dir": "."}
    raw = {**raw, "data": {**(raw.get("data") or {}), "path": str(root / dataset)}}
    try:
        return config_from_dict(raw, root), None
    except ConfigError as exc:
        return None, str(exc)


def check_dataset(root: Path, dataset: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Load a tokenized dataset and run the data gate on it (the gate's own verdict and codes)."""
    from trainer.preflight.data import data_gate
    from trainer.preflight.report import PreflightReport

    cfg, err = _gate_config(root, dataset, manifest)
    if cfg is None:
        return {"ok": False, "loads": False, "why": f"no usable run config for the data gate: {err}"}
    report = PreflightReport()
    data_gate(cfg, None, report)  # target=None: token ids are checked by preflight on the node
    errors = [p.to_dict() for p in report.errors]
    d = report.data
    loads = bool(d)
    verdict = "PASSED" if not errors else "REFUSED"
    figures = (f"{d['num_samples']} samples, {d['usable']} usable, {d['short']} with < {d['min_supervised_tokens']} "
               f"supervised tokens ({d['short_fraction']:.1%})") if d else ""
    return {"ok": not errors, "loads": loads, "verdict": verdict, "figures": figures,
            "errors": errors, "warnings": [p.to_dict() for p in report.warnings],
            "why": "; ".join(f"[{e['code']}] {e['message']}" for e in errors)}


def check_loadable(root: Path, manifest: dict[str, Any], rels: list[str], target: Path | None,
                   data_gate: str = "fail", checkpoints: bool = True) -> dict[str, Any]:
    """Every loadability check over the files `rels` (relative to root) that matched the manifest."""
    have = set(rels)
    ckpts, datasets = _special_dirs(manifest["files"])
    text_rels = [r for r in rels if r.endswith(LOAD_SUFFIXES)]
    failures, warnings = check_text_files(root, text_rels)
    out: dict[str, Any] = {"parsed": len(text_rels), "checkpoints": {}, "datasets": {}, "warnings": warnings}
    for c in ckpts:
        names = [r for r in manifest["files"] if r.rpartition("/")[0] == c]
        if not all(n in have for n in names):
            out["checkpoints"][c] = {"ok": False, "why": "not every file of it was intact (see above)"}
        elif checkpoints:
            out["checkpoints"][c] = check_checkpoint(root / c, target)
        else:
            out["checkpoints"][c] = {"ok": True, "how": "SHA256SUMS only (--no-load-checkpoints)",
                                     **({"why": "; ".join(p)} if (p := _sums_only(root / c)) else {})}
            out["checkpoints"][c]["ok"] = not _sums_only(root / c)
        if not out["checkpoints"][c]["ok"]:
            failures.append({"path": c + "/", "why": f"checkpoint fails: {out['checkpoints'][c]['why']}"})
    for d in datasets:
        names = [r for r in manifest["files"] if r.startswith(d + "/")]
        if not all(n in have for n in names):
            res = {"ok": False, "loads": False, "why": "not every file of it was intact (see above)"}
        else:
            res = check_dataset(root, d, manifest)
        out["datasets"][d] = res
        if not res.get("loads"):
            failures.append({"path": d + "/", "why": f"dataset does not load: {res['why']}"})
        elif not res["ok"]:
            if data_gate == "fail":
                failures.append({"path": d + "/", "why": f"dataset fails the data gate: {res['why']}"})
            else:
                warnings.append(f"{d}/: the data gate REFUSED it (kept as a warning, --data-gate warn): {res['why']}")
    out["failures"] = failures
    return out


def _sums_only(folder: Path) -> list[str]:
    from trainer.checkpoint import verify_checkpoint

    return verify_checkpoint(folder)


# ---------------------------------------------------------------- entry points


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    load = report.get("load") or {}
    bad_load = load.get("failures", [])
    report["ok"] = (report.get("manifest_found", False) and not report["missing"] and not report["differing"]
                    and not bad_load)
    head = [f"salvage verify {report['where']}: {'OK' if report['ok'] else 'FAILED'}"]
    if not report.get("manifest_found", False):
        head.append(f"  NO {MANIFEST_NAME} at {report['where']} (the push never completed?)")
    head.append(f"  integrity: {report['checked']} of {report['entries']} entries read back and hashed "
                f"({report['checked_bytes']:,} bytes): {len(report['missing'])} missing, "
                f"{len(report['differing'])} differing")
    for rel in report["missing"]:
        head.append(f"    MISSING  {rel}")
    for d in report["differing"]:
        head.append(f"    DIFFERS  {d['path']}: {d['why']}")
    if load:
        ck = load.get("checkpoints", {})
        ds = load.get("datasets", {})
        head.append(f"  loadability: {load.get('parsed', 0)} JSON/YAML/safetensors files parsed, "
                    f"{sum(v['ok'] for v in ck.values())}/{len(ck)} checkpoints load + forward, "
                    f"{sum(bool(v.get('ok')) for v in ds.values())}/{len(ds)} datasets pass the data gate")
        for f in bad_load:
            head.append(f"    UNLOADABLE  {f['path']}: {f['why']}")
        for w in load.get("warnings", []):
            head.append(f"    warning  {w}")
    elif report.get("load_skipped"):
        head.append(f"  loadability: NOT CHECKED ({report['load_skipped']})")
    if report.get("extra"):
        head.append(f"  {len(report['extra'])} object(s) not in the manifest (left alone): "
                    + ", ".join(report["extra"][:10]) + (" ..." if len(report["extra"]) > 10 else ""))
    report["summary"] = head
    return report


def verify_s3(url: str, endpoint_url: str | None = None, load: bool = True, target: Path | None = None,
              workdir: Path | None = None, workers: int = 8, data_gate: str = "fail",
              load_checkpoints: bool = True, client=None) -> dict[str, Any]:
    from trainer.s3 import client as s3

    loc = s3.parse_s3_url(url)
    if data_gate not in ("fail", "warn"):
        raise SalvageError(f"--data-gate {data_gate!r}: fail or warn")
    client = client or s3.make_client(endpoint_url, max_pool=max(16, workers * 2))
    s3.check_bucket(client, loc)
    t0 = time.monotonic()
    objects = list(s3.list_objects(client, loc))
    bookkeeping = {loc.key(n) for n in (MANIFEST_NAME, *RECORDS)}
    report: dict[str, Any] = {"where": loc.url(), "endpoint_url": endpoint_url,
                              "inventory": prefix_table([o for o in objects if o["Key"] not in bookkeeping], loc.prefix), "missing": [], "differing": [],
                              "checked": 0, "checked_bytes": 0, "entries": 0, "extra": []}
    manifest = s3.get_json(client, loc.bucket, loc.key(MANIFEST_NAME))
    report["manifest_found"] = manifest is not None
    if manifest is None:
        report["seconds"] = round(time.monotonic() - t0, 3)
        return _finish(report)
    files = {r: e for r, e in manifest.get("files", {}).items() if "sha256" in e}
    locations = manifest.get("locations", {})
    report["entries"] = len(files)
    tmp_root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dflash-verify-"))
    listed = {o["Key"]: o["Size"] for o in objects}
    report["extra"] = sorted(loc.rel(k) for k in listed if loc.rel(k) not in files and k not in bookkeeping)
    intact: list[str] = []

    def one(rel: str) -> tuple[str, str | None, str | None]:
        entry = files[rel]
        where = s3.parse_s3_url(locations[rel]) if rel in locations else None
        bucket, key = (where.bucket, where.prefix) if where else (loc.bucket, loc.key(rel))
        save = tmp_root / rel if load and _needs_load(rel, manifest) else None
        try:
            digest, size, meta = s3.read_back(client, bucket, key, save)
        except Exception as exc:  # noqa: BLE001
            code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
            if code in ("NoSuchKey", "404", "NotFound"):
                return rel, "missing", None
            return rel, "error", f"could not be read: {type(exc).__name__}: {exc}"
        if size != entry["size"]:
            return rel, "differs", f"{size} bytes read back, manifest says {entry['size']}"
        if digest != entry["sha256"]:
            return rel, "differs", f"sha256 read back {digest[:12]}..., manifest says {entry['sha256'][:12]}..."
        if meta.get(s3.SHA_META) != entry["sha256"]:
            return rel, "differs", f"object metadata sha256 {str(meta.get(s3.SHA_META))[:12]}... disagrees with the manifest"
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
            if digest != rec["sha256"]:
                report["differing"].append({"path": name, "why": f"sha256 read back {digest[:12]}..., manifest says {rec['sha256'][:12]}..."})
        report["records"] = sorted(records)
        report["integrity_seconds"] = round(time.monotonic() - t0, 3)
        if load:
            t1 = time.monotonic()
            report["load"] = check_loadable(tmp_root, manifest, [r for r in intact if _needs_load(r, manifest)],
                                            target, data_gate, load_checkpoints)
            report["load_seconds"] = round(time.monotonic() - t1, 3)
        else:
            report["load_skipped"] = "--no-load"
    finally:
        if workdir is None:
            shutil.rmtree(tmp_root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - t0, 3)
    return _finish(report)


def verify_local(set_dir: Path, load: bool = True, target: Path | None = None, data_gate: str = "fail",
                 load_checkpoints: bool = True) -> dict[str, Any]:
    """The same proof for a salvage set on disk (e.g. fetched to the controller)."""
    from trainer.manifest import ManifestError, load_manifest, verify_manifest

    set_dir = Path(set_dir)
    if not set_dir.is_dir():
        raise SalvageError(f"{set_dir} is not a folder")
    t0 = time.monotonic()
    report: dict[str, Any] = {"where": str(set_dir), "missing": [], "differing": [], "checked": 0,
                              "checked_bytes": 0, "entries": 0, "extra": []}
    objects = [{"Key": p.relative_to(set_dir).as_posix(), "Size": p.stat().st_size}
               for p in sorted(set_dir.rglob("*")) if p.is_file() and STATE_DIR not in p.relative_to(set_dir).parts
               and p.relative_to(set_dir).as_posix() not in (MANIFEST_NAME, *RECORDS)]
    report["inventory"] = prefix_table(objects, "")
    try:
        manifest = load_manifest(set_dir / MANIFEST_NAME)
    except ManifestError:
        report["manifest_found"] = False
        return _finish(report)
    report["manifest_found"] = True
    res = verify_manifest(set_dir, manifest, exclude=MANIFEST_EXCLUDE, manifest_path=set_dir / MANIFEST_NAME)
    report["entries"] = sum("sha256" in e for e in manifest["files"].values())
    report.update(missing=res.missing, differing=[{"path": d["path"], "why": d["why"]} for d in res.differing],
                  checked=res.checked, checked_bytes=res.checked_bytes, extra=res.extra)
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
