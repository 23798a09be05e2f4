"""`dflash <verb>`: the only way roles and people drive the package.

Every verb imports its implementation lazily, so `dflash --help` and the light verbs start fast
on a node whose GPU is busy (no torch/transformers/speculators import)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="run config YAML")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=3e-4 (repeatable; values are YAML)",
    )


def _load(args):
    from trainer.config import load_config

    return load_config(args.config, args.overrides)


def cmd_preflight(args) -> int:
    from trainer.preflight import run_preflight

    report = run_preflight(_load(args))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.render_text())
    return 0 if report.ok else 2


def cmd_train(args) -> int:
    from trainer.training.loop import train

    return train(_load(args), skip_preflight=args.skip_preflight)


def cmd_summary(args) -> int:
    from trainer.monitor.summary import render_summary

    print(render_summary(args.run_dir))
    return 0


def cmd_config(args) -> int:
    from trainer.config import schema_reference

    if args.markdown:
        from trainer.config import schema_markdown

        print(schema_markdown(), end="")
        return 0
    if args.schema:
        for key, typ, default, desc in schema_reference():
            print(f"{key:34} {typ:36} {default:14} {desc}")
        return 0
    cfg = _load(args)
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def cmd_demo(args) -> int:
    from trainer.demo.run import run_demo

    return run_demo(args.out, steps=args.steps, tiny=args.tiny, prepare_only=args.prepare_only)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash", description="Online DFlash drafter training: preflight, train, inspect."
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("preflight", help="check data, config and machine before any GPU time")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("train", help="preflight, then train online (resumes from the newest verified checkpoint)")
    _add_config_args(p)
    p.add_argument("--skip-preflight", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("summary", help="print a run's progress and result from its event stream")
    p.add_argument("--run-dir", required=True, type=Path)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("config", help="print the resolved config, or every key with --schema")
    p.add_argument("--config", type=Path)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--schema", action="store_true", help="list every key, type, default")
    p.add_argument("--markdown", action="store_true", help="the reference table as markdown (docs)")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("demo", help="the embedded default: a short run on a small real model on this CPU")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="a random tiny target instead of SmolLM2-135M")
    p.add_argument("--prepare-only", action="store_true",
                   help="write target, data and run.yaml, print their paths as JSON, do not train (train.yml -l local)")
    p.set_defaults(func=cmd_demo)

    # --- verbs of issue #3 (eval, export, regenerate): add below this line
    from trainer.eval.cli import add_verbs as add_issue3_verbs

    add_issue3_verbs(sub)
    # --- verbs of issue #4 (monitor, status): add below this line
    from trainer.monitor.verbs import add_verbs as add_monitor_verbs  # argparse only: stays light

    add_monitor_verbs(sub)
    # --- verbs of issue #5 (plan, manifest): add below this line
    from trainer.cli_ops import add_verbs as _add_issue5_verbs  # plan, manifest, gpu

    _add_issue5_verbs(sub)
    # --- verbs of issue #6 (salvage): add below this line
    from trainer.salvage.cli import add_parser as add_salvage_verbs

    add_salvage_verbs(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from trainer.config import ConfigError

    args = build_parser().parse_args(argv)
    if args.verb == "config" and not (args.schema or args.markdown) and args.config is None:
        print("dflash config: pass --config FILE or --schema", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"dflash {args.verb}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
