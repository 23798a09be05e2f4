"""Experiment trackers (`report_to` in the run config): W&B, TensorBoard, trackio and MLflow get the
run's events from rank 0 through each library's own client. The trackers follow the event stream
(follow.py), the adapters are in clients.py. Their packages are an optional extra
(requirements/trackers.txt): a config that names a tracker whose package is missing is refused by
preflight (and by `dflash train` before the models load), exit 2. Light side. Docs: docs/train.md.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from trainer.errors import DflashError

if TYPE_CHECKING:
    from trainer.config import RunConfig
    from trainer.events import EventWriter
    from trainer.trackers.follow import TrackerHub

# tracker -> (the module its client imports, the package that provides it: requirements/trackers.txt)
PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "trackio": ("trackio", "trackio"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


class TrackerPackageMissing(DflashError):
    """`report_to` names a tracker whose package is not installed."""


def missing_packages(names: list[str]) -> list[tuple[str, str]]:
    """(tracker, package) for each tracker in `names` whose client cannot be imported here."""
    return [(n, PACKAGES[n][1]) for n in names if importlib.util.find_spec(PACKAGES[n][0]) is None]


def missing_message(missing: list[tuple[str, str]]) -> str:
    names = ", ".join(f"{t} (package {p})" for t, p in missing)
    return f"report_to names trackers that are not installed here: {names}"


INSTALL_FIX = (
    "install them into the run's venv: VENV/bin/python -m pip install -r requirements/trackers.txt "
    "(docs/train.md, Trackers), or take them out of report_to"
)


def start_trackers(cfg: RunConfig, events: EventWriter) -> TrackerHub | None:
    """The trackers of `cfg.report_to` following this run's events (None when it names none). Raises
    TrackerPackageMissing before anything starts when a package is missing."""
    if not cfg.report_to:
        return None
    missing = missing_packages(cfg.report_to)
    if missing:
        raise TrackerPackageMissing(f"{missing_message(missing)}: {INSTALL_FIX}")
    from trainer.trackers.clients import TRACKER_CLASSES
    from trainer.trackers.follow import TrackerHub

    t = cfg.trackers
    options = {"wandb": {"mode": t.wandb_mode}}
    trackers = [
        TRACKER_CLASSES[name](cfg.out_dir, t.project, events.run_id, options.get(name))
        for name in cfg.report_to
    ]
    return TrackerHub(events, trackers, t.max_failures, t.close_timeout_s).start()
