"""The model card (README.md) of a drafter pushed to the Hub (`dflash export --push-to-hub`).

Generated from what the export and its run recorded, never typed by hand: the target (the export's
verifier), the recipe (the run config's levers from the run's `run_start` event), the data, the steps
(the exported checkpoint's step of the run's `max_steps`), the τ table (every `eval` event of the run
for the exported checkpoint: chain τ, tree τ per budget and vLLM's τ when measured, one row per prompt
set; "not measured" otherwise) and the `vllm serve` line with the Hub repo as the draft model. The
text depends only on those records, so the same export gives the same card byte for byte (a second
push sends nothing). No token and no secret goes in. Light side.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainer.store.events import load_events

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
LEVERS = {
    "drafter": ("num_layers", "block_size", "aux_layer_ids", "mask_token_id", "sliding_window"),
    "train": (
        "optimizer",
        "lr",
        "muon_lr",
        "schedule",
        "loss",
        "position_weights",
        "gamma",
        "dpace_alpha",
        "max_tokens_per_batch",
        "max_anchors",
        "precision",
    ),
}


def serve_line(export_info: dict[str, Any], repo: str) -> str:
    """The `vllm serve` line of trainer/export.py with the Hub repo as the draft model."""
    spec = json.dumps(
        {"method": "dflash", "model": repo, "num_speculative_tokens": export_info["block_size"] - 1}
    )
    return f"vllm serve {export_info['verifier']} --speculative-config '{spec}'"


def run_records(export_info: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the run's last `run_start` config, the `eval` events of the exported checkpoint) from the
    run the checkpoint belongs to (`<out_dir>/checkpoints/<name>`); (None, []) for anything else."""
    source = Path(export_info.get("source") or "")
    stream = source.parent.parent / "events.jsonl"
    if source.parent.name != "checkpoints" or not stream.is_file():
        return None, []
    events = load_events(stream)
    starts = [e for e in events if e.get("event") == "run_start" and isinstance(e.get("config"), dict)]
    evals = [
        e
        for e in events
        if e.get("event") == "eval"
        and (
            e.get("checkpoint") == source.name
            or (e.get("checkpoint") is None and e.get("step") == export_info.get("step"))
        )
    ]
    return (starts[-1]["config"] if starts else None), evals


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def _prompt_name(p: Any) -> str:
    text = str(p or "?")
    return Path(text).name if "/" in text else text


def tau_table(evals: list[dict[str, Any]]) -> list[str]:
    """One row per prompt set (the newest eval of each): chain τ, tree τ per budget, vLLM's τ."""
    if not evals:
        return ["Not measured: the run recorded no `dflash eval` of this checkpoint (`eval` events)."]
    newest: dict[str, dict[str, Any]] = {}
    for e in evals:
        newest[_prompt_name(e.get("prompts"))] = e
    budgets = sorted({int(b) for e in newest.values() for b in (e.get("tree_tau") or {})})
    head = "| prompts | prompts evaluated | block | chain τ | " + "".join(f"tree τ ({b}) | " for b in budgets)
    lines = [head + "vLLM τ | lossless |", "|" + " --- |" * (6 + len(budgets))]
    for name, e in sorted(newest.items()):
        trees = e.get("tree_tau") or {}
        ok = e.get("lossless_ok")
        lines.append(
            f"| {name} | {_fmt(e.get('num_prompts'))} | {_fmt(e.get('block_size'))} | {_fmt(e.get('tau'))} | "
            + "".join(f"{_fmt(trees.get(str(b)))} | " for b in budgets)
            + f"{_fmt(e.get('tau_vllm'))} | {'–' if ok is None else ('ok' if ok else 'MISMATCH')} |"
        )
    return lines + [
        "",
        "τ: tokens committed per target forward (accepted drafts + 1), greedy and lossless; tree τ: DDTree "
        'verification at that node budget; "–": not measured.',
    ]


def _recipe(config: dict[str, Any] | None) -> list[str]:
    if not config:
        return ["| recipe | not recorded (the checkpoint is not in a run's out_dir) |"]
    rows = []
    weights = (config.get("train") or {}).get("position_weights")
    unused = {"exp": {"dpace_alpha"}, "dpace": {"gamma"}}.get(weights, set())  # the other scheme's knob
    if (config.get("train") or {}).get("optimizer") != "muon":
        unused.add("muon_lr")
    for section, keys in LEVERS.items():
        values = config.get(section) or {}
        got = [f"{k} {json.dumps(values[k])}" for k in keys if values.get(k) is not None and k not in unused]
        rows.append(f"| {section} | {', '.join(got) or '–'} |")
    data = config.get("data") or {}
    rows.append(
        f"| data | `{Path(str(data.get('path', '?'))).name}` (max_length {_fmt(data.get('max_length'))}) |"
    )
    return rows


def render_card(export_info: dict[str, Any], repo: str) -> str:
    """The README.md text of `repo` for the export described by `export_info` (dflash_export.json)."""
    config, evals = run_records(export_info)
    verifier = str(export_info["verifier"])
    meta = ["---", "library_name: speculators", "pipeline_tag: text-generation"]
    if HUB_ID.match(verifier) and not Path(verifier).exists():
        meta.append(f"base_model: {verifier}")
    meta += ["tags:", "- speculative-decoding", "- dflash", "- speculators", "---", ""]
    max_steps = ((config or {}).get("train") or {}).get("max_steps")
    steps = _fmt(export_info.get("step")) + (f" of {max_steps}" if max_steps else "")
    files = export_info.get("files") or {}
    body = [
        f"# {repo.split('/')[-1]}",
        "",
        f"A DFlash drafter (block-diffusion speculative decoding, speculators format) for `{verifier}`, "
        "trained and exported with dflash (`dflash train`, `dflash export`). The weights are the draft "
        "layers only: the embedding and the head come from the target when the server loads it.",
        "",
        "## Serve it",
        "",
        "```sh",
        serve_line(export_info, repo),
        "```",
        "",
        f"`num_speculative_tokens` is the block size ({export_info['block_size']}) minus one. The draft "
        f"block attention is {export_info.get('draft_block_attention', 'as trained')}.",
        "",
        "## Acceptance length τ",
        "",
        *tau_table(evals),
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| target | `{verifier}` |",
        f"| steps | {steps} |",
        f"| aux layer ids | {export_info.get('aux_layer_ids')} |",
        f"| dtype | {export_info.get('dtype', 'as trained')} |",
        *_recipe(config),
        "",
        "## Files",
        "",
        "| file | sha256 |",
        "| --- | --- |",
        *[f"| `{name}` | `{digest}` |" for name, digest in sorted(files.items())],
        "",
        f"Reload check at export: {export_info.get('reload_check', 'not recorded')}. vLLM load check: "
        f"{'passed' if isinstance(export_info.get('vllm_load_check'), dict) else 'not run'}.",
        "",
    ]
    return "\n".join(meta + body)
