"""The chat template / thinking mode a drafter's training data was made with (light side): read by
`dflash eval` (a warning when the prompts differ) and `dflash export` (copied beside the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def training_data_meta(drafter_folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The template settings the drafter's training data was made with, and where they were found:
    an export's copy, or the dataset (dflash_data.json) named by the run's run.yaml."""
    from trainer.regenerate import read_data_meta

    folder = Path(drafter_folder)
    meta = read_data_meta(folder)
    if meta is not None:
        return meta, str(folder)
    run_yaml = folder.parent.parent / "run.yaml"
    if folder.parent.name == "checkpoints" and run_yaml.is_file():
        import yaml

        data_path = (yaml.safe_load(run_yaml.read_text()) or {}).get("data", {}).get("path")
        if data_path:
            meta = read_data_meta(Path(data_path))
            if meta is not None:
                return meta, str(data_path)
    return None, None
