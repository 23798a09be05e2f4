"""`report_to` on one real tiny `dflash train` run (CPU) with the four real trackers: TensorBoard, W&B
(offline), trackio (local) and MLflow (local file store). Each library's own reader reads back every
step's loss and the eval τ (`eval.every_steps`), the config; salvage takes the
trackers' folders with the run. Nothing here reaches the network: W&B is offline, the others local."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_prompts
from tests.integration.test_train import ENV, cfg_file, events_of, run_train
from trainer.eval.prompts import write_prompt_file

pytestmark = pytest.mark.slow

REPORT_TO = ["tensorboard", "wandb", "trackio", "mlflow"]


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file, decoded with wandb's own protobuf (`Record`). The
    file is a LevelDB-style log (wandb's format: a 7-byte `:W&B` header, 32 KiB blocks, records of
    checksum/length/type + bytes); wandb ships no Python reader of it any more (its core, in Go, does)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            buf = chunk
        elif kind in (3, 4):  # middle, last
            buf += chunk
        else:
            break
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
    return rows


def test_every_step_and_eval_reaches_each_tracker_and_each_reads_it_back(
    tmp_path, tiny_target, tiny_data, monkeypatch
):
    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(2)])
    cfg = cfg_file(tmp_path, tiny_target, tiny_data, max_steps=3, checkpoint_every=3)
    extra = {"report_to": REPORT_TO, "eval": {"every_steps": 2, "prompts": str(prompts), "max_new_tokens": 8}}
    cfg.write_text(cfg.read_text() + "".join(f"{k}: {json.dumps(v)}\n" for k, v in extra.items()))
    for var in ("MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID", "WANDB_MODE"):
        monkeypatch.delitem(ENV, var, raising=False)  # the defaults: stores inside out_dir
    res = run_train(cfg)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "run"
    run_id = events_of(out, "run_start")[0]["run_id"]
    loss = {e["step"]: e["loss"] for e in events_of(out, "step")}
    assert sorted(loss) == [1, 2, 3]
    tau = {e["step"]: e["tau"] for e in events_of(out, "eval")}
    assert sorted(tau) == [2, 3], "eval.every_steps 2, and after the final checkpoint"
    assert not [e for e in events_of(out, "warning") if e.get("kind") == "tracker_failed"]
    assert_each_tracker_holds(out, run_id, loss, tau, monkeypatch)

    # salvage takes the trackers' folders with the run
    from trainer.salvage.select import select

    taken = {item.rel for item in select(out, with_data=False).items}
    for folder in ("tensorboard", "wandb", "mlruns", "trackio"):
        assert any(rel.startswith(f"run/{folder}/") for rel in taken), folder


def assert_each_tracker_holds(out: Path, run_id: str, loss: dict, tau: dict, monkeypatch) -> None:
    """Each tracker's own reader finds `loss` and `tau` ({step: value}) and the config in a run folder
    trained with report_to: REPORT_TO (a run that has `report_to` for other reasons can call this)."""
    max_steps = yaml.safe_load((out / "run.yaml").read_text())["train"]["max_steps"]

    # TensorBoard: its EventAccumulator on out_dir/tensorboard/<run id>
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard" / run_id))
    acc.Reload()
    assert {s.step: s.value for s in acc.Scalars("train/loss")} == pytest.approx(loss)
    assert {s.step: s.value for s in acc.Scalars("eval/tau")} == pytest.approx(tau)
    (text,) = acc.Tensors("run")  # the config, layout and totals as text
    assert f'"max_steps": {max_steps}' in text.tensor_proto.string_val[0].decode()

    # W&B offline: the run file under out_dir/wandb, ready for `wandb sync`
    (run_file,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    rows = wandb_history(run_file)
    # every event a row of its own, charted against the run's `step` (τ comes after later steps)
    assert {r["step"]: r["train/loss"] for r in rows if "train/loss" in r} == pytest.approx(loss)
    assert {r["step"]: r["eval/tau"] for r in rows if "eval/tau" in r} == pytest.approx(tau)

    # MLflow: MlflowClient on the local file store out_dir/mlruns
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    exp = client.get_experiment_by_name("dflash")
    (mlrun,) = client.search_runs([exp.experiment_id], filter_string=f"tags.dflash_run_id = '{run_id}'")
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["config.train.max_steps"] == str(max_steps)
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(loss)
    assert {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "eval/tau")} == tau

    # trackio: its SQLite store out_dir/trackio, read by trackio's storage
    import trackio.sqlite_storage as trackio_store

    monkeypatch.setattr(trackio_store, "TRACKIO_DIR", out / "trackio")
    logs = trackio_store.SQLiteStorage.get_logs("dflash", run=run_id)
    assert {r["step"]: r["train/loss"] for r in logs if "train/loss" in r} == pytest.approx(loss)
    assert {r["step"]: r["eval/tau"] for r in logs if "eval/tau" in r} == pytest.approx(tau)
