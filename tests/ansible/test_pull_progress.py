"""data_sync's long pulls say how far they are (roles/data_sync/tasks/watch.yml, docs/provision.md): the
host's `dflash hub pull` runs in the background and the play prints a line (bytes landed of the bytes to
move, rate, ETA) at least every data_sync_progress_every_s; a failed pull is one line; the rerun resumes
and reports done. On this machine (connection local) against the Hub stand-in (tests/hubserver.py), with
the real role and the real `dflash`."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.ansible.conftest import REPO
from tests.integration.test_hub_pull import REPO as HUB_REPO
from tests.integration.test_hub_pull import SHARD, MiB, repo_dir, standin  # noqa: F401

BIN = Path(sys.executable).parent


def play(tmp_path: Path, endpoint: str) -> subprocess.CompletedProcess:
    dest = tmp_path / "node" / "target"
    book = [
        {
            "hosts": "all",
            "gather_facts": False,
            "roles": [
                {
                    "role": "data_sync",
                    "vars": {
                        "data_sync_items": [
                            {
                                "name": "target",
                                "src": f"hf://{HUB_REPO}@main",
                                "dest": str(dest),
                                "direction": "hf",
                            }
                        ],
                        "data_sync_host_dflash": str(BIN / "dflash"),
                        "data_sync_hf_endpoint": endpoint,
                        "data_sync_progress_every_s": 2,
                        "dflash_group_vars": "loaded",  # this play sets what it needs itself
                        "dflash_repo": str(REPO),
                        "dflash_root": str(tmp_path / "node"),
                    },
                }
            ],
        }
    ]
    (tmp_path / "pull.yml").write_text(yaml.safe_dump(book))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        PATH=f"{BIN}:{os.environ['PATH']}",
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        HF_HOME="/nonexistent-hf-home",
        HF_HUB_DOWNLOAD_TIMEOUT="5",  # the stalled read gives up sooner
    )
    cmd = [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(tmp_path / "pull.yml")]
    cmd += ["-e", f"ansible_python_interpreter={sys.executable}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=400)


def lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "(item=localhost: " in line]


def test_a_hub_pull_prints_progress_fails_in_one_line_and_resumes(tmp_path, standin):  # noqa: F811
    standin.stall_after[SHARD] = 12 * MiB  # the stand-in stops sending there for 8 s
    threading.Timer(8.0, standin.release.set).start()
    t0 = time.monotonic()
    first = play(tmp_path, standin.endpoint)
    out = first.stdout + first.stderr
    assert first.returncode != 0, out[-3000:]
    shown = lines(out)
    assert any(f"hf://{HUB_REPO}@main: " in x and "MB of " in x and "ETA " in x for x in shown), out[-3000:]
    assert any(", failed: 1 file(s) failed" in x for x in shown), shown
    fatal = [x for x in out.splitlines() if x.startswith("fatal: ")]
    assert len(fatal) == 1, out[-3000:]
    msg = out[out.index("Stop when the download failed") :]
    assert f"hf://{HUB_REPO}@main -> localhost:" in msg and "Traceback" not in out, msg[:2000]
    print(f"first pull (stalled, failed): {time.monotonic() - t0:.0f} s, {len(shown)} progress line(s)")

    standin.stall_after.clear()
    second = play(tmp_path, standin.endpoint)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    shown = lines(out)
    assert shown and ", done, " in shown[-1], shown
    assert "downloaded" in out and "resumed from partial files" in out  # the role's report, from the result
    assert (tmp_path / "node" / "target" / SHARD).stat().st_size == 16 * MiB
