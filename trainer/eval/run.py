"""`dflash eval` end to end: load the target once, evaluate each drafter on the prompts (cached
harness, or the reference loop with --reference) with a progress bar, check losslessness against
the target's own greedy decoding, warn when the chat template / thinking mode differ from the
drafter's training data, write report.json + .md + .png (a comparison when several drafters).
`--engine vllm` measures acceptance as vLLM serves the drafter instead (trainer/eval/served.py),
`--engine both` measures both and fails when they disagree by more than a tolerance."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.eval import prompts as P
from trainer.eval.report import (
    REPORT_SCHEMA_VERSION,
    aggregate,
    fmt_number,
    per_prompt,
    render_table,
    write_comparison,
    write_report,
)


@dataclass
class EvalOptions:
    drafters: list[Path]
    target: Path
    prompts: Path
    out: Path
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the drafter's
    device: str = "auto"
    chat_template: bool | None = None
    thinking: str | None = None
    limit: int | None = None
    reference: bool = False
    check_lossless: int = 4  # prompts checked against target greedy; -1: all, 0: none
    ignore_eos: bool = False
    engine: str = "harness"  # harness | vllm | both
    served_tolerance: float = 0.1  # --engine both: the largest |tau_vLLM - tau_harness| that passes
    tree_budgets: tuple[int, ...] = ()  # tree verification (DDTree) at these node budgets, beside the chain
    tree_top_k: int | None = None  # children per tree node among the next depth's top-k (None: the budget)


ENGINES = ("harness", "vllm", "both")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise P.PromptError("--device cuda: no CUDA device is visible")
    return torch.device(name)


def training_data_meta(drafter_folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The template settings the drafter's training data was made with, and where they were found:
    an export's copy, or the dataset (dflash_data.json) named by the run's run.yaml."""
    from trainer.regenerate import read_data_meta

    folder = Path(drafter_folder)
    meta = read_data_meta(folder)
    if meta is not None:
        return meta, str(folder)
    run_yaml = folder.parent.parent / "run.yaml"
    if folder.parent.name == "checkpoints" and run_yaml.is_file():
        import yaml

        data_path = (yaml.safe_load(run_yaml.read_text()) or {}).get("data", {}).get("path")
        if data_path:
            meta = read_data_meta(Path(data_path))
            if meta is not None:
                return meta, str(data_path)
    return None, None


