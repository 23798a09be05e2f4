"""One checkpoint evaluated by the harness (heavy side): the drafter against an already-hooked target
on token prompts, tau and the per-position acceptance, the lossless check against the target's own
greedy decoding, tree verification at the asked budgets; the report's frame (what does not depend on
who measured).

The public interface is small: `evaluate_checkpoint` (a checkpoint folder, the target folder, a prompt
file -> the report dict `dflash eval` writes), and the parts `dflash eval` composes
(`evaluate_one`, `evaluate_tree`, `report_frame`, `resolve_device`, `drafter_label`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.eval import prompts as P
from trainer.eval.lossless import GreedyReference, classify, summarise
from trainer.eval.options import EvalOptions
from trainer.eval.report import REPORT_SCHEMA_VERSION, aggregate, per_prompt
from trainer.eval.training_meta import training_data_meta


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise P.PromptError("--device cuda: no CUDA device is visible")
    return torch.device(name)


def drafter_label(path: Path, taken: set[str]) -> str:
    """A short unique name for a drafter in a report: its folder, or run/step-N for a checkpoint."""
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

    from trainer.eval.harness import greedy_reference, speculate
    from trainer.eval.models import load_drafter
    from trainer.eval.reference import ReferenceTarget

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
    runner = ReferenceTarget(target) if opts.reference else target  # the reference path, or the cache's
    results = []
    bar = tqdm(token_prompts, desc=label, unit="prompt", file=sys.stderr, dynamic_ncols=True)
    acc_sum = rounds = 0
    for prompt in bar:
        r = speculate(runner, drafter, prompt, opts.max_new_tokens, B, stop_ids)
        results.append(r)
        acc_sum += sum(r.accepted) + r.rounds
        rounds += r.rounds
        bar.set_postfix(tau=f"{acc_sum / max(1, rounds):.3f}")
    bar.close()
    n_check = len(results) if opts.check_lossless < 0 else min(opts.check_lossless, len(results))
    greedy_ref = {
        i: greedy_reference(target, token_prompts[i], opts.max_new_tokens, stop_ids) for i in range(n_check)
    }
    verdicts = {i: classify(results[i].tokens, results[i].verified, ref) for i, ref in greedy_ref.items()}
    agg = aggregate(results, B)
    greedy_s = sum(ref.seconds for ref in greedy_ref.values())
    target_tps = sum(len(ref.tokens) for ref in greedy_ref.values()) / greedy_s if greedy_s > 0 else None
    ll = {**summarise(verdicts, next(iter(greedy_ref.values()), None)), "target_tokens_per_s": target_tps}
    if ll["mismatches"]:
        warnings.append(
            f"LOSSLESS CHECK FAILED on {len(ll['mismatches'])} of {n_check} prompts: committed tokens differ "
            "from the target's greedy decoding beyond a near tie"
        )
    trees = [
        evaluate_tree(opts, target, drafter, token_prompts, B, budget, stop_ids, greedy_ref, agg, label)
        for budget in opts.tree_budgets
    ]
    for t in trees:
        if t["lossless"]["ok"] is False:
            warnings.append(
                f"LOSSLESS CHECK FAILED for the tree of budget {t['budget']} on "
                f"{len(t['lossless']['mismatches'])} of {t['lossless']['checked']} prompts"
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
        "per_prompt": per_prompt(results, verdicts),
    }


def evaluate_tree(
    opts: EvalOptions,
    target,
    drafter,
    token_prompts: list[list[int]],
    block: int,
    budget: int,
    stop_ids: set[int],
    greedy_ref: dict[int, GreedyReference],
    chain: dict[str, Any],
    label: str,
) -> dict[str, Any]:
    """Tree verification (trainer/eval/tree.py) at one node budget over the same prompts: tau, the
    acceptance per depth, what the tree costs the target (tokens verified per round) and the lossless
    check against the same greedy decoding the chain was checked with (near ties as the chain's)."""
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
    calls = [n for r in results for n in r.target_forwards]
    verdicts = {i: classify(results[i].tokens, results[i].verified, ref) for i, ref in greedy_ref.items()}
    return {
        "budget": budget,
        "top_k": opts.tree_top_k or budget,
        "tau": agg["tau"],
        "tau_over_chain": (agg["tau"] / chain["tau"]) if agg["tau"] and chain["tau"] else None,
        "rounds": agg["rounds"],
        "per_depth_acceptance": agg["per_position_acceptance"],
        "target_tokens_per_round": (1 + sum(nodes) / len(nodes)) if nodes else None,
        # 1 on a dense target; a hybrid's tree is walked by chains (trainer/eval/tree.py walk_tree)
        "target_forwards_per_round": (sum(calls) / len(calls)) if calls else None,
        "tokens_per_s": agg["tokens_per_s"],
        "lossless": summarise(verdicts, next(iter(greedy_ref.values()), None)),
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


def evaluate_checkpoint(
    checkpoint: Path,
    target: Path,
    prompts: Path,
    *,
    max_new_tokens: int = 128,
    limit: int | None = None,
    device: str | torch.device = "auto",
    check_lossless: int = 0,
    chat_template: bool | None = None,
    thinking: str | None = None,
    hooked=None,
) -> dict[str, Any]:
    """tau of one checkpoint (a checkpoint folder, an export or a run's out_dir) on a prompt file, as
    `dflash eval --engine harness` measures it: the report dict `dflash eval` writes (write it with
    `trainer.eval.report.write_report`, record it with `trainer.eval.record.record_in_run`).

    `hooked`: a `trainer.eval.models.HookedTarget` already loaded on `device` with the checkpoint's aux
    layer ids, reused as is (a loop evaluating many checkpoints loads the target once); else the target
    is loaded here and released before returning. `check_lossless`: prompts checked against the
    target's greedy decoding (0: none, -1: all)."""
    from trainer.eval.models import HookedTarget, aux_ids_of, release, speculators_folder

    opts = EvalOptions(
        drafters=[Path(checkpoint)],
        target=Path(target),
        prompts=Path(prompts),
        out=Path("report.json"),
        max_new_tokens=max_new_tokens,
        device=str(device),
        chat_template=chat_template,
        thinking=thinking,
        limit=limit,
        check_lossless=check_lossless,
    )
    lines = P.read_prompt_file(opts.prompts, limit)
    tok = P.load_tokenizer(opts.target)
    settings = P.resolve_settings(tok, chat_template, thinking)
    token_prompts = P.encode(lines, tok, settings)
    stop_ids = set(P.stop_token_ids(opts.target, tok))
    folder = speculators_folder(opts.drafters[0], opts.target)
    dev = resolve_device(str(device)) if hooked is None else hooked.device
    target_model = hooked if hooked is not None else HookedTarget(opts.target, aux_ids_of(folder), dev)
    try:
        return evaluate_one(
            opts,
            folder,
            target_model,
            token_prompts,
            settings,
            stop_ids,
            dev,
            drafter_label(opts.drafters[0], set()),
            P.describe_prompts(opts.prompts),
        )
    finally:
        if hooked is None:
            release(target_model, dev)
