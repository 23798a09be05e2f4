"""`dflash <verb>`: the only way roles and people drive the package.

The verbs are registered here, one module per area: `run` (preflight, train, config, summary, demo),
`evaluate` (eval, export, regenerate), `watch` (monitor, status), `node` (plan, service, manifest, s3,
hub), `gpu` (facts, decide) and `salvage`. Each area module defines only arguments and handlers; a
handler imports its implementation when it runs, so `dflash --help` and the light verbs start fast on a
node whose GPU is busy (no torch/transformers/speculators import).

A handler returns an `ExitCode` (or an int). An input error is a `DflashError` carrying its own exit
code: caught once, in `main`, printed as `dflash VERB: MESSAGE`.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.cli import evaluate, gpu, node, run, salvage, watch
from trainer.errors import DflashError, ExitCode
from trainer.redact import redact_text

AREAS = (run, evaluate, watch, node, gpu, salvage)
S3_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3")


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused argument is one line (`dflash VERB: error: argument --x: ...`), without
    the usage block above it, masked (trainer/redact.py: it quotes the value refused); `--help` still shows
    the usage. The verbs' subparsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {redact_text(message)} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash", description="Online DFlash drafter training: preflight, train, inspect.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for area in AREAS:
        area.register(sub)
    return parser


def verb_name(args: argparse.Namespace) -> str:
    """`salvage stop`, `s3 pull`, `manifest verify`, `eval`: the words a user typed, for messages."""
    words = [args.verb]
    for attr in ("salvage_verb", "s3_cmd", "manifest_cmd", "gpu_cmd", "service_cmd", "hub_cmd"):
        if getattr(args, attr, None):
            words.append(getattr(args, attr))
    return " ".join(words)


def _stdout_gone() -> int:
    """The reader of stdout went away (`dflash plan ... | head`): what it read is all it wanted. Stdout
    is pointed at /dev/null so the interpreter's last flush does not fail too; exit 0, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return int(ExitCode.OK)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except DflashError as exc:
        print(f"dflash {verb_name(args)}: {redact_text(str(exc))}", file=sys.stderr)  # a URL's password
        return int(exc.exit_code)
    except Exception as exc:
        # S3 trouble outside the per-object handling (the endpoint died while listing, say): one clear
        # line, exit 1 (botocore's messages name the operation and the endpoint, never the credentials)
        if type(exc).__module__.split(".")[0] not in S3_LIBRARIES:
            raise
        print(
            f"dflash {verb_name(args)}: S3 failed: {type(exc).__name__}: {redact_text(str(exc))}; "
            "nothing is marked complete: run it again",
            file=sys.stderr,
        )
        return int(ExitCode.FAILED)
