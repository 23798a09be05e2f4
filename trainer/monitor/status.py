"""`dflash status --run-dir DIR [--watch]`: the monitor page's facts on one terminal screen (rich), for a
user without a tunnel. Same state, alerts and machine facts as the page (trainer.monitor). Light side."""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from trainer.monitor.alerts import Thresholds
from trainer.monitor.runs import Hub
from trainer.monitor.server import dumps

STATUS_STYLE = {
    "running": "bold blue",
    "completed": "bold green",
    "stopped": "bold yellow",
    "failed": "bold red",
    "refused": "bold red",
    "waiting": "dim",
}


def _dur(s: float | None) -> str:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        return "-"  # none yet, or "nan" from the stream
    s = int(max(0, s))
    d, h, m, sec = s // 86400, s % 86400 // 3600, s % 3600 // 60, s % 60
    return f"{d}d {h}h{m:02d}m" if d else f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _num(v: Any, p: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        return f"{v:.2e}"
    return f"{v:.{p}f}"


def _bytes(b: int | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b} B"
        b /= 1024
    return "-"


def render(s: dict[str, Any], runs: list[dict[str, Any]] | None = None):
    """A rich renderable of one run's snapshot (plus a line per other run under the root)."""
    head = Text()
    head.append(f"{s['run_dir']}  ", style="bold")
    head.append(f"[{s['status']}]", style=STATUS_STYLE.get(s["status"], "bold"))
    if s.get("run_id"):
        head.append(f"  {s['run_id']}", style="dim")

    prog = Table.grid(padding=(0, 1))
    prog.add_column(justify="right", style="dim")
    prog.add_column()
    total = s["total_steps"]
    step_txt = f"step {s['step']:,}" + (f" / {total:,}  ({100 * s['progress']:.1f}%)" if total else "")
    if s.get("budget_s"):  # train.time_budget: the bar is the budget's
        step_txt = (
            f"step {s['step']:,}   budget {_dur(s['budget_spent_s'])} of {_dur(s['budget_s'])}  "
            f"({100 * s['progress']:.1f}%)"
        )
    done = s["progress"] if s.get("budget_s") else s["step"]
    prog.add_row(
        "progress",
        Group(
            Text(step_txt),
            ProgressBar(
                total=1.0 if s.get("budget_s") else float(total or 1), completed=float(done), width=50
            ),
        ),
    )
    tok = f"{s['tokens']:,}" + (f" / {s['total_tokens']:,} budget" if s["total_tokens"] else "")
    prog.add_row("tokens", tok)
    eta = "done" if s["finished"] else _dur(s["eta_s"])
    tps = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
    prog.add_row(
        "time",
        f"elapsed {_dur(s['elapsed_s'])}   ETA {eta}   {tps} tokens/s   "
        f"{_num(s['seconds_per_step'], 2)} s/step",
    )
    prog.add_row(
        "last step",
        f"loss {_num(s['loss'])}   eal {_num(s['eal'], 3)}   lr {_num(s['lr'])}   "
        f"grad norm {_num(s['grad_norm'], 3)}",
    )
    acc = s.get("position_acc") or []
    if acc:
        prog.add_row(
            "accuracy",
            "  ".join(f"{k + 1}:{_num(a, 2)}" for k, a in enumerate(acc)) + "   (by draft position)",
        )
    c = s["last_checkpoint"]
    ckpt = (
        "-"
        if not c
        else (
            f"{c['name']}  {_bytes(c.get('size_bytes'))}  "
            f"{_dur(s['now'] - c['time']) + ' ago' if c.get('time') else ''}  ({s['checkpoints']} written)"
        )
    )
    prog.add_row("checkpoint", ckpt)
    if s["last_eval"]:
        prog.add_row(
            "eval", f"tau {_num(s['last_eval'].get('tau'), 3)} at step {s['last_eval'].get('step', '-')}"
        )
    sysinfo = s.get("system") or {}
    if sysinfo.get("gpus"):
        for g in sysinfo["gpus"]:
            prog.add_row(
                f"GPU {g['index']}",
                f"{g['name']}  util {g['util_percent']}%  "
                f"mem {_bytes(g['mem_used_bytes'])} / {_bytes(g['mem_total_bytes'])}",
            )
    elif sysinfo:
        prog.add_row(
            "machine",
            f"CPU {sysinfo.get('cpu_percent', 0):.0f}% of {sysinfo.get('cpu_count')}   "
            f"RAM {_bytes(sysinfo.get('ram_used_bytes'))} / {_bytes(sysinfo.get('ram_total_bytes'))}   (no "
            "GPU seen)",
        )
    if s["disk"]:
        prog.add_row("disk", f"{_bytes(s['disk']['free_bytes'])} free of {_bytes(s['disk']['total_bytes'])}")
    if s.get("summary"):
        sm = s["summary"]
        prog.add_row(
            "summary",
            f"loss {_num(sm['loss_first'])} -> {_num(sm['loss_last'])}   "
            f"eal {_num(sm['eal_first'], 3)} -> {_num(sm['eal_last'], 3)}   wall {_dur(sm['wall_s'])}",
        )
    parts: list[Any] = [head, prog]
    for a in s["alerts"]:
        parts.append(
            Text(
                f"ALERT {a['kind']}: {a['message']}",
                style="bold red" if a["level"] == "error" else "bold yellow",
            )
        )
    for w in s["warnings"][-3:]:
        parts.append(Text(f"trainer warning: {w.get('message') or w.get('kind')}", style="yellow"))
    if runs and len(runs) > 1:
        others = Table(title="runs under this folder", title_justify="left", box=None, padding=(0, 2))
        for col in ("run", "status", "step"):
            others.add_column(col)
        for r in runs:
            others.add_row(
                r["run"],
                r["status"],
                f"{r['step']}/{r['total_steps'] or '-'}",
                style="bold" if r["run"] == s["run"] else None,
            )
        parts.append(others)
    return Panel(Group(*parts), title="dflash status", title_align="left", border_style="blue")


def status(
    run_dir: Path,
    run: str | None = None,
    watch: bool = False,
    interval: float = 2.0,
    as_json: bool = False,
    console: Console | None = None,
    thresholds: Thresholds | None = None,
    wait_s: float = 0.0,
    wait_step: int | None = None,
) -> int:
    hub = Hub(Path(run_dir), thresholds)
    hub.refresh()
    if run is not None and run not in hub.runs:
        print(f"dflash status: no run {run!r} under {run_dir} (runs: {', '.join(sorted(hub.runs))})")
        return 2
    console = console or Console()

    def current():
        hub.refresh()
        rid = run or hub.default_run()
        return hub.snapshot(rid), hub.run_list()

    if as_json:
        snap, _ = current()
        # --wait: answer when the run ends (or reaches --wait-step), else after wait_s; a role's poll
        # loop prints one line per answer (roles/regenerate_job/tasks/wait.yml)
        deadline = time.monotonic() + wait_s
        while not snap["finished"] and (wait_step is None or (snap["step"] or 0) < wait_step):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(interval, left))
            snap, _ = current()
        print(dumps(snap).decode())
        return 0
    if not watch:
        console.print(render(*current()))
        return 0
    from rich.live import Live

    # Ctrl-C (or a TERM) only sets an event the loop waits on: a KeyboardInterrupt raised wherever the
    # main thread happens to be (inside rich's lock, in a render) could leave that lock held, and the
    # view's exit then waited on it forever (seen once in the suite under load: no exit within 30 s)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Live(render(*current()), console=console, refresh_per_second=4, screen=False) as live:
            while not stop.wait(interval):
                live.update(render(*current()))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
