"""regenerate_job's wait (roles/regenerate_job/tasks/wait.yml, docs/regenerate.md) on this machine, against
a real event stream (trainer.regenerate.progress.RegenEvents, what `dflash regenerate` writes) and the real
`dflash status`: no fixed end; a job that keeps landing batches is waited for past the stall limit, with a
progress line (batch N/M, tokens/s, ETA) along the way; one whose batches stop fails the play in about the
stall limit, with one line; the old fixed wait (regenerate_job_wait_s) is refused by name."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml

from tests.ansible.conftest import REPO, VENV_BIN, local_play

STALL_S = 8
EVERY_S = 3

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trainer.regenerate.progress import RegenEvents

    run_dir, batches, landed, gap = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    ev = RegenEvents(run_dir, "wait-test")
    plan = {"num_prompts": 4 * batches, "target": "t", "prompts": "p", "backend": "server"}
    plan["max_new_tokens"] = 8
    ev.start(plan, batches, 0, 0)
    ev.generation_started()
    for step in range(1, landed + 1):
        time.sleep(gap)
        ev.batch(step, batches, 100 * step, 4, 0)
    if landed == batches:
        ev.end("completed")
    else:
        time.sleep(600)  # alive, but no batch lands any more
    """
)


def wait_play(tmp_path: Path, batches: int, landed: int, gap: float, **overrides) -> tuple[int, str, float]:
    """The role's wait while a writer lands `landed` of `batches` batches `gap` s apart (then stays alive,
    quiet, unless all landed): the play's exit status, its output and how long it took."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    play = [
        {
            "hosts": "all",
            "gather_facts": False,
            "vars": {
                "regenerate_job_venv": str(VENV_BIN.parent),
                "regenerate_job_dir": str(tmp_path),
                "regenerate_job_run_dir": str(run_dir),
                "regenerate_job_wait": "completed",
                "regenerate_job_engine_wait_s": 0,
                "regenerate_job_stall_s": STALL_S,
                "regenerate_job_progress_every_s": EVERY_S,
                "regenerate_job_poll_s": 1,
                **overrides,
            },
            "tasks": [
                {
                    "name": "The role's wait",
                    "ansible.builtin.include_role": {"name": "regenerate_job", "tasks_from": "wait.yml"},
                }
            ],
        }
    ]
    (tmp_path / "wait.yml").write_text(yaml.safe_dump(play))
    proc = writer(tmp_path, batches, landed, gap)
    t0 = time.monotonic()
    try:
        r = local_play(tmp_path / "wait.yml", timeout=240)
    finally:
        proc.kill()
        proc.wait()
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def writer(tmp_path: Path, batches: int, landed: int, gap: float) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, str(script), str(tmp_path / "run"), str(batches), str(landed), str(gap)]
    (tmp_path / "run").mkdir(exist_ok=True)
    return subprocess.Popen(args, env=env)


def progress_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "(item=localhost: " in line]


def test_a_job_that_keeps_landing_batches_is_waited_for_past_the_stall_limit_with_progress(tmp_path):
    rc, out, took = wait_play(tmp_path, batches=5, landed=5, gap=3.5)  # 17.5 s of batches, > STALL_S
    assert rc == 0, out[-3000:]
    assert took > STALL_S * 1.5, took
    lines = progress_lines(out)
    assert len(lines) >= 2, out[-3000:]  # lines along the way, not one at the end
    assert "running: batch " in "\n".join(lines[:-1]) and "/5 (" in lines[0], lines
    assert "tokens/s, ETA " in lines[-2] and "last batch or start" in lines[-2], lines
    assert "completed: batch 5/5 (100.0%)" in lines[-1], lines
    assert "no batch for" not in out


def test_a_job_whose_batches_stop_fails_the_play_in_about_the_stall_limit(tmp_path):
    rc, out, took = wait_play(tmp_path, batches=6, landed=2, gap=1.0)
    assert rc != 0, out[-3000:]
    quiet = re.search(r"no batch for (\d+) s", out)
    assert quiet and STALL_S <= int(quiet.group(1)) <= STALL_S + 2 * EVERY_S, out[
        -3000:
    ]  # a line late at most
    assert f"(regenerate_job_stall_s {STALL_S})" in out and "the job is left running" in out, out[-3000:]
    assert "running: batch 2/6" in "\n".join(progress_lines(out)), out[-3000:]
    assert took < 120, took  # the stall limit, not a hidden hour
    assert "Traceback" not in out


def test_first_batch_returns_when_it_lands_not_at_the_next_line(tmp_path):
    """`dflash status --wait` answers as soon as the first batch lands (--wait-step 1) or the run ends:
    the play does not sit out the rest of a progress interval."""
    rc, out, took = wait_play(
        tmp_path, 6, 2, 15.0, regenerate_job_wait="first_batch", regenerate_job_progress_every_s=60
    )
    assert rc == 0, out[-3000:]
    lines = progress_lines(out)
    assert len(lines) == 1 and "running: batch 1/6" in lines[0], out[-3000:]
    assert took < 30, took  # the first batch at 15 s, the second at 30 s, the next line at 60 s


def test_the_old_fixed_wait_is_refused_by_name():
    r = local_play(
        "/dev/stdin",
        "-e",
        "regenerate_job_wait_s=3600",
        "-e",
        "regenerate_job_target=/t regenerate_job_prompts=/p",
        input=yaml.safe_dump(
            [
                {
                    "hosts": "all",
                    "gather_facts": False,
                    "roles": [{"role": "regenerate_job", "vars": {"dflash_root": "/x"}}],
                }
            ]
        ),
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "regenerate_job_wait_s is gone" in out and "regenerate_job_stall_s" in out, (
        out[-3000:]
    )
