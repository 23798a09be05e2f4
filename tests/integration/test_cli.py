"""The CLI contract: light verbs never import the heavy stack; the demo (README's main job) runs
end to end in its shortened --tiny form (its full SmolLM2 form is `scripts/demo`)."""

import subprocess
import sys

import pytest

from trainer.events import load_events

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
