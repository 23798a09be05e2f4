"""The verbs the roles call about a node and its files: `dflash plan` (the layout), `service sandbox` (what
the trainer's unit needs from its node), `manifest` (sha256 of a folder), `s3` (a folder to S3 and back) and
`hub` (a model repo from the Hugging Face Hub). The `gpu` verbs are in gpu.py.

Argument definitions only; each handler imports its (light) module when it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.cli.argtypes import above_zero, count, duration, nonnegative, out_file, positive
from trainer.errors import ExitCode
from trainer.redact import redact, redact_text


def _plan(args) -> int:
    from trainer.layout.plan import cmd_plan

    return cmd_plan(args)


def _service_sandbox(args) -> int:
    from trainer.layout.sandbox import cmd_sandbox

    return cmd_sandbox(args)


def _s3(args) -> int:
    from trainer.s3.pull import pull
    from trainer.s3.push import push_folder

    if args.s3_cmd == "push":
        report = push_folder(
            Path(args.dir),
            args.url,
            args.endpoint_url,
            args.check,
            tuple(args.exclude),
            args.workers,
            not args.no_progress,
            progress_file=args.progress_file,
        )
        text = (
            f"{report['s3']}: {report['files']} files, {report['bytes']} bytes; uploaded "
            f"{report['uploaded']} "
            f"({report['uploaded_bytes']} bytes), {report['skipped']} already there; manifest "
            f"{report['manifest']}"
        )
        failed = report.get("failed", [])
    else:

        def run(check: bool):
            return pull(
                args.url,
                Path(args.dir),
                args.endpoint_url,
                check,
                args.workers,
                args.bwlimit_kbps,
                not args.no_progress,
                allow_locations=tuple(args.allow_location),
            )

        report = _with_progress(args, run, args.url)
        text = (
            f"{report['dest']}: {report['files']} files, {report['bytes']} bytes; {report['present']} "
            "already "
            f"there, {report['downloaded']} downloaded ({report['downloaded_bytes']} bytes, "
            f"{report['resumed_bytes']} bytes resumed from partial files)"
        )
        if report.get("extra"):
            text += f"; {len(report['extra'])} local file(s) not in the manifest left alone"
        failed = report["failed"]
    return transfer_report(args, report, text, failed)


def transfer_report(args, report: dict, text: str, failed: list[dict]) -> int:
    """A transfer's report on stdout (JSON with --json, else `text`), each failed file on stderr, all
    through trainer/redact.py (a store's error can quote a presigned URL), and the exit code."""
    if args.json:
        print(json.dumps(redact({k: v for k, v in report.items() if k != "plan" or args.check})))
    else:
        print(redact_text(text + ("" if not args.check else " (--check: nothing moved)")))
    for f in failed:
        print(redact_text(f"FAILED {f['path']}: {f['error']}"), file=sys.stderr)
    return ExitCode.OK if report["ok"] else ExitCode.FAILED


def _with_progress(args, run, label: str) -> dict:
    from trainer.store.progress_file import with_progress

    return with_progress(args.progress_file, Path(args.dir), label, args.check, run)


def _hub(args) -> int:
    from trainer.hub.pull import pull

    def run(check: bool):
        return pull(
            args.spec,
            Path(args.dir),
            args.revision,
            args.token_file,
            args.endpoint,
            check,
            args.workers,
            not args.no_progress,
        )

    report = _with_progress(args, run, args.spec)
    text = (
        f"{report['dest']}: {report['hub']} (commit {report['commit']}): {report['files']} files, "
        f"{report['bytes']} bytes; {report['present']} already there, {report['downloaded']} "
        f"downloaded ({report['downloaded_bytes']} bytes, {report['resumed_bytes']} bytes resumed)"
    )
    return transfer_report(args, report, text, report["failed"])


def _transfer_args(p, workers: int, workers_help: str, progress_help: str) -> None:
    """The options of a transfer verb (`s3 push`, `s3 pull`, `hub pull`) that `_with_progress` and
    `transfer_report` read: a dry run, the parallel transfers, the progress and the JSON report."""
    p.add_argument("--check", action="store_true", help="say what would move, move nothing")
    p.add_argument("--workers", type=positive, default=workers, help=f"{workers_help} (default {workers})")
    p.add_argument("--no-progress", action="store_true", help=progress_help)
    p.add_argument(
        "--progress-file", type=out_file, help="write bytes, rate and ETA there (`dflash progress`)"
    )
    p.add_argument("--json", action="store_true", help="one JSON report on stdout")


def _manifest_create(args) -> int:
    from trainer.store.manifest import cmd_create

    return cmd_create(args)


def _manifest_verify(args) -> int:
    from trainer.store.manifest import cmd_verify

    return cmd_verify(args)


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="GPUs per target copy (or a vLLM split), data-parallel width, memory, and the run config keys "
        "that layout needs",
    )
    p.add_argument(
        "--config",
        metavar="RUN_YAML",
        help="the run config ('-': read it from stdin): every recipe key and the target (target.path) come "
        "from it; then the recipe flags below are refused (set their keys in it)",
    )
    p.add_argument(
        "--target-config",
        metavar="FILE",
        help="the target's config.json (or its folder, or hf://REPO@REVISION: its config.json from the Hub); "
        "with --config: a copy of target.path's here",
    )
    p.add_argument("--gpu", help="GPU kind: A100-40GB, A100-80GB, H100-80GB, H200, B200, RTX-PRO-6000-96GB")
    p.add_argument("--gpu-count", type=positive, help="GPUs on the node")
    p.add_argument("--gpu-memory-gib", type=above_zero, help="per-GPU memory for a GPU not in the catalog")
    p.add_argument(
        "--facts",
        metavar="RECON_JSON",
        action="append",
        help="a host's reports/<host>/recon.json instead of --gpu; once per host of a multi-node group "
        "(they must agree on GPU model, count, memory, driver and CUDA)",
    )
    p.add_argument(
        "--nodes",
        type=positive,
        help="nodes in the run (default: one, or one per --facts); each gets the layout",
    )
    r = p.add_argument_group(
        "recipe flags (without --config; each default is its run-config key's)",
    )
    r.add_argument("--gpus-per-copy", type=positive, help="target.gpus_per_copy: force the in-process layout")
    r.add_argument(
        "--source",
        choices=["auto", "hooked", "vllm"],
        help="target.source: hooked (a target copy per trainer), vllm (a vLLM server holds the target, "
        "the other GPUs train) or auto (hooked when it fits, else vllm; the default)",
    )
    r.add_argument("--dtype", help="target weight dtype (default bfloat16)")
    r.add_argument("--draft-layers", type=positive, help="drafter.num_layers")
    r.add_argument("--aux-layers", type=positive, help="len(drafter.aux_layer_ids) (default 5)")
    r.add_argument("--block-size", type=positive, help="drafter.block_size")
    r.add_argument("--anchors", type=positive, help="train.max_anchors")
    r.add_argument("--tokens-per-batch", type=positive, help="train.max_tokens_per_batch")
    r.add_argument(
        "--loss-chunk-rows",
        type=count,
        help="train.loss_chunk_rows: logits and loss over this many rows at a time (0: all at once)",
    )
    r.add_argument(
        "--shard",
        choices=["auto", "none", "optimizer", "full"],
        help="train.shard (default auto: the lightest level that fits, optimizer then full)",
    )
    r.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="train.activation_checkpointing: recompute the draft layers in the backward",
    )
    r.add_argument(
        "--draft-vocab-size",
        type=positive,
        help="drafter.draft_vocab_size: heads and logits over this many tokens (default: the vocabulary)",
    )
    r.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        help="train.optimizer: muon keeps one momentum per weight-matrix element instead of two moments",
    )
    p.add_argument(
        "--samples",
        type=positive,
        help="training samples (default: --regenerate-samples when given, else the seeds' 902K)",
    )
    p.add_argument(
        "--mean-tokens", type=above_zero, default=2000, help="mean tokens per sample (default 2000)"
    )
    p.add_argument("--epochs", type=above_zero, default=1.0)
    p.add_argument(
        "--time-budget",
        type=duration,
        metavar="DURATION",
        help="train.time_budget (20h, 30m, 90s; default: the run config's): the tokens, steps and epochs "
        "it buys (epochs of --samples x --mean-tokens)",
    )
    p.add_argument(
        "--rate-from",
        metavar="RUN_DIR",
        help="a run's folder (or events.jsonl) on this hardware and recipe: the budget's step rate is "
        "measured there instead of modelled",
    )
    p.add_argument(
        "--regenerate-samples",
        type=count,
        default=0,
        metavar="N",
        help="samples `dflash regenerate` will write on the node: their dataset (N x --mean-tokens tokens) "
        "joins the disk table, its hours the plan, and training's epochs count them unless --samples "
        "(default 0: none planned)",
    )
    p.add_argument(
        "--regenerate-concurrency",
        type=positive,
        metavar="N",
        help="requests in flight per vLLM engine while regenerating (regenerate_job_concurrency, default "
        "16): the regeneration hours scale with it while decoding is memory-bound",
    )
    p.add_argument(
        "--price-per-hour",
        type=nonnegative,
        metavar="PRICE",
        help="what one node costs an hour (any currency): the plan prints regeneration and training "
        "hours x PRICE x nodes",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)

    p = sub.add_parser("service", help="what the trainer's service needs from its node")
    vsub = p.add_subparsers(dest="service_cmd", required=True, metavar="ACTION")
    v = vsub.add_parser(
        "sandbox",
        help="JSON for the unit: device nodes (every NVIDIA naming, InfiniBand), LimitMEMLOCK, the IP "
        "filter and the ranks' network environment (gloo/NCCL/vLLM, torchrun's --local-addr)",
    )
    which = v.add_mutually_exclusive_group(required=True)
    which.add_argument("--facts", metavar="RECON_JSON", help="this node's reports/<host>/recon.json")
    which.add_argument("--facts-json", metavar="JSON", help="the same facts as text (ansible_local.dflash)")
    v.add_argument(
        "--config", metavar="RUN", help="the run config, JSON or YAML ('-': stdin): report_to, trackers"
    )
    v.add_argument("--node-rank", type=count, default=0, help="this node's rank (several nodes)")
    v.add_argument(
        "--node-address",
        action="append",
        metavar="ADDR",
        help="each node's cluster address, in rank order (once per node; none: one node)",
    )
    v.add_argument(
        "--interfaces",
        metavar="JSON",
        help="a JSON list of this node's interfaces as Ansible's facts (ansible_facts[IFACE])",
    )
    v.add_argument("--socket-ifname", default="", help="the interface gloo/NCCL use (default: decided)")
    v.add_argument("--no-ip-filter", action="store_true", help="the unit has no IP filter")
    v.set_defaults(func=_service_sandbox)

    p = sub.add_parser(
        "manifest", help="sha256 manifest of a folder: create one, or verify a copy against one"
    )
    msub = p.add_subparsers(dest="manifest_cmd", required=True, metavar="ACTION")
    c = msub.add_parser("create", help="hash every file under DIR into MANIFEST (written atomically)")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("-o", "--output", required=True, type=out_file, metavar="MANIFEST")
    c.add_argument(
        "--reuse",
        action="store_true",
        help="keep the digests of files whose size and mtime match the existing MANIFEST",
    )
    c.add_argument("--source", help="label stored in the manifest (default: DIR's absolute path)")
    v = msub.add_parser("verify", help="exit 1 naming every missing or differing file under DIR")
    v.add_argument("dir", metavar="DIR")
    v.add_argument("manifest", metavar="MANIFEST")
    v.add_argument("--strict", action="store_true", help="files not in the manifest are errors too")
    for q, impl in ((c, _manifest_create), (v, _manifest_verify)):
        q.add_argument(
            "--exclude", action="append", default=[], metavar="GLOB", help="skip paths matching GLOB"
        )
        q.add_argument(
            "--workers", type=positive, default=None, help="hashing threads (default: min(4, CPUs))"
        )
        q.add_argument("--json", action="store_true", help="one JSON object on stdout")
        q.set_defaults(func=impl)

    p = sub.add_parser("s3", help="copy a folder to S3 or from S3, every file proven by its sha256")
    ssub = p.add_subparsers(dest="s3_cmd", required=True, metavar="ACTION")
    up = ssub.add_parser(
        "push", help="manifest DIR (beside it: DIR.manifest.json) and upload it to s3://BUCKET/PREFIX"
    )
    up.add_argument("dir", metavar="DIR")
    up.add_argument("url", metavar="s3://BUCKET/PREFIX")
    up.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="leave out paths matching GLOB"
    )
    down = ssub.add_parser(
        "pull", help="download s3://BUCKET/PREFIX (it has a MANIFEST.json) into DIR, resumable"
    )
    down.add_argument("url", metavar="s3://BUCKET/PREFIX")
    down.add_argument("dir", metavar="DIR")
    down.add_argument(
        "--bwlimit-kbps", type=count, default=0, help="bandwidth cap in KiB/s (default 0: none)"
    )
    down.add_argument(
        "--allow-location",
        action="append",
        default=[],
        metavar="s3://BUCKET/PREFIX",
        help="the manifest may send reads there too (a salvage set pushed with --reference keeps files "
        "in earlier sets); without it, only the prefix's own objects are read",
    )
    for q, workers in ((up, 8), (down, 4)):
        q.add_argument(
            "--endpoint-url", help="S3 endpoint (default: AWS); credentials: the AWS_* variables or profile"
        )
        _transfer_args(q, workers, "parallel transfers", "no byte progress on stderr")
        q.set_defaults(func=_s3)

    p = sub.add_parser("hub", help="download a model repo from the Hugging Face Hub, every file proven")
    hsub = p.add_subparsers(dest="hub_cmd", required=True, metavar="ACTION")
    h = hsub.add_parser(
        "pull",
        help="download hf://REPO@REVISION into DIR on this machine, resumable, each file checked against "
        "the Hub's sha256 (LFS) or git blob id; writes DIR.manifest.json",
    )
    h.add_argument("spec", metavar="hf://REPO@REVISION")
    h.add_argument("dir", metavar="DIR")
    h.add_argument("--revision", help="branch, tag or commit (default: the spec's @REVISION, else main)")
    h.add_argument(
        "--token-file", help="file holding the Hub token (default: huggingface_hub's own: HF_TOKEN, login)"
    )
    h.add_argument("--endpoint", help="Hub endpoint (default: HF_ENDPOINT, else https://huggingface.co)")
    _transfer_args(h, 4, "parallel downloads", "no progress bars on stderr")
    h.set_defaults(func=_hub)
