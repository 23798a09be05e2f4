"""The target gate: target.path is a model folder with a readable config.json and complete safetensors
weights (headers only, read by trainer/target.py); its shapes are what the other gates check against."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from trainer.preflight.report import PreflightReport
from trainer.target import TargetInfo, read_weight_headers

if TYPE_CHECKING:
    from trainer.config import RunConfig

TARGET_FETCH_FIX = (
    "point target.path at a complete local transformers model folder (config.json + *.safetensors), "
    "e.g. `hf download MODEL --local-dir DIR`"
)


def target_gate(cfg: RunConfig, report: PreflightReport) -> TargetInfo | None:
    path = cfg.target.path
    if not path.is_dir():
        report.error(
            "config.target_missing", f"target.path {path} does not exist or is not a folder", TARGET_FETCH_FIX
        )
        return None
    info: TargetInfo | None = None
    if not (path / "config.json").is_file():
        report.error("config.target_no_config", f"target.path {path} has no config.json", TARGET_FETCH_FIX)
    else:
        try:
            info = TargetInfo.from_folder(path)
        except ValueError as exc:
            report.error("config.target_config_invalid", str(exc), TARGET_FETCH_FIX)
    weights = read_weight_headers(path)
    report.weight_errors("config.target", weights, TARGET_FETCH_FIX)
    if info is None:
        return None
    info = replace(info, stored_params=0 if weights.problems else weights.numel)
    report.target = {
        "path": str(path),
        "num_layers": info.num_layers,
        "hidden": info.hidden,
        "vocab": info.vocab,
        "params": info.params,
        "aux_ids": cfg.drafter.aux_ids,
    }
    return info
