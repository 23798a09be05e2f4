"""The verbs of a run: `dflash init` (a run config for a target), `preflight`, `train`, `config`, `summary`
and `demo` (the embedded default)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer.cli.argtypes import nonnegative, out_file, port, positive
from trainer.errors import ExitCode


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="run config YAML")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=3e-4 (repeatable; values are YAML)",
    )


def _load(args):
    from trainer.config.run import load_config

    return load_config(args.config, args.overrides)


def cmd_init(args) -> int:
    from trainer.run_init import init_run

    result = init_run(
        args.target,
        args.data,
        args.out,
        out_dir=args.out_dir,
        mask_token_id=args.mask_token_id,
        aux_count=args.aux_count,
        force=args.force,
        target_path=args.target_path,
    )
    print(result.render())
    return ExitCode.OK


def cmd_preflight(args) -> int:
    from trainer.preflight import run_preflight

    report = run_preflight(_load(args))
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.render_text())
    return ExitCode.OK if report.ok else ExitCode.REFUSED


def cmd_train(args) -> int:
    cfg = _load(args)  # a bad config is refused before torch is imported
    from trainer.training.loop import train

    return train(cfg, skip_preflight=args.skip_preflight)


def cmd_summary(args) -> int:
    from trainer.monitor.summary import render_summary

    print(render_summary(args.run_dir))
    return 0


def cmd_config(args) -> int:
    from trainer.config.schema import schema_reference

    if args.markdown:
        from trainer.config.schema import schema_markdown

        print(schema_markdown(), end="")
        return 0
    if args.schema:
        for key, typ, default, desc in schema_reference():
            print(f"{key:34} {typ:36} {default:14} {desc}")
        return 0
    if args.config is None:
        from trainer.config.run import ConfigError

        raise ConfigError("pass --config FILE or --schema")
    cfg = _load(args)
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def cmd_capture(args) -> int:
    from trainer.sources.capture import CaptureError, capture_samples, compare_captures

    if args.compare:
        diff = compare_captures(*args.compare)
        print(diff.render())
        if args.tolerance is not None and max(diff.max_rel.values()) > args.tolerance:
            print(f"differences above --tolerance {args.tolerance:g}")
            return ExitCode.FAILED
        return ExitCode.OK
    if args.config is None or args.out is None:
        raise CaptureError("pass --config FILE --out FILE.safetensors (or --compare A B)")
    overrides = list(args.overrides)
    if args.source:
        overrides.append(f"target.source={args.source}")
    from trainer.config.run import load_config

    print(json.dumps(capture_samples(load_config(args.config, overrides), args.samples, args.out)))
    return ExitCode.OK


def cmd_serve_target(args) -> int:
    import os
    import shlex
    import sys

    from trainer.monitor.server import is_loopback
    from trainer.sources.vllm_server import owned_server_command, server_environment

    if not is_loopback(args.host) and not args.allow_remote:
        from trainer.config.run import ConfigError

        raise ConfigError(
            f"--host {args.host}: refusing a non-loopback address: the hidden-states server has no "
            "authentication (anyone who reaches the port drives the target); keep 127.0.0.1, or pass "
            "--allow-remote on a private network"
        )
    cfg = _load(args)
    cmd, changes, storage = owned_server_command(cfg, args.port, host=args.host)
    env, notes = server_environment(os.environ, changes)
    for note in notes:
        print(f"dflash serve-target: {note}", file=sys.stderr, flush=True)
    if args.print_command:
        unset = [f"-u {k}" for k in os.environ if k not in env]
        changed = [f"{k}={shlex.quote(v)}" for k, v in env.items() if os.environ.get(k) != v]
        print(" ".join([*(["env", *unset] if unset else []), *changed, shlex.join(cmd)]))
        return ExitCode.OK
    storage.mkdir(parents=True, exist_ok=True)
    os.execvpe(cmd[0], cmd, env)  # the unit's process becomes the server


def cmd_demo(args) -> int:
    from trainer.demo.run import prepare_prompts, run_demo

    if args.prepare_prompts:
        return prepare_prompts(args.out, tiny=args.tiny, samples=args.samples)
    return run_demo(args.out, steps=args.steps, tiny=args.tiny, prepare_only=args.prepare_only)


def register(sub) -> None:
    p = sub.add_parser(
        "init", help="write a run config for a causal LM from its folder (config.json, tokenizer)"
    )
    p.add_argument(
        "--target",
        required=True,
        help="the target's local model folder (a Hub repo id: only a copy already here, in the HF cache)",
    )
    p.add_argument("--data", required=True, type=Path, help="the dataset folder the run trains on")
    p.add_argument("--out", required=True, type=out_file, help="the run config YAML to write")
    p.add_argument("--out-dir", type=Path, help="the run folder (default: out/ beside the YAML)")
    p.add_argument(
        "--target-path",
        type=Path,
        help="target.path to write (default: a Hub repo id's node folder /opt/dflash/target, where "
        "data_sync's hf item puts it; a local folder as given)",
    )
    p.add_argument(
        "--mask-token-id", type=int, help="use this mask token (checked) instead of the rule's choice"
    )
    p.add_argument(
        "--aux-count", type=positive, help="target layers the drafter reads (default: the DFlash recipes')"
    )
    p.add_argument("--force", action="store_true", help="overwrite --out when it exists")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("preflight", help="check data, config and machine before any GPU time")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser(
        "train", help="preflight, then train online (resumes from the newest verified checkpoint)"
    )
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

    p = sub.add_parser(
        "capture",
        help="write the hidden states a source gives for the first N samples; --compare two such files",
    )
    p.add_argument("--config", type=Path, help="run config YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--source", choices=("hooked", "vllm"), help="override target.source")
    p.add_argument("--samples", type=positive, default=8, help="how many samples, in dataset order (8)")
    p.add_argument("--out", type=out_file, help="the .safetensors file to write")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two capture files")
    p.add_argument(
        "--tolerance", type=nonnegative, help="--compare: exit 1 when a relative difference is above this"
    )
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser(
        "serve-target",
        help="run (or print) the vLLM server that streams a run's hidden states (target.source: vllm)",
    )
    _add_config_args(p)
    p.add_argument("--port", type=port, default=8100, help="port to listen on (8100)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (127.0.0.1; another needs --allow-remote)"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the server has no authentication: a private network only)",
    )
    p.add_argument("--print-command", action="store_true", help="print the command, do not run it")
    p.set_defaults(func=cmd_serve_target)

    p = sub.add_parser("demo", help="the embedded default: a short run on a small real model on this CPU")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--steps", type=positive, default=40)
    p.add_argument("--tiny", action="store_true", help="a random tiny target instead of SmolLM2-135M")
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="write target, data and run.yaml, print their paths as JSON, do not train (train.yml -l local)",
    )
    p.add_argument(
        "--prepare-prompts",
        action="store_true",
        help="write the target and prompts.jsonl (questions on stdlib docstrings), print their paths as "
        "JSON, generate nothing (regenerate.yml -l local)",
    )
    p.add_argument("--samples", type=positive, default=48, help="--prepare-prompts: how many prompts (48)")
    p.set_defaults(func=cmd_demo)
