"""`dflash plan`: how one node's GPUs hold the target (GPUs per copy and data-parallel width, or a vLLM
server beside the trainers), a per-GPU memory estimate with its reason, the offline-vs-online arithmetic,
and what the run config must say for that layout (`apply`).

Inputs (trainer/layout/inputs.py): the run config (`--config RUN.yaml`: every knob the plan uses, and the
target's config.json from target.path unless `--target-config` names a copy on this machine), or the
target's config.json and the recipe flags; and the GPUs (trainer/layout/hardware.py): a catalog name or
each node's recon facts. Layouts: in process (trainer/layout/hooked.py), else, with `target.source`
auto or vllm, a vLLM split (trainer/layout/split.py); both weigh the run with trainer/layout/sizing.py,
the memory model `dflash preflight` uses too. The disk a node needs (target, venv, checkpoints,
hidden-state spool, regenerated data) comes from trainer/layout/disk.py, which preflight's disk gate
checks too; how `dflash eval` and `dflash regenerate --backend vllm` hold the target on the same GPUs
(vLLM's tensor parallelism, the harness's device_map, the drafter on its first GPU) from
trainer/layout/inference.py; where a run's `eval:` child runs (beside rank 0, or on GPUs kept out of
training, said under `apply` as eval.device) from trainer/layout/eval_child.py. A layout, or an `eval:`
child, that does not fit is refused: the report, then the reason on stderr, exit 2. Light side: no torch.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.errors import ExitCode
from trainer.layout.disk import against_nodes, plan_disk
from trainer.layout.eval_child import place_eval_child
from trainer.layout.hardware import node_count, node_gpus
from trainer.layout.hooked import choose_layout
from trainer.layout.inference import kv_bytes_per_token, plan_inference
from trainer.layout.inputs import plan_inputs
from trainer.layout.recipe import (
    ASSUMPTIONS,
    GIB,
    PlanError,
    Recipe,
    TargetShape,
    describe,
    read_target,
    shapes,
)
from trainer.layout.renting import (
    check_price,
    plan_cost,
    plan_regeneration,
    plan_training,
    training_samples,
)
from trainer.layout.report import budget_arithmetic, offline_arithmetic, render_text
from trainer.layout.split import choose_disaggregated, disaggregated_layout


def place(
    t: TargetShape, memory_gib: float, count: int, r: Recipe, source: str, gpus_per_copy: int | None
) -> tuple[dict[str, Any], str]:
    """(the layout, its target.source): in process where it fits (or is asked for), else a vLLM split."""
    if source == "vllm" and gpus_per_copy:
        raise PlanError(
            "target.gpus_per_copy (--gpus-per-copy) is the in-process layout's: it does not combine with "
            "target.source vllm (--source vllm)"
        )
    layout = choose_layout(t, memory_gib, count, r, gpus_per_copy)
    if not (source == "vllm" or (source == "auto" and not layout["fits"] and not gpus_per_copy)):
        return layout, "hooked"
    split = choose_disaggregated(t, memory_gib, count, r)
    if source == "auto" and split["fits"]:
        split["reason"] = (
            "the target in each trainer process does not fit ("
            + layout["reason"]
            + "): a vLLM server holds it instead; "
            + split["reason"]
        )
    if split["fits"] or source == "vllm":
        return disaggregated_layout(split, memory_gib), "vllm"
    layout["reason"] += "; nor does a vLLM server beside the trainers (--source vllm): " + split["reason"]
    return layout, "hooked"


def apply_keys(plan: dict[str, Any]) -> dict[str, Any]:
    """What the run config must say for the layout planned: merged into it by the trainer_service role
    (empty when nothing fits)."""
    if not plan["fits"]:
        return {}
    target: dict[str, Any] = {"source": plan["source"], "gpus_per_copy": plan["gpus_per_copy"]}
    if plan["vllm"]:
        v = plan["vllm"]
        target["vllm"] = {
            "tensor_parallel_size": v["tensor_parallel_size"],
            "data_parallel_size": v["data_parallel_size"],
            "gpus": v["gpus"],
        }
    return {"target": target, "train": {"shard": plan["shard"], "device": "cuda"}}


def make_plan(args) -> dict[str, Any]:
    check_price(getattr(args, "price_per_hour", None))  # bad input: refused before any reading
    inputs = plan_inputs(args)
    target = read_target(inputs.target_config, inputs.dtype)
    nodes = node_count(args.facts, args.nodes)
    gpu_name, spec, count = node_gpus(args)
    r = inputs.recipe
    if r.draft_vocab is not None and not 2 <= r.draft_vocab < target.vocab:
        raise PlanError(
            f"drafter.draft_vocab_size (--draft-vocab-size {r.draft_vocab}): at least 2 and below the "
            f"target's vocabulary ({target.vocab})"
        )
    run = inputs.run
    child = None
    if run is not None and run.eval.enabled and count > 0:  # the eval: child, placed and counted
        child, (layout, source) = place_eval_child(
            target,
            spec["memory_gib"],
            count,
            r,
            run,
            lambda n: place(target, spec["memory_gib"], n, r, inputs.source, inputs.gpus_per_copy),
        )
    else:
        layout, source = place(target, spec["memory_gib"], count, r, inputs.source, inputs.gpus_per_copy)
    plan = {
        "config": inputs.config,
        "gpu": gpu_name,
        "gpu_count": count,
        "nodes": nodes,
        "world_size": nodes * layout["data_parallel"],
        "gpu_memory_gib": spec["memory_gib"],
        "target": {**describe(target), "config": str(inputs.target_config)},
        "source": source,
        "vllm": layout.get("vllm"),
        "gpus_per_copy": layout["gpus_per_copy"],
        "data_parallel": layout["data_parallel"],
        "shard": layout["shard"],
        "fits": layout["fits"],
        "headroom_share": layout.get("headroom_share"),
        "per_gpu_memory_gb": layout["per_gpu_memory_gb"],
        "per_gpu_memory_gib": layout["per_gpu_memory_gib"],
        "per_gpu_breakdown_gib": {k: round(v / GIB, 2) for k, v in layout["per_gpu_bytes"].items()},
        "reason": layout["reason"],
        "tried": layout["tried"],
        "thin_margin": layout.get("thin_margin", False),
        "fits_with_anchors": layout.get("fits_with_anchors", []),
        "drafter": {
            "layers": r.draft_layers,
            "aux_layers": r.n_aux,
            "block_size": r.block,
            "anchors": r.anchors,
            "tokens_per_batch": r.tokens,
            "loss_chunk_rows": r.loss_chunk_rows,
            "activation_checkpointing": r.activation_checkpointing,
            "draft_vocab_size": r.draft_vocab,
            "intermediate_size": r.draft_intermediate,
            "optimizer": r.optimizer,
            "shard": r.shard or "auto",
            "share_target_embedding": r.share_embedding,
            "vllm_gpu_memory_utilization": r.vllm_memory_share,
        },
        "assumptions": ASSUMPTIONS,
    }
    plan["eval_child"] = child
    plan["apply"] = apply_keys(plan)
    if child and plan["apply"] and child["apply"]:
        plan["apply"].update(child["apply"])
    plan["inference"] = plan_inference(target, spec["memory_gib"], count, r)  # dflash eval / regenerate
    samples, samples_source = training_samples(args)
    arith = offline_arithmetic(
        target, r.n_aux, samples, args.mean_tokens, args.epochs, count * nodes, layout["gpus_per_copy"]
    )
    plan["offline_storage_bytes"] = arith["offline_storage_bytes"]
    plan["offline_vs_online"] = arith
    plan["disk"] = plan_disk(
        inputs.target_config,
        inputs.dtype,
        shapes(target, r),
        run=inputs.run,
        source=source,
        trainer_ranks=layout["data_parallel"],
        num_layers=target.layers,
        tokens_per_batch=r.tokens,
        regenerate_samples=args.regenerate_samples,
        mean_tokens=args.mean_tokens,
    )
    plan["disk"]["nodes"] = against_nodes(plan["disk"], args.facts)
    train = inputs.run.train if inputs.run is not None else None
    budget = getattr(args, "time_budget", None) or (train.time_budget if train else None)
    if budget:  # train.time_budget in tokens, steps and epochs
        from trainer.config.run import TrainConfig

        train = train or TrainConfig(max_tokens_per_batch=r.tokens, time_budget=budget)
        plan["time_budget"] = budget_arithmetic(
            budget,
            step_rate(args, gpu_name, arith),
            train.max_tokens_per_step(plan["world_size"]),
            train.max_steps,
            samples * args.mean_tokens,
        )
    renting(plan, args, target, gpu_name, spec, count, arith, samples, samples_source)
    return plan


def renting(plan, args, target, gpu_name, spec, count, arith, samples, samples_source) -> None:
    """The renting question (trainer/layout/renting.py): regeneration and training hours, and money."""
    plan["regeneration"] = None
    if args.regenerate_samples:
        plan["regeneration"] = plan_regeneration(
            target,
            gpu_name,
            spec,
            count,
            plan["inference"]["engine"],
            args.regenerate_samples,
            args.mean_tokens,
            kv_bytes_per_token(target),
            getattr(args, "regenerate_concurrency", None),
        )
    try:
        rate = step_rate(args, gpu_name, arith)
    except PlanError:
        if getattr(args, "rate_from", None):
            raise
        rate = None  # a GPU outside the catalog: no modelled rate, said in the report
    plan["training"] = plan_training(samples, samples_source, args.mean_tokens, args.epochs, rate)
    plan["cost"] = plan_cost(plan["regeneration"], plan["training"], plan["nodes"], args.price_per_hour)


def step_rate(args, gpu_name: str, arith: dict[str, Any]) -> dict[str, Any]:
    """The rate a time budget is turned into tokens with: measured from a run's events
    (`--rate-from RUN_DIR`: its recent step events, checkpoints included), else modelled (this GPU
    kind's tokens/s at the plan's assumptions)."""
    from pathlib import Path

    if getattr(args, "rate_from", None):
        from trainer.store.events import load_events
        from trainer.store.run_state import state_from_events

        path = Path(args.rate_from)
        path = path / "events.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise PlanError(
                f"--rate-from {args.rate_from}: no events.jsonl there (a run folder or its stream)"
            )
        st = state_from_events(load_events(path))
        tok_s, sps = st.tokens_per_s(), st.seconds_per_step()
        if not tok_s or not sps:
            raise PlanError(f"--rate-from {path}: fewer than two step events, no rate to measure")
        return {"tokens_per_s": tok_s, "seconds_per_step": sps, "source": f"measured ({path}, last steps)"}
    for h in arith["per_hardware"]:
        if h["gpu"] == gpu_name:
            return {
                "tokens_per_s": h["tokens_per_s"],
                "source": f"modelled ({h['gpus']} x {gpu_name} at mfu {ASSUMPTIONS['mfu']}; "
                "--rate-from RUN_DIR measures it)",
            }
    raise PlanError(f"no modelled rate for GPU {gpu_name!r}: pass --rate-from RUN_DIR (a run's events)")


def cmd_plan(args) -> int:
    plan = make_plan(args)
    print(json.dumps(plan, indent=1) if args.json else render_text(plan))
    if not plan["fits"]:
        raise PlanError(f"no layout fits: {plan['reason']}")
    if plan.get("eval_child") and not plan["eval_child"]["fits"]:
        raise PlanError(f"the evaluation while training (eval:) has no place: {plan['eval_child']['reason']}")
    return ExitCode.OK
