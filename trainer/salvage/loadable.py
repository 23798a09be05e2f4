"""Can what a salvage set holds be used, not only read: JSON/JSONL/YAML files parse, safetensors headers
parse and cover their files, every checkpoint verifies its SHA256SUMS, loads in speculators and runs one
forward on CPU with a finite loss, every tokenized dataset loads and passes the data gate.
Light at import: torch, datasets and speculators are imported inside the checks that need them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LOAD_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".safetensors")


def needs_load(rel: str, manifest: dict[str, Any]) -> bool:
    """A file the load checks read: by its suffix, or inside a checkpoint or dataset folder."""
    return rel.endswith(LOAD_SUFFIXES) or _in_special_dir(rel, manifest)


def _special_dirs(files: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(checkpoint folders, dataset folders) among the manifest's paths."""
    dirs: dict[str, set[str]] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        dirs.setdefault(parent, set()).add(name)
    ckpts = sorted(
        d for d, names in dirs.items() if {"config.json", "model.safetensors", "SHA256SUMS"} <= names
    )
    datasets = sorted(d for d, names in dirs.items() if {"state.json", "dataset_info.json"} <= names)
    return ckpts, datasets


def _in_special_dir(rel: str, manifest: dict[str, Any]) -> bool:
    ckpts, datasets = manifest.setdefault("_special", _special_dirs(manifest["files"]))
    parent = rel.rpartition("/")[0]
    return parent in ckpts or parent in datasets


def check_text_files(root: Path, rels: list[str]) -> tuple[list[dict[str, str]], list[str]]:
    """Parse JSON / JSONL / YAML / safetensors headers. (failures, warnings)."""
    import yaml

    from trainer.target.info import SafetensorsError, read_safetensors_header

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
                    warnings.append(
                        f"{rel}: the last line is incomplete (a writer was killed mid-line); ignored"
                    )
                # like every reader of an event stream (trainer/store/events.py): a line that does not parse
                # is skipped and named, never a reason to refuse the whole file
                bad = []
                for i, line in enumerate(lines[:-1], 1):
                    if line.strip():
                        try:
                            json.loads(line)
                        except (ValueError, RecursionError):
                            bad.append(i)
                if bad:
                    shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
                    warnings.append(f"{rel}: {len(bad)} line(s) that are not JSON skipped (line {shown})")
            elif rel.endswith((".yaml", ".yml")):
                yaml.safe_load(p.read_text())
            elif rel.endswith(".safetensors"):
                read_safetensors_header(p)
        except (SafetensorsError, ValueError, UnicodeDecodeError, RecursionError, yaml.YAMLError) as exc:
            msg = str(exc).replace(str(root) + "/", "")
            failures.append({"path": rel, "why": f"does not parse: {msg}"})
    return failures, warnings


def check_checkpoint(folder: Path, target: Path | None = None) -> dict[str, Any]:
    """verify SHA256SUMS, load in speculators, run one forward on CPU; the result says how."""
    from trainer.store.checkpoint import verify_checkpoint

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

    from trainer.target.info import read_safetensors_header

    read_safetensors_header(folder / "model.safetensors")  # a clear message for a truncated file
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashSpeculatorConfig

    from trainer.drafter.model import load_sdpa_drafter

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
    bad = {
        k: sorted(v)
        for k, v in info.items()
        if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
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
            torch.randn(1, T, n_aux * hidden, generator=g),
            ids,
            torch.ones(1, T, dtype=torch.long),
            torch.randn(1, T, hidden, generator=g),
            torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T).unsqueeze(0),
            loss_config=resolve_loss_config("ce", "eager"),
            max_anchors=2,
        )
    if not torch.isfinite(loss):
        raise ValueError(f"one CPU forward gave a non-finite loss ({float(loss)})")
    how = (
        f"verifier weights from {verifier}"
        if have_verifier
        else f"target {recorded} not on this machine: verifier-owned weights "
        f"({', '.join(placeholders) or 'none'}) "
        "were placeholders (pass --target DIR to use the real ones)"
    )
    return {
        "ok": True,
        "forward_loss": round(float(loss), 4),
        "params": sum(p.numel() for p in model.parameters()),
        "verifier": str(verifier) if have_verifier else None,
        "how": f"loaded in speculators, one CPU forward; {how}",
    }


def _gate_config(root: Path, dataset: str, manifest: dict[str, Any]):
    """A run config for the data gate: the set's run.yaml with data.path pointed at the copy."""
    import yaml

    from trainer.config.run import ConfigError, config_from_dict

    raw = None
    configs = ["run/run.yaml"] + sorted(
        r for r in manifest["files"] if r.startswith("config/") and r.endswith((".yaml", ".yml"))
    )
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
    figures = (
        (
            f"{d['num_samples']} samples, {d['usable']} usable, {d['short']} with < "
            f"{d['min_supervised_tokens']} "
            f"supervised tokens ({d['short_fraction']:.1%})"
        )
        if d
        else ""
    )
    return {
        "ok": not errors,
        "loads": loads,
        "verdict": verdict,
        "figures": figures,
        "errors": errors,
        "warnings": [p.to_dict() for p in report.warnings],
        "why": "; ".join(f"[{e['code']}] {e['message']}" for e in errors),
    }


def check_loadable(
    root: Path,
    manifest: dict[str, Any],
    rels: list[str],
    target: Path | None,
    data_gate: str = "fail",
    checkpoints: bool = True,
) -> dict[str, Any]:
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
            out["checkpoints"][c] = {
                "ok": True,
                "how": "SHA256SUMS only (--no-load-checkpoints)",
                **({"why": "; ".join(p)} if (p := _sums_only(root / c)) else {}),
            }
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
                warnings.append(
                    f"{d}/: the data gate REFUSED it (kept as a warning, --data-gate warn): {res['why']}"
                )
    out["failures"] = failures
    return out


def _sums_only(folder: Path) -> list[str]:
    from trainer.store.checkpoint import verify_checkpoint

    return verify_checkpoint(folder)
