"""τ measured while training (`eval:` in the run config) and the trackers (`report_to`) on one short real
`dflash train` run of the tiny target (CPU): an `eval` event with τ (chain and tree) at the cadence and
after the final checkpoint, on prompts the run held out of its own data (`eval.holdout`: the sampler
never packs them), each equal to `dflash eval` of the same checkpoint on the same prompts; the
final one before `run_end`; the checkpoint under evaluation survives rotation (keep_checkpoints 1); the
monitor's state and salvage's best-by-τ read the events. The same run reports to the four real trackers
(TensorBoard, W&B offline, trackio local, MLflow on a local file store): each library's own reader reads
back every step's loss, each τ and the config, and salvage takes their folders with the run. Nothing
here reaches the network."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.conftest import dflash_here as train_here
from tests.integration.test_train import cfg_file, events_of
from tests.integration.trackers_readback import REPORT_TO, assert_each_tracker_holds
from trainer.store.checkpoint import list_checkpoints
from trainer.store.events import load_events

pytestmark = pytest.mark.slow

EVAL = {"every_steps": 2, "max_new_tokens": 12, "tree_budget": 4}


def dflash_here(capsys, *args) -> subprocess.CompletedProcess:
    from trainer.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_tau_events_at_the_cadence_equal_dflash_eval_and_reach_every_tracker(
    tmp_path, tiny_target, tiny_data, capsys, monkeypatch
):
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=3, checkpoint_every=100, keep_checkpoints=1)
    extra = {"report_to": REPORT_TO, "eval": {**EVAL, "holdout": 3}}
    cfg.write_text(cfg.read_text() + "".join(f"{k}: {json.dumps(v)}\n" for k, v in extra.items()))
    for var in ("MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)  # the trackers' defaults: stores inside out_dir
    # in this process (the trackers' readers below import the same libraries: paid once)
    res = train_here("train", "--config", cfg)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "run"
    prompts = out / "eval" / "holdout.jsonl"  # the held-out samples' prompts (tests/unit/test_eval_holdout)
    assert len(prompts.read_text().splitlines()) == 3
    data = events_of(out, "run_start")[0]["totals"]["data"]
    assert data["held_out_samples"] == 3 and data["usable_samples"] <= data["samples"] - 3

    evals = events_of(out, "eval")
    assert [e["step"] for e in evals] == [2, 3], "every 2 steps, and after the final checkpoint"
    assert [e["checkpoint"] for e in evals] == ["step-00000002", "step-00000003"]
    for e in evals:
        assert e["tau"] >= 1 and set(e["tree_tau"]) == {"4"} and e["num_prompts"] == 3 and e["eval_s"] > 0
    kinds = [e["event"] for e in load_events(out / "events.jsonl")]
    last_eval = max(i for i, k in enumerate(kinds) if k == "eval")
    assert kinds.index("run_end") > last_eval, "the final τ comes before run_end"
    ckpts = events_of(out, "checkpoint")
    assert [(c["step"], c["reason"]) for c in ckpts] == [(2, "eval"), (3, "final")]
    assert [p.name for p in list_checkpoints(out)] == ["step-00000003"], "rotation went on (keep 1)"
    assert not list((out / "evals").glob("*/drafter")), "the links to a checkpoint's files go when it is done"
    assert not events_of(out, "warning"), events_of(out, "warning")

    # `dflash eval` of the final checkpoint on the same prompts: the same τ, chain and tree
    rep_path = tmp_path / "again" / "report.json"
    again = dflash_here(
        capsys,
        "eval",
        "--drafter",
        out / "checkpoints" / "step-00000003",
        "--target",
        tiny_target,
        "--prompts",
        prompts,
        "--max-new-tokens",
        EVAL["max_new_tokens"],
        "--tree-budget",
        EVAL["tree_budget"],
        "--check-lossless",
        0,
        "--out",
        rep_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rep = json.loads(rep_path.read_text())
    assert evals[-1]["tau"] == rep["tau"] and evals[-1]["tree_tau"] == {"4": rep["trees"][0]["tau"]}
    assert evals[-1]["per_position_acceptance"] == rep["per_position_acceptance"]
    # the in-training report of step 2 (its checkpoint rotated away mid-evaluation) is what the event says
    rep2 = json.loads((out / "evals" / "step-00000002" / "report.json").read_text())
    assert evals[0]["tau"] == rep2["tau"] and rep2["num_prompts"] == 3
    assert evals[0]["report"] == str(out / "evals" / "step-00000002" / "report.json")

    # the monitor's τ curve and salvage's best-by-τ read these events
    from trainer.salvage.select import best_by_tau
    from trainer.store.run_state import state_from_events

    events = load_events(out / "events.jsonl")
    st = state_from_events(events)
    assert st.tau_curve() == [[e["step"], e["tau"]] for e in evals]
    assert best_by_tau(events, {"step-00000003"}) == "step-00000003", "only a checkpoint still there"

    # every tracker holds every step's loss, each τ and the config; salvage takes their folders
    run_id = events_of(out, "run_start")[0]["run_id"]
    loss = {e["step"]: e["loss"] for e in events_of(out, "step")}
    assert sorted(loss) == [1, 2, 3]
    assert_each_tracker_holds(out, run_id, loss, {e["step"]: e["tau"] for e in evals}, monkeypatch)
    from trainer.salvage.select import select

    taken = {item.rel for item in select(out, with_data=False).items}
    for folder in ("tensorboard", "wandb", "mlruns", "trackio"):
        assert any(rel.startswith(f"run/{folder}/") for rel in taken), folder
