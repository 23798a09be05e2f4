"""The CLI contract: exit codes and the preflight report; the demo (README's main job) runs
end to end in its shortened --tiny form (its full SmolLM2 form is `scripts/demo`)."""

import json
import os
import subprocess
import sys

import pytest

from trainer.store.events import load_events

ENV_PY = sys.executable


def test_help_and_config_schema(tmp_path):
    # (that these import no torch: tests/unit/test_architecture.py)
    code = (
        "from trainer.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit: pass\n"
        "main(['config', '--schema'])\n"
    )
    res = subprocess.run([ENV_PY, "-c", code], capture_output=True, text=True, check=True)
    assert "preflight" in res.stdout and "train.max_tokens_per_batch" in res.stdout


def test_config_errors_exit_2_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "target: {path: x}\ndata: {path: y}\nout_dir: z\ndrafter: {aux_layer_ids: [1], mask_token_id: 3, "
        "colour: red}\n"
    )
    res = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "preflight", "--config", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 2 and "drafter.colour: unknown key" in res.stderr


def test_preflight_exits_0_on_a_good_run_and_2_on_a_refused_one_with_the_json_report(make_config, tmp_path):
    good = make_config()
    res = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "preflight", "--config", str(good), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert report["ok"] is True and report["errors"] == []
    assert report["target"]["num_layers"] > 0 and report["data"]["usable"] > 0
    text = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "preflight", "--config", str(good)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert text.returncode == 0 and text.stdout.startswith("dflash preflight: OK")
    # the same run with an aux layer id given twice: a gate refuses it before any training
    bad = make_config(drafter={"aux_layer_ids": [1, 2, 2]})
    res = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "preflight", "--config", str(bad), "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 2
    report = json.loads(res.stdout)
    assert report["ok"] is False and "config.aux_ids_duplicate" in {p["code"] for p in report["errors"]}
    assert all(p["fix"] for p in report["errors"])


@pytest.mark.slow
def test_demo_tiny_runs_trains_and_summarises(tmp_path):
    out = tmp_path / "demo"
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "demo", "--tiny", "--steps", "6", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "dflash preflight: OK" in res.stdout and "[completed]" in res.stdout and "step 6/6" in res.stdout
    ends = [e for e in load_events(out / "run" / "events.jsonl") if e["event"] == "run_end"]
    assert ends[-1]["status"] == "completed" and ends[-1]["step"] == 6
    # a second run of the main job continues the same run instead of starting over
    again = subprocess.run(
        [ENV_PY, "-m", "trainer.cli", "demo", "--tiny", "--steps", "6", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert again.returncode == 0
    starts = [e for e in load_events(out / "run" / "events.jsonl") if e["event"] == "run_start"]
    assert len(starts) == 2 and starts[-1]["resumed_from"] == "step-00000006"
