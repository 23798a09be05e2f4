"""`dflash eval` end to end: load the target once, evaluate each drafter on the prompts (cached
harness, or the reference loop with --reference; trainer/eval/checkpoint_eval.py) with a progress bar,
check losslessness against the target's own greedy decoding, warn when the chat template / thinking
mode differ from the drafter's training data, write report.json + .md + .png (a comparison when several
drafters) and record tau in the run's event stream (trainer/eval/record.py).
`--engine vllm` measures acceptance as vLLM serves the drafter instead (trainer/eval/served_report.py),
`--engine both` measures both and fails when they disagree by more than a tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.eval import prompts as P
from trainer.eval.checkpoint_eval import drafter_label, evaluate_one, resolve_device
from trainer.eval.options import ENGINES, EvalOptions, check_options
from trainer.eval.record import record_in_run
from trainer.eval.report import fmt_number, render_table, write_comparison, write_report
from trainer.eval.served_report import attach_served, served_acceptance, served_frame, served_only_report

__all__ = ["ENGINES", "EvalOptions", "run_eval"]

ENGINE_LOG = "vllm-engine.log"  # beside the report: the output of vLLM's engine (--engine vllm|both)


def place_target(opts: EvalOptions, device, drafters: list[Path] | None = None) -> tuple[int, dict]:
    """vLLM's tensor-parallel size and the harness's placement (trainer/layout/inference.py: the plan's
    choice on the GPUs this process sees, or the flags', counting the largest of `drafters` on GPU 0),
    said on stderr when more than one GPU."""
    from trainer.layout.inference import resolve_engine_tp, resolve_harness

    on_gpu = device.type == "cuda"
    tp, placement = 1, {"load_kwargs": {}, "gpus": 0 if not on_gpu else 1, "reason": str(device)}
    if opts.engine != "harness":
        gpus = None if on_gpu else (0, 0.0)  # vLLM's CPU engine: no tensor parallelism here
        tp, why = resolve_engine_tp(opts.target, opts.tensor_parallel_size, "--tensor-parallel-size", gpus)
        if tp > 1:
            print(f"dflash eval: vLLM shards the target over {tp} GPUs ({why})", file=sys.stderr)
    if opts.engine != "vllm":
        placement = resolve_harness(opts.target, opts.harness_gpus, device.type, drafters=drafters)
        if placement["gpus"] > 1:
            print(
                f"dflash eval: the harness spreads the target over {placement['gpus']} GPUs "
                f"(device_map auto: {placement['reason']})",
                file=sys.stderr,
            )
    return tp, placement


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

    check_options(opts)
    out = Path(opts.out)
    lines = P.read_prompt_file(opts.prompts, opts.limit)
    prompt_set = P.describe_prompts(opts.prompts)  # of what was read, once for every drafter
    for d in opts.drafters:
        resolve_drafter_dir(d)  # a clear error before any model loads
    if not (Path(opts.target) / "config.json").is_file():
        raise ModelError(f"--target {opts.target}: no config.json (a transformers model folder is needed)")
    if opts.engine != "harness":
        from trainer.eval.served import ServedError, served_family_check
        from trainer.vllm_engine import import_vllm

        import_vllm(f"--engine {opts.engine}", ServedError)  # before any model loads
        served_family_check(opts.target, f"--engine {opts.engine}")
    device = resolve_device(opts.device)
    # refuses a size the GPUs or the heads cannot take, or GPUs that cannot hold target and drafter
    tp, placement = place_target(opts, device, [resolve_drafter_dir(d) for d in opts.drafters])
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = P.load_tokenizer(opts.target)
    settings = P.resolve_settings(tok, opts.chat_template, opts.thinking)
    token_prompts = P.encode(lines, tok, settings)
    stop_ids = set() if opts.ignore_eos else set(P.stop_token_ids(opts.target, tok))
    folders = [speculators_folder(d, opts.target) for d in opts.drafters]
    reports = []
    taken: set[str] = set()
    target = None
    labels = [drafter_label(given, taken) for given in opts.drafters]
    if opts.engine in ("harness", "both"):
        for folder, label in zip(folders, labels):
            aux = aux_ids_of(folder)
            if target is None or target.aux_ids != aux:
                release(target, device)  # one target on the device at a time
                target = HookedTarget(opts.target, aux, device, load_kwargs=placement["load_kwargs"])
            reports.append(
                evaluate_one(
                    opts, folder, target, token_prompts, settings, stop_ids, device, label, prompt_set
                )
            )
            reports[-1]["harness_gpus"] = placement["gpus"]
    if opts.engine in ("vllm", "both"):
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
                tensor_parallel_size=tp,
                log=out.parent / ENGINE_LOG,  # vLLM's own lines; a dead engine's message names it
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
