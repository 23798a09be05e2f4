"""Experiment trackers (`report_to` in the run config): W&B, TensorBoard, trackio and MLflow get the
run's events from rank 0 through each library's own client. The trackers follow the event stream
(follow.py) in a process of their own beside rank 0 (sidecar.py); the adapters are in clients.py.
Their packages are an optional extra (requirements/trackers.txt): a config that names a tracker whose
package is missing is refused by preflight (and by `dflash train` before the models load), exit 2.
Light side. Docs: docs/train.md.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from trainer.errors import DflashError

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.store.events import EventWriter
    from trainer.trackers.sidecar import TrackerProcess

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
    "(a node the roles provision: python_env_trackers, on by itself when trainer_service_run_config "
    "names them; docs/train.md, Trackers), or take them out of report_to"
)


def start_trackers(cfg: RunConfig, events: EventWriter) -> TrackerProcess | None:
    """The trackers of `cfg.report_to` following this run's events from now on, in a process of their
    own (sidecar.py); None when it names none. Raises TrackerPackageMissing before anything starts when
    a package is missing."""
    if not cfg.report_to:
        return None
    missing = missing_packages(cfg.report_to)
    if missing:
        raise TrackerPackageMissing(f"{missing_message(missing)}: {INSTALL_FIX}")
    from trainer.trackers.sidecar import TrackerProcess

    t = cfg.trackers
    spec = {
        "out_dir": str(cfg.out_dir),
        "run_id": events.run_id,
        "offset": events.path.stat().st_size if events.path.is_file() else 0,  # this run's events only
        "trackers": list(cfg.report_to),
        "project": t.project,
        "options": {"wandb": {"mode": t.wandb_mode}},
        "max_failures": t.max_failures,
        "close_timeout_s": t.close_timeout_s,
    }
    return TrackerProcess(spec, events).start()
