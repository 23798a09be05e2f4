"""Reading a run's trackers back with each library's own reader (TensorBoard's EventAccumulator, W&B's
offline run file through its own protobuf, MlflowClient on the file store, trackio's SQLite storage):
what tests/integration/test_train_eval.py's run with `report_to` checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

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
