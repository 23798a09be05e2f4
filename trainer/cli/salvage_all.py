"""`dflash salvage all`: every step of a salvage in order, each exactly as `dflash salvage STEP` runs it
(trainer/cli/salvage.py holds the steps)."""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path

from trainer.cli.argtypes import count, seconds
from trainer.errors import ExitCode


def cmd_all(args) -> int:
    """stop (begins the salvage) -> collect -> push -> verify -> notes -> push (the final notes push) ->
    notes (the verdict: S3 holds these notes): what the role runs."""
    base = ["--json"] if args.json else []
    common_s3 = ["--s3", args.s3] + (["--endpoint-url", args.endpoint_url] if args.endpoint_url else [])
    stop = ["stop", "--run-dir", str(args.run_dir), "--out", str(args.out), "--timeout", str(args.timeout)]
    stop += ["--stop-unknown"] if args.stop_unknown else []
    collect = ["collect", "--run-dir", str(args.run_dir), "--out", str(args.out), "--keep", str(args.keep)]
    collect += (["--config", str(args.config)] if args.config else []) + (
        ["--no-data"] if args.no_data else []
    )
    for p in args.include:
        collect += ["--include", str(p)]
    for p in args.recon:
        collect += ["--recon", str(p)]
    push = ["push", str(args.out), *common_s3, "--no-progress"] + functools.reduce(
        operator.iadd, (["--reference", r] for r in args.reference), []
    )
    verify = ["verify", *common_s3, "--out", str(args.out), "--data-gate", args.data_gate]
    verify += ["--target", str(args.target)] if args.target else []
    if args.check:
        codes = [salvage_step([*stop, "--check", *base]), salvage_step([*collect, "--check", *base])]
        if (Path(args.out) / "MANIFEST.json").is_file():
            codes.append(salvage_step([*push, "--check", *base]))
        print(
            f"(--check) then: verify every manifest entry at {args.s3} by reading it back, load each "
            "checkpoint and dataset, write NOTES.md; nothing was changed",
            file=sys.stderr,
        )
        return max(codes)
    notes = ["notes", str(args.out), *base]
    # stop starts the salvage (a new id; the earlier salvage's reports are moved aside). The first step
    # that is refused (or, for collect and push, fails) ends it: nothing after it runs but the notes,
    # which then say DO NOT shut the node down and why (a refused step records a report saying so)
    rc_stop = salvage_step([*stop, *base])
    if rc_stop == ExitCode.REFUSED:
        salvage_step(notes)
        return rc_stop
    for step in (collect, push):
        rc = salvage_step([*step, *base])
        if rc != ExitCode.OK:
            salvage_step(notes)
            return rc
    rc_verify = salvage_step([*verify, *base])
    salvage_step(notes)  # the notes of this salvage; they are not in S3 yet
    if rc_verify == ExitCode.REFUSED:
        return rc_verify
    rc_push = salvage_step([*push, *base])  # the final notes push: NOTES.md, the report, the manifest
    rc_final = salvage_step(notes)  # the node can go only now: S3 holds exactly these notes
    return max(rc_stop, rc_verify, rc_push, rc_final)


def register_all(ss, s3_args) -> None:
    """The `all` parser, under `dflash salvage`'s subparsers `ss`."""
    p = ss.add_parser(
        "all", help="every step in order: stop, collect, push, verify, notes (what the role runs)"
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    s3_args(p)
    p.add_argument("--config", type=Path)
    p.add_argument("--keep", type=count, default=2)
    p.add_argument("--include", type=Path, action="append", default=[])
    p.add_argument("--recon", type=Path, action="append", default=[])
    p.add_argument("--reference", action="append", default=[])
    p.add_argument("--no-data", action="store_true")
    p.add_argument("--timeout", type=seconds, default=600.0)
    p.add_argument("--stop-unknown", action="store_true")
    p.add_argument("--target", type=Path)
    p.add_argument("--data-gate", choices=("fail", "warn"), default="fail")
    p.add_argument("--check", action="store_true", help="list what would be stopped, moved and verified")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_all)


def salvage_step(argv: list[str]) -> int:
    """One step of `salvage all`, exactly as `dflash salvage ARGV...` would run it (its errors become
    its exit code)."""
    from trainer.cli import main

    return main(["salvage", *argv])
