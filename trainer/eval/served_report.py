"""`dflash eval --engine vllm|both` around the engine (heavy side): a checkpoint exported into a
scratch folder so vLLM can load it, served (trainer/eval/served.py), and its numbers put into the
report: alone (`--engine vllm`, a frame from the drafter's config.json) or beside the harness's
(`--engine both`, with the agreement check)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.eval.checkpoint_eval import report_frame
from trainer.eval.options import EvalOptions
from trainer.eval.report import fmt_number
from trainer.eval.served import EXPORT_INFO, agreement, serve_export
from trainer.eval.training_meta import training_data_meta


def exported(folder: Path, target: Path, scratch: Path) -> Path:
    """`folder` when it is an export, else a fresh export of it under `scratch` (what vLLM loads)."""
    from trainer.export import export

    folder = Path(folder)
    if (folder / EXPORT_INFO).is_file():
        return folder
    out = Path(scratch) / "export"
    export(folder, out, target=target)
    return out


def served_acceptance(folder: Path, target: Path, *args: Any, **engine: Any) -> dict[str, Any]:
    """`serve_export` (trainer/eval/served.py: its arguments after `target`, its counts) of `folder`, a
    checkpoint (exported into a scratch folder first, removed after) or an export."""
    scratch = Path(tempfile.mkdtemp(prefix="dflash-served-"))
    try:
        return serve_export(exported(folder, target, scratch), target, *args, named=str(folder), **engine)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def served_frame(
    opts: EvalOptions, folder: Path, label: str, prompt_set, token_prompts, settings, stop_ids, block: int
):
    """The frame of an `--engine vllm` report, from the drafter's config.json (no harness ran)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    meta, _ = training_data_meta(folder)
    frame = report_frame(opts, folder, label, prompt_set, token_prompts, settings, stop_ids, block,
                         int(cfg["block_size"]), list(cfg["aux_hidden_state_layer_ids"]), meta)  # fmt: skip
    return frame | {"wall_s": None, "warnings": [], "prompt_lengths": [len(p) for p in token_prompts]}


def served_only_report(harness_free: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """`--engine vllm`: the report's numbers are vLLM's (no harness run, no lossless check: vLLM verifies
    with its own target)."""
    per = [
        {
            "index": i,
            "prompt_tokens": n,
            "new_tokens": len(t),
            "rounds": None,
            "tau": None,
            "accepted": None,
            "stopped": None,
            "wall_s": None,
            "lossless": None,
            "tokens": t,
        }
        for i, (n, t) in enumerate(zip(harness_free["prompt_lengths"], served["tokens"]))
    ]
    rep = {k: v for k, v in harness_free.items() if k != "prompt_lengths"}
    rep.update(
        mode="served",
        device=served["device"],
        tau=served["tau"],
        rounds=served["drafts"],
        per_position_acceptance=served["per_position_acceptance"],
        acceptance_histogram={},
        new_tokens=served["new_tokens"],
        decode_s=served["decode_s"],
        tokens_per_s=served["tokens_per_s"],
        speedup_vs_target=None,
        lossless={"checked": 0, "matched": 0, "ok": None, "mismatches": [], "target_tokens_per_s": None},
        served={k: v for k, v in served.items() if k != "tokens"},
        per_prompt=per,
    )
    failed = [c["detail"] for c in served["checks"] if not c["ok"]]
    if failed:
        rep["warnings"].append("vLLM SERVES ANOTHER DRAFTER than the one trained: " + "; ".join(failed))
    return rep


def attach_served(rep: dict[str, Any], served: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """`--engine both`: vLLM's numbers beside the harness's, and whether they agree."""
    rep["served"] = {k: v for k, v in served.items() if k != "tokens"}
    rep["engine_agreement"] = agreement(rep, served, tolerance)
    for p, t in zip(rep["per_prompt"], served["tokens"]):
        p["served_tokens_match"] = p["tokens"] == t
    a = rep["engine_agreement"]
    if not a["ok"]:
        rep["warnings"].append(
            f"ENGINES DISAGREE: tau {fmt_number(a['tau_harness'])} in the harness, "
            f"{fmt_number(a['tau_vllm'])} served by {served['engine']} (tolerance {tolerance}); "
            "failed checks: "
            + ("; ".join(c["detail"] for c in a["checks"] if not c["ok"]) or "none of the usual causes")
        )
    return rep
