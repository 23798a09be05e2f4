"""The trackers gate: every tracker `report_to` names has its package installed (trainer/trackers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.trackers import INSTALL_FIX, missing_message, missing_packages

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.preflight.report import PreflightReport
    from trainer.target.info import TargetInfo


def trackers_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    missing = missing_packages(cfg.report_to)
    if missing:
        report.error("trackers.package_missing", missing_message(missing), INSTALL_FIX)
