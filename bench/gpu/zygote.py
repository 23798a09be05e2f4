"""--cpu-smoke's launcher: one interpreter that imports what a stage's process imports (torch,
transformers, speculators, datasets, the trainer) once, then forks a child per stage command, so that
each stage does not spend ~9 s of CPU importing them again (the suite runs the smoke on 2 cores).

Only on the CPU: a CUDA context cannot be forked, and GNU OpenMP hangs a child forked after a parallel
region, so this interpreter runs no tensor operation at all, only imports. On a GPU every stage is a
fresh process (common.run_logged). A child is what `python -m trainer.cli ARGS` (or one_rank.py) would
be: its own session (process group), its output in the stage's log, the stage's environment, and a
normal interpreter exit (atexit handlers run).

Protocol on stdin/stdout, one JSON line each: request {"cmd": [...], "log": PATH, "env": {...}};
answers {"pid": N} when forked, then {"rc": N, "cpu_s": S} when the child ended.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def entry(cmd: list[str]):
    """The function a stage command runs, and its arguments."""
    if cmd[1:3] == ["-m", "trainer.cli"]:
        from trainer.cli import main

        return main, cmd[3:]
    if Path(cmd[1]).name == "one_rank.py":
        from one_rank import main

        return main, cmd[2:]
    raise ValueError(f"the zygote runs dflash commands only, not {cmd[:3]}")


def child(req: dict) -> None:
    """In the forked child: become the stage's process, run it, exit with its code."""
    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(REPO)
    code = 1
    try:
        fn, argv = entry(req["cmd"])
        sys.argv = [req["cmd"][0], *argv]
        code = fn(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def main() -> None:
    sys.path[:0] = [str(HERE), str(REPO)]
    if os.environ.get("GPU_CHECK_ZYGOTE_PRELOAD", "1") == "1":  # 0: the tests of the launcher itself
        # what every stage process imports; nothing that runs a tensor operation
        import datasets  # noqa: F401
        import speculators  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import trainer.eval.run  # noqa: F401
        import trainer.training.loop  # noqa: F401
    import trainer.cli  # noqa: F401

    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(req)
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status, usage = os.wait4(pid, 0)  # the child's CPU time, its reaped descendants' included
        cpu = usage.ru_utime + usage.ru_stime
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "cpu_s": cpu}), file=out, flush=True)


if __name__ == "__main__":
    main()
