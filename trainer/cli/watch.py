"""The verbs that watch a run: `dflash monitor` (the page and its API) and `dflash status` (one screen).
Argparse only at import: the CLI stays light."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trainer.cli.argtypes import above_zero, nonnegative, port, seconds


def _alert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stall-factor",
        type=above_zero,
        default=5.0,
        help="alert when no step came for this many median gaps between steps (default 5)",
    )
    p.add_argument(
        "--stall-min-s",
        type=nonnegative,
        default=60.0,
        help="... and for at least this many seconds (default 60)",
    )
    p.add_argument(
        "--disk-min-gb",
        type=nonnegative,
        default=10.0,
        help="alert below this much free disk, GiB (default 10)",
    )


def _thresholds(args):
    from trainer.monitor.alerts import Thresholds

    return Thresholds(
        stall_factor=args.stall_factor,
        stall_min_s=args.stall_min_s,
        disk_min_bytes=int(args.disk_min_gb * 2**30),
    )


def _run_dir(path: Path) -> Path:
    """A run's folder or a folder of runs; one that does not exist yet is watched until it does."""
    from trainer.monitor.server import MonitorError

    if path.exists() and not path.is_dir():
        raise MonitorError(f"--run-dir {path} is a file: pass a run's out_dir, or a folder of runs")
    return path


def cmd_monitor(args) -> int:
    from trainer.monitor.server import MonitorError, serve

    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise MonitorError(f"cannot read --token-file: {exc}") from None
    elif os.environ.get("DFLASH_MONITOR_TOKEN"):
        token = os.environ["DFLASH_MONITOR_TOKEN"].strip()
    try:
        serve(
            _run_dir(args.run_dir),
            host=args.host,
            port=args.port,
            token=token,
            allow_remote=args.allow_remote,
            thresholds=_thresholds(args),
        )
    except OSError as exc:
        raise MonitorError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    return 0


def cmd_status(args) -> int:
    from trainer.monitor.status import status

    return status(
        _run_dir(args.run_dir),
        run=args.run,
        watch=args.watch,
        interval=args.interval,
        as_json=args.json,
        thresholds=_thresholds(args),
        wait_s=args.wait,
        wait_step=args.wait_step,
    )


def cmd_progress(args) -> int:
    import json

    from trainer.store.progress_file import read, wait

    state = wait(args.file, args.wait, args.interval) if args.wait else read(args.file)
    print(json.dumps(state) if args.json else state["line"])
    return 0


def register(sub) -> None:
    p = sub.add_parser("monitor", help="serve the live run page and its API (127.0.0.1:8080 by default)")
    p.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help="a run's out_dir, or a folder of runs (the page gets a selector); may not exist yet",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default 127.0.0.1: reach it through ssh -L)"
    )
    p.add_argument("--port", type=port, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host; needs a token (--token-file or DFLASH_MONITOR_TOKEN)",
    )
    p.add_argument("--token-file", type=Path, help="file holding the access token (at least 16 characters)")
    _alert_args(p)
    p.set_defaults(func=cmd_monitor)

    p = sub.add_parser("status", help="the monitor's view of a run on one terminal screen")
    p.add_argument("--run-dir", required=True, type=Path, help="a run's out_dir, or a folder of runs")
    p.add_argument("--run", help="which run under --run-dir (default: the one with the newest event)")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=seconds, default=2.0)
    p.add_argument("--json", action="store_true", help="the same facts as /api/status, as JSON")
    p.add_argument(
        "--wait",
        type=nonnegative,
        default=0.0,
        help="with --json: answer when the run ends (or reaches --wait-step), or after this many seconds",
    )
    p.add_argument(
        "--wait-step", type=above_zero, help="with --wait: answer once the run's step reaches this"
    )
    _alert_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "progress", help="a long step's progress file (bytes, rate, ETA), as `dflash hub pull` writes it"
    )
    p.add_argument("file", type=Path, help="the file (--progress-file of the step)")
    p.add_argument(
        "--wait", type=nonnegative, default=0.0, help="answer when the step ends, or after this many seconds"
    )
    p.add_argument("--interval", type=seconds, default=2.0, help="how often --wait reads the file")
    p.add_argument("--json", action="store_true", help="the whole state as JSON (with its `line`)")
    p.set_defaults(func=cmd_progress)
