"""A long step's progress as a small JSON file the play reads (`dflash progress FILE --wait S`): bytes done
and to do, rate, ETA and state, rewritten atomically every few seconds by the process doing the work.
A role starts the step in the background (Ansible `async`) and prints one line per answer of `dflash
progress`, so a 65 GB pull, a 4 GB install or a salvage push is never minutes of silence.
Where dflash is not installed yet (python_env's uv install), `python -m trainer.store.progress_file run FILE
--label L --measure DIR... -- CMD...` runs CMD and writes the file from the growth of the DIRs, and
`python -m trainer.store.progress_file wait FILE --wait S` reads it (PYTHONPATH: the synced source).
Light side: stdlib only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.errors import DflashError, ExitCode

ENDED = ("done", "failed")


class ProgressError(DflashError):
    exit_code = ExitCode.REFUSED


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed; files that vanish mid-walk skipped)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += st.st_size
    return total


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(max(0, s))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _size(b: float | None) -> str:
    if b is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1000:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1000
    return f"{b:.2f} TB"


def line(state: dict[str, Any]) -> str:
    """One line: `target: 12.3 GB of 65.5 GB (19%), 210.4 MB/s, ETA 4m13s, 58s in`."""
    done, total, rate = state.get("done_bytes"), state.get("total_bytes"), state.get("rate_bps")
    text = f"{state.get('label', 'progress')}: {_size(done)}"
    if total:
        text += f" of {_size(total)} ({100 * min(1.0, (done or 0) / total):.0f}%)"
    text += f", {_size(rate)}/s" if rate else ", -/s"
    if state.get("state") == "running":
        text += f", ETA {_dur(state.get('eta_s'))}" if total else ""
    else:
        text += f", {state.get('state')}" + (f": {state['error']}" if state.get("error") else "")
    return text + f", {_dur(state.get('elapsed_s'))} in"


class ProgressFile:
    """Samples `measure()` (bytes done; default: what `count` added) every `every_s` on a thread and
    rewrites `path` (temp name, then rename); `finish` writes the end state. The rate is over the last
    minute of samples."""

    def __init__(
        self, path: Path, label: str, total: int | None, measure: Callable[[], int] | None = None, every_s=2.0
    ):
        self.path, self.label, self.total, self.every_s = Path(path), label, total, every_s
        self.counted = 0
        self._lock = threading.Lock()
        self.measure = measure or (lambda: self.counted)
        self.t0 = time.time()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self, n: int) -> None:
        """`n` more bytes done (negative: a retry took them back); called from any thread."""
        with self._lock:
            self.counted += n

    def state(self, state: str = "running", error: str | None = None) -> dict[str, Any]:
        now = time.time()
        try:
            done = max(0, self.measure())
        except OSError:
            done = self.samples[-1][1] if self.samples else 0
        if self.total is not None:  # done: every byte is in place (a resumed file's earlier bytes too)
            done = self.total if state == "done" else min(done, self.total)
        self.samples = [s for s in self.samples if now - s[0] <= 60] + [(now, done)]
        (t_a, d_a), (t_b, d_b) = self.samples[0], self.samples[-1]
        rate = (d_b - d_a) / (t_b - t_a) if t_b > t_a and d_b >= d_a else None
        left = None if self.total is None else self.total - done
        out = {
            "label": self.label,
            "state": state,
            "error": error,
            "done_bytes": done,
            "total_bytes": self.total,
            "rate_bps": rate,
            "eta_s": (left / rate) if rate and left is not None else (0.0 if left == 0 else None),
            "elapsed_s": now - self.t0,
            "pid": os.getpid(),
            "updated": now,
        }
        out["line"] = line(out)
        return out

    def write(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(state) + "\n")
        os.replace(tmp, self.path)

    def _run(self) -> None:
        # a sample costs what `measure` costs (walking a venv or uv's cache: 100k files, a second or more
        # of CPU): the next one waits at least 20 times as long, so the watch never takes over ~5 % of a
        # core from the work it watches
        wait = self.every_s
        while not self._stop.wait(wait):
            started = time.thread_time()
            try:
                self.write(self.state())
            except OSError:
                pass  # a full disk or a vanished folder: the work itself reports what matters
            wait = max(self.every_s, 20 * (time.thread_time() - started))

    def __enter__(self) -> ProgressFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write(self.state())
        self._thread.start()
        return self

    def finish(self, ok: bool, error: str | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.write(self.state("done" if ok else "failed", error))

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._stop.is_set():  # an exception ended the work before finish()
            self.finish(False, f"{exc_type.__name__}: {exc}" if exc_type else None)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read(path: Path) -> dict[str, Any]:
    """The file's state; `gone` when its writer died before writing the end, `waiting` before it exists."""
    try:
        state = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {"state": "waiting", "line": f"{Path(path).name}: not started yet"}
    except (OSError, ValueError) as exc:
        raise ProgressError(f"{path}: not a progress file: {exc}") from None
    if not isinstance(state, dict):
        raise ProgressError(f"{path}: not a progress file")
    if state.get("state") == "running" and not _alive(state.get("pid")):
        state["state"] = "gone"
        state["line"] = line(state) + " (its process is gone)"
    return state