def _label(path: Path, taken: set[str]) -> str:
    p = Path(path).resolve()
    label = p.name
    if label in taken or label.startswith("step-"):
        label = (
            f"{p.parent.parent.name}/{p.name}"
            if p.parent.name == "checkpoints"
            else f"{p.parent.name}/{p.name}"
        )
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def evaluate_one(
    opts: EvalOptions,
    folder: Path,
    target,
    token_prompts: list[list[int]],
    settings,
    stop_ids: set[int],
    device: torch.device,
    label: str,
    prompt_set: dict[str, Any],
) -> dict[str, Any]:
    from tqdm import tqdm

    from trainer.eval.harness import speculate, target_greedy
    from trainer.eval.models import load_drafter
    from trainer.eval.reference import ReferenceTarget, speculate_reference

    t_start = time.perf_counter()
    drafter = load_drafter(folder, opts.target, device)
    trained_block = int(drafter.config.block_size)
    B = opts.block_size or trained_block
    warnings: list[str] = []
    if B < 2:
        raise P.PromptError("--block-size must be at least 2 (an anchor and one draft)")
    if B > trained_block:
        warnings.append(
            f"block size {B} > the drafter's trained block size {trained_block}: slots past "
            f"{trained_block - 1} were never trained"
        )
    if list(drafter.target_layer_ids) != list(target.aux_ids):
        raise RuntimeError(f"target hooked at {target.aux_ids}, drafter wired to {drafter.target_layer_ids}")
    meta, where = training_data_meta(folder)
    diffs = settings.differences(meta.get("template") if meta else None)
    if diffs:
        warnings.append(
            f"the drafter's training data ({where}) was made with other prompt settings: "
            + "; ".join(diffs)
            + " (train and serve with the same chat template and thinking mode)"
        )
    for w in warnings:
        print(f"dflash eval: WARNING {w}", file=sys.stderr, flush=True)
    ref_target = ReferenceTarget(target) if opts.reference else None
    results = []
    bar = tqdm(token_prompts, desc=label, unit="prompt", file=sys.stderr, dynamic_ncols=True)
    acc_sum = rounds = 0
    for prompt in bar:
        if opts.reference:
            r = speculate_reference(ref_target, drafter, prompt, opts.max_new_tokens, B, stop_ids)
        else:
            r = speculate(target, drafter, prompt, opts.max_new_tokens, B, stop_ids)
        results.append(r)
        acc_sum += sum(r.accepted) + r.rounds
        rounds += r.rounds
        bar.set_postfix(tau=f"{acc_sum / max(1, rounds):.3f}")
    bar.close()
    n_check = len(results) if opts.check_lossless < 0 else min(opts.check_lossless, len(results))
    lossless: dict[int, bool] = {}
    mismatches = []
    greedy_tokens = greedy_s = 0.0
    greedy_ref: dict[int, list[int]] = {}
    for i in range(n_check):
        ref_tokens, secs = target_greedy(target, token_prompts[i], opts.max_new_tokens, stop_ids)
        greedy_ref[i] = ref_tokens
        greedy_tokens += len(ref_tokens)
        greedy_s += secs
        lossless[i] = ref_tokens == results[i].tokens
        if not lossless[i]:
            first = next(
                (j for j, (a, b) in enumerate(zip(ref_tokens, results[i].tokens)) if a != b),
                min(len(ref_tokens), len(results[i].tokens)),
            )
            mismatches.append({"prompt": i, "first_difference_at": first})
    agg = aggregate(results, B)
    target_tps = greedy_tokens / greedy_s if greedy_s > 0 else None
    ll = {
        "checked": n_check,
        "matched": sum(lossless.values()),
        "ok": all(lossless.values()) if n_check else None,
        "mismatches": mismatches,
        "target_tokens_per_s": target_tps,
    }
    if mismatches:
        warnings.append(
            f"LOSSLESS CHECK FAILED on {len(mismatches)} of {n_check} prompts: committed tokens differ "
            "from the target's greedy decoding"
        )
    trees = [
        evaluate_tree(opts, target, drafter, token_prompts, B, budget, stop_ids, greedy_ref, agg, label)
        for budget in opts.tree_budgets
    ]
    for t in trees:
        if t["lossless"]["ok"] is False:
            warnings.append(
                f"LOSSLESS CHECK FAILED for the tree of budget {t['budget']} on "
                f"{t['lossless']['checked'] - t['lossless']['matched']} of {t['lossless']['checked']} prompts"
            )
            ll["ok"] = False
    return {
        **report_frame(
            opts,
            folder,
            label,
            prompt_set,
            token_prompts,
            settings,
            stop_ids,
            B,
            trained_block,
            list(drafter.target_layer_ids),
            meta,
        ),  # fmt: skip
        "mode": "reference" if opts.reference else "cached",
        "device": str(device),
        **agg,
        "speedup_vs_target": (agg["tokens_per_s"] / target_tps)
        if (target_tps and agg["tokens_per_s"])
        else None,
        "lossless": ll,
        "trees": trees,
        "wall_s": round(time.perf_counter() - t_start, 3),
        "warnings": warnings,
        "per_prompt": per_prompt(results, lossless),
    }


def evaluate_tree(
    opts: EvalOptions,
    target,
    drafter,
    token_prompts: list[list[int]],
    block: int,
    budget: int,
    stop_ids: set[int],
    greedy_ref: dict[int, list[int]],
    chain: dict[str, Any],
    label: str,
) -> dict[str, Any]:
    """Tree verification (trainer/eval/tree.py) at one node budget over the same prompts: tau, the
    acceptance per depth, what the tree costs the target (tokens verified per round) and the lossless
    check against the same greedy tokens the chain was checked with."""
    from tqdm import tqdm

    from trainer.eval.tree import speculate_tree

    results = []
    bar = tqdm(
        token_prompts, desc=f"{label} tree {budget}", unit="prompt", file=sys.stderr, dynamic_ncols=True
    )
    for prompt in bar:
        results.append(
            speculate_tree(
                target, drafter, prompt, opts.max_new_tokens, block, budget, stop_ids, top_k=opts.tree_top_k
            )
        )
    bar.close()
    agg = aggregate(results, block)
    nodes = [n for r in results for n in r.tree_nodes]
    matched = sum(greedy_ref[i] == results[i].tokens for i in greedy_ref)
    return {
        "budget": budget,
        "top_k": opts.tree_top_k or budget,
        "tau": agg["tau"],
        "tau_over_chain": (agg["tau"] / chain["tau"]) if agg["tau"] and chain["tau"] else None,
        "rounds": agg["rounds"],
        "per_depth_acceptance": agg["per_position_acceptance"],
        "target_tokens_per_round": (1 + sum(nodes) / len(nodes)) if nodes else None,
        "tokens_per_s": agg["tokens_per_s"],
        "lossless": {
            "checked": len(greedy_ref),
            "matched": matched,
            "ok": matched == len(greedy_ref) if greedy_ref else None,
        },
    }


