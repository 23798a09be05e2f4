"""One adapter per experiment tracker, each through its library's own client: W&B (`wandb`),
TensorBoard (torch's `SummaryWriter`, TensorBoard's event files), trackio, MLflow (`MlflowClient`).

An adapter gets three calls, always from its own worker thread (follow.py): `start(run)` at the run's
`run_start` event (config, layout and totals), `log(step, metrics)` for each event with figures (the
step metrics as `train/...`, the eval τ as `eval/...`), `finish(status)` at `run_end` or when the trainer
stops following. Offline first: every store defaults to a folder inside out_dir (salvage collects the
run folder whole). The library is imported inside `start`, so this module is light.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from trainer.redact import redact_url


class Tracker:
    name = "tracker"

    def __init__(self, out_dir: Path, project: str, run_id: str, options: dict[str, Any] | None = None):
        self.out_dir, self.project, self.run_id = Path(out_dir), project, run_id
        self.options = options or {}

    def where(self) -> str:
        """Where this tracker writes (said in train.log at the start; never a credential)."""
        return ""

    def start(self, run: dict[str, Any]) -> None:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        raise NotImplementedError


def run_params(run: dict[str, Any]) -> dict[str, Any]:
    """The run_start event as one flat {dotted.key: value} mapping of scalars (lists as text): the
    config, the layout and the totals, for trackers that keep flat parameters (MLflow, TensorBoard)."""
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[key] = value
        else:
            flat[key] = str(value)

    walk({k: run.get(k) for k in ("config", "layout", "totals")}, "")
    return flat


class WandbTracker(Tracker):
    """W&B through `wandb.init`: offline by default (out_dir/wandb/offline-run-*; `wandb sync` uploads
    it later), online with WANDB_API_KEY from the environment. The W&B run id is the dflash run id, so a
    resumed run that keeps DFLASH_RUN_ID continues the same W&B run."""

    name = "wandb"

    def where(self) -> str:
        mode = self.options.get("mode", "offline")
        return f"{self.out_dir / 'wandb'} ({mode})"

    def start(self, run: dict[str, Any]) -> None:
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True)
        self.run = wandb.init(
            project=self.project,
            id=self.run_id,
            name=self.run_id,
            dir=str(self.out_dir),
            mode=self.options.get("mode", "offline"),
            resume="allow",
            config={k: run.get(k) for k in ("config", "layout", "totals")},
            settings=settings,
        )
        # τ arrives after later steps (the evaluation runs beside the training) and W&B's own step only
        # grows: every event is a row of its own, charted against the run's step (HF Trainer does the same)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)


class TensorboardTracker(Tracker):
    """TensorBoard event files in out_dir/tensorboard/<run id>/ (`tensorboard --logdir out_dir/tensorboard`),
    written with TensorBoard's own event writer (no torch, no TensorFlow); the config, layout and totals
    as one text summary (`run`)."""

    name = "tensorboard"

    def where(self) -> str:
        return str(self.out_dir / "tensorboard" / self.run_id)

    def start(self, run: dict[str, Any]) -> None:
        import json

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.Event, self.Summary = Event, Summary
        self.writer = EventFileWriter(self.where(), flush_secs=30)
        text = json.dumps({k: run.get(k) for k in ("config", "layout", "totals")}, indent=1)
        summary = text_pb("run", "```\n" + text + "\n```")
        self.writer.add_event(
            Event(wall_time=time.time(), step=int(run.get("start_step") or 0), summary=summary)
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = [self.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_event(
            self.Event(wall_time=time.time(), step=step, summary=self.Summary(value=values))
        )

    def finish(self, status: str) -> None:
        self.writer.close()


class TrackioTracker(Tracker):
    """trackio's local store (SQLite): out_dir/trackio unless TRACKIO_DIR is set (trackio reads it when
    first imported, so it is set before that); TRACKIO_SPACE_ID in the environment sends it to a Space."""

    name = "trackio"

    def where(self) -> str:
        return os.environ.get("TRACKIO_DIR") or str(self.out_dir / "trackio")

    def start(self, run: dict[str, Any]) -> None:
        os.environ.setdefault("TRACKIO_DIR", self.where())
        import trackio

        self.run = trackio.init(
            project=self.project,
            name=self.run_id,
            config=run_params(run),
            resume="allow",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow through `MlflowClient` (no global active run): MLFLOW_TRACKING_URI from the environment
    (a server, credentials included, stay out of the config), else a local file store
    out_dir/mlruns (`mlflow ui --backend-store-uri out_dir/mlruns`)."""

    name = "mlflow"

    def uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or (self.out_dir / "mlruns").resolve().as_uri()

    def where(self) -> str:
        return redact_url(self.uri())

    def start(self, run: dict[str, Any]) -> None:
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked for: asked here
        # (a database store needs SQLAlchemy and Alembic, which mlflow-skinny leaves out)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri())
        exp = self.client.get_experiment_by_name(self.project)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.project)
        found = self.client.search_runs([exp_id], filter_string=f"tags.dflash_run_id = '{self.run_id}'")
        if found:  # a resumed run that kept its DFLASH_RUN_ID: the same MLflow run
            self.mlrun_id, logged = found[0].info.run_id, set(found[0].data.params)
        else:
            self.mlrun_id, logged = (
                self.client.create_run(
                    exp_id, run_name=self.run_id, tags={"dflash_run_id": self.run_id}
                ).info.run_id,
                set(),
            )
        from mlflow.entities import Param

        # MLflow refuses to change a logged parameter: a resumed run adds only the new ones
        params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in run_params(run).items()]
        params = [p for p in params if p.key not in logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.mlrun_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.mlrun_id, metrics=batch)

    def finish(self, status: str) -> None:
        state = {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.mlrun_id, status=state)


def mlflow_key(key: str) -> str:
    """A name MLflow takes (letters, digits, _ - . space /; a mapping's keys from an event may hold
    others, and one refused name would fail the whole batch)."""
    return re.sub(r"[^\w\-. /]", "_", key)


TRACKER_CLASSES: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (WandbTracker, TensorboardTracker, TrackioTracker, MlflowTracker)
}