def wait(path: Path, wait_s: float, interval: float = 2.0) -> dict[str, Any]:
    """The state once the work ended (done, failed, gone) or after `wait_s` seconds, whichever is first."""
    deadline = time.monotonic() + wait_s
    state = read(path)
    while state.get("state") not in (*ENDED, "gone"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(interval, left))
        state = read(path)
    return state


def with_progress(progress_file: Path | None, dest: Path, label: str, check: bool, run) -> dict[str, Any]:
    """A pull's `run(check)` (`dflash hub pull`, `dflash s3 pull`) with --progress-file: its --check pass
    first (the listing) gives the bytes to move, then the real one, while the bytes that land under
    `dest` are written to the file until it ends; a refusal or a failure ends the file `failed`."""
    if not progress_file:
        return run(check)
    start = [0]

    def landed() -> int:
        return folder_bytes(dest) - start[0] if dest.is_dir() else 0

    with ProgressFile(progress_file, label, None, landed) as pf:
        checked = run(True)
        if check:
            report = checked
        else:
            pf.total = checked.get("to_download_bytes") or 0
            start[0] = folder_bytes(dest) if dest.is_dir() else 0
            report = run(False)
        failed = len(report.get("failed") or [])
        pf.finish(bool(report.get("ok")), None if report.get("ok") else f"{failed} file(s) failed")
    return report


class _NoFile:
    """`counting` without a file: every call does nothing."""

    total: int | None = None

    def count(self, n: int) -> None:
        pass

    def finish(self, ok: bool, error: str | None = None) -> None:
        pass

    def __enter__(self) -> _NoFile:
        return self

    def __exit__(self, *exc) -> None:
        pass


def counting(path: Path | None, label: str) -> ProgressFile | _NoFile:
    """A progress file fed by `count(n)` (an upload's bytes sent), or nothing when `path` is None; set
    `.total` once the bytes to move are known."""
    return ProgressFile(path, label, None) if path else _NoFile()


def run_watched(path: Path, label: str, dirs: list[Path], argv: list[str], every_s: float = 5.0) -> int:
    """Run `argv` (its stdout passed through, its stderr passed through line by line) while `path` says
    the bytes the `dirs` grew by (no total: the command's own size is not known ahead). The file ends
    `done` on exit 0, else `failed` with the command's last stderr line. Returns its exit code."""

    def grown() -> int:
        return sum(folder_bytes(d) for d in dirs if d.is_dir()) - start

    start = sum(folder_bytes(d) for d in dirs if d.is_dir())
    last = ""
    with ProgressFile(path, label, None, grown, every_s) as pf:
        try:
            proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, errors="replace")
        except OSError as exc:
            pf.finish(False, f"{argv[0]}: {exc.strerror or exc}")
            print(f"{label}: {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        for text in proc.stderr:
            sys.stderr.write(text)
            last = text.strip() or last
        rc = proc.wait()
        pf.finish(rc == 0, None if rc == 0 else (last or f"exit {rc}"))
    return rc


def main(argv: list[str] | None = None) -> int:
    """`run` and `wait` for a host where dflash is not installed yet (see the module's text)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m trainer.store.progress_file", usage="%(prog)s run|wait ...")
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="run a command, writing the growth of folders to FILE")
    r.add_argument("file", type=Path)
    r.add_argument("--label", required=True)
    r.add_argument("--measure", type=Path, action="append", default=[], help="a folder whose growth counts")
    r.add_argument("--every", type=float, default=5.0, help="seconds between samples (default 5)")
    w = sub.add_parser("wait", help="the state as JSON, when the step ends or after --wait seconds")
    w.add_argument("file", type=Path)
    w.add_argument("--wait", type=float, default=0.0)
    w.add_argument("--interval", type=float, default=2.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    try:
        if args.verb == "wait":
            print(json.dumps(wait(args.file, args.wait, args.interval) if args.wait else read(args.file)))
            return 0
        if not command or not (args.every > 0):
            ap.error("give -- CMD ARGS... and --every above 0")
        return run_watched(args.file, args.label, args.measure, command, args.every)
    except ProgressError as exc:
        print(f"{ap.prog} {args.verb}: {exc}", file=sys.stderr)
        return ExitCode.REFUSED


if __name__ == "__main__":
    sys.exit(main())