def report_frame(
    opts: EvalOptions,
    folder: Path,
    label: str,
    prompt_set: dict[str, Any],
    token_prompts,
    settings,
    stop_ids,
    block: int,
    trained_block: int,
    aux_ids: list[int],
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report's fields that do not depend on who measured: the drafter, the prompts, the settings."""
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "label": label,
        "drafter": str(folder),
        "target": str(opts.target),
        "prompts": str(opts.prompts),
        "prompt_set": prompt_set,
        "num_prompts": len(token_prompts),
        "block_size": block,
        "trained_block_size": trained_block,
        "max_new_tokens": opts.max_new_tokens,
        "aux_layer_ids": aux_ids,
        "stop_token_ids": sorted(stop_ids),
        "template": settings.to_dict(),
        "training_data_template": meta.get("template") if meta else None,
    }


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
    from trainer.eval.served import agreement

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


def record_in_run(checkpoint: Path, report: dict[str, Any], report_path: Path) -> Path | None:
    """Append an `eval` event to the event stream of the run a checkpoint belongs to
    (`<out_dir>/checkpoints/<name>` -> `<out_dir>/events.jsonl`), so the monitor, its metrics and the
    salvage notes show tau beside the loss. Nothing for an export or a foreign drafter. Returns the
    stream's path."""
    import json

    from trainer.checkpoint import read_meta
    from trainer.events import EventWriter

    checkpoint = Path(checkpoint)
    out_dir = checkpoint.parent.parent
    stream = out_dir / "events.jsonl"
    if checkpoint.parent.name != "checkpoints" or not stream.is_file():
        return None
    run_id = ""
    with open(stream, "rb") as fh:  # the newest run id: from the stream's tail (it can be gigabytes)
        fh.seek(max(0, fh.seek(0, 2) - 65536))
        for line in fh.read().splitlines()[::-1]:
            try:
                run_id = json.loads(line).get("run_id") or ""
            except ValueError:
                continue
            if run_id:
                break
    try:
        step = read_meta(checkpoint).get("step")
    except (OSError, ValueError):
        step = None
    EventWriter(out_dir, run_id).emit(
        "eval",
        step=step,
        checkpoint=checkpoint.name,
        tau=report["tau"],
        tau_vllm=(report.get("served") or {}).get("tau"),
        tree_tau={str(t["budget"]): t["tau"] for t in report.get("trees") or []} or None,
        rounds=report["rounds"],
        block_size=report["block_size"],
        per_position_acceptance=report["per_position_acceptance"],
        tokens_per_s=report["tokens_per_s"],
        num_prompts=report["num_prompts"],
        prompts=report["prompts"],
        mode=report["mode"],
        lossless_ok=report["lossless"]["ok"],
        report=str(report_path),
    )
    return stream


