"""Stop the trainer gracefully and prove it stopped well.

1. Find it: the pid of the run's last `run_start` event that has no `run_end` after it, and prove it is
   still that process: /proc/PID/stat's start time must equal the `pid_start` the trainer recorded
   (`proc.py`; a reused pid is never signalled, and the report says so with state `not_ours`).
2. Ask it to stop the way it was started: `systemctl stop UNIT` when it runs in a systemd service
   (read from /proc/PID/cgroup), `supervisorctl stop NAME` under supervisor (from the process's
   SUPERVISOR_* environment), the torchrun launcher when it is a torchrun worker (torchrun forwards the
   signal to every rank), else SIGTERM to the pid. Either way the trainer gets SIGTERM, finishes its
   step, writes a final checkpoint (`reason: signal`) and a `run_end` with `status: stopped`.
3. Wait for those two events (not for the process to vanish: a service manager may keep it around),
   then verify the final checkpoint (SHA256SUMS). A timeout is a failure stated loudly with the newest
   checkpoint that does verify, never a silent "done".

On the other nodes of a multi-node run (no events there: only rank 0 writes them) the node marker
`node.json` names the node's rank: stopping it stops the whole run the same way (`stop_follower`).

Light side: psutil and the event stream; no torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from trainer.salvage import SalvageError
from trainer.salvage.inventory import classify
from trainer.salvage.proc import same_process, start_ticks
from trainer.store import checkpoint as ckpt
from trainer.store.events import load_events, read_events
from trainer.store.node_marker import read_node_marker


def run_state(run_dir: Path) -> dict[str, Any]:
    """The last run_start of the stream and whatever ended it (None: no run_end yet)."""
    evs = load_events(Path(run_dir) / "events.jsonl")
    starts = [i for i, e in enumerate(evs) if e.get("event") == "run_start"]
    if not starts:
        return {"start": None, "end": None}
    i = starts[-1]
    end = next((e for e in evs[i + 1 :] if e.get("event") == "run_end"), None)
    return {"start": evs[i], "end": end}


def stop_method(
    pid: int,
    cgroup: str,
    environ: dict[str, str],
    parent_cmd: list[str] | None,
    have_systemctl: bool,
    have_supervisorctl: bool,
) -> dict[str, Any]:
    """How to ask `pid` to stop, from what the kernel and its environment say about it."""
    unit = None
    for line in cgroup.splitlines():
        path = line.rsplit(":", 1)[-1]
        for part in reversed(path.split("/")):
            if part.endswith(".service"):
                unit = part
                break
        if unit:
            break
    if unit and have_systemctl and not unit.startswith(("user@", "session-", "ssh")):
        return {"how": "systemd", "unit": unit, "command": ["systemctl", "stop", "--no-block", unit]}
    name = environ.get("SUPERVISOR_PROCESS_NAME")
    if name and have_supervisorctl:
        group = environ.get("SUPERVISOR_GROUP_NAME") or name
        cmd = ["supervisorctl"]
        if environ.get("SUPERVISOR_SERVER_URL"):
            cmd += ["-s", environ["SUPERVISOR_SERVER_URL"]]
        return {
            "how": "supervisor",
            "program": f"{group}:{name}",
            "command": [*cmd, "stop", f"{group}:{name}"],
        }
    if parent_cmd:
        cls = classify(parent_cmd, os.path.basename(parent_cmd[0]))
        if cls and cls[0] == "trainer" and "torchrun" in cls[1]:
            return {"how": "torchrun", "signal_pid": "parent"}
    return {"how": "signal", "signal_pid": pid}


def find_tool(name: str) -> str | None:
    """`name` on PATH, else beside this Python (the node's venv holds supervisor next to dflash, and a
    non-interactive SSH session, as Ansible's, does not put that venv on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if os.access(beside, os.X_OK) else None


def _describe(pid: int) -> dict[str, Any]:
    p = psutil.Process(pid)
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        cgroup = ""
    try:
        environ = p.environ()
    except psutil.Error:
        environ = {}
    try:
        parent = p.parent()
        parent_cmd = parent.cmdline() if parent else None
        parent_pid = parent.pid if parent else None
    except psutil.Error:
        parent_cmd, parent_pid = None, None
    supervisorctl = find_tool("supervisorctl")
    method = stop_method(
        pid, cgroup, environ, parent_cmd, shutil.which("systemctl") is not None, supervisorctl is not None
    )
    if method["how"] == "supervisor":
        method["command"][0] = supervisorctl
    if method.get("signal_pid") == "parent":
        method["signal_pid"] = parent_pid
    return method


def proven(record: dict[str, Any]) -> tuple[bool, str]:
    """(is `record["pid"]` provably the process that wrote `record`, why not). `record` is a run_start
    event or a node marker. With `pid_start` (what the trainer writes): /proc must show that start time
    now, on the same boot. An older record without it: the process must be a dflash trainer by its
    command line and older than the record. Nothing else is ever signalled."""
    pid = record.get("pid")
    if "pid_start" in record:
        return same_process(pid, record.get("pid_start"), record.get("boot_id"))
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False, f"no usable pid ({pid!r})"
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False, f"pid {pid} has exited (a zombie)"
        cmd = p.cmdline()
        created = p.create_time()
    except psutil.Error:
        return False, f"pid {pid} is gone"
    cls = classify(cmd, os.path.basename(cmd[0])) if cmd else None
    if not cls or cls[0] != "trainer":
        return False, (
            f"pid {pid} is not a dflash trainer ({' '.join(cmd)[:80] or '?'}) and the run recorded no "
            "start time to prove it is the run's"
        )
    started_before = record.get("time")
    if isinstance(started_before, (int, float)) and created > started_before + 1.0:
        return False, f"pid {pid} started after the run recorded it: its pid was reused"
    return True, ""


def check_stop_input(run_dir: Path, timeout_s: float) -> None:
    """Refuse (SalvageError, exit 2) a folder that holds no run, or a non-positive timeout: before a
    salvage begins or anything is written."""
    if not (Path(run_dir) / "events.jsonl").is_file() and read_node_marker(Path(run_dir)) is None:
        raise SalvageError(
            f"{run_dir}/events.jsonl (or a multi-node run's node.json) does not exist: not a dflash run "
            "folder (pass its out_dir)"
        )
    if timeout_s <= 0:
        raise SalvageError(f"--timeout {timeout_s}: must be positive")


def _gone(pid: Any) -> bool:
    return not isinstance(pid, int) or start_ticks(pid) is None


def stop_trainer(
    run_dir: Path, timeout_s: float = 600.0, check: bool = False, poll_s: float = 0.2
) -> dict[str, Any]:
    """Stop the run writing `run_dir`; returns the stop report (`ok` false on any doubt)."""
    run_dir = Path(run_dir)
    check_stop_input(run_dir, timeout_s)
    st = run_state(run_dir)
    start, end = st["start"], st["end"]
    report: dict[str, Any] = {"run_dir": str(run_dir.resolve()), "check": check, "timeout_s": timeout_s}
    if start is None:
        marker = read_node_marker(run_dir)
        if marker is not None:  # another node than node 0 of a multi-node run
            return _with_checkpoint(stop_follower(marker, report, timeout_s, check, poll_s), run_dir)
        report.update(state="never_started", ok=True, message="no run_start event: nothing ran here")
        return _with_checkpoint(report, run_dir)
    pid = start.get("pid")
    report["pid"] = pid
    report["run_id"] = start.get("run_id")
    if end is not None:
        report.update(
            state="not_running",
            ok=True,
            end=end,
            message=f"the run already ended ({end.get('status')} at step {end.get('step')}): nothing to stop",
        )
        return _with_checkpoint(report, run_dir)
    ours, why = proven(start)
    if not ours and _gone(pid):
        report.update(
            state="dead",
            ok=False,
            message=f"the run has no run_end and its process {pid} is gone (killed or crashed): "
            "no final checkpoint; the newest verified one is salvaged",
        )
        return _with_checkpoint(report, run_dir)
    if not ours:
        report.update(
            state="not_ours",
            ok=False,
            message=f"the run has no run_end, and pid {pid} is NOT its trainer: {why}. Nothing was "
            "signalled (the trainer died without run_end; whatever has that pid now is left alone); "
            "the newest verified checkpoint is salvaged",
        )
        return _with_checkpoint(report, run_dir)
    method = _describe(pid)
    report["method"] = method
    if check:
        report.update(state="running", ok=True, message=f"would stop pid {pid} via {method['how']}")
        return _with_checkpoint(report, run_dir)
    offset = (run_dir / "events.jsonl").stat().st_size
    t0 = time.monotonic()
    _send(method, pid, report, start)
    final = None
    run_end = None
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        for end_at, ev in read_events(run_dir / "events.jsonl", offset):
            offset = end_at
            if ev.get("event") == "checkpoint" and ev.get("reason") == "signal":
                final = ev
            elif ev.get("event") == "run_end":
                run_end = ev
        if run_end is not None:
            break
        if not proven(start)[0]:
            # it exited: read what it managed to write
            for _, ev in read_events(run_dir / "events.jsonl", offset):
                if ev.get("event") == "run_end":
                    run_end = ev
                elif ev.get("event") == "checkpoint" and ev.get("reason") == "signal":
                    final = ev
            break
        time.sleep(poll_s)
    report["waited_s"] = round(time.monotonic() - t0, 3)
    report["final_checkpoint_event"] = final
    report["end"] = run_end
    if run_end is None and proven(start)[0]:
        report.update(
            state="timeout",
            ok=False,
            message=f"TIMEOUT: pid {pid} got SIGTERM ({method['how']}) but wrote no run_end within "
            f"{timeout_s:.0f}s; it is STILL RUNNING. Its newest checkpoint that verifies is salvaged; "
            "raise --timeout or look at train.log before shutting the node down",
        )
    elif run_end is None:
        report.update(
            state="died",
            ok=False,
            message=f"pid {pid} exited without a run_end event after SIGTERM: no final checkpoint",
        )
    elif run_end.get("status") != "stopped" or final is None:
        report.update(
            state=f"ended_{run_end.get('status')}",
            ok=run_end.get("status") == "completed",
            message=f"the run ended with status {run_end.get('status')!r} at step {run_end.get('step')} "
            f"({'with' if final else 'without'} a final signal checkpoint)",
        )
    else:
        report.update(
            state="stopped",
            ok=True,
            message=f"stopped at step {run_end.get('step')} with final checkpoint {final.get('name')}",
        )
    report["process_exited"] = not proven(start)[0]
    _with_checkpoint(report, run_dir)
    if report["state"] == "stopped" and report.get("checkpoint") != final.get("name"):
        report["ok"] = False
        report["message"] += f"; but `latest` names {report.get('checkpoint')}, not the final checkpoint"
    if report.get("checkpoint_problems"):
        report["ok"] = False
        report["message"] += "; the checkpoint does NOT verify: " + "; ".join(report["checkpoint_problems"])
    return report


def stop_follower(
    marker: dict[str, Any], report: dict[str, Any], timeout_s: float, check: bool, poll_s: float
) -> dict[str, Any]:
    """Stop this node's share of a multi-node run, found by its node marker (trainer/store/node_marker.py).
    Any rank's SIGTERM is agreed by every rank before the next checkpoint decision, so the whole run
    stops, rank 0 writes the final checkpoint on node 0, and this node's marker ends with status
    `stopped`. When node 0 was stopped first, the marker already says so."""
    run_dir = Path(report["run_dir"])
    pid, node = marker["pid"], marker.get("node")
    report.update(pid=pid, node=node)
    where = f"node {node} of a multi-node run (its events and checkpoints are node 0's)"
    if marker.get("status") != "running":
        ok = marker.get("status") in ("stopped", "completed")
        report.update(
            state="follower_ended",
            ok=ok,
            end=marker,
            message=f"{where}: its ranks ended ({marker.get('status')} at step {marker.get('step')})",
        )
        return report
    ours, why = proven(marker)
    if not ours and not _gone(pid):
        report.update(
            state="not_ours",
            ok=False,
            message=f"{where}: pid {pid} is NOT its rank: {why}. Nothing was signalled",
        )
        return report
    if not ours:
        report.update(
            state="dead",
            ok=False,
            message=f"{where}: its rank (pid {pid}) is gone without ending (killed, crashed, or its group "
            "lost a node): the run's newest checkpoint is node 0's",
        )
        return report
    # SIGTERM to the rank itself, not to its torchrun or service: the rank ends with exit 0 like every
    # other rank, so each node's agent sees its ranks succeed and ends cleanly (a signalled torchrun
    # exits 1 and leaves the other nodes' agents waiting at their exit barrier; nothing restarts either way)
    method = {"how": "signal", "signal_pid": pid}
    report["method"] = method
    if check:
        report.update(state="running", ok=True, message=f"{where}: would stop pid {pid} via {method['how']}")
        return report
    t0 = time.monotonic()
    _send(method, pid, report, marker)
    while time.monotonic() < t0 + timeout_s and proven(marker)[0]:  # its last write done
        time.sleep(poll_s)
    report["waited_s"] = round(time.monotonic() - t0, 3)
    end = read_node_marker(run_dir) or marker
    report["end"] = end
    if end.get("status") == "running" and proven(marker)[0]:
        report.update(
            state="timeout",
            ok=False,
            message=f"TIMEOUT: {where}: pid {pid} got SIGTERM ({method['how']}) but did not end within "
            f"{timeout_s:.0f}s; it is STILL RUNNING",
        )
    elif end.get("status") == "running":
        report.update(state="died", ok=False, message=f"{where}: pid {pid} exited without ending its share")
    else:
        report.update(
            state="follower_stopped",
            ok=end.get("status") in ("stopped", "completed"),
            message=f"{where}: its ranks ended ({end.get('status')} at step {end.get('step')}); the final "
            "checkpoint is node 0's",
        )
    report["process_exited"] = not proven(marker)[0]
    return report


def _send(method: dict[str, Any], pid: int, report: dict[str, Any], record: dict[str, Any]) -> None:
    if method["how"] in ("systemd", "supervisor"):
        # supervisorctl waits for the stop; run it detached and watch the event stream instead
        proc = subprocess.Popen(method["command"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        report["stop_command"] = " ".join(method["command"])
        report["stop_command_pid"] = proc.pid
        if method["how"] == "systemd":
            _, err = proc.communicate(timeout=60)
            if proc.returncode != 0:
                raise SalvageError(
                    f"{report['stop_command']} failed (exit {proc.returncode}): {err.decode()[:300]}"
                )
        return
    target = int(method.get("signal_pid") or pid)
    # a pidfd pins the process: the proof is checked again on it, so the signal cannot reach a process
    # that took the pid between the check and the kill
    fd = None
    try:
        fd = os.pidfd_open(target) if hasattr(os, "pidfd_open") else None
        ours, why = proven(record)
        if ours and target != pid:  # the torchrun launcher: still the proven rank's parent
            ours = psutil.Process(pid).ppid() == target
            why = f"pid {target} is no longer the launcher of pid {pid}"
        if not ours:
            report["not_signalled"] = why  # the wait below sees it gone, or times out loudly
            return
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
        else:
            os.kill(target, signal.SIGTERM)
    except (ProcessLookupError, psutil.NoSuchProcess):
        report["not_signalled"] = f"pid {target} exited before it could be signalled"
        return
    finally:
        if fd is not None:
            os.close(fd)
    report["signalled_pid"] = target


def _with_checkpoint(report: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Add the checkpoint `latest` names (or the newest that verifies) and whether it verifies."""
    latest = ckpt.read_latest(run_dir)
    if latest is not None:
        report["checkpoint"] = latest.name
        report["checkpoint_problems"] = ckpt.verify_checkpoint(latest)
        if report["checkpoint_problems"]:
            good, _ = ckpt.find_resume_checkpoint(run_dir)
            report["newest_verified_checkpoint"] = good.name if good else None
    else:
        report["checkpoint"] = None
        report["checkpoint_problems"] = []
    return report


def stop_others(inventory: dict[str, Any], timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """SIGTERM the non-trainer processes the inventory marked `stop` (only with stop_unknown); then
    SIGKILL what is still there after `timeout_s`. Returns what happened to each."""
    out = []
    targets = [p for p in inventory["processes"] if p["action"] == "stop" and p["kind"] != "trainer"]
    for p in targets:
        try:
            proc = psutil.Process(p["pid"])
            if p["started"] and abs(proc.create_time() - p["started"]) > 1.0:
                out.append({"pid": p["pid"], "result": "gone (pid reused)"})
                continue
            proc.terminate()
            out.append({"pid": p["pid"], "what": p["what"], "result": "SIGTERM sent", "_proc": proc})
        except psutil.Error:
            out.append({"pid": p["pid"], "what": p["what"], "result": "already gone"})
    procs = [o.pop("_proc") for o in out if "_proc" in o]
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        proc.kill()
    for o in out:
        if any(a.pid == o["pid"] for a in alive):
            o["result"] = f"did not exit within {timeout_s:.0f}s of SIGTERM: SIGKILLed"
        elif o["result"] == "SIGTERM sent":
            o["result"] = "exited after SIGTERM"
    return out
