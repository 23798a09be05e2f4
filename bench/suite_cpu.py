"""Where the suite's CPU goes: run a command (default `scripts/test`) while sampling every process's own
CPU time from /proc every 2 s, then print the wall time, the CPU minutes by kind of process (the vLLM
servers' three processes, `dflash train`, pytest, ssh, the test containers' venv, ...) and the processes
that took the most. The goal it serves: the whole suite <= 30 min on a quiet 2-core machine, which is
bound by CPU work in its busy phases (docs/quickstart.md): this names the work to remove.

    .venv/bin/python bench/suite_cpu.py [--out cpu.json] [--top 25] [-- COMMAND ...]
    .venv/bin/python bench/suite_cpu.py --report cpu.json      # print a saved sample again

A process is counted from its first sample to its last, less the CPU it had when the sampling began (a
process that lives less than 2 s may be missed; its parent does not get its time either). Linux only.

The tests' own clock (DFLASH_TEST_CLOCK, tests/conftest.py: each test's span and its pytest process's CPU)
charges each process to a test: the one running in the pytest process it descends from, or, for a process
outside pytest's tree (a test host's sshd session, a container's service), the one running in the lane
whose tmp folder its command line names, when the process appeared."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HZ = os.sysconf("SC_CLK_TCK")
# first match wins: a process's kind from its command line
KINDS = [
    ("vllm server (api)", r"vllm\.entrypoints|serve-target"),
    ("vllm engine/worker (spawned)", r"multiprocessing\.spawn import spawn_main"),
    ("vllm model registry probe", r"vllm\.model_executor\.models\.registry"),
    ("dflash train (incl. ranks)", r"(trainer\.cli|dflash|poisoned_grads|hang_at_step|_rank) train\b"),
    ("dflash other verbs", r"trainer\.cli|bin/dflash "),
    ("pytest", r"bin/pytest"),
    ("ansible", r"ansible|AnsiballZ"),
    ("uv / pip", r"/uv |bin/uv\b| -m pip |bin/pip"),
    ("ssh / sshd / rsync", r"^(\S*/)?(ssh|rsync)\b|^sshd"),
    ("radosgw", r"radosgw"),
    ("browser", r"chrom|headless_shell|playwright"),
    ("bench children", r"/bench/"),
    ("kernel threads", r"^$"),
]


def sample(stop: threading.Event, seen: dict, t0: float, period: float = 2.0) -> None:
    first_round = True
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                cpu = (int(fields[11]) + int(fields[12])) / HZ
                key = f"{pid}:{fields[19]}"  # the pid and its start time: a reused pid is another process
                entry = seen.get(key)
                if entry is None:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    cmd = raw.replace(b"\0", b" ").decode(errors="replace")
                    base = cpu if first_round else 0.0  # what it had before the sampling began
                    seen[key] = entry = {"pid": int(pid), "cmd": cmd.strip()[:300], "base": base, "cpu": cpu}
                    entry["ppid"] = int(fields[1])
                    entry["first"] = round(time.monotonic() - t0, 1)
                entry["cpu"] = max(entry["cpu"], cpu)
                entry["last"] = round(time.monotonic() - t0, 1)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        first_round = False
        stop.wait(period)


def kind(cmd: str) -> str:
    return next((name for name, rx in KINDS if re.search(rx, cmd)), "other")


def report(data: dict, top: int) -> None:
    procs = data["processes"]
    used = [(p["cpu"] - p["base"], p) for p in procs]
    total = sum(u for u, _ in used)
    wall = data["wall_s"]
    print(f"wall {wall / 60:.1f} min; CPU {total / 60:.1f} min over {len(procs)} processes")
    print(f"({total / wall:.2f} cores busy on average of {os.cpu_count()})")
    by_kind: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for u, p in used:
        by_kind[kind(p["cmd"])] += u
        count[kind(p["cmd"])] += 1
    print("\nCPU min  share  processes  kind")
    for name, u in by_kind.most_common():
        print(f"{u / 60:7.2f}  {u / total:5.1%}  {count[name]:9d}  {name}")
    print(f"\nthe {top} processes that took the most (CPU s, seconds from the start, command):")
    for u, p in sorted(used, key=lambda x: -x[0])[:top]:
        print(f"{u:7.1f}  {p['first']:6.0f}-{p['last']:<6.0f} {p['cmd'][:150]}")
    if data.get("tests"):
        per_test(data, top)


def per_test(data: dict, top: int) -> None:
    """Each test's CPU: what its pytest process spent in it plus every process charged to it."""
    tests, t0 = data["tests"], data["t0"]
    lanes = {t["pid"] for t in tests}
    by_pid = collections.defaultdict(list)
    for p in data["processes"]:
        by_pid[p["pid"]].append(p)

    def lane_of(p: dict) -> int | None:
        for _ in range(64):  # up the parent chain to a pytest process
            if p["pid"] in lanes:
                return p["pid"]
            parents = [q for q in by_pid.get(p.get("ppid", 0), []) if q["first"] <= p["first"]]
            if not parents:
                break
            p = max(parents, key=lambda q: q["first"])
        return None

    temps = {t["basetemp"]: t["pid"] for t in tests if t.get("basetemp")}
    spent = collections.Counter({t["test"]: t["cpu"] for t in tests})
    where = collections.Counter()
    for p in data["processes"]:
        if p["pid"] in lanes:
            continue
        lane = lane_of(p) or next((pid for tmp, pid in temps.items() if tmp in p["cmd"]), None)
        at = t0 + p["first"]
        test = next((t for t in tests if t["pid"] == lane and t["start"] - 2 <= at <= t["end"]), None)
        name = test["test"] if test else "(no test: " + kind(p["cmd"]) + ")"
        spent[name] += p["cpu"] - p["base"]
        where[name if test else "unattributed"] += p["cpu"] - p["base"]
    wall = {t["test"]: t["end"] - t["start"] for t in tests}
    print(f"\nthe {top} tests that took the most (CPU s: pytest's own + its processes; wall s):")
    for name, u in spent.most_common(top):
        print(f"{u:7.1f}  {wall.get(name, 0):6.0f}  {name[:150]}")
    print(f"(unattributed to a test: {where['unattributed'] / 60:.1f} CPU-min)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "build" / "suite-cpu.json")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--report", type=Path, help="print a saved sample and exit")
    ap.add_argument("command", nargs="*", help="what to run (default: scripts/test)")
    args = ap.parse_args(argv)
    if args.report:
        report(json.loads(args.report.read_text()), args.top)
        return 0
    command = args.command or [str(REPO / "scripts" / "test")]
    seen: dict = {}
    stop = threading.Event()
    start = time.monotonic()
    sampler = threading.Thread(target=sample, args=(stop, seen, start), daemon=True)
    sampler.start()
    clock = args.out.with_suffix(".tests.jsonl")
    clock.parent.mkdir(parents=True, exist_ok=True)
    clock.unlink(missing_ok=True)
    env = {**os.environ, "DFLASH_TEST_CLOCK": str(clock)}
    rc = subprocess.run(command, check=False, env=env).returncode
    wall = time.monotonic() - start
    stop.set()
    sampler.join()
    tests = [json.loads(line) for line in clock.read_text().splitlines()] if clock.exists() else []
    data = {"command": command, "rc": rc, "wall_s": wall, "t0": start, "processes": list(seen.values())}
    data["tests"] = tests
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(args.out)
    report(data, args.top)
    print(f"\nthe command exited {rc}; the sample: {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
