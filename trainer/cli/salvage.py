"""`dflash salvage inventory|stop|collect|push|verify|notes|all`.

Exit codes (`trainer.errors.ExitCode`): OK everything holds; FAILED a check failed (verify, push, stop
without a verified final checkpoint); REFUSED bad input, refused before any work; STOP_TIMEOUT the
trainer did not stop within --timeout.
Each verb that is given the salvage set (`--out SET` / `SET`) records its report in SET/.salvage/,
which `notes` turns into NOTES.md and salvage-report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainer.cli.argtypes import chunk_mib, count, out_file, positive, seconds
from trainer.cli.salvage_all import register_all
from trainer.errors import ExitCode
from trainer.redact import redact, redact_text
from trainer.salvage.session import record, recorded, s3_name


def emit_report(args, report: dict[str, Any], text: str) -> None:
    """A step's report on stdout (the play's output), masked as its recorded copy is (trainer/redact.py)."""
    if getattr(args, "json", False):
        print(json.dumps(redact(json.loads(json.dumps(report, default=str))), indent=1))
    else:
        print(redact_text(text))


def _save(set_dir: Path | None, step: str, report: dict[str, Any]) -> None:
    if set_dir is not None and not report.get("check"):
        record(set_dir, step, report)


def cmd_inventory(args) -> int:
    from trainer.salvage.inventory import render_table, take_inventory

    inv = take_inventory(args.run_dir, args.stop_unknown)
    _save(args.out, "inventory", inv)
    emit_report(args, inv, render_table(inv))
    return ExitCode.OK


def cmd_stop(args) -> int:
    from trainer.salvage.inventory import render_table, take_inventory
    from trainer.salvage.stop import check_stop_input, stop_others, stop_trainer

    check_stop_input(args.run_dir, args.timeout)  # a refusal begins no salvage and writes nothing
    if args.out is not None and not args.check:
        # the stop starts a salvage of the set: a new id, the earlier salvage's reports moved aside
        from trainer.salvage.session import begin

        began = begin(args.out)
        moved = (
            f"; the earlier salvage's reports kept in {began['moved_aside']}" if began["moved_aside"] else ""
        )
        print(f"dflash salvage: salvage {began['id'][:12]} of {args.out} began{moved}", file=sys.stderr)
    inv = take_inventory([args.run_dir], args.stop_unknown)
    if args.out is not None and not args.check:
        from trainer.salvage.notes import save_step

        save_step(args.out, "inventory", inv)
    rep = stop_trainer(args.run_dir, args.timeout, check=args.check)
    # after the trainer's final checkpoint: the run's own vLLM server (always), the rest with --stop-unknown
    others = [p for p in inv["processes"] if p["action"] == "stop" and p["kind"] != "trainer"]
    if others:
        rep["others_planned"] = [{"pid": p["pid"], "what": p["what"]} for p in others]
        if not args.check:
            rep["others"] = stop_others(inv)
    _save(args.out, "stop", rep)
    text = render_table(inv) + "\n\n" + f"trainer: {rep['state']}: {rep['message']}"
    if rep.get("checkpoint"):
        text += f"\ncheckpoint {rep['checkpoint']}: " + (
            "verifies"
            if not rep["checkpoint_problems"]
            else "DOES NOT VERIFY: " + "; ".join(rep["checkpoint_problems"])
        )
    if args.check:
        text += "\n(--check: nothing was stopped)"
    emit_report(args, rep, text)
    if rep["state"] == "timeout":
        print(f"dflash salvage stop: {rep['message']}", file=sys.stderr)
        return ExitCode.STOP_TIMEOUT
    return ExitCode.OK if rep["ok"] else ExitCode.FAILED


def cmd_collect(args) -> int:
    from trainer.salvage.collect import collect

    with recorded(args.out, "collect", args.check):
        rep = collect(
            args.run_dir,
            args.out,
            keep=args.keep,
            config=args.config,
            includes=args.include,
            recon=args.recon,
            with_data=not args.no_data,
            hardlink=not args.copy,
            check=args.check,
            refresh_facts=args.refresh_facts,
        )
    _save(args.out, "collect", rep)
    lines = [
        (
            f"salvage set {rep['set_dir']}{' (--check: nothing written)' if args.check else ''}: "
            f"{rep['files']} files, {rep['bytes']:,} bytes"
        )
    ]
    for kind, c in sorted(rep["by_kind"].items()):
        lines.append(f"  {kind:11} {c['files']:6} files {c['bytes']:>15,} bytes")
    for c in rep["checkpoints"]:
        lines.append(
            f"  checkpoint {c['name']} ({c['why']}): "
            + ("verifies" if not c["problems"] else "DOES NOT VERIFY: " + "; ".join(c["problems"]))
        )
    for n in rep["not_moved"]:
        lines.append(f"  not moved: {n['path']} ({n['bytes']:,} bytes): {n['why']}")
    if args.check:
        places = rep["would_place"]
        for item in places[:200]:
            lines.append(f"  would collect {item['path']} ({item['bytes']:,} bytes)")
        if len(places) > 200:
            lines.append(f"  ... and {len(places) - 200} more files")
    if not args.check:
        lines.append(
            f"  manifest {rep['manifest']}: {rep['file_count']} files, {rep['total_bytes']:,} bytes "
            f"({rep['hashed']} hashed now, the rest unchanged)"
        )
    emit_report(args, rep, "\n".join(lines))
    return ExitCode.OK


def cmd_push(args) -> int:
    from trainer.s3.push import push
    from trainer.salvage import RECORDS
    from trainer.salvage.verify import repairs

    with recorded(args.set, "push", args.check, s3=s3_name(args.s3)):
        rep = push(
            args.set,
            args.s3,
            args.endpoint_url,
            check=args.check,
            references=args.reference,
            records=RECORDS,
            workers=args.workers,
            chunk_bytes=args.chunk_mib * 2**20,
            threshold_bytes=args.chunk_mib * 2**20,
            progress=not args.no_progress,
            progress_file=args.progress_file,
            force=repairs(args.set, args.s3),  # what the last verify of this prefix found wrong: sent again
        )
    _save(args.set, "push", rep)
    lines = [
        (
            f"push {args.set} -> {rep['s3']}{' (--check: nothing sent)' if args.check else ''}: "
            f"{rep['files']} files, {rep['bytes']:,} bytes; {rep['to_upload']} to upload "
            f"({rep['to_upload_bytes']:,} bytes), "
            f"{rep['skipped']} already there with equal sha256, {len(rep['referenced'])} referenced elsewhere"
        ),
        f"  bucket versioning: {rep['bucket_versioning']}"
        + ("" if rep["bucket_versioning"] == "enabled" else " (an overwritten object's bytes are gone)"),
    ]
    if rep["resent"]:
        lines.append(f"  {len(rep['resent'])} object(s) the last verify found wrong: sent again")
    if args.check:
        for p in rep["plan"]:
            if p["action"] != "skip":
                lines.append(f"  would {p['action']:9} {p['path']} ({p['size']:,} bytes): {p['why']}")
    else:
        n_rec = sum(r["uploaded"] for r in rep.get("records", {}).values())
        lines.append(
            f"  uploaded {rep['uploaded']} object(s) + {n_rec} record(s) (NOTES.md, report), "
            f"{rep['uploaded_bytes']:,} bytes in {rep['seconds']} s"
        )
        if rep.get("aborted_stale_uploads"):
            lines.append(
                f"  aborted {len(rep['aborted_stale_uploads'])} multipart upload(s) left by an interrupted "
                "push"
            )
        for f in rep["failed"]:
            lines.append(f"  FAILED {f['path']}: {f['error']}")
        if rep["ok"]:
            lines.append(f"  manifest stored at s3://{rep['s3'][5:].split('/')[0]}/{rep['manifest_key']}")
        else:
            lines.append(
                "  the manifest was NOT stored (the set is incomplete in S3): re-run the same push to resume"
            )
    rep.pop("plan", None) if not args.json else None
    emit_report(args, rep, "\n".join(lines))
    return ExitCode.OK if rep["ok"] else ExitCode.FAILED


def cmd_verify(args) -> int:
    from trainer.salvage.verify import render

    if (args.s3 is None) == (args.set is None):
        from trainer.salvage import SalvageError

        raise SalvageError("give either --s3 s3://BUCKET/PREFIX or a local salvage set folder")
    with recorded(args.out, "verify", False, where=s3_name(args.s3) if args.s3 else str(args.set)):
        rep = _verify(args)
    _save(args.out, "verify", rep)
    emit_report(args, rep, render(rep))
    return ExitCode.OK if rep["ok"] else ExitCode.FAILED


def _verify(args) -> dict[str, Any]:
    from trainer.salvage.session import pushed_references
    from trainer.salvage.verify import verify_local, verify_s3

    if args.s3:
        local = None
        if args.out is not None:  # the collected set: what must be in S3
            from trainer.salvage import SalvageError
            from trainer.store.manifest import MANIFEST_NAME, load_manifest

            if not (Path(args.out) / MANIFEST_NAME).is_file():
                raise SalvageError(
                    f"--out {args.out}: no {MANIFEST_NAME} there, so there is no collected set to compare "
                    f"S3 with: run `dflash salvage collect --out {args.out}` first"
                )
            local = load_manifest(Path(args.out) / MANIFEST_NAME)
        rep = verify_s3(
            args.s3,
            args.endpoint_url,
            load=not args.no_load,
            target=args.target,
            workdir=args.workdir,
            workers=args.workers,
            data_gate=args.data_gate,
            load_checkpoints=not args.no_load_checkpoints,
            local_manifest=local,
            referenced=pushed_references(args.out),
            allow=args.allow_location,
        )
    else:
        rep = verify_local(
            args.set,
            load=not args.no_load,
            target=args.target,
            data_gate=args.data_gate,
            load_checkpoints=not args.no_load_checkpoints,
        )
    return rep


def cmd_notes(args) -> int:
    from trainer.salvage.notes import write_notes

    rep = write_notes(args.set)
    if rep["node_can_go"]:
        verdict = "the node can go (S3 holds these notes)"
    elif rep["notes_verdict"]:
        verdict = "they say it may go once S3 holds them; DO NOT shut the node down yet:\n  "
    else:
        verdict = "DO NOT shut the node down yet:\n  "
    text = f"wrote {rep['notes']} and {rep['report']}: {verdict}" + (
        "" if rep["node_can_go"] else "\n  ".join(rep["reasons"])
    )
    emit_report(args, rep, text)
    return ExitCode.OK if rep["node_can_go"] else ExitCode.FAILED


def register(sub) -> None:
    sal = sub.add_parser(
        "salvage", help="before a node is shut down: stop, collect, upload, verify, write notes"
    )
    ss = sal.add_subparsers(dest="salvage_verb", required=True, metavar="STEP")

    def s3_args(p, required=True):
        p.add_argument(
            "--s3", required=required, metavar="s3://BUCKET/PREFIX", help="where the set lives in S3"
        )
        p.add_argument("--endpoint-url", help="S3 endpoint (Ceph radosgw, MinIO, ...); default: AWS")

    p = ss.add_parser(
        "inventory", help="list running work (GPU processes, trainer, servers, sessions), classified"
    )
    p.add_argument(
        "--run-dir", type=Path, action="append", default=[], help="a run folder (its pid is the trainer)"
    )
    p.add_argument("--stop-unknown", action="store_true", help="mark non-trainer work to be stopped too")
    p.add_argument("--out", type=Path, help="salvage set: record the report in SET/.salvage/")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inventory)

    p = ss.add_parser(
        "stop", help="SIGTERM the trainer (via systemd/supervisor/torchrun), wait for its final checkpoint"
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--timeout", type=seconds, default=600.0, help="seconds to wait for run_end (default 600)")
    p.add_argument(
        "--stop-unknown", action="store_true", help="also SIGTERM servers and unknown work afterwards"
    )
    p.add_argument("--check", action="store_true", help="say what would be stopped; stop nothing")
    p.add_argument("--out", type=Path)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stop)

    p = ss.add_parser(
        "collect", help="copy the run's artifacts and node facts into a salvage set + sha256 manifest"
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the salvage set folder")
    p.add_argument("--config", type=Path, help="the run config file as started (default: RUN_DIR/run.yaml)")
    p.add_argument(
        "--keep", type=count, default=2, help="newest K checkpoints (default 2) + the best by eval tau"
    )
    p.add_argument("--include", type=Path, action="append", default=[], help="scripts/patches/configs to add")
    p.add_argument("--recon", type=Path, action="append", default=[], help="recon report(s) of this node")
    p.add_argument(
        "--no-data", action="store_true", help="leave the tokenized dataset out (listed as not moved)"
    )
    p.add_argument("--copy", action="store_true", help="copy large files instead of hard-linking them")
    p.add_argument(
        "--refresh-facts", action="store_true", help="take the node facts again (default: keep the first)"
    )
    p.add_argument("--check", action="store_true", help="list what would be collected; write nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_collect)

    p = ss.add_parser(
        "push", help="upload a salvage set to S3 (multipart, Content-MD5, sha256 metadata, resumable)"
    )
    p.add_argument("set", type=Path, metavar="SET")
    s3_args(p)
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="s3://BUCKET/PREFIX",
        help="another salvage set in S3: files with equal sha256 there are referenced, not re-sent",
    )
    p.add_argument("--workers", type=positive, default=8, help="parallel part uploads (default 8)")
    p.add_argument(
        "--chunk-mib", type=chunk_mib, default=16, help="multipart part size and threshold (default 16)"
    )
    p.add_argument("--no-progress", action="store_true", help="no byte progress on stderr")
    p.add_argument(
        "--progress-file", type=out_file, help="write bytes sent, rate and ETA there (`dflash progress`)"
    )
    p.add_argument("--check", action="store_true", help="list what would be uploaded; send nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_push)

    p = ss.add_parser("verify", help="read every manifest entry back, hash it, load checkpoints and datasets")
    p.add_argument("set", type=Path, nargs="?", metavar="SET", help="a local salvage set (instead of --s3)")
    s3_args(p, required=False)
    p.add_argument("--target", type=Path, help="target model folder for the checkpoints' verifier weights")
    p.add_argument("--no-load", action="store_true", help="integrity only: skip every loadability check")
    p.add_argument(
        "--no-load-checkpoints", action="store_true", help="checkpoints: SHA256SUMS only, no speculators"
    )
    p.add_argument(
        "--data-gate",
        choices=("fail", "warn"),
        default="fail",
        help="a dataset the data gate refuses fails verify (default) or is a warning",
    )
    p.add_argument(
        "--workdir", type=Path, help="keep the read-back copies here (default: a temp folder, removed)"
    )
    p.add_argument("--workers", type=positive, default=8)
    p.add_argument(
        "--out",
        type=Path,
        help="the collected salvage set: S3 must hold exactly its MANIFEST.json's files (with --s3); "
        "the report is recorded in SET/.salvage/",
    )
    p.add_argument(
        "--allow-location",
        action="append",
        default=[],
        metavar="S3_PREFIX",
        help="read S3 manifest locations under this prefix too (a set pushed with --reference; with --out "
        "the references of this salvage's own push are allowed already)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = ss.add_parser(
        "notes", help="write NOTES.md and salvage-report.json into the set from the step reports"
    )
    p.add_argument("set", type=Path, metavar="SET")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_notes)

    register_all(ss, s3_args)
