"""The verbs that use a trained drafter or the target: `dflash eval`, `export`, `regenerate` and
`prompts` (chat datasets into regenerate's prompt lines).
Light at import: each handler imports its implementation when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.cli.argtypes import count, nonnegative, out_file, positive, seconds


def _checks(text: str) -> int:
    if text == "all":
        return -1
    return count(text)


def _template_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--chat-template",
        dest="chat_template",
        action="store_true",
        default=None,
        help="apply the target tokenizer's chat template to text prompts (default when it has one)",
    )
    g.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="tokenize text prompts as plain text",
    )
    p.add_argument(
        "--thinking",
        choices=("on", "off"),
        default=None,
        help="enable_thinking passed to the chat template (default: the template's own default)",
    )
    p.add_argument("--limit", type=positive, default=None, help="only the first N prompts")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at end-of-sequence / end-of-turn tokens (always --max-new-tokens)",
    )


def _options_from_args(cls, args, **named):
    """`cls` (an options dataclass: EvalOptions, RegenOptions) built from the parsed arguments: each
    field from `named` (renamed or converted) or else from the argument of its own name (every field
    must be one or the other: a field the parser does not fill is an AttributeError here, not a default)."""
    from dataclasses import fields

    return cls(**{f.name: named[f.name] if f.name in named else getattr(args, f.name) for f in fields(cls)})


def cmd_eval(args) -> int:
    from trainer.eval.prompts import is_prompt_set, read_prompt_file

    if not is_prompt_set(args.prompts):  # a bad prompt file is refused before torch is imported (~2 s)
        read_prompt_file(args.prompts, args.limit)
    from trainer.eval.run import EvalOptions, run_eval

    return run_eval(
        _options_from_args(
            EvalOptions, args, drafters=args.drafter, tree_budgets=tuple(args.tree_budget or ())
        )
    )


def cmd_export(args) -> int:
    push = None
    if args.push_to_hub:  # repo, token and network checked before the export starts
        from trainer.hub.push import prepare

        push = prepare(args.push_to_hub, args.revision, args.token_file)
    if push is None or not push.reuses(args.out, args.checkpoint):
        from trainer.export import export

        export(
            args.checkpoint,
            args.out,
            target=args.target,
            verifier=args.verifier,
            dtype=args.dtype,
            vllm_check=args.vllm_check,
        )
    if push is not None:
        push.run(args.out)
    return 0


def cmd_regenerate(args) -> int:
    from trainer.regenerate import RegenOptions, regenerate

    opts = _options_from_args(
        RegenOptions,
        args,
        backend=args.backend or ("server" if args.server else "transformers"),
        servers=tuple(args.server or ()),
        request_timeout_s=args.request_timeout,
        server_wait_s=args.server_wait,
        push_every_s=args.push_every,
    )
    if args.check_only:
        from trainer.regenerate.options import check_before_engines

        check_before_engines(opts)
        print(f"dflash regenerate: can start here ({opts.backend} backend; nothing started)")
        return 0
    regenerate(opts)
    return 0


def cmd_prompts(args) -> int:
    from trainer.regenerate.chat_input import convert, summary

    report = convert(
        args.input,
        args.format,
        args.out,
        thinking=args.thinking,
        split=args.split,
        limit=args.limit,
        report_path=args.report,
    )
    print(summary(report), flush=True)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="acceptance length tau of drafters against the target (report .json/.md/.png)"
    )
    p.add_argument(
        "--drafter",
        required=True,
        type=Path,
        action="append",
        help="checkpoint folder, export, run out_dir (its latest), or a z-lab/SpecForge drafter; "
        "repeat to compare drafters side by side",
    )
    p.add_argument("--target", required=True, type=Path, help="the target's transformers folder")
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help='JSON lines: {"prompt": ...}, {"messages": [...]} or {"input_ids": [...]}; or a named set: '
        "humaneval, mt-bench, gsm8k, math500, alpaca (the last four fetched from the Hub once, then cached)",
    )
    p.add_argument("--max-new-tokens", type=positive, default=128)
    p.add_argument(
        "--out", required=True, type=out_file, help="REPORT.json (REPORT.md and REPORT.png beside it)"
    )
    p.add_argument("--block-size", type=positive, default=None, help="default: the drafter's")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--reference",
        action="store_true",
        help="the slow reference loop (no caches, speculators' training forward): same tau and tokens",
    )
    p.add_argument(
        "--check-lossless",
        type=_checks,
        default=4,
        metavar="N|all",
        help="prompts whose tokens are checked against the target's own greedy decoding (default 4)",
    )
    p.add_argument(
        "--engine",
        choices=("harness", "vllm", "both"),
        default="harness",
        help="who measures tau: this project's harness (default), vLLM serving the drafter (the number a "
        "server shows; needs vllm), or both side by side (fails when they disagree)",
    )
    p.add_argument(
        "--served-tolerance",
        type=nonnegative,
        default=0.1,
        help="--engine both: the largest |tau_vLLM - tau_harness| that passes (default 0.1)",
    )
    p.add_argument(
        "--tree-budget",
        type=positive,
        action="append",
        metavar="N",
        help="also verify a tree of at most N drafted nodes per round (DDTree: one drafter forward, one "
        "target forward with tree attention, lossless); repeat for several budgets, e.g. 16 and 64",
    )
    p.add_argument(
        "--tree-top-k",
        type=positive,
        default=None,
        metavar="K",
        help="--tree-budget: children per node among the next depth's top K (default: the budget)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive,
        default=None,
        metavar="N",
        help="--engine vllm|both: GPUs vLLM shards the target over (default: the plan's for the visible "
        "GPUs, as `dflash plan` reports it)",
    )
    p.add_argument(
        "--harness-gpus",
        type=positive,
        default=None,
        metavar="N",
        help="the harness's target spread over N GPUs by device_map (default: the plan's; 1: one GPU)",
    )
    _template_args(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "export",
        help="weights-only speculators folder of a checkpoint, reload-verified; prints the vllm line",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="checkpoint folder, RUN/checkpoints/latest or a run's out_dir (its latest)",
    )
    p.add_argument("--out", required=True, type=Path, help="new folder (must not exist)")
    p.add_argument(
        "--target",
        type=Path,
        default=None,
        help="target folder to take the frozen embedding/head from (default: the one recorded)",
    )
    p.add_argument(
        "--verifier",
        default=None,
        help="verifier name or path written into the export's config (what the server loads); its "
        "config.json (a folder, hf://REPO@REV, or ORG/NAME from the HF cache or the Hub) must be the "
        "training target's (hidden size, vocabulary, layers), else exit 2",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast the weights (default: as trained)",
    )
    p.add_argument(
        "--vllm-check",
        action="store_true",
        help="vLLM loads the export and drafts a few tokens; refused unless it taps the trained layers, "
        "uses the trained mask token and runs the block as trained (needs vllm; about a minute)",
    )
    p.add_argument(
        "--push-to-hub",
        metavar="ORG/NAME",
        default=None,
        help="then upload the export with a model card generated from the run to this Hub model repo "
        "(token: HF_TOKEN, the stored login or --token-file); rerun the same command to resume",
    )
    p.add_argument("--revision", default=None, help="--push-to-hub: the branch (default main)")
    p.add_argument("--token-file", default=None, help="--push-to-hub: file holding the Hub token")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "regenerate", help="the target writes the responses: a tokenized, loss-masked training dataset"
    )
    p.add_argument("--target", required=True, type=Path)
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help='JSON lines: {"prompt": ...}, {"messages": [...]} or {"input_ids": [...]}',
    )
    p.add_argument("--out", required=True, type=Path, help="dataset folder (datasets.save_to_disk)")
    p.add_argument("--max-new-tokens", type=positive, default=256)
    p.add_argument("--batch-size", type=positive, default=16)
    p.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default=None,
        help="the engine in this process (default transformers; not with --server)",
    )
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible engine already running (vllm serve TARGET), e.g. http://127.0.0.1:8000; "
        "repeat for one engine per GPU (prompts dealt round robin)",
    )
    p.add_argument(
        "--concurrency", type=positive, default=16, help="--server: requests in flight per engine (16)"
    )
    p.add_argument(
        "--request-timeout", type=seconds, default=600.0, help="--server: seconds per request (600)"
    )
    p.add_argument(
        "--retries", type=count, default=4, help="--server: retries per request, exponential backoff (4)"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="vLLM backend: the engine's dtype (default: the model's)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive,
        default=None,
        help="vLLM backend: GPUs the target is sharded over (default: the plan's for the visible GPUs, "
        "as `dflash plan` reports it)",
    )
    p.add_argument(
        "--server-wait",
        type=nonnegative,
        default=0.0,
        help="--server: seconds to wait for engines that do not answer yet (still loading; 0)",
    )
    p.add_argument(
        "--max-empty-share",
        type=nonnegative,
        default=0.02,
        help="refuse the run when more than this share of the responses are empty (0.02); "
        "the empty ones below it are left out of the dataset",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="write the event stream there (events.jsonl): dflash monitor / dflash status show the progress",
    )
    p.add_argument(
        "--push-to",
        default=None,
        metavar="S3_URL",
        help="push finished batches to S3_URL/partial/ and the dataset to S3_URL/dataset/ "
        "(sha256 manifests); a fresh node with the same arguments pulls the batches back and goes on",
    )
    p.add_argument("--endpoint-url", default=None, help="--push-to: the S3 endpoint (radosgw, MinIO)")
    p.add_argument(
        "--push-every", type=seconds, default=60.0, help="--push-to: seconds between batch pushes (60)"
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="check the arguments and this host (/dev/shm for vLLM engines on it: the in-process one, or "
        "--server at a loopback address) and start nothing (regenerate_job does, before its engines)",
    )
    _template_args(p)
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser(
        "prompts",
        help="ShareGPT/UltraChat/OpenAI messages/plain-prompt data into the prompt lines regenerate reads",
    )
    p.add_argument("input", type=Path, help="JSON lines, a parquet file or a datasets.save_to_disk folder")
    p.add_argument("--format", required=True, choices=("sharegpt", "ultrachat", "messages", "prompt"))
    p.add_argument("--out", required=True, type=out_file, help="OUT.jsonl (written atomically)")
    p.add_argument(
        "--thinking",
        choices=("on", "off"),
        default=None,
        help="enable_thinking for every row without its own enable_thinking/thinking field",
    )
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict (default: its only one)")
    p.add_argument("--limit", type=positive, default=None, help="stop after N kept rows")
    p.add_argument(
        "--report", type=out_file, default=None, help="the report's path (default: OUT.jsonl.report.json)"
    )
    p.set_defaults(func=cmd_prompts)