def run_eval(opts: EvalOptions) -> int:
    """Returns 0, or 1 when a lossless check failed (the report is written either way)."""
    from trainer.eval.models import (
        HookedTarget,
        ModelError,
        aux_ids_of,
        release,
        resolve_drafter_dir,
        speculators_folder,
    )

    if opts.engine not in ENGINES:
        raise P.PromptError(f"--engine {opts.engine!r}: choose one of {', '.join(ENGINES)}")
    if opts.engine == "vllm" and opts.reference:
        raise P.PromptError("--reference is the harness's slow loop: use it with --engine harness or both")
    if opts.served_tolerance < 0:
        raise P.PromptError("--served-tolerance must be >= 0")
    if opts.max_new_tokens < 1:
        raise P.PromptError("--max-new-tokens must be at least 1")
    if any(b < 1 for b in opts.tree_budgets) or (opts.tree_top_k is not None and opts.tree_top_k < 1):
        raise P.PromptError("--tree-budget and --tree-top-k must be at least 1")
    if opts.tree_budgets and (opts.reference or opts.engine == "vllm"):
        raise P.PromptError(
            "--tree-budget runs in the harness's cached loop: not with --reference or --engine vllm"
        )
    if opts.block_size is not None and opts.block_size < 2:
        raise P.PromptError("--block-size must be at least 2 (an anchor and one draft)")
    out = Path(opts.out)
    if out.suffix != ".json":
        raise P.PromptError(f"--out {out}: give a .json path (the .md and .png go beside it)")
    lines = P.read_prompt_file(opts.prompts, opts.limit)
    prompt_set = P.describe_prompts(opts.prompts)  # of what was read, once for every drafter
    for d in opts.drafters:
        resolve_drafter_dir(d)  # a clear error before any model loads
    if not (Path(opts.target) / "config.json").is_file():
        raise ModelError(f"--target {opts.target}: no config.json (a transformers model folder is needed)")
    if opts.engine != "harness":
        from trainer.eval.served import ServedError
        from trainer.vllm_engine import import_vllm

        import_vllm(f"--engine {opts.engine}", ServedError)  # before any model loads
    out.parent.mkdir(parents=True, exist_ok=True)
    device = resolve_device(opts.device)
    tok = P.load_tokenizer(opts.target)
    settings = P.resolve_settings(tok, opts.chat_template, opts.thinking)
    token_prompts = P.encode(lines, tok, settings)
    stop_ids = set() if opts.ignore_eos else set(P.stop_token_ids(opts.target, tok))
    folders = [speculators_folder(d, opts.target) for d in opts.drafters]
    reports = []
    taken: set[str] = set()
    target = None
    labels = [_label(given, taken) for given in opts.drafters]
    if opts.engine in ("harness", "both"):
        for folder, label in zip(folders, labels):
            aux = aux_ids_of(folder)
            if target is None or target.aux_ids != aux:
                release(target, device)  # one target on the device at a time
                target = HookedTarget(opts.target, aux, device)
            reports.append(
                evaluate_one(
                    opts, folder, target, token_prompts, settings, stop_ids, device, label, prompt_set
                )
            )
    if opts.engine in ("vllm", "both"):
        from trainer.eval.served import served_acceptance

        release(target, device)  # the engine takes the memory the harness's target held
        for i, (folder, label) in enumerate(zip(folders, labels)):
            block = opts.block_size or int(json.loads((folder / "config.json").read_text())["block_size"])
            served = served_acceptance(
                folder,
                opts.target,
                token_prompts,
                opts.max_new_tokens,
                block,
                stop_ids,
                device=opts.device,
            )
            print(
                f"{label}: tau {fmt_number(served['tau'])} served by {served['engine']} "
                f"({served['drafts']} drafts)"
            )
            if opts.engine == "both":
                attach_served(reports[i], served, opts.served_tolerance)
            else:
                reports.append(
                    served_only_report(
                        served_frame(
                            opts, folder, label, prompt_set, token_prompts, settings, stop_ids, block
                        ),
                        served,
                    )
                )
    if len(reports) == 1:
        paths = write_report(reports[0], out)
        r = reports[0]
        print(
            f"tau {fmt_number(r['tau'])} over {r['rounds']} rounds (block {r['block_size']}), "
            f"{fmt_number(r['tokens_per_s'], 1)} tokens/s; per position "
            + " ".join(fmt_number(p, 2) for p in r["per_position_acceptance"])
        )
        for t in r.get("trees") or []:
            print(
                f"tree budget {t['budget']}: tau {fmt_number(t['tau'])} "
                f"({fmt_number(t['tau_over_chain'], 2)}x the chain), "
                f"{fmt_number(t['target_tokens_per_round'], 1)} target tokens per round"
            )
    else:
        paths = write_comparison(reports, out)
        print(render_table(reports))
    print("wrote " + ", ".join(str(p) for p in paths))
    for given, r in zip(opts.drafters, reports):
        where = record_in_run(resolve_drafter_dir(given), r, paths[0])
        if where is not None:
            print(f"recorded tau in {where} (the monitor's eval panel)")
    rc = 0
    failed = [r["label"] for r in reports if r["lossless"]["ok"] is False]
    if failed:
        print(f"dflash eval: lossless check FAILED for {failed}: see the report", file=sys.stderr)
        rc = 1
    for r in reports:
        a = r.get("engine_agreement")
        served_only_failed = r["mode"] == "served" and not all(c["ok"] for c in r["served"]["checks"])
        if (a is not None and not a["ok"]) or served_only_failed:
            print(f"dflash eval: {r['label']}: {r['warnings'][-1]}", file=sys.stderr)
            rc = 1
        elif a is not None:
            print(
                f"{r['label']}: harness and vLLM agree: tau {fmt_number(a['tau_harness'])} vs "
                f"{fmt_number(a['tau_vllm'])} (tolerance {a['tolerance']})"
            )
    return rc
